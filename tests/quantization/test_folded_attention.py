"""Decode attention over quantized blocks without dequantizing them (pyramidkv.quantization.kernels, the
stack in pyramidkv.quantization.stack, QuantizedStore.attend), against float64 references written here:
the blocks are unpacked and dequantized by numpy from their stored tensors, then multiplied in float64.
A wrong fold (scale or zero applied to the wrong group, tokens or channels out of order, a span cut at
the wrong byte) moves the result far beyond the tolerances below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv.core.kept import KeptKV
from pyramidkv.core.quantized import QuantizedStore
from pyramidkv.quantization import GEARQuantizer, KIVIQuantizer, KVQuantQuantizer
from pyramidkv.quantization.kernels import Scratch, folds, key_scores, weighted_values
from pyramidkv.quantization.stack import split_groups, splits

HEAD_DIM = 64


# --- references -----------------------------------------------------------------------------------

def dequantized_f64(block) -> np.ndarray:
    """The block's tensor [N, T, D] in float64, from its stored codes, scales, zeros, codebook, low-rank
    factors and outliers (block.py's format), element by element in numpy."""
    n, tokens, dim = block.shape
    num_rows, length = block.rows
    per = 8 // block.nbits
    packed = block.codes.numpy().astype(np.int64)
    i = np.arange(length)
    codes = (packed[..., i // per] >> ((i % per) * block.nbits)) & ((1 << block.nbits) - 1)     # [N, V, L]
    levels = codes.astype(np.float64)
    if block.codebook is not None:
        levels = block.codebook.double().numpy()[codes]
    group = np.arange(length) // block.group_size
    x = levels * block.scale.double().numpy()[..., group] + block.zero.double().numpy()[..., group]
    if block.layout == "channel":
        x = x.transpose(0, 2, 1)
    x = np.ascontiguousarray(x)
    if block.left is not None:
        x = x + block.left.double().numpy() @ block.right.double().numpy().transpose(0, 2, 1)
    if block.outlier_index is not None:
        index = block.outlier_index.numpy().astype(np.int64)
        values = block.outlier_value.double().numpy()
        for h in range(n):
            for row in range(index.shape[1]):
                for k in range(index.shape[2]):
                    if block.outlier_layout == "head":
                        t, d = divmod(int(index[h, row, k]), dim)
                    elif block.layout == "channel":
                        t, d = int(index[h, row, k]), row
                    else:
                        t, d = row, int(index[h, row, k])
                    x[h, t, d] = values[h, row, k]
    return x


def random_block(quantizer, layout: str, heads: int, tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, tokens, HEAD_DIM, generator=generator) * torch.linspace(0.3, 3.0, HEAD_DIM)
    return quantizer.quantize_keys(x) if layout == "channel" else quantizer.quantize_values(x)


# 2 bits: a group row of G / 4 bytes, moved as 1 (G = 4), 2, 4 or 8 bytes (G = 32) or as two 8-byte words.
SETTINGS = [(2, 4), (2, 8), (2, 16), (2, 32), (2, 64), (4, 8), (4, 32), (8, 16), (8, 64)]


# --- the kernels ------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbits,group", SETTINGS)
def test_folded_key_scores_equal_float64_dequantize_then_matmul(nbits, group):
    block = random_block(KIVIQuantizer(nbits=nbits, group_size=group, residual_length=0), "channel", 3, 4 * 64, 1)
    assert folds(block)
    keys = dequantized_f64(block)
    queries = torch.randn(3, 5, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    scratch = Scratch()
    tokens = block.shape[1]
    for start, stop in [(0, tokens), (group, tokens - group), (tokens - group, tokens), (0, group)]:
        got = key_scores(block, queries, start, stop, scratch=scratch)
        want = queries.double().numpy() @ keys[:, start:stop].transpose(0, 2, 1)
        assert got.shape == (3, 5, stop - start)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("nbits,group", SETTINGS)
def test_folded_weighted_values_equal_float64_dequantize_then_matmul(nbits, group):
    block = random_block(KIVIQuantizer(nbits=nbits, group_size=group, residual_length=0), "token", 3, 160, 3)
    assert folds(block)
    values = dequantized_f64(block)
    scratch = Scratch()
    for start, stop in [(0, 160), (group, 160 - group), (160 - group, 160), (7, 90)]:     # any token span
        probs = torch.softmax(torch.randn(3, 5, stop - start, generator=torch.Generator().manual_seed(start)), -1)
        got = weighted_values(block, probs, start, stop, torch.float32, scratch=scratch)
        want = probs.double().numpy() @ values[:, start:stop]
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_shared_codebook_folds_too():
    quantizer = KVQuantQuantizer(nbits=4, group_size=16, residual_length=0, outlier_fraction=0.0, datatype="nuq")
    keys, values = random_block(quantizer, "channel", 2, 64, 4), random_block(quantizer, "token", 2, 64, 5)
    assert keys.codebook is not None and folds(keys) and values.codebook is not None and folds(values)
    generator = torch.Generator().manual_seed(6)
    queries = torch.randn(2, 4, HEAD_DIM, generator=generator)
    probs = torch.softmax(torch.randn(2, 3, 64, generator=generator), -1)
    np.testing.assert_allclose(key_scores(keys, queries, 16, 64).double().numpy(),
                               queries.double().numpy() @ dequantized_f64(keys)[:, 16:64].transpose(0, 2, 1),
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(weighted_values(values, probs, 0, 64, torch.float32).double().numpy(),
                               probs.double().numpy() @ dequantized_f64(values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantizer", [GEARQuantizer(group_size=16, residual_length=16),
                                       KVQuantQuantizer(group_size=16, residual_length=0),
                                       KIVIQuantizer(nbits=2, group_size=2, residual_length=0)],
                         ids=["gear", "kvquant", "kivi-groups-inside-a-byte"])
def test_blocks_that_do_not_fold_are_dequantized_with_the_same_result(quantizer):
    keys, values = random_block(quantizer, "channel", 2, 64, 6), random_block(quantizer, "token", 2, 64, 7)
    assert not folds(keys) and not folds(values)
    queries = torch.randn(2, 3, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    probs = torch.softmax(torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(9)), -1)
    np.testing.assert_allclose(key_scores(keys, queries, 16, 48).double().numpy(),
                               queries.double().numpy() @ dequantized_f64(keys)[:, 16:48].transpose(0, 2, 1),
                               rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(weighted_values(values, probs, 32, 64, torch.float32).double().numpy(),
                               probs.double().numpy() @ dequantized_f64(values)[:, 32:64], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("nbits,group", [(2, 8), (2, 32), (4, 16), (8, 32)])
def test_a_block_split_into_groups_stores_the_same_bytes_and_values(nbits, group):
    quantizer = KIVIQuantizer(nbits=nbits, group_size=group, residual_length=0)
    for layout in ("channel", "token"):
        block = random_block(quantizer, layout, 3, 4 * group, 10)
        assert splits(block)
        rows = split_groups(block)
        assert rows.shape == (12, group, HEAD_DIM) and rows.nbytes() == block.nbytes()
        np.testing.assert_array_equal(dequantized_f64(rows).reshape(3, 4 * group, HEAD_DIM), dequantized_f64(block))
    assert not splits(random_block(GEARQuantizer(group_size=16), "channel", 1, 32, 11))


def test_scratch_views_follow_a_replaced_buffer():
    scratch = Scratch()
    small = scratch.take("levels", (2, 3), torch.float32, torch.device("cpu"))
    assert scratch.take("levels", (2, 3), torch.float32, torch.device("cpu")) is small      # same shape: same view
    large = scratch.take("levels", (50, 50), torch.float32, torch.device("cpu"))             # the buffer grows
    again = scratch.take("levels", (2, 3), torch.float32, torch.device("cpu"))
    assert again.data_ptr() == large.data_ptr() != small.data_ptr()


# --- the store ------------------------------------------------------------------------------------

def kept_prompt(counts: list[int], seed: int) -> tuple[KeptKV, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    total = sum(counts)
    keys = torch.randn(total, HEAD_DIM, generator=generator) * torch.linspace(0.3, 3.0, HEAD_DIM)
    values = torch.randn(total, HEAD_DIM, generator=generator)
    positions = torch.cat([torch.sort(torch.randperm(300, generator=generator)[:n]).values for n in counts])
    return KeptKV(keys, values, list(counts), positions), positions


def expected_attention(quantizer, handed_keys, handed_values, query) -> np.ndarray:
    """float64 softmax attention of query [D] over one segment's tokens as the store must hold them: the first
    G * floor((n - R) / G) quantized (KIVI groups depend on their own tokens only), the rest exact."""
    n = handed_keys.shape[0]
    q = quantizer.group_size * (max(0, n - quantizer.residual_length) // quantizer.group_size)
    keys, values = handed_keys.double().numpy().copy(), handed_values.double().numpy().copy()
    if q:
        keys[:q] = dequantized_f64(quantizer.quantize_keys(handed_keys[None, :q]))[0]
        values[:q] = dequantized_f64(quantizer.quantize_values(handed_values[None, :q]))[0]
    logits = keys @ query.double().numpy() / HEAD_DIM ** 0.5
    weights = np.exp(logits - logits.max())
    return weights / weights.sum() @ values


@pytest.mark.parametrize("nbits,group,residual", [(2, 32, 32), (2, 8, 16), (4, 16, 0), (8, 32, 64), (2, 16, 128)])
def test_store_attention_equals_float64_softmax_over_ragged_segments(nbits, group, residual):
    """Two prompts of three stored heads keeping different counts (with most settings some head holds fewer
    than R tokens, or no whole group past R, at first), 2 query heads per stored head; tokens appended until
    groups leave the windows while decoding."""
    quantizer = KIVIQuantizer(nbits=nbits, group_size=group, residual_length=residual)
    counts = [[70, 130, 33], [200, 12, 96]]
    kept, positions = zip(*(kept_prompt(c, seed) for seed, c in enumerate(counts)))
    store = QuantizedStore(quantizer, list(kept), list(positions), [300, 300], None, Scratch())
    handed = [list(zip(k.keys.split(k.lengths), k.values.split(k.lengths))) for k in kept]
    generator = torch.Generator().manual_seed(42)
    steps = group + 5
    for step in range(steps):
        keys, values = torch.randn(2, 2, 3, 1, HEAD_DIM, generator=generator)
        store.append(keys, values, torch.tensor([300 + step, 300 + step]))
        for b in range(2):
            handed[b] = [(torch.cat([k, keys[b, h]]), torch.cat([v, values[b, h]]))
                         for h, (k, v) in enumerate(handed[b])]
        if step % 4 and step != steps - 1:
            continue
        queries = torch.randn(2, 6, 1, HEAD_DIM, generator=generator)
        got = store.attend(queries)
        for b in range(2):
            for h in range(3):
                for j in range(2):
                    want = expected_attention(quantizer, *handed[b][h], queries[b, 2 * h + j, 0])
                    np.testing.assert_allclose(got[b, 2 * h + j, 0].double().numpy(), want, rtol=1e-5, atol=2e-5)
    assert store.decoded.rows > 0                                  # groups were quantized while decoding


def test_store_attention_over_blocks_read_whole_equals_a_float64_softmax():
    """GEAR's blocks keep their outliers and low-rank factors (not stacked): attention dequantizes them span by
    span; the reference is a float64 softmax over what the store holds, dequantized."""
    quantizer = GEARQuantizer(group_size=16, residual_length=16)
    kept, positions = zip(*(kept_prompt(c, seed) for seed, c in enumerate([[70, 130, 33], [200, 12, 96]])))
    store = QuantizedStore(quantizer, list(kept), list(positions), [300, 300], None, Scratch())
    assert store.prefill and store.decoded.prefill_rows == 0
    generator = torch.Generator().manual_seed(7)
    for step in range(20):
        keys, values = torch.randn(2, 2, 3, 1, HEAD_DIM, generator=generator)
        store.append(keys, values, torch.tensor([300 + step, 300 + step]))
    queries = torch.randn(2, 6, 1, HEAD_DIM, generator=generator)
    got = store.attend(queries)
    for b in range(2):
        for h, (_, keys, values) in enumerate(store.stored_kv(b)):
            for j in range(2):
                logits = keys.double() @ queries[b, 2 * h + j, 0].double() / HEAD_DIM ** 0.5
                want = torch.softmax(logits, 0) @ values.double()
                torch.testing.assert_close(got[b, 2 * h + j, 0].double(), want, rtol=1e-5, atol=2e-5)
