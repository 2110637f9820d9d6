"""KV quantizer units (pyramidkv.quantization) against independent numpy references written here from
the papers' formulas; nothing below calls the code under test to produce an expected value."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from pyramidkv.quantization import (
    QUANTIZERS, GEARQuantizer, KIVIQuantizer, KVQuantQuantizer, make_quantizer, pack_codes, quantize_groups,
    unpack_codes,
)

BITS = (2, 4, 8)


# --- references ---------------------------------------------------------------------------------

def pack_ref(codes: np.ndarray, nbits: int) -> np.ndarray:
    """Code i of a row at bit (i % per_byte) * nbits of byte i // per_byte, one element at a time."""
    per = 8 // nbits
    rows = codes.reshape(-1, codes.shape[-1])
    out = np.zeros((rows.shape[0], math.ceil(codes.shape[-1] * nbits / 8)), dtype=np.uint8)
    for r, row in enumerate(rows):
        for i, c in enumerate(row):
            out[r, i // per] |= np.uint8(int(c) << ((i % per) * nbits))
    return out.reshape(*codes.shape[:-1], -1)


def unpack_ref(packed: np.ndarray, nbits: int, m: int) -> np.ndarray:
    per = 8 // nbits
    i = np.arange(m)
    return ((packed[..., i // per].astype(np.int64) >> ((i % per) * nbits)) & ((1 << nbits) - 1)).astype(np.uint8)


def uniform_ref(x: np.ndarray, nbits: int, keep: np.ndarray | None = None):
    """KIVI's asymmetric quantization of the groups x [..., G] (min/max over `keep` only), scale and zero
    rounded to fp16 before the codes are taken. Returns codes, scale, zero [..., 1], dequantized fp32."""
    x = x.astype(np.float32)
    levels = (1 << nbits) - 1
    keep = np.ones(x.shape, bool) if keep is None else keep
    lo = np.where(keep, x, np.inf).min(-1, keepdims=True)
    hi = np.where(keep, x, -np.inf).max(-1, keepdims=True)
    empty = ~keep.any(-1, keepdims=True)
    lo[empty], hi[empty] = 0, 0
    scale = ((hi - lo) / np.float32(levels)).astype(np.float16)
    zero = lo.astype(np.float16)
    s, z = scale.astype(np.float32), zero.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.clip(np.round((x - z) / s), 0, levels)
    codes = np.where((s > 0) & keep, codes, 0).astype(np.uint8)
    return codes, scale, zero, codes.astype(np.float32) * s + z


def top_ref(v: np.ndarray, fraction: float) -> np.ndarray:
    """Positions of the ceil(fraction * n) largest |v| (exact rational count; ties: lower position)."""
    k = math.ceil(Fraction(str(fraction)) * v.size)
    return np.argsort(-np.abs(v), kind="stable")[:k]


def keys_ref(keys: np.ndarray, nbits: int, group: int, keep: np.ndarray | None = None):
    """Per channel: groups of `group` tokens of one channel. Returns codes [N, D, T], scale/zero [N, D, T/G], deq [N, T, D]."""
    n, t, d = keys.shape
    rows = keys.transpose(0, 2, 1).reshape(n, d, t // group, group)
    k = None if keep is None else keep.transpose(0, 2, 1).reshape(rows.shape)
    codes, scale, zero, deq = uniform_ref(rows, nbits, k)
    return codes.reshape(n, d, t), scale[..., 0], zero[..., 0], deq.reshape(n, d, t).transpose(0, 2, 1)


def values_ref(values: np.ndarray, nbits: int, group: int, keep: np.ndarray | None = None):
    """Per token: groups of `group` channels of one token. Returns codes [N, T, D], scale/zero [N, T, D/G], deq."""
    n, t, d = values.shape
    rows = values.reshape(n, t, d // group, group)
    k = None if keep is None else keep.reshape(rows.shape)
    codes, scale, zero, deq = uniform_ref(rows, nbits, k)
    return codes.reshape(n, t, d), scale[..., 0], zero[..., 0], deq.reshape(n, t, d)


def sample(shape, seed=0, outliers=0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    x = g.normal(size=shape).astype(np.float32)
    x *= g.uniform(0.2, 3.0, size=(1, 1, shape[-1])).astype(np.float32)         # channels of different range
    flat = x.reshape(-1)
    flat[g.choice(flat.size, outliers, replace=False)] = g.choice([-1, 1], outliers) * g.uniform(20, 40, outliers)
    return torch.from_numpy(x)


def codes_of(block) -> np.ndarray:
    """The block's codes [N, V, L], unpacked by the reference."""
    return unpack_ref(block.codes.numpy(), block.nbits, block.rows[1])


# --- packing ------------------------------------------------------------------------------------

def test_pack_hand_built_bytes():
    assert pack_codes(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001]    # 57
    assert pack_codes(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [57, 3]
    assert pack_codes(torch.tensor([1, 2, 15], dtype=torch.uint8), 4).tolist() == [0x21, 0x0F]
    assert pack_codes(torch.tensor([7, 200], dtype=torch.uint8), 8).tolist() == [7, 200]


@pytest.mark.parametrize("nbits", BITS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 13])
def test_pack_matches_reference_and_round_trips(nbits, m):
    codes = np.random.default_rng(m).integers(0, 1 << nbits, size=(2, 3, m)).astype(np.uint8)
    packed = pack_codes(torch.from_numpy(codes), nbits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, math.ceil(m * nbits / 8))
    np.testing.assert_array_equal(packed.numpy(), pack_ref(codes, nbits))
    np.testing.assert_array_equal(unpack_codes(packed, nbits, m).numpy(), codes)
    np.testing.assert_array_equal(unpack_codes(torch.from_numpy(pack_ref(codes, nbits)), nbits, m).numpy(), codes)


def test_pack_rejects_bad_bits_and_lengths():
    with pytest.raises(ValueError, match="nbits must be one of 2, 4, 8.*got 3"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="5 codes at 2 bits take 2 bytes, got 1"):
        unpack_codes(torch.zeros(1, dtype=torch.uint8), 2, 5)


# --- uniform groups -----------------------------------------------------------------------------

def test_uniform_hand_made():
    codes, scale, zero = quantize_groups(torch.tensor([[0.0, 0.5, 1.0, 3.0], [-1.0, 0.5, 2.0, 2.0]]), 2)
    # row 0: scale 1, zero 0, 0.5 rounds half to even -> 0; row 1: scale 1, zero -1, 1.5 -> 2
    assert codes.tolist() == [[0, 0, 1, 3], [0, 2, 3, 3]]
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (2, 1)
    assert scale.flatten().tolist() == [1.0, 1.0] and zero.flatten().tolist() == [0.0, -1.0]
    codes, scale, zero = quantize_groups(torch.tensor([[0.0, 0.1, 0.2, 0.3]]), 4)
    s = np.float32(np.float16(np.float32(0.3) / np.float32(15)))                 # fp16-rounded scale
    assert scale.item() == s and zero.item() == 0.0
    np.testing.assert_array_equal(codes.numpy(), np.round(np.float32([0.0, 0.1, 0.2, 0.3]) / s)[None])


def test_uniform_constant_group():
    x = torch.full((1, 8), 0.1)
    codes, scale, zero = quantize_groups(x, 2)
    assert scale.item() == 0 and codes.sum() == 0 and zero.item() == np.float16(0.1)
    block = KIVIQuantizer(group_size=8).quantize_values(x.view(1, 1, 8))
    np.testing.assert_array_equal(block.dequantize().numpy(), np.full((1, 1, 8), np.float16(0.1), np.float32))


@pytest.mark.parametrize("nbits", BITS)
def test_uniform_matches_reference_and_error_bound(nbits):
    g = np.random.default_rng(nbits)
    x = (g.normal(size=(40, 16)) * g.uniform(1e-3, 50, size=(40, 1)) + g.normal(size=(40, 1)) * 10).astype(np.float32)
    codes, scale, zero = quantize_groups(torch.from_numpy(x), nbits)
    ref_codes, ref_scale, ref_zero, ref_deq = uniform_ref(x, nbits)
    np.testing.assert_array_equal(codes.numpy(), ref_codes)
    np.testing.assert_array_equal(scale.numpy(), ref_scale)
    np.testing.assert_array_equal(zero.numpy(), ref_zero)
    deq = codes.float() * scale.float() + zero.float()
    np.testing.assert_array_equal(deq.numpy(), ref_deq)
    # |x - x^| <= scale/2, plus what fp16 rounding of zero and scale moves the grid, plus fp32 slack
    lo, hi = x.astype(np.float64).min(1, keepdims=True), x.astype(np.float64).max(1, keepdims=True)
    exact_scale = (hi - lo) / ((1 << nbits) - 1)
    s16 = scale.double().numpy()
    bound = s16 / 2 + np.abs(lo - zero.double().numpy()) + ((1 << nbits) - 1) * np.abs(exact_scale - s16)
    assert np.all(np.abs(x - deq.numpy()) <= bound + 1e-5 * np.abs(x) + 1e-7)


# --- KIVI ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbits", BITS)
def test_kivi_keys_per_channel_values_per_token(nbits):
    x = sample((2, 64, 64), seed=nbits)
    quantizer = KIVIQuantizer(nbits=nbits)
    keys, values = quantizer.quantize_keys(x), quantizer.quantize_values(x)
    codes, scale, zero, deq = keys_ref(x.numpy(), nbits, 32)
    assert keys.layout == "channel" and keys.scale.shape == (2, 64, 2)            # [N, D, T/G]
    np.testing.assert_array_equal(codes_of(keys), codes)
    np.testing.assert_array_equal(keys.scale.numpy(), scale)
    np.testing.assert_array_equal(keys.zero.numpy(), zero)
    np.testing.assert_array_equal(keys.dequantize().numpy(), deq)
    codes, scale, zero, deq = values_ref(x.numpy(), nbits, 32)
    assert values.layout == "token" and values.scale.shape == (2, 64, 2)          # [N, T, D/G]
    np.testing.assert_array_equal(codes_of(values), codes)
    np.testing.assert_array_equal(values.scale.numpy(), scale)
    np.testing.assert_array_equal(values.zero.numpy(), zero)
    np.testing.assert_array_equal(values.dequantize().numpy(), deq)
    assert values.dequantize(torch.float16).dtype == torch.float16
    if nbits == 8:
        for block in (keys, values):
            assert (block.dequantize() - x).norm() / x.norm() < 0.01


def test_kivi_keys_and_values_group_differently():
    """A channel with a large offset: per-channel groups absorb it, per-token groups do not."""
    x = sample((1, 32, 32), seed=3)
    x[..., 5] += 100
    keys, values = KIVIQuantizer(nbits=4).quantize_keys(x), KIVIQuantizer(nbits=4).quantize_values(x)
    assert (keys.dequantize() - x).abs().max() < 0.5 < (values.dequantize() - x).abs().max()


def test_select_heads_dequantizes_the_same_rows():
    x = sample((4, 32, 64), seed=5, outliers=20)
    for quantizer in (KIVIQuantizer(), KVQuantQuantizer(), GEARQuantizer(group_size=32, residual_length=0)):
        for block in (quantizer.quantize_keys(x), quantizer.quantize_values(x)):
            full = block.dequantize()
            np.testing.assert_array_equal(block.dequantize(heads=slice(1, 3)).numpy(), full[1:3].numpy())
            np.testing.assert_array_equal(block.dequantize(heads=[3, 0]).numpy(), full[[3, 0]].numpy())
            np.testing.assert_array_equal(block.dequantize(heads=2).numpy(), full[2:3].numpy())
            assert block.select(slice(0, 2)).nbytes() < block.nbytes()


# --- KVQuant ------------------------------------------------------------------------------------

@pytest.mark.parametrize("nbits", BITS)
def test_kvquant_dense_and_sparse_per_vector(nbits):
    x = sample((2, 64, 64), seed=10 + nbits, outliers=30)
    x[0, 7, 3], x[0, 9, 3] = 50.0, -50.0          # a magnitude tie in key channel 3 of head 0 (k = 1 there)
    quantizer = KVQuantQuantizer(nbits=nbits, outlier_fraction=0.01)
    for block, rows in ((quantizer.quantize_keys(x), x.numpy().transpose(0, 2, 1)),   # a row = a channel
                        (quantizer.quantize_values(x), x.numpy())):                   # a row = a token
        n, v, length = rows.shape
        keep = np.ones(rows.shape, bool)
        for i in range(n):
            for j in range(v):
                top = top_ref(rows[i, j], 0.01)
                assert sorted(block.outlier_index[i, j].tolist()) == sorted(top.tolist())
                np.testing.assert_array_equal(block.outlier_value[i, j].numpy(), rows[i, j, top].astype(np.float16))
                keep[i, j, top] = False
        assert block.outlier_index.dtype == torch.int16
        codes, scale, zero, _ = uniform_ref(rows.reshape(n, v, length // 32, 32), nbits, keep.reshape(n, v, -1, 32))
        np.testing.assert_array_equal(codes_of(block), codes.reshape(n, v, length))
        np.testing.assert_array_equal(block.scale.numpy(), scale[..., 0])
        np.testing.assert_array_equal(block.zero.numpy(), zero[..., 0])
        deq = block.dequantize().numpy()
        deq_rows = deq.transpose(0, 2, 1) if block.layout == "channel" else deq
        np.testing.assert_array_equal(deq_rows[~keep], rows[~keep].astype(np.float16).astype(np.float32))
    keys = quantizer.quantize_keys(x)
    assert keys.outlier_index[0, 3].tolist() == [7]          # |50| == |-50|: the lower token wins


def test_kvquant_ranges_leave_outliers_out():
    x = sample((1, 32, 32), seed=4)
    x[0, 3, 4] = 400.0
    plain = KIVIQuantizer(nbits=4).quantize_values(x)
    sparse = KVQuantQuantizer(nbits=4, outlier_fraction=0.01).quantize_values(x)
    assert sparse.scale[0, 3, 0] < plain.scale[0, 3, 0] / 20
    assert (sparse.dequantize() - x).abs().max() < (plain.dequantize() - x).abs().max() / 20
    assert sparse.dequantize()[0, 3, 4] == 400.0


def test_kvquant_outlier_count_rounds_up():
    x = sample((1, 64, 64), seed=6)
    assert KVQuantQuantizer(outlier_fraction=0.01).quantize_values(x).outlier_index.shape == (1, 64, 1)  # 0.64 -> 1
    assert KVQuantQuantizer(outlier_fraction=0.05).quantize_keys(x).outlier_index.shape == (1, 64, 4)    # 3.2 -> 4
    assert KVQuantQuantizer(outlier_fraction=0.0).quantize_keys(x).outlier_index is None
    assert KVQuantQuantizer.keys_before_rope and not KIVIQuantizer.keys_before_rope


def test_kvquant_nuq_codes_are_nearest_levels_and_beat_uniform():
    x = sample((2, 64, 64), seed=8)
    nuq = KVQuantQuantizer(nbits=2, outlier_fraction=0.0, datatype="nuq").quantize_values(x)
    uni = KVQuantQuantizer(nbits=2, outlier_fraction=0.0).quantize_values(x)
    levels = nuq.codebook.float().numpy()
    assert nuq.codebook.dtype == torch.float16 and levels.shape == (4,) and np.all(np.diff(levels) >= 0)
    rows = x.numpy().reshape(2, 64, 2, 32)
    lo, hi = rows.min(-1, keepdims=True), rows.max(-1, keepdims=True)
    s, z = (hi - lo).astype(np.float16).astype(np.float32), lo.astype(np.float16).astype(np.float32)
    u = (rows - z) / s
    dist = np.abs(u[..., None] - levels)
    nearest = np.argmin(dist, axis=-1)               # argmin takes the first (lower) level on a tie
    np.testing.assert_array_equal(codes_of(nuq), nearest.reshape(2, 64, 64))
    np.testing.assert_array_equal(nuq.dequantize().numpy(), (levels[nearest] * s + z).reshape(2, 64, 64))
    assert nuq.bytes_breakdown()["codebook"] == 8
    assert ((nuq.dequantize() - x) ** 2).mean() < ((uni.dequantize() - x) ** 2).mean()


# --- GEAR ---------------------------------------------------------------------------------------

def planted(seed=0) -> torch.Tensor:
    """Keys with a rank-1 part u v^T (v > 0) plus small noise and a few spikes: per-channel quantization
    error of u v^T is itself close to rank 1."""
    g = np.random.default_rng(seed)
    u = g.normal(size=(2, 64, 1)) * 3
    v = g.uniform(0.5, 2.0, size=(2, 1, 32))
    x = (u * v + 0.01 * g.normal(size=(2, 64, 32))).astype(np.float32)
    x[0, 5, 7], x[1, 40, 2] = 60.0, -70.0
    return torch.from_numpy(x)


def gear_ref(x: np.ndarray, nbits: int, group: int, fraction: float, keys: bool):
    """D + S of GEAR: per head the top-|x| entries are exact, the rest quantized KIVI-style with ranges
    leaving them out. Returns (D + S, E = X - D with 0 on S, outlier flat positions per head)."""
    n, t, d = x.shape
    keep = np.ones(x.shape, bool)
    tops = []
    for i in range(n):
        top = top_ref(x[i].reshape(-1), fraction)
        keep[i].reshape(-1)[top] = False
        tops.append(top)
    deq = (keys_ref if keys else values_ref)(x, nbits, group, keep)[3]
    error = np.where(keep, x - deq, 0)
    return np.where(keep, deq, x.astype(np.float16).astype(np.float32)), error, tops


def test_gear_low_rank_reduces_the_error_and_outliers_stay_exact():
    x = planted()
    quantizer = GEARQuantizer(nbits=2, group_size=32, residual_length=0, outlier_fraction=0.01, rank=2)
    block = quantizer.quantize_keys(x)
    dense_sparse, error, tops = gear_ref(x.numpy(), 2, 32, 0.01, keys=True)
    without = dataclasses.replace(block, left=None, right=None).dequantize().numpy()
    np.testing.assert_array_equal(without, dense_sparse)
    full = block.dequantize().numpy()
    assert block.left.shape == (2, 64, 2) and block.right.shape == (2, 32, 2) and block.left.dtype == torch.float16
    for i, top in enumerate(tops):
        assert sorted(block.outlier_index[i, 0].tolist()) == sorted(top.tolist())
        np.testing.assert_array_equal(full[i].reshape(-1)[top], x[i].numpy().reshape(-1)[top].astype(np.float16))
    err_with, err_without = np.linalg.norm(full - x.numpy()), np.linalg.norm(without - x.numpy())
    assert err_with < 0.5 * err_without
    # the power iteration gets close to the best rank-2 approximation of E (numpy SVD)
    low = block.left.float().numpy() @ block.right.float().numpy().transpose(0, 2, 1)
    for i in range(2):
        sv = np.linalg.svd(error[i], compute_uv=False)
        best = np.sqrt((sv[2:] ** 2).sum())
        assert np.linalg.norm(error[i] - low[i]) <= 1.02 * best + 1e-3


def test_gear_values_rank_zero_decoding_rank_and_reproducibility():
    x = planted(1)
    quantizer = GEARQuantizer(group_size=32, residual_length=0)
    a, b = quantizer.quantize_values(x), quantizer.quantize_values(x)
    for name, tensor in a.tensors().items():
        assert (tensor is None and getattr(b, name) is None) or torch.equal(tensor, getattr(b, name))
    assert a.rank == 4 and quantizer.quantize_values(x, decoding=True).rank == 2
    none = GEARQuantizer(group_size=32, residual_length=0, rank=0).quantize_values(x)
    assert none.left is None and none.right is None and none.bytes_breakdown()["factors"] == 0
    dense_sparse, _, _ = gear_ref(x.numpy(), 2, 32, 0.02, keys=False)
    np.testing.assert_array_equal(none.dequantize().numpy(), dense_sparse)
    assert np.linalg.norm(a.dequantize().numpy() - x.numpy()) < np.linalg.norm(dense_sparse - x.numpy())


# --- bytes --------------------------------------------------------------------------------------

def expected_bytes(quantizer, shape, keys: bool, decoding=False) -> dict:
    """The storage formula: packed codes per row, 2 bytes per scale and zero per group, outliers as
    index (int16 if it fits, else int32) + fp16 value, low rank 2 * (T + D) * r per head, codebook 2 * 2^b."""
    n, t, d = shape
    rows, length = (d, t) if keys else (t, d)
    b, g = quantizer.nbits, quantizer.group_size
    out = {"codes": n * rows * math.ceil(length * b / 8), "scales": n * rows * (length // g) * 2,
           "zeros": n * rows * (length // g) * 2, "codebook": 0, "outliers": 0, "factors": 0}
    fraction = getattr(quantizer, "outlier_fraction", 0.0)
    if isinstance(quantizer, KVQuantQuantizer):
        k = math.ceil(Fraction(str(fraction)) * length)
        out["outliers"] = n * rows * k * ((2 if length - 1 <= 32767 else 4) + 2)
        out["codebook"] = 2 * 2 ** b if quantizer.datatype == "nuq" else 0
    if isinstance(quantizer, GEARQuantizer):
        k = math.ceil(Fraction(str(fraction)) * t * d)
        out["outliers"] = n * k * ((2 if t * d - 1 <= 32767 else 4) + 2)
        out["factors"] = n * 2 * (t + d) * min(quantizer.decode_rank if decoding else quantizer.rank, t, d)
    return out


@pytest.mark.parametrize("nbits", BITS)
@pytest.mark.parametrize("shape,group", [((2, 64, 64), 32), ((3, 6, 9), 3), ((1, 10, 6), 2)])
def test_bytes_match_the_formula(nbits, shape, group):
    x = sample(shape, seed=nbits)
    for quantizer in (KIVIQuantizer(nbits=nbits, group_size=group, residual_length=0),
                      KVQuantQuantizer(nbits=nbits, group_size=group, outlier_fraction=0.05),
                      KVQuantQuantizer(nbits=nbits, group_size=group, datatype="nuq"),
                      GEARQuantizer(nbits=nbits, group_size=group, residual_length=0, rank=3)):
        for keys in (True, False):
            for decoding in (False, True):
                block = (quantizer.quantize_keys if keys else quantizer.quantize_values)(x, decoding=decoding)
                expected = expected_bytes(quantizer, shape, keys, decoding)
                assert block.bytes_breakdown() == expected, (quantizer.label(), keys)
                assert block.nbytes() == sum(expected.values())


def test_outlier_index_widens_to_int32_when_int16_cannot_hold_it():
    x = sample((1, 512, 128), seed=2)                   # 65536 entries per head
    block = GEARQuantizer(rank=0).quantize_values(x)
    assert block.outlier_index.dtype == torch.int32
    assert block.bytes_breakdown() == expected_bytes(GEARQuantizer(rank=0), (1, 512, 128), keys=False)


# --- settings and bad input ---------------------------------------------------------------------

def test_registry_and_defaults():
    assert set(QUANTIZERS) == {"kivi", "kvquant", "gear"}
    assert make_quantizer("KIVI", nbits=4) == KIVIQuantizer(nbits=4)
    kivi, kvq, gear = KIVIQuantizer(), KVQuantQuantizer(), GEARQuantizer()
    assert (kivi.nbits, kivi.group_size, kivi.residual_length) == (2, 32, 128)
    assert (kvq.nbits, kvq.outlier_fraction, kvq.sink_tokens, kvq.datatype) == (4, 0.01, 1, "uniform")
    assert (gear.nbits, gear.group_size, gear.outlier_fraction, gear.rank, gear.decode_rank,
            gear.power_iterations) == (2, 64, 0.02, 4, 2, 3)
    assert make_quantizer("gear", rank=8).label() == "gear-rank=8"


@pytest.mark.parametrize("name", ["kivi", "kvquant", "gear"])
def test_bad_settings_are_named(name):
    with pytest.raises(ValueError, match="nbits must be one of 2, 4, 8.*got 3"):
        make_quantizer(name, nbits=3)
    with pytest.raises(ValueError, match="residual_length must be a multiple of group_size 32.*got 100"):
        make_quantizer(name, group_size=32, residual_length=100)
    with pytest.raises(ValueError, match="residual_length .* got -32"):
        make_quantizer(name, group_size=32, residual_length=-32)
    with pytest.raises(ValueError, match="group_size must be >= 1.*got 0"):
        make_quantizer(name, group_size=0, residual_length=0)
    with pytest.raises(ValueError, match="nbits"):
        make_quantizer(name, nbits="2")
    quantizer = make_quantizer(name, group_size=48, residual_length=96)
    with pytest.raises(ValueError, match="group_size 48 does not divide head_dim 64"):
        quantizer.check_head_dim(64)
    with pytest.raises(ValueError, match="group_size 48 does not divide head_dim 64"):
        quantizer.quantize_values(torch.zeros(1, 48, 64))
    with pytest.raises(ValueError, match="T=40 tokens, not a multiple of group_size 48"):
        quantizer.quantize_keys(torch.zeros(1, 40, 96))
    with pytest.raises(ValueError, match=r"floating tensor \[N, T, D\]"):
        quantizer.quantize_keys(torch.zeros(48, 96))


def test_bad_method_specific_settings():
    for fraction in (1.0, -0.1):
        for name in ("kvquant", "gear"):
            with pytest.raises(ValueError, match=f"outlier_fraction must be in \\[0, 1\\).*got {fraction}"):
                make_quantizer(name, outlier_fraction=fraction)
    with pytest.raises(ValueError, match="rank must be >= 0.*got -1"):
        GEARQuantizer(rank=-1)
    with pytest.raises(ValueError, match="decode_rank must be >= 0"):
        GEARQuantizer(decode_rank=-2)
    with pytest.raises(ValueError, match="power_iterations must be >= 1"):
        GEARQuantizer(power_iterations=0)
    with pytest.raises(ValueError, match="datatype must be one of uniform, nuq, got 'nuq3'"):
        KVQuantQuantizer(datatype="nuq3")
    with pytest.raises(ValueError, match="sink_tokens must be >= 0"):
        KVQuantQuantizer(sink_tokens=-1)
    with pytest.raises(ValueError, match="unknown quantizer 'hqq'; choose one of: kivi, kvquant, gear"):
        make_quantizer("hqq")


def test_nuq_nearest_level_and_kmeans_hand_worked():
    from pyramidkv.quantization.kvquant import fit_levels, nearest_level

    assert nearest_level(torch.tensor([0.5, 0.51, 0.49, -3.0, 7.0]), torch.tensor([0.0, 1.0])).tolist() == [0, 1, 0, 0, 1]
    # start at the quantiles 1/4, 3/4 -> [0, 1]; step 1: {0,0,0}, {1,1,1,10} -> [0, 3.25];
    # step 2: {0,0,0,1,1,1}, {10} -> [0.5, 10], then stable
    levels = fit_levels(torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 10.0]), 2, 5)
    assert levels.tolist() == [0.5, 10.0]
