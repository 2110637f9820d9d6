"""Save and load speed of compressed caches on disk (pyramidkv.save_cache / load_cache), in MB/s of file size.

    python measure/cache_file_speed.py --context_length 2048 --repeats 5 fullkv snapkv

Each spec (NAME[:setting=value,...], budget from --max_capacity_prompts) prefills the same prompt of the default
model (or --model_path) and decodes --decode_steps tokens; its cache is then saved and loaded --repeats times to
--folder (default: a temporary folder); reported per spec: the file size, the stored K/V bytes, and the median
save and load time and MB/s (file bytes / time; MB = 10^6 bytes).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_cache, load_model, save_cache
from pyramidkv.benchmarks.measure import method_from_spec, prompt_ids
from pyramidkv.runner.arguments import ArgumentParser


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--context_length", type=int, default=2048)
    parser.add_argument("--max_capacity_prompts", type=int, default=256)
    parser.add_argument("--decode_steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default=None)
    args = parser.parse_args()
    methods = [method_from_spec(spec, args.max_capacity_prompts) for spec in args.specs]
    model, tokenizer = load_model(args.model_path, "sdpa", args.device, None)
    ids = prompt_ids(tokenizer, args.context_length).to(args.device)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        path = Path(folder) / "cache.safetensors"
        print(f"{args.model_path}, {args.context_length} tokens + {args.decode_steps} decoded, {args.device}, "
              f"median of {args.repeats}")
        print("| spec | file MB | K/V MB | save s | save MB/s | load s | load MB/s |\n|---|---|---|---|---|---|---|")
        for spec, method in zip(args.specs, methods):
            with compress(model, method), torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=args.decode_steps + 1, min_new_tokens=args.decode_steps + 1,
                                     return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
            cache = out.past_key_values
            saves, loads = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                save_cache(cache, path, model)
                saves.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                load_cache(path, model)
                loads.append(time.perf_counter() - t0)
            size = path.stat().st_size / 1e6
            save, load = statistics.median(saves), statistics.median(loads)
            print(f"| {spec} | {size:.1f} | {cache.kv_bytes() / 1e6:.1f} | {save:.3f} | {size / save:.0f} | "
                  f"{load:.3f} | {size / load:.0f} |")


if __name__ == "__main__":
    main()
