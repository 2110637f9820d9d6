"""The segment path of decode attention in C (pyramidkv/native/segment_attend.c, called by core/layout.py): one
call a layer, against a float64 softmax attention written here per segment over its own kept rows (less those
marked gone) and the tail, for several query rows a stored head (1-9: one panel and more), head dims 64 and 40 (a
narrow panel), and left-padding-like masked tail logits. The torch path (the kernels turned off) is held to the same
reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import native
from pyramidkv.core import layout
from pyramidkv.core.kept import KeptKV


def kept_layer(lengths: list[list[int]], dim: int, seed: int) -> list[KeptKV]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for prompt in lengths:
        rows = sum(prompt)
        keys, values = torch.randn(rows, dim, generator=generator), torch.randn(rows, dim, generator=generator)
        positions = torch.cat([torch.arange(n) for n in prompt])
        out.append(KeptKV(keys, values, list(prompt), positions))
    return out


def reference(kept, gone, queries, tail_keys, tail_values, tail_mask) -> np.ndarray:
    """[B, Hq, 1, D] in float64: per stored head, softmax(q . [its rows not gone, tail]) @ [values]."""
    bsz, num_q, _, dim = queries.shape
    heads = len(kept[0].lengths)
    group = num_q // heads
    out = np.zeros((bsz, num_q, 1, dim))
    row = 0
    flat_gone = gone.numpy()
    for b, k in enumerate(kept):
        start = 0
        for h, n in enumerate(k.lengths):
            own = slice(start, start + n)
            stay = ~flat_gone[row + start: row + start + n]
            keys = np.concatenate([k.keys[own].double().numpy()[stay], tail_keys[b, h].double().numpy()])
            values = np.concatenate([k.values[own].double().numpy()[stay], tail_values[b, h].double().numpy()])
            allowed = np.concatenate([np.ones(int(stay.sum()), bool), tail_mask[b, h].numpy()])
            for j in range(group):
                q = queries[b, h * group + j, 0].double().numpy() * dim ** -0.5
                logits = np.where(allowed, keys @ q, -np.inf)
                weights = np.exp(logits - logits.max())
                out[b, h * group + j, 0] = weights / weights.sum() @ values
            start += n
        row += sum(k.lengths)
    return out


@pytest.mark.parametrize("in_c", [True, False])
@pytest.mark.parametrize("group,dim", [(1, 64), (3, 64), (4, 40), (9, 64)])
def test_segments_equal_a_float64_softmax(monkeypatch, in_c, group, dim):
    if not in_c:
        monkeypatch.setattr(native, "_OFF", [1])
    calls = []
    original = layout._segments_in_c
    monkeypatch.setattr(layout, "_segments_in_c", lambda *args: calls.append(1) or original(*args))
    lengths = [[37, 300, 5], [130, 1, 64]]                       # two prompts, three stored heads each
    kept = kept_layer(lengths, dim, seed=group)
    decode = layout.DecodeLayout(kept)
    decode.by_segment = True
    total = sum(map(sum, lengths))
    gone = torch.zeros(total, dtype=torch.bool)
    marked = [0, 5, 36, 40, 41, 200, 342 + 3, 342 + 129]          # rows of several segments, first and last rows
    gone[marked] = True
    decode.gone = gone
    decode.mark(marked)
    generator = torch.Generator().manual_seed(7)
    heads, tail = 3, 6
    queries = torch.randn(2, heads * group, 1, dim, generator=generator) * 3
    tail_keys, tail_values = torch.randn(2, 2, heads, tail, dim, generator=generator)
    tail_gone = torch.zeros(2, heads, 2, dtype=torch.bool)
    tail_gone[0, 1, 0] = tail_gone[1, 2, 1] = True                 # tail tokens that left: masked logits
    got = decode.attend(queries, tail_keys, tail_values, tail_gone)
    mask = torch.ones(2, heads, tail, dtype=torch.bool)
    mask[:, :, :2] = ~tail_gone
    np.testing.assert_allclose(got.double().numpy(), reference(kept, gone, queries, tail_keys, tail_values, mask),
                               rtol=1e-5, atol=1e-5)
    assert bool(calls) == in_c
