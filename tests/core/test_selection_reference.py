"""Kept positions per layer and head equal an independent reference from the model's eager attention.

The reference (tests/reference.py) scores tokens in numpy from the attention
probabilities transformers returns with output_attentions=True, and from the
post-RoPE keys of an ordinary DynamicCache; it shares no code with pyramidkv's core.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyramidkv import make_method
from tests import reference as ref
from tests.helpers import prefill

BUDGET, WINDOW, KERNEL = 64, 16, 5


def reference_scores(name, attn, keys, kernel, pooling):
    if name in ("snapkv", "pyramidkv"):
        return ref.snapkv_scores(attn, WINDOW, kernel, pooling)
    if name == "h2o":
        return ref.h2o_scores(attn, WINDOW)
    if name == "l2norm":
        return ref.l2norm_scores(keys, WINDOW)
    raise AssertionError(name)


CASES = [
    ("snapkv", dict(kernel_size=KERNEL, pooling="max")),
    ("snapkv", dict(kernel_size=KERNEL, pooling="avg")),
    ("pyramidkv", dict(kernel_size=KERNEL, pooling="max", beta=20)),
    ("h2o", {}),
    ("l2norm", dict(skip_layers=0)),
]


@pytest.mark.parametrize("layout", ["kv_head", "query_head"])
@pytest.mark.parametrize("name,settings", CASES, ids=[f"{n}-{s.get('pooling', '')}" for n, s in CASES])
def test_kept_positions_match_reference(eager_setup, name, settings, layout):
    model, ids, attentions, keys = eager_setup
    n = ids.shape[1]
    num_layers = len(attentions)
    num_q, num_kv = attentions[0].shape[0], keys[0].shape[0]
    group = num_q // num_kv
    method = make_method(name, budget=BUDGET, window_size=WINDOW, gqa_layout=layout, **settings)
    cache = prefill(model, ids, method)

    if name == "pyramidkv":
        budgets = [WINDOW + c for c in ref.pyramid_counts(BUDGET - WINDOW, num_layers, 20)]
    else:
        budgets = [BUDGET] * num_layers
    window = set(range(n - WINDOW, n))
    for layer in range(num_layers):
        if name in ("snapkv", "pyramidkv") and layout == "kv_head":
            # The published order (public PyramidKV / AdaKV code): mean over the query group, then pool.
            scores = ref.snapkv_scores_reduce_then_pool(attentions[layer], num_kv, "mean", WINDOW,
                                                        settings["kernel_size"], settings["pooling"])
        else:
            scores = reference_scores(name, attentions[layer], keys[layer], settings.get("kernel_size"),
                                      settings.get("pooling"))
        if layout == "kv_head":
            if scores.shape[0] == num_q:
                scores = ref.reduce_groups(scores, num_kv, "mean")
        elif scores.shape[0] == num_kv:
            scores = np.repeat(scores, group, axis=0)
        kept = cache.kept_positions(layer)
        assert len(kept) == scores.shape[0]
        for head, positions in enumerate(kept):
            positions = set(positions.tolist())
            assert len(positions) == budgets[layer], (layer, head)
            assert window <= positions, f"layer {layer} head {head}: window not kept"
            ref.assert_same_selection(positions - window, scores[head], budgets[layer] - WINDOW)


def test_streamingllm_keeps_sinks_and_recent(eager_setup):
    model, ids, attentions, _ = eager_setup
    n = ids.shape[1]
    for sinks in (4, 0):
        cache = prefill(model, ids, make_method("streamingllm", budget=BUDGET, num_sinks=sinks))
        expected = set(range(sinks)) | set(range(n - (BUDGET - sinks), n))
        for layer in range(len(attentions)):
            for positions in cache.kept_positions(layer):
                assert set(positions.tolist()) == expected


def test_gqa_reduce_max_and_sum(eager_setup):
    model, ids, attentions, keys = eager_setup
    num_kv = keys[0].shape[0]
    for how in ("max", "sum"):
        method = make_method("snapkv", budget=BUDGET, window_size=WINDOW, kernel_size=KERNEL, gqa_reduce=how)
        cache = prefill(model, ids, method)
        for layer in (0, 14, 29):
            scores = ref.snapkv_scores_reduce_then_pool(attentions[layer], num_kv, how, WINDOW, KERNEL, "max")
            n = ids.shape[1]
            for head, positions in enumerate(cache.kept_positions(layer)):
                ref.assert_same_selection(set(positions.tolist()) - set(range(n - WINDOW, n)), scores[head],
                                          BUDGET - WINDOW)


def test_gqa_pooling_before_reduce_pools_each_query_head_first(eager_setup):
    """The optional order: max-pool each query head's window sums, then mean over the group."""
    model, ids, attentions, keys = eager_setup
    n, num_kv = ids.shape[1], keys[0].shape[0]
    method = make_method("snapkv", budget=BUDGET, window_size=WINDOW, kernel_size=KERNEL,
                         gqa_pooling="before_reduce")
    cache = prefill(model, ids, method)
    differs = 0
    for layer in range(len(attentions)):
        pooled_first = ref.reduce_groups(ref.snapkv_scores(attentions[layer], WINDOW, KERNEL, "max"), num_kv, "mean")
        reduced_first = ref.snapkv_scores_reduce_then_pool(attentions[layer], num_kv, "mean", WINDOW, KERNEL, "max")
        for head, positions in enumerate(cache.kept_positions(layer)):
            chosen = set(positions.tolist()) - set(range(n - WINDOW, n))
            ref.assert_same_selection(chosen, pooled_first[head], BUDGET - WINDOW)
            differs += chosen != ref.top_positions(reduced_first[head], BUDGET - WINDOW)
    assert differs > 0  # the two orders really select differently on this model


def test_l2norm_defaults_follow_the_paper(eager_setup):
    """Devoto et al. (and their l2_compress(skip_layers=[0, 1])): layers 0 and 1 keep everything; the
    other layers keep exactly the `budget` lowest-norm keys, with no forced recent window."""
    model, ids, attentions, keys = eager_setup
    n = ids.shape[1]
    method = make_method("l2norm", budget=BUDGET)
    cache = prefill(model, ids, method)
    for layer in range(len(attentions)):
        for head, positions in enumerate(cache.kept_positions(layer)):
            positions = set(positions.tolist())
            if layer < 2:
                assert positions == set(range(n)), layer
            else:
                norms = np.linalg.norm(keys[layer][head], axis=-1)   # every prompt token is a candidate
                ref.assert_same_selection(positions, -norms, BUDGET)
