"""Adaptive allocation on SmolLM2: kept positions per layer and head against a reference computed
in numpy from the model's own eager attention weights (tests/reference.py, tests/allocation/test_allocation.py);
ragged counts, exact totals, stored bytes; batches."""

from __future__ import annotations

import numpy as np
import pytest

from pyramidkv import make_method
from pyramidkv.generation import generate
from tests import reference as ref
from tests.prompts import STORY, passkey_prompt
from tests.allocation.test_allocation import adakv_reference, largest_remainder, lmba_reference
from tests.helpers import prefill

BUDGET, WINDOW, KERNEL = 64, 16, 5
S = BUDGET - WINDOW


def layer_scores(name, attn, keys, num_kv, layout):
    """Reference candidate scores [H, n - WINDOW] of one layer for the scorer of `name`."""
    if name == "h2o":
        scores = ref.h2o_scores(attn, WINDOW)
        return ref.reduce_groups(scores, num_kv, "mean") if layout == "kv_head" else scores
    if layout == "kv_head":
        return ref.snapkv_scores_reduce_then_pool(attn, num_kv, "mean", WINDOW, KERNEL, "max")
    return ref.snapkv_scores(attn, WINDOW, KERNEL, "max")


def check_heads(cache, layer, scores, head_counts, n):
    window = set(range(n - WINDOW, n))
    kept = cache.kept_positions(layer)
    assert [len(p) for p in kept] == [WINDOW + c for c in head_counts], layer
    for head, positions in enumerate(kept):
        positions = set(positions.tolist())
        assert window <= positions
        ref.assert_same_selection(positions - window, scores[head], head_counts[head])


@pytest.mark.parametrize("layout", ["kv_head", "query_head"])
@pytest.mark.parametrize("name,settings", [("adakv", {}), ("h2o", {"head_allocation": "adakv"}),
                                           ("ada_pyramidkv", {})])
def test_adakv_kept_positions_match_reference(eager_setup, name, settings, layout):
    model, ids, attentions, keys = eager_setup
    n, num_layers, num_kv = ids.shape[1], len(attentions), keys[0].shape[0]
    extra = {} if name == "h2o" else {"kernel_size": KERNEL}
    method = make_method(name, budget=BUDGET, window_size=WINDOW, gqa_layout=layout, **extra, **settings)
    cache = prefill(model, ids, method)
    if name == "ada_pyramidkv":
        layer_selected = ref.pyramid_counts(S, num_layers, 20)
    else:
        layer_selected = [S] * num_layers
    ragged_layers, total = 0, 0
    cfg = model.config
    for layer in range(num_layers):
        scores = layer_scores(name, attentions[layer], keys[layer], num_kv, layout)
        counts = adakv_reference(scores, layer_selected[layer], 0.2)
        check_heads(cache, layer, scores, counts, n)
        assert sum(counts) == scores.shape[0] * layer_selected[layer]
        ragged_layers += len(set(counts)) > 1
        total += sum(counts) + WINDOW * scores.shape[0]
    assert ragged_layers > num_layers // 2          # the scores differ across heads, so do the counts
    assert total == num_layers * len(cache.kept_counts(0)[0]) * BUDGET   # exactly the uniform total
    assert cache.kv_bytes() == total * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 4


def test_zigzag_kept_positions_match_reference(eager_setup):
    model, ids, attentions, keys = eager_setup
    n, num_layers, num_kv = ids.shape[1], len(attentions), keys[0].shape[0]
    cache = prefill(model, ids, make_method("zigzagkv", budget=BUDGET, window_size=WINDOW,
                                                      kernel_size=KERNEL))
    scores = [layer_scores("zigzagkv", attentions[l], keys[l], num_kv, "kv_head") for l in range(num_layers)]
    values = np.array([lmba_reference(s, 0.9) for s in scores])
    exact = 0.2 * S + (S - 0.2 * S) * num_layers * values / values.sum()
    selected = largest_remainder(exact, num_layers * S, [int(0.2 * S)] * num_layers, [n - WINDOW] * num_layers)
    assert len(set(selected)) > 1
    assert cache.layer_budgets_used(0) == [WINDOW + s for s in selected]
    for layer in range(num_layers):
        check_heads(cache, layer, scores[layer], [selected[layer]] * num_kv, n)
    # the deferred gather held every layer's full K/V until the end of prefill
    full_bytes = num_layers * num_kv * n * 64 * 2 * 4
    assert cache.peak_prefill_kv_bytes >= full_bytes > cache.kv_bytes()


def test_floor_ratio_one_is_plain_snapkv(eager_setup):
    model, ids, _, _ = eager_setup
    plain = prefill(model, ids, make_method("snapkv", budget=BUDGET, window_size=WINDOW))
    uniform = prefill(model, ids, make_method("adakv", budget=BUDGET, window_size=WINDOW, floor_ratio=1.0))
    for layer in range(model.config.num_hidden_layers):
        for a, b in zip(plain.kept_positions(layer), uniform.kept_positions(layer)):
            assert a.tolist() == b.tolist()


@pytest.mark.parametrize("name", ["adakv", "zigzagkv"])
def test_left_padded_batch_equals_single_prompts(random_llama, name):
    model, tokenizer, _ = random_llama  # a batch computes each prompt alone whatever the weights
    prompts = [passkey_prompt(41872, 12), STORY, passkey_prompt(90311, 0)]
    method = make_method(name, budget=96, window_size=16)
    single = [generate(model, tokenizer, [p], method, 12, min_new_tokens=12)[0] for p in prompts]
    batch = generate(model, tokenizer, prompts, method, 12, min_new_tokens=12)
    for s, b in zip(single, batch):
        assert (b.text, b.kv_bytes_per_prompt) == (s.text, s.kv_bytes_per_prompt)
