"""One layer's decode attention over a KIVI-quantized store against the full-precision store of the same tokens,
thread CPU time, one torch thread, rows interleaved in one process (SmolLM2-135M's layer shape: 3 stored heads,
3 query heads each, head dim 64, float32).

    PYTHONPATH=. python measure/quantized_attend.py --lengths 1024 4096 --rounds 30

Rows: "full precision" (FullPrecisionStore.attend), "kivi, spans" (the stacked groups read span by span, each
G-token group its own product: the path before the grid, still taken by stacks that are not plain), "kivi, grid"
(quantization/cells.py), "kivi, torch ops" (the grid read by torch ops instead of the C kernels of
pyramidkv/native; the two rows before use the C kernels where this machine built them). Each store holds n prompt
tokens of every head plus 16 appended (the decode benchmark's steps). Prints per length the least CPU milliseconds per
attend of each row over the rounds (the machine is shared: the least is the run least disturbed) and its ratio to full
precision.
"""

from __future__ import annotations

import time

import torch

from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.quantized import QuantizedStore
from pyramidkv import native
from pyramidkv.quantization import KIVIQuantizer
from pyramidkv.quantization.kernels import Scratch
from pyramidkv.quantization.stack import DecodeBlocks
from pyramidkv.runner.arguments import ArgumentParser

HEADS, QUERY_HEADS, DIM, APPENDED = 3, 9, 64, 16


def stores(n: int, nbits: int):
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(HEADS * n, DIM, generator=generator) for _ in range(2))
    positions = torch.arange(n).repeat(HEADS)
    quantized = QuantizedStore(KIVIQuantizer(nbits=nbits), [KeptKV(keys, values, [n] * HEADS, positions)],
                               [positions], [n], None, Scratch())
    full = FullPrecisionStore([KeptKV(keys.clone(), values.clone(), [n] * HEADS, positions)], [n])
    for step in range(APPENDED):
        k, v = torch.randn(2, 1, HEADS, 1, DIM, generator=generator)
        for store in (quantized, full):
            store.append(k, v, torch.tensor([n + step]))
    return quantized, full, torch.randn(1, QUERY_HEADS, 1, DIM, generator=generator)


def main() -> None:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--nbits", type=int, default=2, choices=(2, 4, 8))
    args = ap.parse_args()
    torch.set_num_threads(1)
    grid = DecodeBlocks.grid
    for n in args.lengths:
        quantized, full, queries = stores(n, args.nbits)

        def spans():
            DecodeBlocks.grid = lambda self: None
            try:
                return quantized.attend(queries)
            finally:
                DecodeBlocks.grid = grid

        def torch_ops():
            with native.off():
                return quantized.attend(queries)

        rows = {"full precision": lambda: full.attend(queries), "kivi, spans": spans,
                "kivi, grid": lambda: quantized.attend(queries), "kivi, torch ops": torch_ops}
        times = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, attend in rows.items():
                attend()
                start = time.thread_time()
                for _ in range(5):
                    attend()
                times[name].append((time.thread_time() - start) / 5)
        base = min(times["full precision"])
        print(f"n = {n}, kivi-{args.nbits}, {args.rounds} rounds, least CPU ms per attend (x full precision)")
        for name, values in times.items():
            print(f"  {name:17s} {min(values) * 1e3:7.3f}  ({min(values) / base:.2f}x)")


if __name__ == "__main__":
    main()
