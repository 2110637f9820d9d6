"""The quantized store's grid read (pyramidkv.quantization.cells): KIVI's stacked groups read as one [S, M] grid
of cells, one matmul per segment for the values. Against a float64 softmax over what the store holds (dequantized
by numpy from the stored codes, tests/quantization/test_folded_attention.py's reference), in the three layouts
the grid meets: the stack already in grid order (every head quantized the same count), gathered into grid order
(ragged heads, empty cells, groups pushed while decoding), and under a logit soft-cap (empty cells masked after
the cap)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.quantized import QuantizedStore
from pyramidkv.quantization import GEARQuantizer, KIVIQuantizer
from pyramidkv.quantization.kernels import Scratch
from tests.quantization.test_folded_attention import HEAD_DIM, dequantized_f64, kept_prompt


def float64_attention(store: QuantizedStore, queries: torch.Tensor, softcap=None) -> np.ndarray:
    """[B, Hq, D]: softmax attention per query head over its stored head's tokens, every stored block dequantized
    by numpy (the stacked groups from their codes, scales and zeros), in float64."""
    heads, group = store.heads, queries.shape[1] // store.heads
    stacked_keys, _ = store.decoded.keys.block()
    stacked_values, _ = store.decoded.values.block()
    keys_f64, values_f64 = dequantized_f64(stacked_keys), dequantized_f64(stacked_values)     # [R, G, D]
    out = np.zeros((queries.shape[0], queries.shape[1], HEAD_DIM))
    for s in range(store.segments):
        rows = (store.decoded.segment == s).nonzero().squeeze(1)
        rows = rows[store.decoded.slot[rows].argsort()].numpy()
        sink, fp = int(store.sink[s]), int(store.fp_len[s])
        keys = np.concatenate([keys_f64[rows].reshape(-1, HEAD_DIM), store.fp_keys[s, sink:fp].double().numpy()])
        values = np.concatenate([values_f64[rows].reshape(-1, HEAD_DIM), store.fp_values[s, sink:fp].double().numpy()])
        b, h = divmod(s, heads)
        for j in range(group):
            logits = keys @ queries[b, h * group + j, 0].double().numpy() / HEAD_DIM ** 0.5
            if softcap is not None:
                logits = np.tanh(logits / softcap) * softcap
            weights = np.exp(logits - logits.max())
            out[b, h * group + j] = weights / weights.sum() @ values
    return out


def grown_store(counts, quantizer, steps: int, form=AttentionForm()) -> QuantizedStore:
    kept, positions = zip(*(kept_prompt(c, seed) for seed, c in enumerate(counts)))
    store = QuantizedStore(quantizer, list(kept), list(positions), [300] * len(counts), None, Scratch(), form)
    generator = torch.Generator().manual_seed(11)
    heads = len(counts[0])
    for step in range(steps):
        keys, values = torch.randn(2, len(counts), heads, 1, HEAD_DIM, generator=generator)
        store.append(keys, values, torch.tensor([300 + step] * len(counts)))
    return store


@pytest.mark.parametrize("counts,steps,in_order,empty", [
    ([[160, 160, 160]], 3, True, False),            # the prefill's groups are the grid: read as views
    ([[160, 160, 160], [96, 96, 96]], 0, False, True),   # two prompts: the second's cells past 2 groups empty
    ([[70, 130, 33], [200, 12, 96]], 40, False, True),   # ragged heads, groups pushed while decoding
])
def test_grid_read_equals_a_float64_softmax_over_the_dequantized_store(counts, steps, in_order, empty, reader):
    store = grown_store(counts, KIVIQuantizer(nbits=2, group_size=32, residual_length=32), steps)
    grid = store.decoded.grid()
    assert grid is not None
    assert (grid.order is None) == in_order and (grid.empty is not None) == empty
    queries = torch.randn(len(counts), 6, 1, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    got = store.attend(queries)[:, :, 0].double().numpy()
    np.testing.assert_allclose(got, float64_attention(store, queries), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("nbits,group", [(4, 16), (8, 32), (2, 8)])
def test_grid_read_at_other_widths(nbits, group, reader):
    store = grown_store([[70, 130, 33]], KIVIQuantizer(nbits=nbits, group_size=group, residual_length=group), group + 3)
    assert store.decoded.grid() is not None
    queries = torch.randn(1, 6, 1, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    got = store.attend(queries)[:, :, 0].double().numpy()
    np.testing.assert_allclose(got, float64_attention(store, queries), rtol=1e-5, atol=2e-5)


def test_soft_capped_grid_masks_empty_cells_after_the_cap(reader):
    """cap(lowest) is -softcap, a logit like any other: empty cells must be masked after the cap, not before."""
    cap = 5.0
    store = grown_store([[70, 130, 33]], KIVIQuantizer(nbits=2, group_size=16, residual_length=16), 0,
                        AttentionForm(softcap=cap))
    assert store.decoded.grid().empty is not None
    queries = 4 * torch.randn(1, 6, 1, HEAD_DIM, generator=torch.Generator().manual_seed(9))
    got = store.attend(queries)[:, :, 0].double().numpy()
    np.testing.assert_allclose(got, float64_attention(store, queries, softcap=cap), rtol=1e-5, atol=2e-5)


def test_blocks_with_outliers_or_low_rank_terms_are_not_read_as_a_grid():
    store = grown_store([[70, 130, 33]], GEARQuantizer(group_size=16, residual_length=16), 20)
    assert store.decoded.stacked > 0 and store.decoded.grid() is None


def test_a_store_with_nothing_stacked_reads_without_a_grid():
    """GEAR's prefill blocks stay whole (outliers, low-rank term): before a group leaves the window the stack is
    empty, and attention reads the blocks and the window alone."""
    store = grown_store([[70, 130, 33]], GEARQuantizer(group_size=16, residual_length=16), 0)
    assert store.decoded.stacked == 0 and store.decoded.grid() is None
    queries = torch.randn(1, 6, 1, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    assert torch.isfinite(store.attend(queries)).all()
