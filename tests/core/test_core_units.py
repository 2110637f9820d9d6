"""Hand-worked cases for the core pieces: tie-break, budgets, chunked H2O scores, ragged attention."""

from __future__ import annotations

import math

import pytest
import torch

from pyramidkv import make_method
from pyramidkv.components import AttentionForm
from pyramidkv.core import scoring
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.selection import select_kept_positions, top_k_recent_first
from tests import reference as ref


def test_ties_go_to_the_more_recent_position():
    scores = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert top_k_recent_first(scores, 2).tolist() == [2, 4]
    assert top_k_recent_first(scores, 3).tolist() == [1, 2, 4]
    assert top_k_recent_first(torch.zeros(6), 2).tolist() == [4, 5]


def test_selection_with_padding_and_window():
    # 3 padding positions, 7 real ones; window 2, budget 4: best 2 of real positions 3..7 plus 8, 9.
    scores = torch.tensor([[9.0, 9.0, 9.0, 0.1, 0.5, 0.2, 0.9, 0.3, 0.0, 0.0]])
    kept = select_kept_positions(scores, pad_len=3, head_budgets=[4], window_size=2)
    assert kept[0].tolist() == [4, 6, 8, 9]  # padding (score 9) never kept


def test_budget_equal_to_window_keeps_exactly_the_window():
    # The public harness's `x[-0:]` bug kept everything here.
    scores = torch.arange(10.0)[None]
    kept = select_kept_positions(scores, pad_len=0, head_budgets=[3], window_size=3)
    assert kept[0].tolist() == [7, 8, 9]


def test_short_prompt_is_kept_whole_without_padding():
    scores = torch.zeros(1, 8)
    kept = select_kept_positions(scores, pad_len=5, head_budgets=[4], window_size=2)
    assert kept[0].tolist() == [5, 6, 7]


def test_pyramid_budgets_hand_worked():
    # L=4, s=10, beta=2: min 5, max 15, exact 15, 11.67, 8.33, 5 -> 15, 12, 8, 5 (sum 40 = 4 * 10).
    method = make_method("pyramidkv", budget=42, window_size=32, beta=2)
    assert method.layer_budgets(42, 4, 1000) == [47, 44, 40, 37]


@pytest.mark.parametrize("budget", [40, 64, 128, 256, 2048])
def test_pyramid_total_equals_uniform_total(budget):
    method = make_method("pyramidkv", budget=budget)
    counts = method.layer_budgets(budget, 30, 100_000)
    assert sum(counts) == 30 * budget  # the public harness overshoots by ~9.8% at 128
    selected = budget - 32
    exact = [2 * selected - selected / 20 - (2 * selected - 2 * selected / 20) * l / 29 for l in range(30)]
    for c, x in zip(counts, exact):
        assert math.floor(x) <= c - 32 <= math.ceil(x)
    assert counts == sorted(counts, reverse=True)
    assert [c - 32 for c in counts] == ref.pyramid_counts(selected, 30, 20)


def test_ratio_budget():
    method = make_method("snapkv", budget_ratio=0.25)
    assert method.prompt_budget(1000) == 250
    assert method.prompt_budget(40) == 32  # never below the window


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_chunked_column_sums_equal_dense_and_stay_small(monkeypatch, softcap):
    """Against a dense reference; with a soft-cap (Gemma2), the logits capped as cap * tanh(s / cap) first."""
    torch.manual_seed(0)
    bsz, hq, hkv, n, d = 2, 4, 2, 50, 8
    q, k = torch.randn(bsz, hq, n, d), torch.randn(bsz, hkv, n, d)
    real = torch.ones(bsz, n, dtype=torch.bool)
    real[1, :7] = False  # left padding in the second row
    # dense reference
    kr = k.repeat_interleave(hq // hkv, dim=1)
    s = q @ kr.transpose(-1, -2) / math.sqrt(d)
    s = s if softcap is None else softcap * torch.tanh(s / softcap)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    allowed = causal[None, None] & real[:, None, None, :] & real[:, None, :, None]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    expected = p.sum(dim=2)
    seen = []
    original = scoring.grouped_scores

    def spy(queries, keys, form=scoring.PLAIN):
        out = original(queries, keys, form)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(scoring, "grouped_scores", spy)
    got = scoring.attention_column_sums(q, k, real, max_chunk_elements=bsz * hq * n * 8,
                                        form=AttentionForm(softcap=softcap))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(seen) == math.ceil(n / 8) and max(seen) <= bsz * hq * n * 8  # no [n, n] block per head


@pytest.mark.parametrize("q_len", [1, 3])
def test_ragged_attention_matches_per_segment_softmax(q_len):
    """Hand-built ragged cache (2 prompts x 5 heads, every count different, so blocks of segments
    span prompts) against softmax(q k^T / sqrt(d)) v per prompt and head, written out directly."""
    torch.manual_seed(1)
    bsz, heads, group, d, t = 2, 5, 2, 8, 4
    lengths = [[5, 9, 2, 7, 1], [3, 4, 11, 6, 8]]
    kept = [(torch.randn(sum(n), d), torch.randn(sum(n), d)) for n in lengths]
    store = FullPrecisionStore([KeptKV(k, v, n, torch.zeros(sum(n), dtype=torch.long)) for (k, v), n in zip(kept, lengths)],
                               real_lens=[sum(n) for n in lengths])
    prefix = kept
    tail_k, tail_v = torch.randn(bsz, heads, t, d), torch.randn(bsz, heads, t, d)
    no_rope = torch.zeros(bsz, dtype=torch.long)  # a full-precision store does not read RoPE positions
    for i in range(t - q_len):  # one token per step (the tail buffer grows), then q_len tokens at once
        store.append(tail_k[:, :, i:i + 1], tail_v[:, :, i:i + 1], no_rope)
    store.append(tail_k[:, :, t - q_len:], tail_v[:, :, t - q_len:], no_rope)
    q = torch.randn(bsz, heads * group, q_len, d)
    got = store.attend(q)
    for b in range(bsz):
        offsets = [0] + torch.tensor(lengths[b]).cumsum(0).tolist()
        for h in range(heads):
            keys = torch.cat([prefix[b][0][offsets[h]:offsets[h + 1]], tail_k[b, h]])
            values = torch.cat([prefix[b][1][offsets[h]:offsets[h + 1]], tail_v[b, h]])
            for g in range(group):
                for i in range(q_len):
                    visible = keys.shape[0] - (q_len - 1 - i)  # token i of q sees the tail up to itself
                    weights = torch.softmax(q[b, h * group + g, i] @ keys[:visible].T / math.sqrt(d), dim=-1)
                    torch.testing.assert_close(got[b, h * group + g, i], weights @ values[:visible])
