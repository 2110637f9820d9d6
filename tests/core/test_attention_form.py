"""The attention form's logits and the one probability function, against sums written out by hand.

References: per query row and key, the dot product summed term by term in float64, divided by sqrt(D) (the engine's
queries come scaled so that this is the model's logit), then cap * tanh(logit / cap); a softmax written as
exp(x - max) / sum over the allowed keys only.
"""

from __future__ import annotations

import math

import pytest
import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.scoring import grouped_scores, probabilities


def hand_logit(q: list[float], k: list[float], cap) -> float:
    s = sum(a * b for a, b in zip(q, k)) / math.sqrt(len(q))
    return s if cap is None else cap * math.tanh(s / cap)


@pytest.mark.parametrize("cap", [None, 1.5])
def test_grouped_scores_are_each_query_heads_capped_logits(cap):
    """Query head h reads KV head h // g; with a cap the large logits (the queries are scaled up to reach it)
    are bent towards +-cap, and differ from the uncapped ones."""
    torch.manual_seed(0)
    bsz, hq, hkv, q_len, n, d = 2, 4, 2, 3, 5, 8
    queries, keys = torch.randn(bsz, hq, q_len, d) * 3, torch.randn(bsz, hkv, n, d)
    got = grouped_scores(queries, keys, AttentionForm(softcap=cap))   # [B, Hq, q, n]
    want = torch.tensor([[[[hand_logit(queries[b, h, i].tolist(), keys[b, h // (hq // hkv), j].tolist(), cap)
                            for j in range(n)] for i in range(q_len)] for h in range(hq)] for b in range(bsz)])
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    if cap is not None:
        assert got.abs().max() < cap and not torch.allclose(got, grouped_scores(queries, keys))


def test_form_logits_are_the_plain_product_capped():
    """`logits` takes queries already scaled: q . k, then the cap; no cap: the product itself, bit for bit."""
    torch.manual_seed(1)
    queries, keys_t = torch.randn(3, 2, 6) * 4, torch.randn(3, 6, 7)
    plain = AttentionForm().logits(queries, keys_t)
    assert torch.equal(plain, queries @ keys_t)
    capped = AttentionForm(scale=0.25, softcap=2.0).logits(queries, keys_t)   # the scale is the model side's
    want = torch.tensor([[[2.0 * math.tanh(sum(a * b for a, b in zip(queries[s, r].tolist(), keys_t[s, :, c].tolist()))
                                           / 2.0) for c in range(7)] for r in range(2)] for s in range(3)])
    torch.testing.assert_close(capped, want.float(), rtol=1e-5, atol=1e-5)


def test_probabilities_softmax_over_the_allowed_keys_in_float32():
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0], [0.5, 0.5, 9.0, 9.0]], dtype=torch.float16)
    allowed = torch.tensor([[True, True, False, True], [False, False, False, False]])
    got = probabilities(logits, allowed)
    assert got.dtype == torch.float32
    row = [1.0, 2.0, -1.0]
    top = max(row)
    total = sum(math.exp(x - top) for x in row)
    want = [math.exp(1.0 - top) / total, math.exp(2.0 - top) / total, 0.0, math.exp(-1.0 - top) / total]
    torch.testing.assert_close(got[0], torch.tensor(want), rtol=1e-6, atol=1e-7)
    assert torch.equal(got[1], torch.zeros(4))   # a row with nothing allowed (a padding query): 0, not NaN
    assert probabilities(logits, dtype=torch.float16).dtype == torch.float16


def test_a_form_window_per_layer():
    form = AttentionForm(windows=(4, None, 4))
    assert [form.window(layer) for layer in range(3)] == [4, None, 4] and form.sliding and not form.capped
    assert AttentionForm().window(7) is None and not AttentionForm().sliding
