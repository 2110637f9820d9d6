"""One budget over every layer (head_allocation global) cut while the prefill runs (core/running_top.py): the kept
sets are the best B scores over every layer and head, against a float64 SnapKV recomputation and one global sort of
the test's own (near-ties at the cut allowed, tests/near_ties.py's rule of thumb: within float32 resolution); the
same kept sets, K/V and bytes as with every layer waiting whole, over the units the cut composes with (a batch with
a prompt kept whole, sinks, z-scored scores, ThinK's channels, a quantizer, the query_head layout); the peak prefill
K/V counted by hand, under fullkv's / 2; a batch keeps what each prompt keeps alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
import pyramidkv.core.prefill as prefill_module
from tests.conftest import tiny_llama
from tests.engine_snapshot import assert_batch_equals_alone
from tests.reference import pool_1d, prompt_queries_and_keys, reduce_groups

LAYERS, HEADS, DIM = 4, 2, 16
TOKEN_BYTES = 2 * DIM * 4          # K and V of one token of one stored head, float32


def model():
    """A random 4-layer Llama (GQA 4 / 2, head dim 16): shared, never changed."""
    return tiny_llama(layers=LAYERS, vocab=128, seed=7, std=0.2, max_position_embeddings=256)


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def prefilled(method, ids, attention_mask=None):
    with torch.no_grad(), compress(model(), method) as patch:
        cache = patch.new_cache()
        model()(ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    return cache


def snapkv_float64(n: int, window: int, ids) -> list[np.ndarray]:
    """Per layer [Hkv, n - window] SnapKV scores in float64: the last `window` queries' causal softmax over the keys,
    summed over those rows, the query group's mean, max-pooled over 7 positions."""
    queries, keys = prompt_queries_and_keys(model(), ids)
    out = []
    for q, k in zip(queries, keys):
        group = q.shape[0] // k.shape[0]
        logits = q[:, n - window:] @ np.repeat(k, group, axis=0).transpose(0, 2, 1) / math.sqrt(DIM)   # [Hq, w, n]
        logits[:, np.arange(window)[:, None] < np.arange(n)[None, :] - (n - window)] = -np.inf
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        summed = probs[:, :, : n - window].sum(axis=1)
        out.append(pool_1d(reduce_groups(summed, k.shape[0], "mean"), 7, "max"))
    return out


def test_kept_sets_are_the_best_scores_over_every_layer_in_float64():
    """n = 96, budget 16, window 4: the L x H x 12 = 96 best of the 4 x 2 x 92 float64 scores, in the global order
    (the score, then the lower layer, the more recent position, the lower head), are what the layers keep besides
    their window; a kept set that differs does so only within float32 resolution of the cut."""
    n, budget, window = 96, 16, 4
    ids = ids_of(n)
    cache = prefilled(make_method("snapkv", budget=budget, window_size=window, head_allocation="global"), ids)
    scores = snapkv_float64(n, window, ids)
    total = LAYERS * HEADS * (budget - window)
    entries = sorted(((float(s[h, p]), layer, p, h) for layer, s in enumerate(scores)
                      for h in range(HEADS) for p in range(n - window)), key=lambda e: (-e[0], e[1], -e[2], e[3]))
    expected = {(layer, h, p) for _, layer, p, h in entries[:total]}
    cut = entries[total - 1][0]
    kept = set()
    for layer in range(LAYERS):
        for h, positions in enumerate(cache.kept_positions(layer)):
            assert set(range(n - window, n)) <= {int(p) for p in positions}
            kept |= {(layer, h, int(p)) for p in positions if p < n - window}
    assert len(kept) == total
    assert len({sum(1 for e in expected if e[:2] == (layer, h)) for layer in range(LAYERS) for h in range(HEADS)}) > 1
    for layer, h, p in kept ^ expected:
        assert abs(scores[layer][h, p] - cut) <= 1e-5 * abs(cut), (layer, h, p, scores[layer][h, p], cut)


def waiting_whole(monkeypatch):
    """Runs the prefill as before the running cut: every layer waits whole until the last is scored."""
    monkeypatch.setattr(prefill_module, "runs_top", lambda method: False)


