"""Sliding-window layers and Gemma2's attention (docs/models.md, "Sliding windows").

References: the unpatched model (its greedy tokens and logits; its own eager attention weights, soft-capped and
scaled by its modeling file); each prompt run alone; and the window rule worked by hand from positions: after a
prompt of n real tokens and t decode steps a sliding layer of window W holds only positions >= n + t - W, at most
W - 1 of them from the prompt.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, MistralConfig

from pyramidkv import compress, make_method
from pyramidkv.components import AttentionForm
from pyramidkv.models.patch import MODEL_GLUE, model_shape

WINDOW, LAYERS, PROMPT, NEW = 16, 4, 40, 12


def tiny(model_type: str, attn: str = "eager", **settings):
    """4 layers, GQA 4/2, head_dim 16, a window of 16 that binds on a 40-token prompt."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, sliding_window=WINDOW,
                  attn_implementation=attn)
    if model_type == "gemma2":  # a scalar other than head_dim and a cap the logits reach
        config = Gemma2Config(**{**common, "head_dim": 16, "query_pre_attn_scalar": 24,
                                 "attn_logit_softcapping": 2.0, **settings})
    else:
        config = MistralConfig(**{**common, **settings})
    return MODEL_GLUE[model_type].causal_lm(config).eval()


def ids(batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 96, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt, mask=None, cache=None):
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=mask if mask is not None else torch.ones_like(prompt),
                             max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, past_key_values=cache)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["gemma2", "mistral"])
def test_fullkv_is_the_unpatched_model_past_the_window(model_type, attn):
    """40 prompt tokens + 12 new against a window of 16: the unpatched model (Gemma2: its HybridCache ring buffer;
    Mistral: its sliding mask) and fullkv give the same tokens and logits."""
    model = tiny(model_type, attn)
    prompt = ids()
    tokens, logits = greedy(model, prompt)
    with compress(model, make_method("fullkv")):
        got_tokens, got_logits = greedy(model, prompt)
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [dict(name="fullkv"), dict(name="snapkv", budget=12, window_size=4)])
def test_left_padded_batch_equals_each_prompt_alone(spec):
    """Gemma2, eager: three prompts of 40, 33 and 20 real tokens in one left-padded batch decode as each alone
    (the unpatched 4.44.2 Gemma2 does not: its HybridCache mis-handles left padding while decoding)."""
    model = tiny("gemma2")
    prompt = ids(3)
    mask = torch.ones_like(prompt)
    mask[1, :7] = 0
    mask[2, :20] = 0
    with compress(model, make_method(**spec)):
        tokens, logits = greedy(model, prompt, mask)
        for b in range(3):
            pad = int((mask[b] == 0).sum())
            alone_tokens, alone_logits = greedy(model, prompt[b:b + 1, pad:])
            assert torch.equal(tokens[b, PROMPT:], alone_tokens[0, PROMPT - pad:])
            torch.testing.assert_close(logits[b], alone_logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma2", "mistral"])
def test_a_sliding_layer_holds_only_its_window(model_type):
    """snapkv, budget 12 (window 4): right after the prompt a sliding layer keeps 12 of the last W - 1 = 15
    positions, a global layer 12 of all 40; after each of the decode steps a sliding layer holds only positions
    >= newest - W + 1 (at most W), a global one its 12 plus every new token."""
    model = tiny(model_type)
    prompt = ids()
    windows = model_shape(model.config).form.windows
    assert windows == ((WINDOW, None) * 2 if model_type == "gemma2" else (WINDOW,) * LAYERS)
    with compress(model, make_method("snapkv", budget=12, window_size=4)) as patch:
        cache = patch.new_cache()
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
        for layer, window in enumerate(windows):
            for positions in cache.kept_positions(layer):
                assert len(positions) == 12
                assert int(positions.min()) >= (PROMPT - WINDOW + 1 if window else 0)
            if window is None:   # a global layer chooses among every position
                assert any(int(p.min()) < PROMPT - WINDOW + 1 for p in cache.kept_positions(layer))
        cache = patch.new_cache()
        greedy(model, prompt, cache=cache)
    newest = PROMPT + NEW - 2   # generate feeds NEW - 1 tokens back
    for layer, window in enumerate(windows):
        for positions, held in zip(cache.held_positions(layer), cache.held_counts(layer)[0]):
            if window is None:
                assert held == 12 + NEW - 1
            else:
                assert int(positions.min()) >= newest - WINDOW + 1 and held <= WINDOW
                assert positions[-(NEW - 1):].tolist() == list(range(PROMPT, newest + 1))


@pytest.mark.parametrize("model_type, attn, scale, cap", [
    ("gemma2", "eager", 24 ** -0.5, 2.0),   # query_pre_attn_scalar 24, attn_logit_softcapping 2
    ("gemma2", "sdpa", 24 ** -0.5, None),   # 4.44.2's Gemma2 sdpa applies no cap
    ("mistral", "eager", None, None),
])
def test_the_glue_builds_the_form_and_the_cache_and_its_stores_hold_that_one(model_type, attn, scale, cap):
    """The config's scale, soft-cap and window per layer (Gemma2: every even layer slides), built once: the cache
    and every layer store read the one object the patch's model shape holds."""
    model = tiny(model_type, attn)
    windows = (WINDOW, None) * 2 if model_type == "gemma2" else (WINDOW,) * LAYERS
    form = model_shape(model.config).form
    assert form == AttentionForm(scale=scale, softcap=cap, windows=windows)
    with compress(model, make_method("snapkv", budget=12, window_size=4)) as patch:
        cache = patch.new_cache()
        with torch.no_grad():
            model(ids(), past_key_values=cache, use_cache=True)
    assert cache.form is patch.shape.form and cache.form == form
    assert all(cache.layers[layer].form is cache.form for layer in range(LAYERS))


def test_a_window_beyond_the_context_is_global():
    model = tiny("gemma2", sliding_window=8192)
    assert model_shape(model.config).form.windows == ()


def test_scorer_attention_is_gemma2s_own():
    """SnapKV's observation-window attention on a global layer equals the unpatched model's own eager attention
    weights (its query_pre_attn_scalar and soft-cap), and would not without the cap."""
    model = tiny("gemma2")
    attention = model.model.layers[1].self_attn
    with torch.no_grad():   # logits well past the cap of 2 (a random init's are far below it)
        attention.q_proj.weight *= 8
        attention.k_proj.weight *= 8
    prompt = ids()
    with torch.no_grad():
        own = model(prompt, output_attentions=True).attentions[1][0, :, -4:].double()   # [Hq, 4, n]
    from pyramidkv.core import scoring
    method = make_method("snapkv", budget=12, window_size=4)
    original = type(method).score
    seen = {}

    def recording(self, ctx):
        if ctx.layer_idx == 1:
            seen["capped"] = scoring.window_attention(ctx.queries, ctx.keys, ctx.real, 4, form=ctx.form)
            seen["uncapped"] = scoring.window_attention(ctx.queries, ctx.keys, ctx.real, 4)
        return original(self, ctx)

    with compress(model, method), pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(method), "score", recording)
        with torch.no_grad():
            model(prompt, use_cache=True)
    torch.testing.assert_close(seen["capped"][0].double(), own, rtol=0, atol=1e-6)
    assert (seen["uncapped"][0].double() - own).abs().max() > 1e-2


