"""At a decode-time re-selection `score()` sees the prefill layout: one prompt as a batch of 1, its stored heads
as the heads, the buffered queries as the queries (DecodeScoreContext). A scorer that averages over every head
of the prompt keeps, at each re-selection, what a float64 reference computes from the held K/V and the
buffered queries; the context's shapes and masks for both GQA layouts, ragged heads and padded batches; the
helpers on per-head masks and on fewer queries than keys; the query buffer's own size."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.capabilities import DecodeBudget
from pyramidkv.core.context import DecodeScoreContext, ScoreContext
from pyramidkv.core.decoding import DecodeCompressor
from pyramidkv.core.scoring import attention_column_sums, window_attention
from pyramidkv.generation import generate
from pyramidkv.methods.base import Method
from pyramidkv.methods.snapkv import SnapKV
from tests.prompts import STORY, passkey_prompt


@dataclass(frozen=True)
class HeadMean(Method):
    """TOVA-like: the last query's attention to each token, averaged over every query head of the prompt; the
    same score for every head. Written for prefill only (no decode_score of its own)."""

    name = "head_mean_test"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        last = window_attention(ctx.queries, ctx.keys, ctx.real, 1)[:, :, 0]  # [B, Hq, n]
        return last.mean(dim=1, keepdim=True).expand(-1, ctx.keys.shape[1], -1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def head_mean_reference(heads: list[tuple[np.ndarray, np.ndarray]], queries: np.ndarray, budget: int,
                        window: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """What each stored head keeps, in float64. heads: per stored head (positions [c], keys [c, D]) in time
    order; queries [Hq, w, D], the newest last. The last query of every query head attends over its stored
    head's tokens; the probabilities are averaged over all Hq query heads token slot by token slot, the slots
    of each head counted from its newest token backwards (a head holding fewer adds nothing to the older
    slots). Each head keeps its newest `window` tokens and the best-scored others (ties: the more recent).
    Returns the kept positions and each head's scores."""
    num_query_heads, dim = queries.shape[0], queries.shape[-1]
    group = num_query_heads // len(heads)
    m = max(len(p) for p, _ in heads)
    total = np.zeros(m)
    for query_head in range(num_query_heads):
        positions, keys = heads[query_head // group]
        total[m - len(positions):] += softmax(keys @ queries[query_head, -1] / np.sqrt(dim))
    score = total / num_query_heads
    kept, scores = [], []
    for positions, _ in heads:
        count = len(positions)
        own = score[m - count:]
        scores.append(own)
        if count <= budget:
            kept.append(positions.tolist())
            continue
        best = sorted(range(count - window), key=lambda i: (-own[i], -i))[:budget - window]
        kept.append(sorted(int(positions[i]) for i in best) + positions[count - window:].tolist())
    return kept, scores


def spy_reselections(monkeypatch) -> list[dict]:
    """Per re-selected prompt and layer: what its heads held and the buffered queries before, what they hold after."""
    records = []
    real_compress = DecodeCompressor._compress

    def spy(self, layer_idx, fire):
        store = self.stores[layer_idx]
        before = {b: ([(p.numpy().copy(), k.double().numpy()) for p, k, _ in store.stored_kv(b)],
                      self.queries[layer_idx][b].double().numpy())
                  for b, fired in enumerate(fire) if fired}
        real_compress(self, layer_idx, fire)
        for b, (heads, queries) in before.items():
            records.append(dict(layer=layer_idx, prompt=b, heads=heads, queries=queries,
                                kept=[p.tolist() for p in store.held_positions(b)]))

    monkeypatch.setattr(DecodeCompressor, "_compress", spy)
    return records


@pytest.mark.parametrize("settings", [dict(), dict(gqa_layout="query_head"), dict(head_allocation="headkv")],
                         ids=["kv_head", "query_head", "headkv-ragged"])
def test_head_averaging_scorer_keeps_what_a_float64_reference_keeps(smollm2, monkeypatch, settings):
    """SmolLM2 (9 query heads, 3 KV heads): a 186-token prompt, prefill budget 96, decode_budget 48, interval 8,
    window 8, 17 new tokens: every layer re-selects right after prefill and twice while decoding. HeadKV's
    head budgets (from its head-importance table, not from the scores) leave heads holding different counts."""
    model, tokenizer = smollm2
    budget, window = 48, 8
    method = HeadMean(budget=96, window_size=window, decode=DecodeBudget(budget, 8), **settings)
    records = spy_reselections(monkeypatch)
    generate(model, tokenizer, [STORY], method, 17, min_new_tokens=17)
    layers = model.config.num_hidden_layers
    ragged = sum(len({len(p) for p, _ in r["heads"]}) > 1 for r in records)
    if "head_allocation" in settings:  # heads holding different counts are scored together
        assert len(records) > layers and ragged > layers
    else:
        assert len(records) == 3 * layers
    near_ties = 0
    for r in records:
        expected, scores = head_mean_reference(r["heads"], r["queries"], budget, window)
        for head, (got, want, score) in enumerate(zip(r["kept"], expected, scores)):
            if got == want:
                continue
            near_ties += 1  # allowed only where float32 rounding can swap two near-equal scores at the cut
            at_cut = np.sort(score[:len(score) - window])[::-1][budget - window - 1:budget - window + 1]
            assert at_cut[0] - at_cut[1] < 1e-6, (r["layer"], head, sorted(set(got) ^ set(want)))
    assert near_ties <= 2


# --- the context's layout -----------------------------------------------------------------------------

CONTEXTS: list[DecodeScoreContext] = []


@dataclass(frozen=True)
class RecordingSnapKV(SnapKV):
    """SnapKV that keeps every decode-time context it is given."""

    name = "recording_snapkv_test"

    def decode_score(self, ctx: DecodeScoreContext) -> torch.Tensor:
        CONTEXTS.append(ctx)
        return super().decode_score(ctx)


@pytest.mark.parametrize("settings", [dict(), dict(gqa_layout="query_head"), dict(head_allocation="adakv")],
                         ids=["kv_head", "query_head", "adakv-ragged"])
def test_decode_context_has_the_prefill_layout_per_prompt(random_llama, monkeypatch, settings):
    """A left-padded batch of 3: every context is one prompt (batch 1) with its stored heads; keys, values,
    positions and `real` hold exactly what each head held (per-head padding in `real` where counts differ);
    the queries are the buffered ones of the newest tokens."""
    model, tokenizer, _ = random_llama  # the layout holds whatever the weights
    cfg = model.config
    query_heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    stored = query_heads if settings.get("gqa_layout") == "query_head" else kv_heads
    head_dim = cfg.hidden_size // query_heads
    method = RecordingSnapKV(budget=96, window_size=8, decode=DecodeBudget(48, 8), **settings)
    records = spy_reselections(monkeypatch)
    CONTEXTS.clear()
    prompts = [passkey_prompt(41872, 12), STORY, passkey_prompt(90311, 0)]
    generate(model, tokenizer, prompts, method, 24, min_new_tokens=24)
    assert len(CONTEXTS) == len(records) > cfg.num_hidden_layers
    shapes = set()
    for ctx, r in zip(CONTEXTS, records):
        counts = [len(p) for p, _ in r["heads"]]
        m, w = max(counts), min(8, max(counts))
        assert ctx.layer_idx == r["layer"] and ctx.pattern is None and ctx.column_sums is None
        assert ctx.queries.shape == (1, query_heads, w, head_dim)
        np.testing.assert_array_equal(ctx.queries[0].double().numpy(), r["queries"][:, -w:])
        assert ctx.keys.shape == ctx.values.shape == (1, stored, m, head_dim)
        assert ctx.positions.shape == (1, stored, m)
        per_head = ctx.real[0] if ctx.real.dim() == 3 else ctx.real.expand(stored, m)
        assert ctx.real.shape == ((1, m) if len(set(counts)) == 1 else (1, stored, m))
        shapes.add(ctx.real.dim())
        for h, (positions, keys) in enumerate(r["heads"]):
            pad = m - len(positions)
            assert per_head[h].tolist() == [False] * pad + [True] * len(positions)
            assert ctx.positions[0, h].tolist() == [-1] * pad + positions.tolist()
            np.testing.assert_array_equal(ctx.keys[0, h, pad:].double().numpy(), keys)
            assert not ctx.keys[0, h, :pad].any()
    assert shapes == ({2, 3} if "head_allocation" in settings else {2})


def test_accumulated_and_history_follow_the_layout(random_llama):
    """H2O's accumulated attention is [1, Hq, m] (per query head, like prefill's column sums) and
    Scissorhands' history [1, Hq, w_h, m] with levels [1, Hq, w_h]; both in both GQA layouts."""
    model, tokenizer, _ = random_llama
    query_heads = model.config.num_attention_heads
    seen = {}

    def recording(cls):
        @dataclass(frozen=True)
        class Recording(cls):
            name = f"recording_{cls.__name__.lower()}_test"

            def decode_score(self, ctx):
                seen.setdefault((cls.__name__, self.gqa_layout), ctx)
                return super().decode_score(ctx)
        return Recording

    from pyramidkv.methods.h2o import H2O
    from pyramidkv.methods.scissorhands import Scissorhands

    for layout in ("kv_head", "query_head"):
        for cls, extra in ((H2O, {}), (Scissorhands, dict(history_window=6))):
            method = recording(cls)(budget=64, window_size=8, decode=DecodeBudget(40, 8),
                                    gqa_layout=layout, **extra)
            generate(model, tokenizer, [STORY], method, 4, min_new_tokens=4)
    for (name, layout), ctx in seen.items():
        m = ctx.keys.shape[2]
        if name == "H2O":
            assert ctx.accumulated.shape == (1, query_heads, m) and ctx.history is None
            assert (ctx.accumulated[..., -1] > 0).all()  # the newest token was attended at least by itself
        else:
            assert ctx.history.shape == (1, query_heads, 6, m) and ctx.history_levels.shape == (1, query_heads, 6)
            group = query_heads // ctx.keys.shape[1]
            levels = ctx.history_levels[0].reshape(-1, group, 6)
            assert torch.equal(levels, levels[:, :1].expand_as(levels))  # one level per stored head
    assert len(seen) == 4


def test_query_window_sets_the_buffer(random_llama):
    """The decode budget's decode_query_window buffers that many recent queries, independent of window_size
    (none: max(window_size, 1)); the re-selection's context gets them."""
    model, tokenizer, _ = random_llama
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    CONTEXTS.clear()
    with compress(model, RecordingSnapKV(budget=64, window_size=4, decode=DecodeBudget(40, 8))) as patch:
        assert patch.new_cache().decoding.buffer_size == 4
    method = RecordingSnapKV(budget=64, window_size=4, decode=DecodeBudget(40, 8, decode_query_window=12))
    assert make_method("snapkv", budget=64, window_size=4, decode_budget=40, decode_interval=8,
                       decode_query_window=12).decode == method.decode
    for window, message in ((0, "must be an integer >= 1"), (49, "decode_query_window 49 is more than")):
        with pytest.raises(ValueError, match=message):
            make_method("snapkv", budget=64, decode_budget=40, decode_interval=8, decode_query_window=window)
    with compress(model, method) as patch, torch.no_grad():
        cache = patch.new_cache()
        assert cache.decoding.buffer_size == 12
        out = model(ids, past_key_values=cache, use_cache=True)  # 64 kept >= 48: re-selected at once
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        assert all(q.shape[2] == 12 for q in cache.decoding.queries)
    assert CONTEXTS and all(ctx.queries.shape[2] == 12 for ctx in CONTEXTS)
    with pytest.raises(ValueError, match="query_window must be >= 1"):
        DecodeCompressor(method, [None], 4, 2, query_window=0)


# --- the helpers on the decode layout -------------------------------------------------------------

def test_helpers_honour_per_head_masks_and_fewer_queries_than_keys():
    """window_attention and attention_column_sums with a per-head `real` [B, Hkv, n] equal each KV head run
    alone with its own [B, n] mask; with only the last q queries, column sums equal the last q rows of the
    full causal attention."""
    gen = torch.Generator().manual_seed(0)
    bsz, kv_heads, group, n, dim = 2, 3, 2, 12, 8
    queries = torch.randn(bsz, kv_heads * group, n, dim, generator=gen)
    keys = torch.randn(bsz, kv_heads, n, dim, generator=gen)
    pads = torch.tensor([[0, 3, 5], [2, 0, 7]])  # per prompt and head
    real = torch.arange(n)[None, None] >= pads[..., None]  # [B, Hkv, n]
    for q in (n, 5):
        window = window_attention(queries[:, :, n - q:], keys, real, 4)
        sums = attention_column_sums(queries[:, :, n - q:], keys, real)
        for h in range(kv_heads):
            rows = slice(h * group, (h + 1) * group)
            alone = window_attention(queries[:, rows, n - q:], keys[:, h:h + 1], real[:, h], 4)
            torch.testing.assert_close(window[:, rows], alone, rtol=0, atol=0)
            full = window_attention(queries[:, rows], keys[:, h:h + 1], real[:, h], n)  # every row, causal
            torch.testing.assert_close(sums[:, rows], full[:, :, n - q:].sum(dim=2))  # padding rows are 0
    uniform = torch.arange(n)[None] >= torch.tensor([[2], [0]])  # [B, n]: the prefill form
    torch.testing.assert_close(window_attention(queries, keys, uniform, 4),
                               window_attention(queries, keys, uniform[:, None].expand(-1, kv_heads, -1), 4),
                               rtol=0, atol=0)
