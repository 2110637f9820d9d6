"""What recording the block-freeable share costs a generation (docs/speed.md, "Block-freeable share").

    OMP_NUM_THREADS=1 nice python measure/block_free_cost.py [--tokens 1024] [--new_tokens 16] [--repeats 5]

The same greedy generation (SmolLM2-135M, fp32, a `tokens`-token essay prompt, `new_tokens` tokens, snapkv at a
quarter of the prompt) with the share computed when the answer ends (as shipped) and with that computation
replaced by nothing, alternated `repeats` times; thread CPU time (time.thread_time, one torch thread), and the
share's own time measured alone on the finished cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pyramidkv.runner.arguments import ArgumentParser


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from pyramidkv import load_model, make_method
    from pyramidkv.benchmarks.prompting import essay_dir
    from pyramidkv.generation import greedy

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m", attn_implementation="sdpa", device="cpu")
    text = "".join(p.read_text() for p in sorted(essay_dir().glob("*.txt"))[:3])
    ids = tokenizer(text, add_special_tokens=False).input_ids[:args.tokens]
    method = make_method("snapkv", budget_ratio=0.25)
    shipped, share_seconds = greedy.blocks_free_now, []

    def timed_share(cache, row):
        started = time.thread_time()
        out = shipped(cache, row)
        share_seconds.append(time.thread_time() - started)
        return out

    times = {"with the share": [], "without": []}
    for _ in range(args.repeats):
        for label, hook in (("with the share", timed_share), ("without", lambda cache, row: {})):
            greedy.blocks_free_now = hook
            started = time.thread_time()
            greedy.generate(model, tokenizer, [ids], method, args.new_tokens, stop_token_ids=[])
            times[label].append(time.thread_time() - started)
    greedy.blocks_free_now = shipped
    with_share, without = (statistics.median(times[k]) for k in ("with the share", "without"))
    print(f"{len(ids)}-token prompt, {args.new_tokens} new tokens, snapkv@0.25, median of {args.repeats}:")
    print(f"  generate with the share {with_share:.3f} s, without {without:.3f} s: ratio {with_share / without:.4f}")
    print(f"  the share alone: {statistics.median(share_seconds) * 1000:.2f} ms per generation "
          f"({statistics.median(share_seconds) / without:.2%} of it)")


if __name__ == "__main__":
    main()