@pytest.mark.parametrize("model_type, spec, message", [
    ("gemma2", dict(name="minicache"), "sliding-window layers (2)"),
    ("gemma2", dict(name="minference"), "sliding-window layers or a soft-capped attention"),
    ("mistral", dict(name="snapkv", budget=12, window_size=4, quant_method="kivi", group_size=8), "every layer of this model has a sliding window (16"),
])
def test_what_cannot_hold_a_window_is_refused(model_type, spec, message):
    """One line each, from the config: a merged pair holding a sliding layer, a sparse prefill that applies no
    window, a quantizer on a model whose every layer slides (its sliding layers are kept in full precision)."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_method(**spec).check_model(model_shape(tiny(model_type).config, 4))


def test_a_quantizer_stores_gemma2s_sliding_layers_in_full_precision():
    """KIVI on Gemma2: the global layers (1, 3) quantized, the sliding ones (0, 2) in full precision, each at the
    bytes of its 12 kept tokens x 2 KV heads x 16 channels x K and V in float32."""
    model = tiny("gemma2")
    with compress(model, make_method("snapkv", budget=12, window_size=4, quant_method="kivi", nbits=2, group_size=8,
                                     residual_length=0)) as patch:
        cache = patch.new_cache()
        with torch.no_grad():
            model(ids(), past_key_values=cache, use_cache=True)
    full = 12 * 2 * 16 * 2 * 4
    assert [cache.layers[layer].nbytes() == full for layer in range(LAYERS)] == [True, False, True, False]
    assert all(cache.layers[layer].nbytes() < full for layer in (1, 3))
