"""Decode attention over quantized blocks without dequantizing them (pyramidkv.quantization.kernels, the
stack in pyramidkv.quantization.stack, QuantizedStore.attend), against float64 references written here:
the blocks are unpacked and dequantized by numpy from their stored tensors, then multiplied in float64.
A wrong fold (scale or zero applied to the wrong group, tokens or channels out of order, a span cut at
the wrong byte) moves the result far beyond the tolerances below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyramidkv.core.quantized as quantized_module
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.quantized import QuantizedStore
from pyramidkv.quantization import GEARQuantizer, KIVIQuantizer, KVQuantQuantizer
from pyramidkv.quantization.kernels import Scratch, folds, key_scores, weighted_values
from pyramidkv.quantization.stack import BlockStack, split_groups, splits

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
def test_folded_key_scores_equal_float64_dequantize_then_matmul(nbits, group, reader):
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
def test_folded_weighted_values_equal_float64_dequantize_then_matmul(nbits, group, reader):
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


# --- outliers and low-rank terms (GEAR: x ~ D + L + S, S replacing D + L at its entries) --------------------

def planted_block(quantizer, layout: str, heads: int, tokens: int, edges: list[int], seed: int, decoding: bool):
    """A block whose outliers include entries at the tokens `edges` (planted large values, 3 channels each),
    so that spans cut at those tokens have outliers on their first and last rows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, tokens, HEAD_DIM, generator=generator) * torch.linspace(0.3, 3.0, HEAD_DIM)
    for i, t in enumerate(edges):
        for h in range(heads):
            x[h, t, (7 * i + 5 * h + torch.arange(3) * 11) % HEAD_DIM] = 40.0 * (-1) ** (i + h)
    quantize = quantizer.quantize_keys if layout == "channel" else quantizer.quantize_values
    block = quantize(x, decoding=decoding)
    if block.outlier_index is not None:                   # every planted token holds an outlier in every head
        tokens_held = block.flat_outlier_index() // HEAD_DIM
        assert all(bool((tokens_held == t).any(1).all()) for t in edges)
    return block


GEAR_SETTINGS = {   # id -> (quantizer, decoding): rank 4 at prefill, rank 2 while decoding, one part alone
    "gear-prefill-rank4": (GEARQuantizer(group_size=16, residual_length=16), False),
    "gear-decode-rank2": (GEARQuantizer(group_size=16, residual_length=16), True),
    "gear-4bit-g64": (GEARQuantizer(nbits=4, group_size=64, residual_length=64, rank=3), False),
    "gear-outliers-only": (GEARQuantizer(group_size=32, residual_length=32, rank=0, decode_rank=0), False),
    "gear-low-rank-only": (GEARQuantizer(group_size=16, residual_length=16, outlier_fraction=0.0), False),
    "kvquant-row-outliers": (KVQuantQuantizer(group_size=16, residual_length=0), False),
    "kvquant-nuq-shared-codebook": (KVQuantQuantizer(group_size=16, residual_length=0, datatype="nuq"), False),
}


@pytest.mark.parametrize("setting", list(GEAR_SETTINGS))
def test_key_scores_fold_outliers_and_low_rank_terms(setting):
    quantizer, decoding = GEAR_SETTINGS[setting]
    g, tokens = quantizer.group_size, 8 * quantizer.group_size
    edges = [0, g - 1, g, 3 * g - 1, 3 * g, tokens - g, tokens - 1]
    block = planted_block(quantizer, "channel", 3, tokens, edges, 12, decoding)
    low_rank = "low-rank" in setting or setting.startswith("gear") and "outliers-only" not in setting
    assert folds(block) and (block.left is not None) == low_rank
    if low_rank:
        assert block.rank == min(quantizer.decode_rank if decoding else quantizer.rank, HEAD_DIM)
    keys = dequantized_f64(block)
    queries = torch.randn(3, 5, HEAD_DIM, generator=torch.Generator().manual_seed(13))
    scratch = Scratch()
    for start, stop in [(0, tokens), (g, 3 * g), (3 * g, tokens), (tokens - g, tokens), (0, g), (g, tokens - g)]:
        got = key_scores(block, queries, start, stop, scratch=scratch)
        want = queries.double().numpy() @ keys[:, start:stop].transpose(0, 2, 1)
        assert got.shape == (3, 5, stop - start)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("setting", list(GEAR_SETTINGS))
