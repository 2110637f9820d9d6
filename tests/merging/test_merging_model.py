"""Merging on the real SmolLM2: what is stored equals a numpy reference computed from the model's own
uncompressed K/V (a transformers DynamicCache) at the kept positions; kept positions never change;
runs reproduce; a left-padded batch equals its prompts run alone (on conftest's random Llama: it holds
whatever the weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from pyramidkv import make_method
from pyramidkv.generation import generate
from tests.helpers import prefill
from tests.prompts import STORY, passkey_prompt
from tests.reference import ref_cam, ref_mergingpress, ref_pivot, ref_route, ref_weighted

CHECKED_LAYERS = (0, 14, 29)


@pytest.fixture(scope="module")
def story(smollm2):
    """(ids [1, n], per layer (keys, values) [Hkv, n, D] float64 from an ordinary DynamicCache)."""
    model, tokenizer = smollm2
    ids = tokenizer(STORY * 2, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        full = model(ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
    kv = [(full[layer][0][0].double().numpy(), full[layer][1][0].double().numpy())
          for layer in range(model.config.num_hidden_layers)]
    return ids, kv


def expected_head(rule, keys, values, kept, settings):
    """Reference (keys, values) a head stores: keys/values [n, D] of that stored head, kept positions."""
    evicted = np.setdiff1d(np.arange(len(keys)), kept)
    kk, kv, ek, ev = keys[kept], values[kept], keys[evicted], values[evicted]
    if rule == "mergingpress":
        return kk, ref_mergingpress(kk, kv, ek, ev, settings.get("similarity_threshold", 0.0),
                                    settings.get("merge_fraction", 1.0))
    sims, targets = ref_route(ek, kk)
    if rule == "pivot":
        return ref_pivot(kk, ek, targets), ref_pivot(kv, ev, targets)
    return ref_weighted(kk, ek, targets, (sims + 1) / 2), ref_weighted(kv, ev, targets, (sims + 1) / 2)


def stored_heads(kv, layout, group):
    keys, values = kv
    if layout == "query_head":
        return np.repeat(keys, group, axis=0), np.repeat(values, group, axis=0)
    return keys, values


RULES = {"pivot": ("pivot", {}), "weighted": ("weighted", {}), "mergingpress": ("mergingpress", {}),
         "mergingpress-0.2-0.5": ("mergingpress", {"similarity_threshold": 0.2, "merge_fraction": 0.5})}
# Every rule with SnapKV; every other scorer and allocator (ragged AdaKV heads, ZigZagKV's deferred
# gather, L2Norm without a window) with at least one rule.
CASES = [("snapkv", {}, rule) for rule in RULES] + [
    ("pyramidkv", {}, "pivot"), ("h2o", {}, "mergingpress"), ("streamingllm", {}, "weighted"),
    ("l2norm", {"skip_layers": 0}, "mergingpress"), ("adakv", {}, "mergingpress-0.2-0.5"), ("zigzagkv", {}, "pivot")]


@pytest.mark.parametrize("name,settings,rule_id", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_stored_kv_equals_reference_and_kept_positions_do_not_move(smollm2, story, name, settings, rule_id):
    rule, rule_settings = RULES[rule_id]
    model, _ = smollm2
    ids, kv = story
    window = {"streamingllm": {}, "l2norm": {}}.get(name, {"window_size": 16})
    plain = prefill(model, ids, make_method(name, budget=64, **window, **settings))
    merged = prefill(model, ids, make_method(name, budget=64, **window, **settings, merge=rule, **rule_settings))
    for layer in range(model.config.num_hidden_layers):
        assert merged.kept_counts(layer) == plain.kept_counts(layer)
        for (p0, _, _), (p1, _, _) in zip(plain.kept_kv(layer), merged.kept_kv(layer)):
            assert torch.equal(p0, p1)
    for layer in CHECKED_LAYERS:
        for h, (positions, keys, values) in enumerate(merged.kept_kv(layer)):
            want_keys, want_values = expected_head(rule, kv[layer][0][h], kv[layer][1][h], positions.numpy(),
                                                   rule_settings)
            np.testing.assert_allclose(keys.double().numpy(), want_keys, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(values.double().numpy(), want_values, rtol=1e-4, atol=1e-4)


def test_query_head_layout_merges_the_repeated_heads(smollm2, story):
    model, _ = smollm2
    ids, kv = story
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    cache = prefill(model, ids, make_method("snapkv", budget=64, window_size=16, gqa_layout="query_head",
                                            merge="pivot"))
    for layer in CHECKED_LAYERS:
        heads = cache.kept_kv(layer)
        assert len(heads) == model.config.num_attention_heads
        keys_all, values_all = stored_heads(kv[layer], "query_head", group)
        for h, (positions, keys, values) in enumerate(heads):
            want_keys, want_values = expected_head("pivot", keys_all[h], values_all[h], positions.numpy(), {})
            np.testing.assert_allclose(keys.double().numpy(), want_keys, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(values.double().numpy(), want_values, rtol=1e-4, atol=1e-4)


def test_mergingpress_keeps_keys_bit_identical_and_changes_values_pivot_changes_keys(smollm2, story):
    model, _ = smollm2
    ids, _ = story
    plain = prefill(model, ids, make_method("snapkv", budget=64, window_size=16))
    press = prefill(model, ids, make_method("snapkv", budget=64, window_size=16, merge="mergingpress"))
    pivot = prefill(model, ids, make_method("snapkv", budget=64, window_size=16, merge="pivot"))
    changed_values = changed_pivot_keys = 0
    for layer in range(model.config.num_hidden_layers):
        for (_, k0, v0), (_, k1, v1), (_, k2, _) in zip(plain.kept_kv(layer), press.kept_kv(layer),
                                                        pivot.kept_kv(layer)):
            assert torch.equal(k0, k1)
            changed_values += int((v0 != v1).any(-1).sum())
            changed_pivot_keys += int((k0 != k2).any(-1).sum())
    assert changed_values > 0 and changed_pivot_keys > 0


def test_cam_merge_equals_reference_from_eager_attention(eager_setup):
    """CaM's probabilities come from the window's attention: recompute it from transformers' eager weights."""
    model, ids, attentions, keys = eager_setup
    with torch.no_grad():
        full = model(ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
    window = 16
    cache = prefill(model, ids, make_method("cam", budget=64, window_size=window))
    n = ids.shape[1]
    num_kv = model.config.num_key_value_heads
    for layer in CHECKED_LAYERS:
        values = full[layer][1][0].double().numpy()
        window_rows = attentions[layer][:, n - window:, :].mean(axis=1)  # [Hq, n]
        attention = window_rows.reshape(num_kv, -1, n).mean(axis=1)     # mean over each query group
        for h, (positions, stored_keys, stored_values) in enumerate(cache.kept_kv(layer)):
            kept = positions.numpy()
            evicted = np.setdiff1d(np.arange(n), kept)
            want = ref_cam(kept, values[h][kept], evicted, values[h][evicted], attention[h], window, 0.1, window)
            np.testing.assert_allclose(stored_values.double().numpy(), want, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(stored_keys.double().numpy(), keys[layer][h][kept], rtol=1e-4, atol=1e-4)
            assert not np.allclose(want, values[h][kept])  # the case merges something


def values_of(cache, layers=range(30)):
    return [v.clone() for layer in layers for _, _, v in cache.kept_kv(layer)]


def test_cam_is_reproducible_deterministic_and_seeded(smollm2, story):
    model, tokenizer = smollm2
    ids, _ = story
    def run(**settings):
        return values_of(prefill(model, ids, make_method("cam", budget=64, window_size=16, **settings)))
    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    expected, sampled = run(), run(sampling=True, seed=3)
    assert same(expected, run())
    assert same(sampled, run(sampling=True, seed=3))
    assert not same(sampled, run(sampling=True, seed=4))
    assert not same(expected, sampled)
    method = make_method("cam", budget=64, window_size=16)
    prompt = passkey_prompt(41872, 12)
    texts = [generate(model, tokenizer, [prompt], method, 12, min_new_tokens=12)[0].text for _ in range(2)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("name,settings", [
    ("snapkv", {"merge": "mergingpress"}), ("snapkv", {"merge": "pivot"}), ("cam", {}),
    ("cam", {"sampling": True, "seed": 5}), ("adakv", {"merge": "weighted"})])
def test_left_padded_batch_with_merging_equals_single_prompts(random_llama, name, settings):
    model, tokenizer, _ = random_llama  # a batch computes each prompt alone whatever the weights
    prompts = [passkey_prompt(41872, 12), STORY, passkey_prompt(90311, 0)]
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    assert len(set(lengths)) == 3 and min(lengths) < 128 < max(lengths)
    method = make_method(name, budget=128, window_size=16, **settings)
    single = [generate(model, tokenizer, [p], method, 20, min_new_tokens=20)[0] for p in prompts]
    batch = generate(model, tokenizer, prompts, method, 20, min_new_tokens=20)
    for s, b in zip(single, batch):
        assert b.text == s.text
        assert b.kv_bytes_per_prompt == s.kv_bytes_per_prompt
    # What is stored, prompt by prompt: padding (the shorter prompts') never entered a merge.
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    batched = prefill(model, enc.input_ids, method, attention_mask=enc.attention_mask,
                      position_ids=(enc.attention_mask.cumsum(-1) - 1).clamp(min=0))
    for b, prompt in enumerate(prompts):
        alone = prefill(model, tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids, method)
        for layer in range(model.config.num_hidden_layers):
            for (p0, k0, v0), (p1, k1, v1) in zip(alone.kept_kv(layer), batched.kept_kv(layer, b)):
                assert torch.equal(p0, p1)
                torch.testing.assert_close(k1, k0, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-4)
