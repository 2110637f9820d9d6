"""H2O's column sums from a fused kernel's logsumexp (core/fused_column_sums.py), on the CPU's kernel.

References: the float64 causal softmax built entry by entry (tests/core/test_column_sums_pass.py's `reference`:
output and column sums), the two-pass `attention_column_sums` H2O scored by first (sums to 1e-5 relative, kept
sets through the selection's own top-k), and the model's own attention (the unpatched tiny model's logits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.core import fused_column_sums
from pyramidkv.core.fused_column_sums import column_sums_attention, fused_attention_with_column_sums
from pyramidkv.core.scoring import attention_column_sums
from pyramidkv.methods.h2o import H2O
from tests.conftest import tiny_llama
from tests.core.test_column_sums_pass import reference


@pytest.mark.parametrize("max_entries", [1, 6 * 40 * 7, 1 << 21])   # 1 row, 7 rows, all at once
def test_output_and_column_sums_equal_the_float64_reference(max_entries):
    torch.manual_seed(0)
    bsz, num_q, num_kv, n, dim = 3, 6, 2, 40, 16
    pads = [0, 5, 11]
    queries = torch.randn(bsz, num_q, n, dim) * 2
    keys, values = torch.randn(bsz, num_kv, n, dim), torch.randn(bsz, num_kv, n, dim)
    real = torch.arange(n)[None, :] >= torch.tensor(pads)[:, None]
    out, sums = fused_attention_with_column_sums(queries, keys, values, real, max_entries)
    want_out, want_sums = reference(queries, keys, values, pads)
    for b, pad in enumerate(pads):
        np.testing.assert_allclose(out[b, :, pad:].numpy(), want_out[b, :, pad:], rtol=0, atol=2e-6)
        assert torch.all(out[b, :, :pad] == 0) and torch.all(sums[b, :, :pad] == 0)
    np.testing.assert_allclose(sums.numpy(), want_sums, rtol=1e-5, atol=1e-6)


def test_sums_and_kept_sets_equal_the_two_pass_ones():
    """The sums H2O's two-pass scorer gives, to 1e-5 relative, and each head's top 64 the same set but for
    candidates within 1e-5 relative of the cut."""
    torch.manual_seed(1)
    queries, keys, values = torch.randn(2, 9, 300, 64), torch.randn(2, 3, 300, 64), torch.randn(2, 3, 300, 64)
    real = torch.arange(300)[None, :] >= torch.tensor([0, 37])[:, None]
    _, sums = fused_attention_with_column_sums(queries, keys, values, real, max_entries=9 * 300 * 50)
    before = attention_column_sums(queries, keys, real)
    torch.testing.assert_close(sums, before, rtol=1e-5, atol=1e-7)
    for got, want in zip(sums.flatten(0, 1), before.flatten(0, 1)):
        cut = want.sort(descending=True).values[63]
        sure = set(torch.nonzero(want > cut * (1 + 1e-5)).flatten().tolist())
        near = set(torch.nonzero(want >= cut * (1 - 1e-5)).flatten().tolist())
        assert sure <= set(got.topk(64).indices.tolist()) <= near


def test_the_path_follows_the_device_and_the_soft_cap(monkeypatch):
    """The fused kernel where the device is in FUSED_DEVICES and the logits are uncapped, else the explicit pass."""
    calls = []
    monkeypatch.setattr(fused_column_sums, "fused_attention_with_column_sums", lambda *a: calls.append("fused"))
    monkeypatch.setattr(fused_column_sums, "attention_with_column_sums", lambda *a, **k: calls.append("explicit"))
    q = torch.zeros(1, 2, 4, 8)
    real = torch.ones(1, 4, dtype=torch.bool)
    from pyramidkv.components import AttentionForm
    for devices, form in [(("cuda",), AttentionForm()), (("cpu",), AttentionForm()),
                          (("cpu",), AttentionForm(softcap=30.0))]:
        monkeypatch.setattr(fused_column_sums, "FUSED_DEVICES", devices)
        column_sums_attention(q, q, q, real, form)
    assert calls == ["explicit", "fused", "explicit"]
    assert fused_column_sums.chunk_entries(torch.device("cpu")) == fused_column_sums.CPU_ENTRIES


def test_h2o_on_the_fused_path_keeps_what_the_two_pass_sums_keep(monkeypatch):
    """A left-padded batch through a tiny model with the fused path on the CPU: every layer's sums equal the
    two-pass ones of the same queries and keys, and the logits the unpatched model's to rounding."""
    monkeypatch.setattr(fused_column_sums, "FUSED_DEVICES", ("cuda", "cpu"))
    model = tiny_llama(layers=2, std=0.2)
    torch.manual_seed(3)
    ids = torch.randint(3, 96, (2, 60))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    seen = []
    original = H2O.score

    def spy(self, ctx):
        seen.append((ctx.column_sums.clone(), attention_column_sums(ctx.queries, ctx.keys, ctx.real)))
        return original(self, ctx)

    monkeypatch.setattr(H2O, "score", spy)
    with compress(model, make_method("h2o", budget=24, window_size=4)) as patch, torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=position_ids, past_key_values=patch.new_cache(),
                    use_cache=True).logits
    assert len(seen) == 2
    for fused, two_pass in seen:
        torch.testing.assert_close(fused, two_pass, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(got[0], plain[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, 9:], plain[1, 9:], rtol=0, atol=1e-5)
