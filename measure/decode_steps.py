"""Decode time per token of method specs after one untimed prefill each: the thread's CPU time (time.thread_time,
one torch thread) of each greedy step, median over the steps, and each row as a ratio to the first. The prefill is
not timed and runs once per row (measure/benchmark_latency_memory.py times both and repeats every row): this is the
cheap figure for decode-time work such as per-step eviction, on a machine too loaded for the full benchmark.

    PYTHONPATH=. python measure/decode_steps.py --context_length 4096 --budget 256 \
        --methods snapkv fullkv tova kvzap duo_attention --new_tokens 24 --warmup 4

Base and branch side by side: run it twice at once, PYTHONPATH at each checkout, same arguments. Each row also
reports what its cache holds after the last step (tokens summed over layers and heads, and bytes).

A row ending in @torch (`"fullkv:quant_method=kivi,nbits=2@torch"`, `kvzap@torch`) runs the torch ops where the
C kernels (pyramidkv/native: the quantized reads, the ragged segments) run by default: both side by side in one run.

--interleave: every row gets its own copy of the model and cache, prefilled first, then the rows take their decode
steps in turn (step 1 of every row, then step 2, ...), so that a load changing over the run weighs on every row
alike: on a shared machine the ratios between rows hold where separate windows of time move a row by 10-20 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from copy import deepcopy

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model
from pyramidkv.benchmarks.measure import method_from_spec, prompt_ids

try:   # the strict parser (a repeated flag or a prefix of one refused); checkouts before it had argparse's own
    from pyramidkv.runner.arguments import ArgumentParser
except ImportError:
    from argparse import ArgumentParser


@torch.no_grad()
def decode_row(model, ids, spec: str, budget: int, new_tokens: int, warmup: int) -> dict:
    method = method_from_spec(spec, budget)
    patch = compress(model, method)
    try:
        try:
            cache = patch.new_cache(ids.tolist(), None)
        except TypeError:   # checkouts before the cache took the prompt (67e8965 and older: bisecting)
            cache = patch.new_cache()
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        times = []
        for step in range(warmup + new_tokens):
            start = time.thread_time()
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            if step >= warmup:
                times.append(time.thread_time() - start)
        held = sum(sum(cache.held_counts(layer)[0]) for layer in range(len(cache.layers)))
        return {"decode_s_per_token": statistics.median(times), "held_tokens": held, "kv_bytes": cache.kv_bytes()}
    finally:
        patch.remove()


TORCH_READS = "@torch"


def step_reads(row: str):
    """The context a row's steps run in: a row ending in @torch with the torch ops, not the C kernels
    (pyramidkv/native); any other row as the machine's default."""
    import contextlib

    if not row.endswith(TORCH_READS):
        return contextlib.nullcontext()
    from pyramidkv import native
    return native.off()


@torch.no_grad()
def interleaved_rows(model, ids, specs: list[str], budget: int, new_tokens: int, warmup: int) -> dict:
    """decode_row's figures for every spec, the steps of the rows taken in turn (each row its own model copy)."""
    rows = []
    try:
        for spec in specs:
            copy = deepcopy(model)
            patch = compress(copy, method_from_spec(spec.removesuffix(TORCH_READS), budget))
            rows.append((spec, copy, patch, patch.new_cache(ids.tolist(), None), []))
        tokens = []
        for spec, m, _, cache, _ in rows:
            with step_reads(spec):
                tokens.append(m(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1))
        for step in range(warmup + new_tokens):
            for i, (spec, m, _, cache, times) in enumerate(rows):
                with step_reads(spec):
                    start = time.thread_time()
                    tokens[i] = m(tokens[i], past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    if step >= warmup:
                        times.append(time.thread_time() - start)
        return {spec: {"decode_s_per_token": statistics.median(times), "kv_bytes": cache.kv_bytes(),
                       "held_tokens": sum(sum(cache.held_counts(layer)[0]) for layer in range(len(cache.layers)))}
                for spec, _, _, cache, times in rows}
    finally:
        for _, _, patch, _, _ in rows:
            patch.remove()


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--context_length", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--methods", nargs="+", default=["snapkv", "fullkv", "tova", "kvzap", "duo_attention"])
    parser.add_argument("--new_tokens", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--interleave", action="store_true",
                        help="the rows' decode steps taken in turn, each row on its own model copy")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for flag in ("context_length", "budget", "new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model_path, "sdpa", "cpu", None)
    ids = prompt_ids(tokenizer, args.context_length)
    if args.interleave:
        rows = interleaved_rows(model, ids, args.methods, args.budget, args.new_tokens, args.warmup)
    else:
        rows = {}
        for spec in args.methods:
            with step_reads(spec):
                rows[spec] = decode_row(model, ids, spec.removesuffix(TORCH_READS), args.budget, args.new_tokens,
                                        args.warmup)
    first = rows[args.methods[0]]["decode_s_per_token"]
    print(f"\nn = {args.context_length}, budget {args.budget}, {args.new_tokens} timed steps after {args.warmup}"
          f"{' (rows interleaved)' if args.interleave else ''}, "
          f"thread CPU time, 1 thread\n\n| row | decode ms/token | x {args.methods[0]} | held tokens | KV MiB |\n"
          "|---|---|---|---|---|")
    for spec, r in rows.items():
        print(f"| {spec} | {1000 * r['decode_s_per_token']:.1f} | {r['decode_s_per_token'] / first:.3f} | "
              f"{r['held_tokens']} | {r['kv_bytes'] / 2**20:.2f} |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"arguments": vars(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
