"""The cache really shrinks, and batching with left padding changes nothing."""

from __future__ import annotations

import pytest
import torch

from pyramidkv import make_method
from pyramidkv.generation import generate
from tests.helpers import prefill
from tests.prompts import STORY, passkey_prompt


@pytest.mark.parametrize("layout,stored_heads", [("kv_head", 3), ("query_head", 9)])
@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "h2o", "streamingllm", "l2norm"])
def test_stored_bytes_equal_kept_counts(smollm2, name, layout, stored_heads):
    model, tokenizer = smollm2
    cfg = model.config
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    extra = {"skip_layers": 0} if name == "l2norm" else {}
    cache = prefill(model, ids, make_method(name, budget=64, window_size=16 if name != "streamingllm" else 0,
                                            gqa_layout=layout, **extra))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kept_tokens = 0
    for layer in range(cfg.num_hidden_layers):
        counts = cache.kept_counts(layer)[0]
        assert len(counts) == stored_heads
        kept_tokens += sum(counts)
        kept = cache.layers[layer].kept[0]  # the prompt's KeptKV in the layer's full-precision store
        # Physically small: the stored tensors own exactly their bytes (not views into the full K/V).
        for t in (kept.keys, kept.values):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    expected = kept_tokens * head_dim * 2 * 4  # keys + values, float32
    assert cache.kv_bytes() == expected
    if name != "pyramidkv":
        assert kept_tokens == cfg.num_hidden_layers * stored_heads * 64
    else:
        assert kept_tokens == cfg.num_hidden_layers * stored_heads * 64  # pyramid total == uniform total


def test_kv_head_layout_is_budget_over_n_of_full(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    n = ids.shape[1]
    full = prefill(model, ids, make_method("fullkv")).kv_bytes()
    cfg = model.config
    assert full == cfg.num_hidden_layers * cfg.num_key_value_heads * 64 * 2 * 4 * n  # no repeated heads
    small = prefill(model, ids, make_method("snapkv", budget=64, window_size=16)).kv_bytes()
    assert small * n == full * 64


def padded_batch(tokenizer, prompts):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


@pytest.mark.parametrize("method_args", [("fullkv", {}), ("snapkv", {"budget": 128, "window_size": 16})],
                         ids=["fullkv", "snapkv"])
def test_left_padded_batch_equals_single_prompts(random_llama, method_args):
    model, tokenizer, _ = random_llama  # a batch computes each prompt alone whatever the weights
    name, settings = method_args
    prompts = [passkey_prompt(41872, 12), STORY, passkey_prompt(90311, 0)]
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    assert len(set(lengths)) == 3 and min(lengths) < 128 < max(lengths)  # some compressed, one kept whole
    method = make_method(name, **settings)
    single = [generate(model, tokenizer, [p], method, 20, min_new_tokens=20)[0] for p in prompts]
    batch = generate(model, tokenizer, prompts, method, 20, min_new_tokens=20)
    for s, b in zip(single, batch):
        assert b.text == s.text
        assert b.kv_bytes_per_prompt == s.kv_bytes_per_prompt


def test_padding_is_never_kept(smollm2):
    model, tokenizer = smollm2
    prompts = [STORY, passkey_prompt(123, 3)]
    ids, mask = padded_batch(tokenizer, prompts)
    pads = (mask == 0).sum(1).tolist()
    assert pads[0] == 0 < pads[1]
    real = mask.sum(1).tolist()
    for name, settings in [("fullkv", {}), ("snapkv", {"budget": 64, "window_size": 16}),
                           ("h2o", {"budget": 64, "window_size": 16}), ("streamingllm", {"budget": 64})]:
        cache = prefill(model, ids, make_method(name, **settings), attention_mask=mask)
        for layer in range(model.config.num_hidden_layers):
            for b in range(2):
                for positions in cache.kept_positions(layer, b):
                    # positions count from each prompt's first real token: padding would be negative
                    assert positions.min() >= 0 and positions.max() < real[b]
                    assert len(positions) == min(real[b], settings.get("budget", real[b]))


def test_passkey_answered_by_fullkv_and_snapkv_128(smollm2):
    """REFERENCE.md's pass-key prompt, ~1500 tokens, needle in the middle."""
    model, tokenizer = smollm2
    prompt = passkey_prompt(73691, 60, depth=0.5)
    assert 1400 <= len(tokenizer(prompt, add_special_tokens=False).input_ids) <= 1600
    for method in (make_method("fullkv"), make_method("snapkv", budget=128)):
        out = generate(model, tokenizer, [prompt], method, 8)[0]
        assert out.text.startswith("73691"), (method.name, out.text)


def test_kept_kv_returns_the_model_keys_and_values_at_the_kept_positions(smollm2):
    """Inspection API against transformers' own DynamicCache of the same prompt (left-padded batch)."""
    from transformers import DynamicCache

    model, tokenizer = smollm2
    prompts = [STORY, passkey_prompt(123, 3)]
    ids, mask = padded_batch(tokenizer, prompts)
    method = make_method("pyramidkv", budget=64, window_size=16)
    cache = prefill(model, ids, method, attention_mask=mask)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, past_key_values=DynamicCache(), use_cache=True).past_key_values
    pads = (mask == 0).sum(1).tolist()
    for b in range(2):
        budgets = cache.layer_budgets_used(b)
        real = ids.shape[1] - pads[b]
        assert sum(budgets) == model.config.num_hidden_layers * 64 or budgets == [real] * model.config.num_hidden_layers
        for layer in (0, 13, 29):
            heads = cache.kept_kv(layer, b)
            assert len(heads) == model.config.num_key_value_heads
            for h, (positions, keys, values) in enumerate(heads):
                assert len(positions) == min(real, budgets[layer]) == keys.shape[0] == values.shape[0]
                rows = positions + pads[b]
                torch.testing.assert_close(keys, full.key_cache[layer][b, h, rows], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(values, full.value_cache[layer][b, h, rows], rtol=1e-5, atol=1e-5)
