"""Decode time per token of method specs measured step by step side by side, for a CPU shared with other work.

    python measure/benchmark_paired_decode.py --context_length 4096 --threads 1 --steps 32 \
        fullkv fullkv:quant_method=kivi,nbits=2 snapkv snapkv:quant_method=kivi,nbits=2

Each spec (as in benchmark_latency_memory.py: NAME[:setting=value,...], budget from
--max_capacity_prompts) prefills the same prompt into its own cache; then every decode step feeds each
cache in turn (same token stream: the first spec's greedy tokens), so a burst of load from elsewhere
hits all specs within the same few hundred milliseconds. Reported per spec: the median and the minimum
step time, and the median over steps of the step time divided by that of the same spec without its
quantizer (`snapkv:quant_method=kivi` -> `snapkv`) in the same step, where that spec is in the run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model
from pyramidkv.benchmarks.measure import method_from_spec, prompt_ids, unquantized_spec
from pyramidkv.runner.arguments import ArgumentParser


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--context_length", type=int, default=4096)
    parser.add_argument("--max_capacity_prompts", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path, "sdpa", "cpu", None)
    ids = prompt_ids(tokenizer, args.context_length)
    caches, first = [], None
    with torch.no_grad():
        for spec in args.specs:
            with compress(model, method_from_spec(spec, args.max_capacity_prompts, "kv_head")) as patch:
                cache = patch.new_cache()
                out = model(ids, past_key_values=cache, use_cache=True)
            caches.append(cache)
            first = out.logits[:, -1:].argmax(-1) if first is None else first
        times = [[] for _ in args.specs]
        token = first
        # The patched forward reads whichever cache it is given; the patch only builds new caches.
        with compress(model, method_from_spec(args.specs[0], args.max_capacity_prompts, "kv_head")):
            for _ in range(args.steps):
                for i, cache in enumerate(caches):
                    t0 = time.perf_counter()
                    out = model(token, past_key_values=cache, use_cache=True)
                    times[i].append(time.perf_counter() - t0)
                    if i == 0:
                        next_token = out.logits[:, -1:].argmax(-1)
                token = next_token
    print(f"n = {args.context_length}, budget {args.max_capacity_prompts}, {args.steps} steps, "
          f"{torch.get_num_threads()} threads")
    print("| spec | median ms/token | min ms/token | x unquantized (median of per-step ratios) |")
    print("|---|---|---|---|")
    for spec, t in zip(args.specs, times):
        base = unquantized_spec(spec)
        ratio = "-"
        if base != spec and base in args.specs:
            ratio = f"{statistics.median(a / b for a, b in zip(t, times[args.specs.index(base)])):.3f}"
        print(f"| {spec} | {1000 * statistics.median(t):.1f} | {1000 * min(t):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
