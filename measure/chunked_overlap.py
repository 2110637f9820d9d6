"""Chunked prefill against the whole prompt at once: per method and prompt length, how much of what the unchunked
method keeps the chunked one keeps too, and the peak prefill K/V of both (the layer in flight counted).

    python measure/chunked_overlap.py --lengths 1024 4096 --max_capacity_prompts 256 --prefill_chunk_size 512 \\
        --methods snapkv pyramidkv h2o --threads 1 [--out FILE.json]

Overlap: per layer and KV head, |kept unchunked & held chunked| / |kept unchunked| (the chunked cache holds the
prompt's last token beside its budget: it is fed as generate()'s first step), averaged over heads, then layers;
also the worst layer's. The prompt is RULER's noise haystack with a needle and its question (niah_single_1 text,
built here: no data set needed), so that attention has something to find.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model
from pyramidkv.benchmarks.measure import method_from_spec
from pyramidkv.core.chunked import PrefillChunks
from pyramidkv.generation.chunked import prefill_in_chunks
from pyramidkv.models.glue import decoder
from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.runner.results import atomic_write_json

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def haystack_ids(tokenizer, n: int, seed: int = 0) -> torch.Tensor:
    """[1, n]: noise sentences with one needle at a random depth, then the question, cut to n tokens from the front."""
    rng = random.Random(seed)
    number = rng.randrange(1_000_000, 10_000_000)
    question = f" What is the special magic number for bright-river mentioned in the provided text? The number is"
    needle = f" One of the special magic numbers for bright-river is: {number}. "
    per = len(tokenizer(NOISE, add_special_tokens=False).input_ids)
    sentences = [NOISE] * (2 * n // per + 2)   # tokenized together, sentences take fewer tokens than alone
    sentences.insert(rng.randrange(len(sentences) // 5, len(sentences)), needle)
    ids = tokenizer("".join(sentences), add_special_tokens=False).input_ids
    tail = tokenizer(question, add_special_tokens=False).input_ids
    out = ids[len(ids) + len(tail) - n:] + tail
    if len(ids) + len(tail) < n or len(out) != n:
        raise ValueError(f"could not build a {n}-token haystack")
    return torch.tensor([out])


@torch.no_grad()
def kept_sets(model, method, ids: torch.Tensor, chunk) -> tuple[list[list[set]], int, float]:
    """Per layer and head the positions held after the prompt (chunk None: one forward), the peak prefill bytes
    with the layer in flight counted, and the prefill's CPU seconds (this thread)."""
    with compress(model, method) as patch:
        cache = patch.new_cache()
        peak = [0]
        whole = cache.prefill

        def counted(layer_idx, queries, keys, values, *args, **kwargs):
            peak[0] = max(peak[0], cache.kv_bytes() + keys.numel() * keys.element_size() * 2)
            return whole(layer_idx, queries, keys, values, *args, **kwargs)
        cache.prefill = counted
        t0 = time.thread_time()
        if chunk is None:
            decoder(model)(input_ids=ids, past_key_values=cache, use_cache=True)
        else:
            prefill_in_chunks(model, cache, ids, chunk)
            last = torch.tensor([[ids.shape[1] - 1]])
            decoder(model)(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, position_ids=last,
                           cache_position=last[0])
        seconds = time.thread_time() - t0
        held = [[set(p.tolist()) for p in cache.held_positions(layer)] for layer in range(cache.num_layers)]
        return held, max(peak[0], cache.peak_prefill_kv_bytes), seconds


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--max_capacity_prompts", type=int, default=256)
    parser.add_argument("--prefill_chunk_size", type=int, default=512)
    parser.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv", "h2o"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        methods = {spec: method_from_spec(spec, args.max_capacity_prompts) for spec in args.methods}
        for method in methods.values():
            PrefillChunks(args.prefill_chunk_size).check(method)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path, "sdpa", "cpu", None)
    rows = []
    print("| method | n | overlap (mean over layers) | worst layer | peak prefill KV, unchunked -> chunked (MiB) | "
          "x | prefill CPU s, unchunked -> chunked |")
    print("|---|---|---|---|---|---|---|")
    for n in args.lengths:
        ids = haystack_ids(tokenizer, n)
        for spec, method in methods.items():
            whole, peak_whole, s_whole = kept_sets(model, method, ids, None)
            chunked, peak_chunked, s_chunked = kept_sets(model, method, ids, args.prefill_chunk_size)
            per_layer = [statistics.fmean(len(a & b) / len(a) for a, b in zip(layer_a, layer_b))
                         for layer_a, layer_b in zip(whole, chunked)]
            row = {"method": spec, "n": n, "overlap": statistics.fmean(per_layer), "worst_layer": min(per_layer),
                   "peak_unchunked": peak_whole, "peak_chunked": peak_chunked, "prefill_s_unchunked": s_whole,
                   "prefill_s_chunked": s_chunked}
            rows.append(row)
            print(f"| {spec} | {n} | {row['overlap']:.3f} | {row['worst_layer']:.3f} | {peak_whole / 2**20:.2f} -> "
                  f"{peak_chunked / 2**20:.2f} | {peak_chunked / peak_whole:.3f} | {s_whole:.1f} -> {s_chunked:.1f} |",
                  flush=True)
    if args.out:
        atomic_write_json(args.out, {"arguments": vars(args), "rows": rows})
    print(json.dumps({"arguments": vars(args)}))


if __name__ == "__main__":
    main()
