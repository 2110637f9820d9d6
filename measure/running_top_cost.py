"""What the running cut of head_allocation global costs (core/running_top.py), apart from the model's forward.

    python measure/running_top_cost.py --context_length 4096 --max_capacity_prompts 256 --rounds 3

The prefill pipeline of one prompt is fed synthetic scored layers of the default model's shape (SmolLM2-135M: 30
layers, 3 KV heads, head dim 64, float32; random K/V and SnapKV-like scores: a random attention row's window sums),
once with the running cut and once with every layer waiting whole until the last is scored, in interleaved rounds.
Per path: the thread CPU time of all the layers' `keep` calls (the selection, the cut, the gathers) and the peak
prefill K/V bytes. The kept positions of the two paths are checked equal. The model's own forward (the same for
both) is not here: measure/benchmark_latency_memory.py times the whole prefill.
"""

from __future__ import annotations

import statistics
import time

import torch

from pyramidkv import make_method
from pyramidkv.components import ModelShape
import pyramidkv.core.prefill as prefill_module
from pyramidkv.core.prefill import PromptCompressor, ScoredLayer
from pyramidkv.runner.arguments import ArgumentParser

LAYERS, KV_HEADS, QUERY_HEADS, DIM = 30, 3, 9, 64


def layers(n: int, seed: int) -> list[ScoredLayer]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        keys, values = torch.randn(1, KV_HEADS, n, DIM, generator=g), torch.randn(1, KV_HEADS, n, DIM, generator=g)
        scores = torch.softmax(torch.randn(1, KV_HEADS, n, generator=g) * 3, dim=-1) * 32
        out.append(ScoredLayer(keys, values, scores, None, None))
    return out


def run(method, scored: list[ScoredLayer], n: int, cut: bool) -> tuple[float, int, list]:
    """(CPU seconds of every layer's keep, peak prefill K/V bytes, kept positions per layer)."""
    original = prefill_module.runs_top
    if not cut:
        prefill_module.runs_top = lambda m: False
    try:
        shape = ModelShape(LAYERS, QUERY_HEADS, KV_HEADS, head_dim=DIM, dtype_bytes=4)
        compressor = PromptCompressor(method, shape, [0], n)
        kept, peak, spent = {}, 0, 0.0
        for layer, one in enumerate(scored):
            start = time.thread_time()
            kept.update(compressor.keep(layer, ScoredLayer(one.keys, one.values, one.scores, None, None)))
            spent += time.thread_time() - start
            peak = max(peak, compressor.peak_waiting_bytes, compressor.waiting_bytes())
    finally:
        prefill_module.runs_top = original
    return spent, peak, [kept[layer][0].positions for layer in range(LAYERS)]


def main() -> None:
    parser = ArgumentParser(prog="running_top_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--context_length", type=int, default=4096)
    parser.add_argument("--max_capacity_prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.context_length
    method = make_method("snapkv", budget=args.max_capacity_prompts, head_allocation="global")
    scored = layers(n, seed=0)
    times = {True: [], False: []}
    peaks = {}
    for _ in range(args.rounds + 1):   # the first round warms up
        kept = {}
        for cut in (True, False):
            spent, peaks[cut], kept[cut] = run(method, scored, n, cut)
            times[cut].append(spent)
        assert all(torch.equal(a, b) for a, b in zip(kept[True], kept[False])), "the two paths keep different tokens"
    full = LAYERS * KV_HEADS * n * DIM * 2 * 4
    print(f"n = {n}, budget {args.max_capacity_prompts}, {args.rounds} rounds (median, thread CPU s); fullkv "
          f"{full / 2**20:.2f} MiB")
    print("| path | keep(), all layers, CPU s | peak prefill KV MiB | x fullkv |")
    print("|---|---|---|---|")
    for cut, name in ((False, "every layer waits whole"), (True, "running cut")):
        print(f"| {name} | {statistics.median(times[cut][1:]):.3f} | {peaks[cut] / 2**20:.2f} | "
              f"{peaks[cut] / full:.4f} |")


if __name__ == "__main__":
    main()
