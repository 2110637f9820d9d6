"""The patched model against the unpatched one: same logits, same generations, nothing leaks."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers import DynamicCache

from pyramidkv import METHODS, compress, load_model, make_method
from pyramidkv.methods import budget_flag_applies
from pyramidkv.generation import generate
from tests.models.families import SMOLLM2_AS
from tests.prompts import STORY


@functools.lru_cache(maxsize=None)
def _load(path, attn, model_class):
    return load_model(path, attn_implementation=attn, device="cpu", model_class=model_class)


@pytest.fixture(scope="module")
def models(smollm2_path):
    return lambda attn, model_class=None: _load(smollm2_path, attn, model_class)


def step_logits(model, ids, steps, cache):
    """Greedy: prompt forward then `steps` single-token forwards; logits of every forward's last position."""
    out = []
    with torch.no_grad():
        res = model(ids, past_key_values=cache, use_cache=True)
        out.append(res.logits[0, -1])
        cache = res.past_key_values
        for _ in range(steps):
            nxt = res.logits[:, -1:].argmax(-1)
            res = model(nxt, past_key_values=cache, use_cache=True)
            out.append(res.logits[0, -1])
            cache = res.past_key_values
    return out


@pytest.mark.parametrize("model_class", SMOLLM2_AS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fullkv_logits_equal_unpatched(models, attn, model_class):
    model, tokenizer = models(attn, model_class)
    assert model.config.model_type == model_class
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    expected = step_logits(model, ids, 5, DynamicCache())
    with compress(model, make_method("fullkv")):
        got = step_logits(model, ids, 5, None)
    assert torch.equal(got[0], expected[0])  # prefill runs the model's own attention unchanged
    for g, e in zip(got[1:], expected[1:]):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


# The settings that make a method lossless once its token budget covers the prompt: ThinK's channel axis
# prunes keys at any token budget (tested in test_think.py), so here it is off; Scissorhands only
# compresses while decoding, and a decode budget above prompt + new tokens never triggers; Quest's budget
# counts the tokens of the pages it reads per step, so it must cover the prompt, the 20 new tokens and a
# partial page. Methods without a budget (fullkv, minicache, minference) have their own exactness tests.
LOSSLESS = {"think": lambda budget: {"budget": budget, "key_channel_ratio": 0.0},
            "scissorhands": lambda budget: {"budget": budget, "decode_budget": budget + 50},
            "tova": lambda budget: {"budget": budget, "decode_budget": budget + 50},   # else one eviction a step
            "quest": lambda budget: {"budget": -(-(budget + 20 + 16) // 16) * 16}}   # whole pages of 16


def logits_and_text(model, tokenizer, ids, method, new_tokens=20):
    """generate()'s last-position logits of every forward (the prefill and each decode step) and its output."""
    logits = []
    hook = model.register_forward_hook(lambda module, args, output: logits.append(output.logits[0, -1].clone()))
    try:
        out = generate(model, tokenizer, [ids], method, new_tokens, min_new_tokens=new_tokens)[0]
    finally:
        hook.remove()
    return logits, out


@pytest.fixture(scope="module")
def full_story(sharp_llama):
    """fullkv's logits and 20 greedy tokens after STORY: the reference of every method's lossless budget."""
    model, tokenizer, _ = sharp_llama
    ids = tokenizer(STORY, add_special_tokens=False).input_ids
    return ids, logits_and_text(model, tokenizer, ids, make_method("fullkv"))


@pytest.mark.parametrize("name", [m for m, cls in METHODS.items() if budget_flag_applies(cls)])   # threshold: no budget
def test_budget_at_least_prompt_generates_like_full_cache(sharp_llama, full_story, name):
    """Every step's logits equal fullkv's (a method that drops one token fails by 0.2 or more) and so does the
    text. Losslessness does not depend on the weights: a random model runs it in a second, not in 13 s."""
    model, tokenizer, tables = sharp_llama
    ids, (full_logits, full) = full_story
    settings = LOSSLESS.get(name, lambda budget: {"budget": budget})
    defaults = {f.name: f.default for f in dataclasses.fields(METHODS[name])}
    table = {"head_scores": tables["head_scores"]} if hasattr(defaults["head_allocation"], "head_scores") else {}
    table.update({setting: path for setting, path in tables.items() if setting in defaults})   # calibration files
    for budget in (len(ids), len(ids) + 50):
        logits, got = logits_and_text(model, tokenizer, ids, make_method(name, **settings(budget), **table))
        assert got.new_tokens == 20 and len(logits) == 20
        for step, (g, e) in enumerate(zip(logits, full_logits)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {budget} step {step}: {m}")
        assert got.text == full.text, (name, budget)


@pytest.mark.parametrize("model_class", [name for name in SMOLLM2_AS if name != "llama"])
def test_every_class_keeps_and_generates_what_llama_does(models, model_class):
    """SmolLM2's weights loaded into each glued architecture: the same kept tokens, the same text."""
    llama, tokenizer = models("sdpa", "llama")
    other, _ = models("sdpa", model_class)
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    for name in ("snapkv", "h2o", "pyramidkv"):
        method = make_method(name, budget=96, window_size=16)
        caches = []
        for model in (llama, other):
            with compress(model, method) as patch:
                cache = patch.new_cache()
                with torch.no_grad():
                    model(ids, past_key_values=cache, use_cache=True)
                caches.append(cache)
        for layer in range(llama.config.num_hidden_layers):
            for a, b in zip(caches[0].kept_positions(layer), caches[1].kept_positions(layer)):
                assert torch.equal(a, b), (name, layer)
        texts = [generate(m, tokenizer, [STORY], method, 20)[0].text for m in (llama, other)]
        assert texts[0] == texts[1]


def test_no_state_leaks_between_generate_calls(models):
    model, tokenizer = models("sdpa")
    method = make_method("snapkv", budget=64, window_size=16)
    other = STORY.replace("Marta", "Ines").replace("bees", "goats")
    first = generate(model, tokenizer, [STORY], method, 12)[0].text
    generate(model, tokenizer, [other], method, 12)
    again = generate(model, tokenizer, [STORY], method, 12)[0].text
    assert again == first
    # Two generate() calls inside one patch each start from a fresh cache.
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    with compress(model, method):
        a = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        b = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)


def test_unpatch_restores_the_model(models):
    model, tokenizer = models("sdpa")
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    before = step_logits(model, ids, 3, DynamicCache())
    with compress(model, make_method("streamingllm", budget=40)):
        pass
    after = step_logits(model, ids, 3, DynamicCache())
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)


def test_decode_after_compression_equals_attention_over_the_kept_tokens(models):
    """Independent reference: HF's own attention over a DynamicCache holding only the kept tokens,
    new tokens at their true (uncompressed) RoPE positions. StreamingLLM keeps the same positions in
    every head, so a dense DynamicCache can hold exactly that set."""
    model, tokenizer = models("eager")
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    n, budget, sinks = ids.shape[1], 48, 4
    kept = torch.tensor(list(range(sinks)) + list(range(n - (budget - sinks), n)))
    with torch.no_grad():
        full = model(ids, use_cache=True)
    shrunk = DynamicCache()
    for layer, (k, v) in enumerate(full.past_key_values):
        shrunk.update(k[:, :, kept], v[:, :, kept], layer)
    with compress(model, make_method("streamingllm", budget=budget, num_sinks=sinks)):
        got = step_logits(model, ids, 4, None)
    token = full.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        for step in range(4):
            res = model(token, past_key_values=shrunk, use_cache=True, position_ids=torch.tensor([[n + step]]),
                        cache_position=torch.tensor([budget + step]))
            torch.testing.assert_close(got[step + 1], res.logits[0, -1], rtol=1e-4, atol=1e-4)
            token = res.logits[:, -1:].argmax(-1)
