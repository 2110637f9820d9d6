"""MiniCache's cross-layer merging: the SLERP arithmetic in closed form, the restoration, attention folded
over magnitudes equal to attention over the restored K/V on the model, the cache's restoration equal to a
float64 one from a plain run, one selection per pair with eviction, exact bytes, batch independence, bad
input."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import AutoConfig, DynamicCache

from pyramidkv import compress, make_method
from pyramidkv.core.cross_layer import layer_pairs, merge_pair, retained_tokens
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.merged_pair import MergedPair, PairedLayerStore
from pyramidkv.models.patch import model_shape
from tests.engine_snapshot import assert_batch_equals_alone, record
from tests.helpers import prefill
from tests.prompts import STORY, passkey_prompt
from tests.reference import assert_same_selection, minicache_restore, snapkv_scores_reduce_then_pool


def random_pair(n=40, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lower = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    upper = lower + 0.7 * torch.randn(n, dim, generator=generator, dtype=torch.float64)
    return lower, upper


def test_round_trip_exact_at_retained_tokens_and_norm_times_direction_elsewhere():
    lower, upper = random_pair()
    pair = MergedPair([KeptKV.from_heads([(lower, lower, torch.arange(40))])],
                      [KeptKV.from_heads([(upper, upper, torch.arange(40))])], [40], t=0.6, retain=0.1)
    direction, norms, distance = merge_pair(lower, upper, 0.6)
    retained, _ = retained_tokens(distance, 0.1)
    assert len(retained) == 4 and set(retained.tolist()) == set(distance.argsort()[-4:].tolist())
    for which, original in ((0, lower), (1, upper)):
        _, keys, values = pair.segment_rows(which, 0, 40)
        expected = direction * norms[:, which:which + 1]
        expected[retained] = original[retained]
        assert torch.equal(keys, expected) and torch.equal(values, expected)
        assert torch.allclose(keys.norm(dim=-1), original.norm(dim=-1), atol=1e-12)  # magnitudes are exact


def test_t_zero_and_one_give_each_layer_its_own_direction():
    lower, upper = random_pair(seed=1)
    assert torch.allclose(merge_pair(lower, upper, 0.0)[0], lower / lower.norm(dim=-1, keepdim=True), atol=1e-12)
    assert torch.allclose(merge_pair(lower, upper, 1.0)[0], upper / upper.norm(dim=-1, keepdim=True), atol=1e-12)


def test_orthogonal_pair_at_half_is_the_bisector_and_identical_layers_are_lossless():
    a, b = torch.tensor([[3.0, 0.0]], dtype=torch.float64), torch.tensor([[0.0, 5.0]], dtype=torch.float64)
    direction, norms, distance = merge_pair(a, b, 0.5)
    assert torch.allclose(direction, torch.tensor([[1.0, 1.0]], dtype=torch.float64) / math.sqrt(2), atol=1e-15)
    assert norms.tolist() == [[3.0, 5.0]] and distance.item() == pytest.approx(0.5)
    lower, _ = random_pair(seed=2)
    for t in (0.0, 0.6, 1.0):
        direction, norms, distance = merge_pair(lower, lower.clone(), t)
        assert torch.allclose(direction * norms[:, :1], lower, atol=1e-12) and float(distance.max()) < 1e-6


def test_retention_count_threshold_and_ties():
    distance = torch.tensor([0.1, 0.5, 0.5, 0.2, 0.05], dtype=torch.float64)
    kept, threshold = retained_tokens(distance, 0.3)          # ceil(1.5) = 2; the tie at 0.5 keeps both
    assert kept.tolist() == [1, 2] and threshold == 0.2        # the largest merged distance
    kept, threshold = retained_tokens(distance, 0.2)          # one of the tied pair: the later token
    assert kept.tolist() == [2] and threshold == 0.5
    kept, threshold = retained_tokens(distance, 0.0)          # none now, none later
    assert kept.numel() == 0 and threshold == math.inf
    assert retained_tokens(distance, 1.0)[1] == -math.inf
    assert layer_pairs(None, 30) == {15: 16, 17: 18, 19: 20, 21: 22, 23: 24, 25: 26, 27: 28}
    assert layer_pairs(3, 8) == {3: 4, 5: 6}


def story(tokenizer):
    return torch.tensor([tokenizer(STORY * 2, add_special_tokens=False).input_ids])


def test_cache_restoration_equals_a_float64_reference_from_a_plain_run(smollm2):
    """Prefill is untouched by merging (each layer's own attention runs first), so every merged pair's
    kept_kv() equals the float64 restoration of the two layers' K/V of an ordinary DynamicCache."""
    model, tokenizer = smollm2
    ids = story(tokenizer)
    cache = prefill(model, ids, make_method("minicache"))
    with torch.no_grad():
        plain = model(ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
    pairs = layer_pairs(None, model.config.num_hidden_layers)
    for lower, upper in pairs.items():
        for h in range(model.config.num_key_value_heads):
            for tensor in (0, 1):   # keys, values
                a, b = plain[lower][tensor][0, h].double().numpy(), plain[upper][tensor][0, h].double().numpy()
                expected = minicache_restore(a, b, 0.6, 0.05)
                for which, layer in ((0, lower), (1, upper)):
                    positions, keys, values = cache.kept_kv(layer, 0)[h]
                    got = (keys, values)[tensor].double().numpy()
                    assert positions.tolist() == list(range(ids.shape[1]))
                    np.testing.assert_allclose(got, expected[which], rtol=1e-5, atol=1e-5)
    for layer in range(model.config.num_hidden_layers):   # layers outside pairs keep their own K/V
        if layer not in pairs and layer - 1 not in pairs:
            keys = cache.kept_kv(layer, 0)[0][1]
            assert torch.equal(keys, plain[layer][0][0, 0])


def test_folded_attention_equals_attention_over_the_restored_kv_on_the_model(smollm2, monkeypatch):
    """At every decode step and paired layer, the output computed on directions with folded magnitudes equals
    attention over the materialised restoration (merged rows restored, this step's tokens as they are) to
    1e-6: the model in float64, so the comparison is not limited by float32 rounding."""
    model, tokenizer = smollm2
    model = copy.deepcopy(model).double()
    calls = []
    real = PairedLayerStore.attend

    def attend(store, queries):
        held = [store.stored_kv(b) for b in range(store.pair.batch)]
        out = real(store, queries)
        calls.append((queries.double(), out.double(), held, store.heads))
        return out

    monkeypatch.setattr(PairedLayerStore, "attend", attend)
    prompts = [tokenizer(STORY * 2, add_special_tokens=False).input_ids, tokenizer(STORY, add_special_tokens=False).input_ids]
    record(model, tokenizer, make_method("minicache", cross_layer_retain=0.2), prompts, 6)
    assert len(calls) == 14 * 5
    for queries, out, held, heads in calls:
        group = queries.shape[1] // heads
        for b, per_head in enumerate(held):
            for h, (_, keys, values) in enumerate(per_head):
                q = queries[b, h * group:(h + 1) * group, 0]                      # [g, D]
                probs = torch.softmax(q @ keys.double().T / math.sqrt(q.shape[-1]), dim=-1)
                expected = probs @ values.double()
                assert torch.allclose(out[b, h * group:(h + 1) * group, 0], expected, rtol=0, atol=1e-6)


def test_eviction_selects_once_per_pair_on_the_summed_scores(eager_setup):
    """snapkv + cross-layer merging: both layers of a pair keep the same tokens, the top of the sum of their
    SnapKV scores (float64 from eager attention); a layer outside the pairs keeps its own top."""
    model, ids, attentions, _ = eager_setup
    window, budget = 16, 64
    method = make_method("snapkv", budget=budget, window_size=window, cross_layer_merge=True)
    cache = prefill(model, ids, method)
    n, kv_heads = ids.shape[1], model.config.num_key_value_heads

    def scores(layer):
        return snapkv_scores_reduce_then_pool(attentions[layer], kv_heads, "mean", window, 7, "max")

    for lower, upper in layer_pairs(None, model.config.num_hidden_layers).items():
        summed = scores(lower) + scores(upper)
        for h in range(kv_heads):
            kept_lower, kept_upper = cache.kept_positions(lower, 0)[h], cache.kept_positions(upper, 0)[h]
            assert torch.equal(kept_lower, kept_upper)
            chosen = {int(p) for p in kept_lower if p < n - window}
            assert_same_selection(chosen, summed[h], budget - window)
    alone = {int(p) for p in cache.kept_positions(3, 0)[0] if p < n - window}
    assert_same_selection(alone, scores(3)[0], budget - window)


def test_bytes_equal_the_formula(smollm2):
    """Unmerged layers: n (K + V) rows; each merged pair per stored head: directions 2 n D, magnitudes 4 n,
    originals 2 (r_K + r_V) D values (float32) + (r_K + r_V) int64 indices, r = ceil(0.05 n) at prefill."""
    model, tokenizer = smollm2
    cfg = model.config
    ids = story(tokenizer)
    n, dim, heads, layers = ids.shape[1], 64, cfg.num_key_value_heads, cfg.num_hidden_layers
    steps = 4
    with torch.no_grad(), compress(model, make_method("minicache")) as patch:
        cache = patch.new_cache()
        out = model(ids, past_key_values=cache, use_cache=True)
        retained = math.ceil(0.05 * n)
        pairs = 7
        unmerged = (layers - 2 * pairs) * heads * n * 2 * dim * 4
        merged = pairs * heads * (2 * n * dim * 4 + 4 * n * 4 + 2 * 2 * retained * dim * 4 + 2 * retained * 8)
        assert cache.kv_bytes(0) == unmerged + merged
        parts = cache.kv_bytes_breakdown(0)
        assert parts["directions"] == pairs * heads * 2 * n * dim * 4
        assert parts["indices"] == pairs * heads * 2 * retained * 8
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    held = n + steps
    retained_after = sum(int(cache.layers[lower].pair.keys.count.sum() + cache.layers[lower].pair.values.count.sum())
                         for lower in layer_pairs(None, layers))
    expected = ((layers - 2 * pairs) * heads * held * 2 * dim * 4
                + pairs * heads * (2 * held * dim * 4 + 4 * held * 4) + retained_after * (2 * dim * 4 + 8))
    assert cache.kv_bytes(0) == expected


@pytest.mark.parametrize("name,settings", [("minicache", {}), ("snapkv", {"budget": 96, "window_size": 16,
                                                                           "cross_layer_merge": True})])
def test_batch_of_three_equals_single_runs(random_llama, name, settings, request):
    model, tokenizer, _ = random_llama  # a batch computes each prompt alone whatever the weights
    prompts = [tokenizer(p, add_special_tokens=False).input_ids
               for p in (passkey_prompt(52817, 12), STORY, "<|im_start|>user\nName a colour.<|im_end|>\n")]
    method = make_method(name, cross_layer_start=2, **settings)  # layers 2-3 of 4 merged
    assert_batch_equals_alone(model, tokenizer, method, prompts, 10, request)


@pytest.mark.parametrize("settings,message", [
    (dict(name="minicache", cross_layer_t=1.5), "cross_layer_t must be in \\[0, 1\\]"),
    (dict(name="minicache", cross_layer_t=-0.1), "cross_layer_t must be in \\[0, 1\\]"),
    (dict(name="minicache", cross_layer_retain=2.0), "cross_layer_retain must be in \\[0, 1\\]"),
    (dict(name="snapkv", budget=64, cross_layer_t=0.5), "only applies with cross_layer_merge"),
    (dict(name="pyramidkv", budget=64, cross_layer_merge=True), "does not combine with layer_allocation='pyramid'"),
    (dict(name="snapkv", budget=64, cross_layer_merge=True, head_allocation="headkv"),
     "does not combine with head_allocation='headkv'"),
    (dict(name="zigzagkv", budget=64, cross_layer_merge=True), "does not combine with layer_allocation='zigzag'"),
    (dict(name="snapkv", budget=64, cross_layer_merge=True, quant_method="kivi"), "does not combine with quant_method"),
    (dict(name="snapkv", budget=64, cross_layer_merge=True, decode_budget=64),
     "decode_budget .* does not combine with cross_layer_merge=True: the paired store .* cannot re-select"),
])
def test_bad_settings_fail_with_one_line(settings, message):
    settings = dict(settings)
    with pytest.raises(ValueError, match=message) as error:
        make_method(settings.pop("name"), **settings)
    assert "\n" not in str(error.value)


def test_a_start_layer_outside_the_model_fails_on_the_config(smollm2_path):
    config = AutoConfig.from_pretrained(smollm2_path)   # no weights loaded
    with pytest.raises(ValueError, match="cross_layer_start 29 leaves no layer pair") as error:
        make_method("minicache", cross_layer_start=29).check_model(model_shape(config))
    assert "\n" not in str(error.value)
    make_method("minicache", cross_layer_start=28).check_model(model_shape(config))
