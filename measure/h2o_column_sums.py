"""H2O's prefill attention with column sums, the two paths side by side against the model's own causal kernel, one
layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64), random float32 tensors, one prompt.

    PYTHONPATH=. python measure/h2o_column_sums.py --lengths 1024 4096 --rounds 3 [--device cpu|cuda]
        [--dtype bfloat16] [--json FILE]

Rows, interleaved each round, median of the rounds (thread CPU time on the CPU, synchronized wall time on CUDA):
  sdpa      torch's scaled_dot_product_attention, causal (what the plain prefill runs; no column sums)
  explicit  scoring.attention_with_column_sums (one pass: chunks of queries, an explicit float32 softmax)
  fused     fused_column_sums.fused_attention_with_column_sums (the fused kernel with its logsumexp, then one
            [q, -lse] . [k, 1] product per chunk of queries)
Prints each row's seconds and its ratio to sdpa; decides core/fused_column_sums.FUSED_DEVICES.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pyramidkv.core.fused_column_sums import fused_attention_with_column_sums
from pyramidkv.core.scoring import attention_with_column_sums
from pyramidkv.runner.arguments import ArgumentParser


def main() -> None:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--json", default=None, help="the medians and ratios per length (for scripts/gpu_check.py)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    device = torch.device(args.device)

    def clock():
        if device.type == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    report = {}
    for n in args.lengths:
        torch.manual_seed(0)
        q = torch.randn(1, 9, n, 64, device=device, dtype=dtype)
        k, v = (torch.randn(1, 3, n, 64, device=device, dtype=dtype) for _ in range(2))
        real = torch.ones(1, n, dtype=torch.bool, device=device)
        rows = {
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True),
            "explicit": lambda: attention_with_column_sums(q, k, v, real),
            "fused": lambda: fused_attention_with_column_sums(q, k, v, real),
        }
        times = {name: [] for name in rows}
        with torch.no_grad():
            for run in rows.values():
                run()
            for _ in range(args.rounds):
                for name, run in rows.items():
                    start = clock()
                    run()
                    times[name].append(clock() - start)
        base = statistics.median(times["sdpa"])
        print(f"n = {n}, {device.type}, median of {args.rounds}:")
        for name, t in times.items():
            print(f"  {name:9s} {statistics.median(t):8.4f} s  {statistics.median(t) / base:5.2f}x sdpa")
        report[n] = {name: {"seconds": statistics.median(t), "x_sdpa": round(statistics.median(t) / base, 3)}
                     for name, t in times.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "dtype": args.dtype, "rounds": args.rounds, "lengths": report}, f,
                      indent=1)


if __name__ == "__main__":
    main()
