"""Llama 3.1 / 3.2 RoPE scaling (rope_type llama3): what the methods rotate or read uses the model's scaled
frequencies.

Reference: the llama3 rule written out here in float64 (Meta's: a wavelength above original_max / low_freq_factor
is divided by `factor`, one below original_max / high_freq_factor is kept, the band between is interpolated), and
the tiny model's own forward (the keys it caches, k_proj's and q_proj's outputs). The prompt sits at RoPE
positions 4000.. (past the high-frequency band), where an unscaled rotation is far from the model's keys: the
first test checks that, so a store falling back to unscaled frequencies fails the others.

KVQuant quantizes keys before RoPE: the keys it is handed (the glue's rotation undone) are k_proj's output and
rotate back to the model's cached keys, at 1e-5. Quest's page bounds and ThinK's channel scores only see keys and
queries after RoPE, as the model computed them: the page min / max are those of the model's cached keys, ThinK's
queries are q_proj's output rotated by the scaled frequencies and its kept keys the model's cached keys.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from pyramidkv import compress, make_method
from pyramidkv.models import rope
from pyramidkv.models.patch import MODEL_GLUE
from tests.models.families import SIZES, tiny_family

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
THETA = 500000.0
START, N = 4000, 96      # the prompt's RoPE positions: START .. START + N - 1


def llama3_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """float64 [dim / 2]: the inverse frequencies, scaled by the llama3 rule (None: unscaled)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if scaling is None:
        return inv
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    out = []
    for f in inv.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < old / high:
            out.append(f)
        elif wavelength > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def rotate64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [..., n, D] rotated (rotate_half convention) to positions [n], float64."""
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = x.double()
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.fixture(scope="module")
def scaled():
    """(model, ids [1, N], positions [1, N], per layer: k_proj's output, q_proj's output [1, H, N, D], cached keys)."""
    model = tiny_family("llama", None, rope_theta=THETA, rope_scaling=LLAMA3)
    ids = torch.randint(0, SIZES["vocab_size"], (1, N), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(START, START + N)[None]
    raw = {}
    hooks = []
    for l, layer in enumerate(model.model.layers):
        for name in ("k_proj", "q_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda m, i, o, key=(l, name): raw.__setitem__(key, o.view(1, N, -1, 16).transpose(1, 2))))
    try:
        with torch.no_grad():
            cached = model(ids, position_ids=positions, past_key_values=DynamicCache(), use_cache=True).past_key_values
    finally:
        for hook in hooks:
            hook.remove()
    layers = [(raw[l, "k_proj"], raw[l, "q_proj"], cached[l][0]) for l in range(len(model.model.layers))]
    return model, ids, positions, layers


def test_the_model_caches_keys_rotated_by_the_scaled_frequencies(scaled):
    """The model's keys are k_proj's output rotated by the llama3-scaled frequencies, far from an unscaled
    rotation at these positions; the glue's rotation (KVQuant's) gives them at 1e-5, both ways."""
    model, _, positions, layers = scaled
    rotation = MODEL_GLUE["llama"].key_rotation(model)
    at = positions.expand(SIZES["num_key_value_heads"], -1)
    for raw, _, keys in layers:
        scaled_keys = rotate64(raw, positions[0], llama3_inv_freq(16, THETA, LLAMA3))
        unscaled_keys = rotate64(raw, positions[0], llama3_inv_freq(16, THETA, None))
        assert (scaled_keys - keys.double()).abs().max() < 2e-3      # float32 angles at ~4000: ~1e-4
        assert (unscaled_keys - keys.double()).abs().max() > 0.1
        torch.testing.assert_close(rotation.rotate(raw[0], at), keys[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(rotation.rotate(keys[0], at, inverse=True), raw[0], atol=1e-5, rtol=0)


def run_compressed(model, ids, positions, method):
    with compress(model, method) as patch, torch.no_grad():
        cache = patch.new_cache()
        model(ids, position_ids=positions, past_key_values=cache, use_cache=True)
    return cache


def test_kvquant_quantizes_the_pre_rope_keys_of_the_scaled_model(scaled, monkeypatch):
    """Every key KVQuant is handed before RoPE is k_proj's output at its position (1e-5), and rotating it back
    gives the model's cached key (1e-5)."""
    model, ids, positions, layers = scaled
    handed = []
    rotate = rope.HalfRotation.rotate

    def recording(self, x, at, inverse=False):
        out = rotate(self, x, at, inverse)
        if inverse:
            handed.append((x.reshape(-1, x.shape[-1]), at.reshape(-1), out.reshape(-1, x.shape[-1]), self))
        return out

    monkeypatch.setattr(rope.HalfRotation, "rotate", recording)
    method = make_method("snapkv", budget=48, window_size=8, quant_method="kvquant", nbits=8, group_size=16,
                         residual_length=16)
    run_compressed(model, ids, positions, method)
    found = set()
    every_raw = torch.cat([raw[0] for raw, _, _ in layers])         # [layers * Hkv, N, D]
    every_key = torch.cat([keys[0] for _, _, keys in layers])
    for post, at, pre, rotation in handed:
        assert int(at.min()) >= START
        column = at - START
        # the (layer, head) whose cached key each row is
        distance = (every_key[:, column] - post[None]).abs().amax(-1)                  # [layers * Hkv, rows]
        which = distance.argmin(0)
        assert distance.min(0).values.max() < 1e-6
        torch.testing.assert_close(pre, every_raw[which, column], atol=1e-5, rtol=0)
        torch.testing.assert_close(rotate(rotation, pre, at), every_key[which, column], atol=1e-5, rtol=0)
        found |= set((which // SIZES["num_key_value_heads"]).tolist())
    assert found == set(range(len(layers)))      # every layer's keys went through it


def test_quest_pages_and_think_channels_see_the_models_scaled_keys(scaled, monkeypatch):
    """Quest's page min / max are those of the model's cached keys at the tokens each page holds; ThinK scores
    channels with q_proj's output rotated by the scaled frequencies (not the unscaled ones) and the model's
    cached keys of the tokens kept."""
    from pyramidkv.core import prefill

    model, ids, positions, layers = scaled
    cache = run_compressed(model, ids, positions, make_method("quest", page_budget=32, page_size=8,
                                                              page_dense_layers=0))
    for l, (_, _, keys) in enumerate(layers):
        table, size = cache.layers[l].table, 8
        for h, held in enumerate(cache.held_positions(l, 0)):
            page_keys = keys[0, h, held]
            pages = -(-len(held) // size)
            for p in range(pages):
                torch.testing.assert_close(table.mins[h, p], page_keys[p * size:(p + 1) * size].amin(0), atol=0, rtol=0)
                torch.testing.assert_close(table.maxs[h, p], page_keys[p * size:(p + 1) * size].amax(0), atol=0, rtol=0)

    seen = []
    prune = prefill.prune_key_channels
    monkeypatch.setattr(prefill, "prune_key_channels",
                        lambda kept, queries, *a: seen.append((kept, queries)) or prune(kept, queries, *a))
    run_compressed(model, ids, positions, make_method("think", budget=48, window_size=8))
    assert len(seen) == len(layers)
    for (kept, queries), (_, raw_q, keys) in zip(seen, layers):
        w = queries.shape[1]
        last = positions[0, -w:]
        scaled_q = rotate64(raw_q[0, :, -w:], last, llama3_inv_freq(16, THETA, LLAMA3))
        assert (queries.double() - scaled_q).abs().max() < 2e-3
        assert (queries.double() - rotate64(raw_q[0, :, -w:], last, llama3_inv_freq(16, THETA, None))).abs().max() > 0.1
        for h, ((kept_keys, _), at) in enumerate(zip(kept.per_head(), kept.positions_per_head())):
            torch.testing.assert_close(kept_keys, keys[0, h, at], atol=0, rtol=0)
