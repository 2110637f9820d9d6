"""Decode attention over a ragged cache against a dense cache of the same size: each layer's held counts per head
after a real prefill of a threshold method (kvzap, duo_attention), its rows attended one segment at a time (the
threshold decoder's path, core/layout.py `_attend_segments`: in C, pyramidkv/native/segment_attend.c, and by the
torch ops it replaces) or in blocks of segments (the ragged path of AdaKV and
HeadKV), beside a dense store holding each layer's mean count in every head. Thread CPU time, one torch thread,
rows interleaved in one process, random K/V (the counts set the cost, not the values), 16 tokens appended.

    PYTHONPATH=. python measure/ragged_attend.py --context_length 4096 --methods kvzap duo_attention --rounds 15

Prints per method the median CPU milliseconds of one attend over every layer, and each row's ratio to dense.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model
from pyramidkv.benchmarks.measure import method_from_spec, prompt_ids
from pyramidkv import native
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.runner.arguments import ArgumentParser

APPENDED = 16


def held_counts(model, ids, spec: str) -> list[list[int]]:
    """Per layer, per stored head: what the method's cache holds after its prefill."""
    patch = compress(model, method_from_spec(spec, 256))
    try:
        cache = patch.new_cache(ids.tolist(), None)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        return [cache.held_counts(layer)[0] for layer in range(len(cache.layers))]
    finally:
        patch.remove()


def store(counts: list[int], dim: int, query_heads: int, by_segment: bool, generator) -> FullPrecisionStore:
    total = sum(counts)
    keys, values = (torch.randn(total, dim, generator=generator) for _ in range(2))
    positions = torch.cat([torch.arange(n) for n in counts])
    built = FullPrecisionStore([KeptKV(keys, values, list(counts), positions)], [max(counts)])
    built.by_segment = by_segment
    for _ in range(APPENDED):
        built.append(*torch.randn(2, 1, len(counts), 1, dim, generator=generator), None)
    return built


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--context_length", type=int, default=4096)
    parser.add_argument("--methods", nargs="+", default=["kvzap", "duo_attention"])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model_path, "sdpa", "cpu", None)
    config = model.config
    dim, query_heads = config.hidden_size // config.num_attention_heads, config.num_attention_heads
    ids = prompt_ids(tokenizer, args.context_length)
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(1, query_heads, 1, dim, generator=generator)
    for spec in args.methods:
        layers = held_counts(model, ids, spec)
        by_segment = [store(c, dim, query_heads, True, generator) for c in layers]
        rows = {
            "ragged, by segment": by_segment,
            "ragged, by segment, torch ops": by_segment,
            "ragged, in blocks": [store(c, dim, query_heads, False, generator) for c in layers],
            "dense, same size": [store([round(sum(c) / len(c))] * len(c), dim, query_heads, False, generator)
                                 for c in layers]}
        times = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, stores in rows.items():
                with native.off() if name.endswith("torch ops") else contextlib.nullcontext():
                    start = time.thread_time()
                    for layer_store in stores:
                        layer_store.attend(queries)
                    times[name].append(time.thread_time() - start)
        dense = statistics.median(times["dense, same size"])
        print(f"\n{spec}: {sum(map(sum, layers))} held tokens over {len(layers)} layers\n\n"
              f"| row | ms per attend of every layer | x dense |\n|---|---|---|")
        for name, values in times.items():
            print(f"| {name} | {1000 * statistics.median(values):.2f} | {statistics.median(values) / dense:.3f} |")


if __name__ == "__main__":
    main()
