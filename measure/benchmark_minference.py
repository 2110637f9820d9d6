"""MInference's prefill on CPU: the share of the causal attention entries each layer computes, per context
length, on RULER prompts (the masked reference computes exactly the pattern's entries; on CPU it saves no
time, so this reports the work a sparse kernel would do, not a speed-up).

    python measure/benchmark_minference.py --lengths 4096 8192 [--task niah_multikey_1] [--num_samples 2]
        [--method minference] [--threads 1] [--out docs/benchmarks/minference_density.json]

Per length and sample one prefill (the prompt without generation); per layer the fraction of the causal
query-key entries computed (layers below the unit's start_layer or with a dense pattern count 1), then the
mean over layers and over all entries (layers weigh equally: every layer has the same causal entries).
Accuracy against dense prefill: `run_ruler.py --method minference` next to `--method fullkv`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pyramidkv.benchmarks.ruler.generate import PromptFormatter, generate_rows
from pyramidkv.methods import parse_method_spec
from pyramidkv.models.loading import load_model
from pyramidkv.models.patch import compress
from pyramidkv.runner.arguments import ArgumentParser, output_file


def layer_densities(model, tokenizer, prompt: str, method) -> list[float]:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad(), compress(model, method) as patch:
        cache = patch.new_cache()
        model(ids, past_key_values=cache, use_cache=True)
    # A layer the unit left dense has no density recorded: it computes every causal entry.
    return [1.0 if density is None else density[0] for density in cache.prefill_density]


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    parser.add_argument("--task", default="niah_multikey_1")
    parser.add_argument("--num_samples", type=int, default=2)
    parser.add_argument("--method", default="minference", help="a method spec with a sparse prefill")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, type=output_file)
    args = parser.parse_args(argv)
    for flag in ("num_samples", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: at least 1")
    try:
        method = parse_method_spec(args.method)
    except ValueError as e:
        parser.error(f"--method {args.method}: {e}")
    if method.prefill_attention is None:
        parser.error(f"--method {args.method!r} has no sparse prefill (prefill_attention); use minference or "
                     f"e.g. snapkv:budget=256,prefill_attention=minference")
    from transformers import AutoConfig, AutoTokenizer

    from pyramidkv.models.default_model import default_model_path
    from pyramidkv.models.patch import model_shape

    try:   # the model's checks (a pattern table of another shape) before its weights load, as the runners make them
        method.check_model(model_shape(AutoConfig.from_pretrained(default_model_path()), 4, "sdpa"))
    except ValueError as e:
        parser.error(f"--method {args.method}: {e}")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    prompts = {}
    for length in args.lengths:     # every prompt before the model loads: a bad task or length is refused now
        try:
            prompts[length] = [row["input"] for row in generate_rows(args.task, length, args.num_samples,
                                                                     PromptFormatter(tokenizer))]
            for prompt in prompts[length]:
                method.check_prompt(len(tokenizer(prompt, add_special_tokens=False).input_ids))
        except (ValueError, KeyError) as e:
            parser.error(f"--task {args.task} at --lengths {length}: {str(e).strip(chr(39))}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(attn_implementation="sdpa", device="cpu")
    results = {"arguments": vars(args), "threads": torch.get_num_threads(), "rows": []}
    for length in args.lengths:
        per_sample = []
        for prompt in prompts[length]:
            started = time.time()
            per_sample.append(layer_densities(model, tokenizer, prompt, method))
            print(f"{length}: sample done in {time.time() - started:.0f} s", flush=True)
        per_layer = [statistics.fmean(sample[layer] for sample in per_sample) for layer in range(len(per_sample[0]))]
        result = {"length": length, "samples": len(per_sample), "per_layer": per_layer,
                  "mean": statistics.fmean(per_layer), "min": min(per_layer), "max": max(per_layer)}
        results["rows"].append(result)
        print(f"{length} tokens, {len(per_sample)} samples: computed share of causal entries mean "
              f"{result['mean']:.3f} (layers {result['min']:.3f} .. {result['max']:.3f}); per layer "
              + " ".join(f"{d:.2f}" for d in per_layer), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
