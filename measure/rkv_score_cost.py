"""What R-KV's score costs beside SnapKV's, on one layer of the default model's shape (9 query / 3 KV heads, head
dim 64, float32): the two scorers interleaved in one process, each timed on the same random queries and keys, at
the prompt lengths given (a prefill's score) and at a decode-time re-selection (decode_budget + decode_interval
held tokens). R-KV's redundancy compares every held key with every other (n^2 D per head); SnapKV reads the
window's attention (w n D).

    python measure/rkv_score_cost.py [--lengths 256 1024 4096] [--repeats 5] [--clock cpu|wall]

Prints, per length, the median seconds of each scorer and the ratio rkv / snapkv, and for rkv the share of its
time in the redundancy.
"""

import argparse
import statistics
import time

import torch

from pyramidkv import make_method
from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.rkv import redundancy
from pyramidkv.runner.arguments import ArgumentParser


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    generator = torch.Generator().manual_seed(0)
    snapkv = make_method("snapkv", budget=128, window_size=8)   # R-KV's window, so the two read the same queries
    rkv = make_method("rkv", budget=128)
    print(f"one layer, 9 query / 3 KV heads, D 64, float32, 1 thread, {args.clock} clock, median of {args.repeats}")
    print("| held tokens n | snapkv s | rkv s | rkv / snapkv | rkv's redundancy share |")
    print("|---|---|---|---|---|")
    for n in args.lengths:
        queries = torch.randn(1, 9, n, 64, generator=generator)
        keys = torch.randn(1, 3, n, 64, generator=generator)
        ctx = ScoreContext(0, 30, queries, keys, keys, torch.ones(1, n, dtype=torch.bool))
        real = torch.ones(1, 3, n, dtype=torch.bool)
        times = {"snapkv": [], "rkv": [], "redundancy": []}
        for _ in range(args.repeats):   # interleaved: a load change hits all three alike
            for name, run in (("snapkv", lambda: snapkv.score(ctx)), ("rkv", lambda: rkv.score(ctx)),
                              ("redundancy", lambda: redundancy(keys, real, 0.5))):
                start = clock()
                run()
                times[name].append(clock() - start)
        s, r, d = (statistics.median(times[k]) for k in ("snapkv", "rkv", "redundancy"))
        print(f"| {n} | {s:.4f} | {r:.4f} | {r / s:.1f}x | {d / r:.0%} |")


if __name__ == "__main__":
    main()