def test_weighted_values_fold_outliers_and_low_rank_terms(setting):
    quantizer, decoding = GEAR_SETTINGS[setting]
    g, tokens = quantizer.group_size, 8 * quantizer.group_size
    edges = [0, 6, 7, 3 * g - 1, 3 * g, tokens - 1]
    block = planted_block(quantizer, "token", 3, tokens, edges, 14, decoding)
    assert folds(block)
    values = dequantized_f64(block)
    scratch = Scratch()
    for start, stop in [(0, tokens), (7, 3 * g), (6, 3 * g), (3 * g, tokens), (3 * g - 1, tokens - 1), (0, 7)]:
        probs = torch.softmax(torch.randn(3, 5, stop - start, generator=torch.Generator().manual_seed(start)), -1)
        got = weighted_values(block, probs, start, stop, torch.float32, scratch=scratch)
        want = probs.double().numpy() @ values[:, start:stop]
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_stacked_gear_decode_rows_fold():
    """GEAR groups quantized while decoding, stacked row by row (each with its own factors and outliers), read
    as one block and in spans of rows."""
    quantizer = GEARQuantizer(group_size=16, residual_length=16)
    keys, values = BlockStack(), BlockStack()
    for seed in range(5):
        heads = 1 + seed % 3
        keys.push(planted_block(quantizer, "channel", heads, 16, [0, 15], 20 + seed, True))
        values.push(planted_block(quantizer, "token", heads, 16, [0, 15], 30 + seed, True))
    generator = torch.Generator().manual_seed(15)
    for a, b in [(0, keys.rows), (2, 7), (keys.rows - 1, keys.rows)]:
        (k, _), (v, _) = keys.block(a, b), values.block(a, b)
        assert folds(k) and folds(v) and k.rank == 2 and k.outlier_index is not None
        queries = torch.randn(b - a, 3, HEAD_DIM, generator=generator)
        probs = torch.softmax(torch.randn(b - a, 3, 16, generator=generator), -1)
        np.testing.assert_allclose(key_scores(k, queries, 0, 16, scratch=Scratch()).double().numpy(),
                                   queries.double().numpy() @ dequantized_f64(k).transpose(0, 2, 1),
                                   rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(weighted_values(v, probs, 0, 16, torch.float32).double().numpy(),
                                   probs.double().numpy() @ dequantized_f64(v), rtol=1e-5, atol=1e-5)


def test_blocks_that_do_not_fold_are_dequantized_with_the_same_result():
    """Groups that split a byte and per-row codebooks (KVQuant nuq decode groups): the dequantized span."""
    quantizer = KIVIQuantizer(nbits=2, group_size=2, residual_length=0)
    keys, values = random_block(quantizer, "channel", 2, 64, 6), random_block(quantizer, "token", 2, 64, 7)
    assert not folds(keys) and not folds(values)
    kvquant = KVQuantQuantizer(group_size=16, residual_length=0)
    assert folds(random_block(kvquant, "token", 2, 64, 7)) and folds(random_block(GEARQuantizer(group_size=16), "token", 2, 64, 7))
    nuq = KVQuantQuantizer(group_size=16, residual_length=0, datatype="nuq")
    nuq_keys, nuq_values = random_block(nuq, "channel", 2, 64, 6), random_block(nuq, "token", 2, 64, 7)
    books = nuq_keys.codebook.unsqueeze(0).expand(2, -1), nuq_values.codebook.unsqueeze(0).expand(2, -1)
    assert not folds(nuq_keys, books[0]) and not folds(nuq_values, books[1])
    queries = torch.randn(2, 3, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    probs = torch.softmax(torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(9)), -1)
    for (k, v), (key_book, value_book) in [((keys, values), (None, None)), ((nuq_keys, nuq_values), books)]:
        np.testing.assert_allclose(key_scores(k, queries, 16, 48, key_book).double().numpy(),
                                   queries.double().numpy() @ dequantized_f64(k)[:, 16:48].transpose(0, 2, 1),
                                   rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(weighted_values(v, probs, 32, 64, torch.float32, value_book).double().numpy(),
                                   probs.double().numpy() @ dequantized_f64(v)[:, 32:64], rtol=1e-4, atol=1e-4)


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
def test_store_attention_equals_float64_softmax_over_ragged_segments(nbits, group, residual, reader):
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


@pytest.mark.parametrize("quantizer", [GEARQuantizer(group_size=16, residual_length=16),
                                       GEARQuantizer(group_size=32, residual_length=32, rank=0, decode_rank=0),
                                       KVQuantQuantizer(group_size=16, residual_length=0, sink_tokens=0)],
                         ids=["gear", "gear-outliers-only", "kvquant-values"])
def test_store_attention_over_blocks_read_whole_equals_a_float64_softmax(quantizer):
    """GEAR's prefill blocks keep their outliers and low-rank factors (read whole, not split into groups), its
    decode groups are stacked with theirs; attention folds both (the outliers and low-rank terms as
    corrections). Two prompts of ragged heads, prefill blocks read in spans cut inside them. The reference is
    a float64 softmax over what the store holds, dequantized."""
    kept, positions = zip(*(kept_prompt(c, seed) for seed, c in enumerate([[70, 130, 33], [200, 12, 96]])))
    store = QuantizedStore(quantizer, list(kept), list(positions), [300, 300], None, Scratch())
    assert store.prefill and store.decoded.prefill_rows == 0
    generator = torch.Generator().manual_seed(7)
    for step in range(40):
        keys, values = torch.randn(2, 2, 3, 1, HEAD_DIM, generator=generator)
        store.append(keys, values, torch.tensor([300 + step, 300 + step]))
    assert store.decoded.rows > 0                                  # groups were quantized while decoding
    stacked_values, _ = store.decoded.values.block()
    assert folds(stacked_values) and stacked_values.outlier_index is not None
    assert all(folds(group.values) and group.values.outlier_index is not None for group in store.prefill)
    queries = torch.randn(2, 6, 1, HEAD_DIM, generator=generator)
    chunk = quantized_module.CHUNK_ELEMENTS
    quantized_module.CHUNK_ELEMENTS = 3 * HEAD_DIM * 64           # prefill blocks read in spans of 64 tokens
    try:
        got = store.attend(queries)
    finally:
        quantized_module.CHUNK_ELEMENTS = chunk
    for b in range(2):
        for h, (_, keys, values) in enumerate(store.stored_kv(b)):
            for j in range(2):
                logits = keys.double() @ queries[b, 2 * h + j, 0].double() / HEAD_DIM ** 0.5
                want = torch.softmax(logits, 0) @ values.double()
                torch.testing.assert_close(got[b, 2 * h + j, 0].double(), want, rtol=1e-5, atol=2e-5)
