"""Bytes held against blocks a paged engine could free, per method (docs/serving.md, "What each method frees").

    OMP_NUM_THREADS=1 nice python measure/block_free.py [--tokens 1024] [--new_tokens 8] [--ratios 0.25 0.0625]

A prompt of the first `tokens` tokens of the needle data's essays, greedy-decoded `new_tokens` tokens under every
registered method as the leaderboard enters it (grid.entries_of: one entry per ratio for methods with a budget,
decode-time methods holding the same share while decoding; one entry at its defaults otherwise). Per entry: the
K/V bytes held when the answer ended x fullkv's, and the share of the full cache's 16- and 32-token blocks that
no head of their layer holds (sizing/blocks.py). A markdown table on stdout.
"""

from __future__ import annotations

import argparse
import time

import torch

from pyramidkv.runner.arguments import ArgumentParser


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=8)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.0625])
    parser.add_argument("--methods", nargs="+", default=None, help="method specs (default: every registered one)")
    args = parser.parse_args(argv)
    from pyramidkv import load_model
    from pyramidkv.benchmarks.prompting import essay_dir
    from pyramidkv.generation import generate
    from pyramidkv.leaderboard.grid import entries_of
    from pyramidkv.methods import METHODS, parse_method_spec

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m", attn_implementation="sdpa", device="cpu")
    text = "".join(p.read_text() for p in sorted(essay_dir().glob("*.txt"))[:3])
    ids = tokenizer(text, add_special_tokens=False).input_ids[:args.tokens]
    full = generate(model, tokenizer, [ids], parse_method_spec("fullkv"), args.new_tokens, stop_token_ids=[])[0]
    print(f"prompt {len(ids)} tokens + {args.new_tokens} new; fullkv {full.kv_bytes_per_prompt} bytes\n")
    print("| entry | treatment | bytes x fullkv | free@16 | free@32 | seconds |\n|---|---|---|---|---|---|")
    for spec in args.methods or [m for m in METHODS if m != "fullkv"]:
        try:
            entries = entries_of(spec, args.ratios, len(ids))
        except ValueError as e:
            print(f"| {spec} | refused: {' '.join(str(e).split())[:120]} | | | | |", flush=True)
            continue
        for entry in entries:
            started = time.thread_time()
            try:
                out = generate(model, tokenizer, [ids], parse_method_spec(entry.spec), args.new_tokens,
                               stop_token_ids=[])[0]
            except ValueError as e:
                print(f"| {entry.label} | refused: {' '.join(str(e).split())[:120]} | | | | |", flush=True)
                continue
            print(f"| {entry.label} | {entry.treatment} | {out.kv_bytes_per_prompt / full.kv_bytes_per_prompt:.3f} | "
                  f"{out.block_free[16]:.3f} | {out.block_free[32]:.3f} | {time.thread_time() - started:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