CASES = {
    "snapkv": dict(method="snapkv"),
    "sinks": dict(method="snapkv", num_sinks=3),
    "l2norm-zscore": dict(method="l2norm", skip_layers=0),
    "think": dict(method="snapkv", key_channel_ratio=0.5, key_recent_size=8),
    "kivi": dict(method="snapkv", quant_method="kivi", nbits=2, group_size=8, residual_length=8),
    "query_head": dict(method="snapkv", gqa_layout="query_head"),
    "h2o": dict(method="h2o"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_cut_keeps_what_waiting_whole_keeps(case, monkeypatch):
    """A left-padded batch of three (96, 70 and 12 tokens: the last kept whole): per layer, prompt and head the same
    positions, the same stored K/V (the same rows, copied) and bytes as with every layer waiting whole; the peak
    lower."""
    settings = dict(CASES[case])
    method = make_method(settings.pop("method"), budget=20, window_size=4, head_allocation="global", **settings)
    lengths = [96, 70, 12]
    ids = torch.zeros(3, 96, dtype=torch.long)
    mask = torch.zeros(3, 96, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, 96 - length:] = ids_of(length, seed=b + 2)
        mask[b, 96 - length:] = 1
    cut = prefilled(method, ids, mask)
    assert cut.prompt.running is not None and not cut.prompt.running.held
    with monkeypatch.context() as patch:
        waiting_whole(patch)
        whole = prefilled(method, ids, mask)
    assert whole.prompt.running is None
    for layer in range(LAYERS):
        for b in range(3):
            ours, theirs = cut.stored_kv(layer, b), whole.stored_kv(layer, b)
            for (p, k, v), (q, k2, v2) in zip(ours, theirs):
                assert torch.equal(p, q) and torch.equal(k, k2) and torch.equal(v, v2), (layer, b)
        assert cut.kept_counts(layer) == whole.kept_counts(layer)
    assert [cut.kv_bytes(b) for b in range(3)] == [whole.kv_bytes(b) for b in range(3)]
    assert cut.layer_budgets_used(0) == whole.layer_budgets_used(0)
    assert cut.peak_prefill_kv_bytes < whole.peak_prefill_kv_bytes


def test_peak_prefill_bytes_counted_by_hand():
    """n = 128, budget 16, window 4: B = 4 x 2 x 12 = 96. When layer l is scored the l layers before it hold their
    window (l x 2 x 4) and min(B, their l x 2 x 124 candidates), and layer l its whole prompt (2 x 128): the peak is
    the largest of these, 8 x 3 + 96 + 256 = 376 tokens at the last layer, 128 bytes each; fullkv's is 4 x 2 x 128
    = 1,024 tokens, so 0.37 of it, within the stated bound (the final cache + one layer's whole K/V)."""
    n, budget, window = 128, 16, 4
    method = make_method("snapkv", budget=budget, window_size=window, head_allocation="global")
    cache = prefilled(method, ids_of(n))
    total = LAYERS * HEADS * (budget - window)
    by_hand = max(layer * HEADS * window + min(total, layer * HEADS * (n - window)) + HEADS * n
                  for layer in range(LAYERS))
    assert by_hand == 376
    assert cache.peak_prefill_kv_bytes == by_hand * TOKEN_BYTES
    assert cache.kv_bytes() == LAYERS * HEADS * budget * TOKEN_BYTES
    assert cache.peak_prefill_kv_bytes <= cache.kv_bytes() + HEADS * n * TOKEN_BYTES
    assert cache.peak_prefill_kv_bytes <= LAYERS * HEADS * n * TOKEN_BYTES / 2


def test_a_batch_keeps_what_each_prompt_keeps_alone(random_llama, request):
    model_, tokenizer, _ = random_llama
    text = "A ferry crossed the fjord at dawn, its log noting wind, cargo and the pilot's name. "

    def chat(body: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False).input_ids

    prompts = [chat(text * 6 + "The pilot was Ines."), chat(text * 3 + "The pilot was Ola."), chat("Pilot: Siv.")]
    method = make_method("snapkv", budget=48, window_size=8, head_allocation="global")
    assert_batch_equals_alone(model_, tokenizer, method, prompts, 6, request)
