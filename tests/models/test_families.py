"""Every family of MODEL_GLUE on a tiny random instance of its own 4.44.2 config class (tests/models/families.py).

References: the unpatched model (its generate, logits and cached keys), transformers' own classes, and hand
counts (a budget of 16 keeps 16 tokens per head).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.phi3 import modeling_phi3

from pyramidkv import compress, load_model, make_method
from pyramidkv.models.loading import check_model
from pyramidkv.models.patch import MODEL_GLUE
from tests.models.families import (FAMILY_CONFIGS, LLAMA_LAYOUT, WINDOW_SETTINGS, family_config,
                                   family_implementation_pairs, tiny_family)

VOCAB = FAMILY_CONFIGS["llama"]["vocab_size"]


def greedy(model, ids, new_tokens=12):
    """(tokens [1, n + new], logits of every step [new, V]) of greedy generate."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.cat(out.logits)


# Families whose own generate() preallocates its cache: the unpatched prompt attention runs over max_length key
# slots (Gemma2's HybridCache: 52 for this test's 40 + 12, the rest masked) where ours runs over the prompt's 40;
# the same values reduced over another length round otherwise, by an amount that depends on the CPU's kernels
# (seen: 1.5e-7 on AVX-512, 0 on AVX2).
PREALLOCATED_KEYS = {"gemma2"}
PROMPT_LOGITS_ATOL = 1e-6


@pytest.mark.parametrize("model_type, attn", family_implementation_pairs())
def test_fullkv_generates_as_unpatched_and_snapkv_holds_its_budget(model_type, attn):
    """fullkv: the unpatched greedy tokens; the prompt's logits bit-identical where the model's own kernel runs
    over the same q, k, v (to PROMPT_LOGITS_ATOL where the unpatched model attends over preallocated key slots),
    each decode step's to float rounding (attention over the cache's own buffers). snapkv with budget 16,
    window 4: 16 tokens per prompt and KV head on every layer."""
    model = tiny_family(model_type, attn)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        tokens, logits = greedy(model, ids)
        with compress(model, make_method("fullkv")):
            got_tokens, got_logits = greedy(model, ids)
    assert torch.equal(got_tokens, tokens)
    if model_type in PREALLOCATED_KEYS:
        torch.testing.assert_close(got_logits[0], logits[0], rtol=0, atol=PROMPT_LOGITS_ATOL)
    else:
        assert torch.equal(got_logits[0], logits[0])
    torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)

    with compress(model, make_method("snapkv", budget=16, window_size=4)) as patch, torch.no_grad():
        cache = patch.new_cache()
        model(ids, past_key_values=cache, use_cache=True)
    heads = model.config.num_key_value_heads
    assert [cache.kept_counts(layer) for layer in range(model.config.num_hidden_layers)] == [[[16] * heads]] * 2


@pytest.mark.parametrize("model_type", list(MODEL_GLUE))
def test_llama_weights_load_as_the_families_of_llamas_layout_only(tiny_model_dir, model_type):
    """A Llama checkpoint: as a family of Llama's layout (Qwen2's missing q/k/v biases start at zero), refused with
    one line naming the weights each side lacks for Phi-3 (fused projections) and Mixtral (experts)."""
    if model_type in LLAMA_LAYOUT:
        _, config, _, _ = check_model(tiny_model_dir, device="cpu", model_class=model_type)
        assert config.model_type == model_type
        return
    with pytest.raises(ValueError) as refused:
        check_model(tiny_model_dir, device="cpu", model_class=model_type)
    assert str(refused.value) == REFUSED_LLAMA[model_type]


REFUSED_LLAMA = {
    "gemma2": "llama weights do not load as gemma2: llama has no model.layers.*.post_feedforward_layernorm.weight, "
              "model.layers.*.pre_feedforward_layernorm.weight",
    "phi3": "llama weights do not load as phi3: Phi3ForCausalLM has no model.layers.*.mlp.gate_proj.weight, "
            "model.layers.*.mlp.up_proj.weight, model.layers.*.self_attn.k_proj.weight, "
            "model.layers.*.self_attn.q_proj.weight, model.layers.*.self_attn.v_proj.weight; llama has no "
            "model.layers.*.mlp.gate_up_proj.weight, model.layers.*.self_attn.qkv_proj.weight",
    "mixtral": "llama weights do not load as mixtral: MixtralForCausalLM has no model.layers.*.mlp.down_proj.weight, "
               "model.layers.*.mlp.gate_proj.weight, model.layers.*.mlp.up_proj.weight; llama has no "
               "model.layers.*.block_sparse_moe.experts.*.w1.weight, model.layers.*.block_sparse_moe.experts.*.w2.weight, "
               "model.layers.*.block_sparse_moe.experts.*.w3.weight, model.layers.*.block_sparse_moe.gate.weight",
}


@pytest.mark.parametrize("source, target, refused", [
    ("qwen2", "llama", "qwen2 weights do not load as llama: LlamaForCausalLM has no model.layers.*.self_attn.k_proj.bias, "
                       "model.layers.*.self_attn.q_proj.bias, model.layers.*.self_attn.v_proj.bias"),
    ("mixtral", "mistral", "mixtral weights do not load as mistral: MistralForCausalLM has no "
                           "model.layers.*.block_sparse_moe.experts.*.w1.weight, "
                           "model.layers.*.block_sparse_moe.experts.*.w2.weight, "
                           "model.layers.*.block_sparse_moe.experts.*.w3.weight, "
                           "model.layers.*.block_sparse_moe.gate.weight; mixtral has no "
                           "model.layers.*.mlp.down_proj.weight, model.layers.*.mlp.gate_proj.weight, "
                           "model.layers.*.mlp.up_proj.weight"),
])
def test_a_checkpoint_is_refused_as_a_family_without_a_place_for_its_weights(tmp_path, source, target, refused):
    """Qwen2's q/k/v biases would be dropped by Llama; Mixtral's experts have no place in Mistral: one line
    naming the weights, from the config alone."""
    family_config(source).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        check_model(str(tmp_path), attn_implementation="eager", device="cpu", model_class=target)
    assert str(error.value) == refused


def test_qwen2_from_llama_weights_has_zero_biases_and_llamas_logits(tiny_model_dir):
    qwen2, _ = load_model(tiny_model_dir, attn_implementation="eager", device="cpu", model_class="qwen2")
    llama, _ = load_model(tiny_model_dir, attn_implementation="eager", device="cpu")
    for layer in qwen2.model.layers:
        attention = layer.self_attn
        assert all(torch.count_nonzero(p.bias) == 0 for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(qwen2(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call", ["check_model", "load_model"])
def test_an_attention_implementation_the_family_lacks_is_refused_before_weights_load(tmp_path, call):
    """Phi-3 has no sdpa in 4.44.2: one line naming what it has; the folder holds no weights, so reaching
    transformers' loading would raise another error."""
    family_config("phi3").save_pretrained(tmp_path)
    run = {"check_model": check_model, "load_model": load_model}[call]
    with pytest.raises(ValueError) as refused:
        run(str(tmp_path), attn_implementation="sdpa", device="cpu")
    assert str(refused.value) == ("Phi3ForCausalLM has no sdpa attention in transformers 4.44.2; use "
                                  "attn_implementation eager or flash_attention_2 (on CUDA)")
    assert check_model(str(tmp_path), attn_implementation="eager", device="cpu")[1].model_type == "phi3"


# ---- sliding windows: what the unpatched model does under eager / sdpa, per layer --------------------------
@pytest.mark.parametrize("model_type, attn", family_implementation_pairs())
def test_layer_windows_are_the_windows_the_unpatched_model_applies(model_type, attn):
    """A config setting a window of 8 (each family's way: WINDOW_SETTINGS); per layer, whether the last of 24
    tokens still sees the first (a change to layer l's input at position 0 alone reaches layer l's output at
    position 23) must be what layer_windows says: seen exactly where the layer has no window."""
    window, n = 8, 24
    settings = {"sliding_window": window, **WINDOW_SETTINGS.get(model_type, {})}
    model = tiny_family(model_type, attn, **settings)
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(6))
    expected = [w is None or w >= n for w in MODEL_GLUE[model_type].layer_windows(model.config, attn)]
    seen = []
    for layer in model.model.layers:
        outputs = []
        for shift in (0.0, 1.0):
            def nudge(module, args, shift=shift):   # the decoders pass hidden_states first, positionally
                hidden = args[0].clone()
                hidden[:, 0] += shift
                return (hidden, *args[1:])

            hooks = [layer.register_forward_pre_hook(nudge),
                     layer.register_forward_hook(lambda m, a, out: outputs.append(out[0][0, -1].clone()))]
            try:
                with torch.no_grad():
                    model(ids, use_cache=False)
            finally:
                for hook in hooks:
                    hook.remove()
        seen.append(not torch.equal(outputs[0], outputs[1]))
    assert seen == expected


# ---- Phi-3's rotary variants -------------------------------------------------------------------------------
ORIGINAL = 64


def phi3_scaled(kind: str):
    """A tiny Phi-3 whose rope_scaling is of `kind` (4.44.2 builds LongRoPE for all three), factors in 1..4, its
    original context 64 of 256 positions (so cos and sin carry an attention factor too)."""
    generator = torch.Generator().manual_seed(7)
    half = FAMILY_CONFIGS["phi3"]["hidden_size"] // FAMILY_CONFIGS["phi3"]["num_attention_heads"] // 2
    factors = {name: (1 + 3 * torch.rand(half, generator=generator)).tolist() for name in ("short_factor", "long_factor")}
    return tiny_family("phi3", rope_scaling={"type": kind, **factors}, original_max_position_embeddings=ORIGINAL,
                       max_position_embeddings=4 * ORIGINAL)


def keys_before_and_after_rope(model, ids, cache=None):
    """(per layer: keys before RoPE [1, Hkv, n, D] from qkv_proj's key slice, and the keys the model caches;
    `cache` given: the forward continues it)."""
    before = []

    def keep(module, args, out):
        attention = model.model.layers[len(before)].self_attn
        start, size = attention.num_heads * attention.head_dim, attention.num_key_value_heads * attention.head_dim
        before.append(out[..., start:start + size].reshape(*out.shape[:2], attention.num_key_value_heads, -1)
                      .transpose(1, 2))

    hooks = [layer.self_attn.qkv_proj.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():
            cache = model(ids, past_key_values=DynamicCache() if cache is None else cache, use_cache=True).past_key_values
    finally:
        for hook in hooks:
            hook.remove()
    return before, [cache[layer][0] for layer in range(len(before))]


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])
def test_phi3_scaled_key_rotation_is_the_models_rotation_of_its_newest_position(kind):
    """Prompts of 40 (below the original 64) and 100 (above) tokens, then decoding from 60 to 70 tokens: the
    glue's rotation equals the keys the model caches (1e-5) wherever the model rotated a key while its position
    was the newest of the forward (the documented rule), and undoes it; it differs from the model exactly on the
    keys below 64 of the 100-token prompt, which the model rotated with long_factor."""
    model = phi3_scaled(kind)
    assert type(model.model.layers[0].self_attn.rotary_emb) is modeling_phi3.Phi3LongRoPEScaledRotaryEmbedding
    rotation = MODEL_GLUE["phi3"].key_rotation(model)
    generator = torch.Generator().manual_seed(8)
    for n in (40, 100):
        ids = torch.randint(0, VOCAB, (1, n), generator=generator)
        positions = torch.arange(n).expand(1, 2, n)
        for raw, keys in zip(*keys_before_and_after_rope(model, ids)):
            rotated = rotation.rotate(raw, positions)
            torch.testing.assert_close(rotation.rotate(keys, positions, inverse=True)[..., ORIGINAL:, :],
                                       raw[..., ORIGINAL:, :], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rotation.rotate(rotated, positions, inverse=True), raw, rtol=1e-5, atol=1e-5)
            if n <= ORIGINAL:
                torch.testing.assert_close(rotated, keys, rtol=1e-5, atol=1e-5)
            else:
                torch.testing.assert_close(rotated[..., ORIGINAL:, :], keys[..., ORIGINAL:, :], rtol=1e-5, atol=1e-5)
                assert not torch.allclose(rotated[..., 1:ORIGINAL, :], keys[..., 1:ORIGINAL, :], atol=1e-3)
    # decoding one token at a time across the original context: each key rotated as the newest position
    ids = torch.randint(0, VOCAB, (1, 70), generator=generator)
    raws, cache = [], DynamicCache()
    for start, stop in [(0, 60)] + [(p, p + 1) for p in range(60, 70)]:
        raws.append(keys_before_and_after_rope(model, ids[:, start:stop], cache)[0])
    positions = torch.arange(70).expand(1, 2, 70)
    for layer in range(model.config.num_hidden_layers):
        raw = torch.cat([step[layer] for step in raws], dim=2)
        torch.testing.assert_close(rotation.rotate(raw, positions), cache[layer][0], rtol=1e-5, atol=1e-5)


# ---- every method and axis, as on Llama --------------------------------------------------------------------
BUDGET, PROMPT_LEN = 16, 40
KIVI = dict(quant_method="kivi", nbits=2, group_size=8, residual_length=8)
METHODS = {   # name -> (spec, what the cache must hold after the prompt: per layer and KV head)
    "snapkv": dict(name="snapkv", budget=BUDGET, window_size=4),
    "adakv": dict(name="adakv", budget=BUDGET, window_size=4),
    "cam": dict(name="snapkv", budget=BUDGET, window_size=4, merge="cam"),
    "kivi": dict(name="snapkv", budget=BUDGET, window_size=4, **KIVI),
    "decode_budget": dict(name="snapkv", budget=BUDGET, window_size=4, decode_budget=BUDGET, decode_interval=2),
    "think": dict(name="think", budget=BUDGET, window_size=4, key_channel_ratio=0.5, key_recent_size=4),
    "quest": dict(name="quest", page_budget=BUDGET, page_size=4, page_dense_layers=0),
    "minicache": dict(name="minicache", cross_layer_start=0),
}


def prompt_ids(batch: int = 1, seed: int = 5) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model_type", list(MODEL_GLUE))
def test_every_method_holds_its_budget_on_every_family(model_type, method):
    """After a 40-token prompt and 8 greedy tokens, counted by hand: the evicting methods keep 16 tokens per
    KV head (AdaKV: 16 x heads per layer, split as it likes), a merge rule's 16 slots, KIVI its 16 tokens in
    fewer bytes than full precision, a decode budget at most 16 + 2 held, ThinK its 16 in fewer bytes than
    SnapKV's, Quest every token held and at most 16 of them (whole pages) read per step, MiniCache both layers
    of its pair in fewer bytes than fullkv. Gemma2's merged pairs would hold a sliding layer: refused."""
    model = tiny_family(model_type)
    spec = METHODS[method]
    if model_type == "gemma2" and method == "minicache":
        with pytest.raises(ValueError, match="sliding-window layers"):
            compress(model, make_method(**spec))
        return
    heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers

    def run(settings, new_tokens=8):
        with compress(model, make_method(**settings)) as patch, torch.no_grad():
            cache = patch.new_cache()
            model.generate(prompt_ids(), attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                           past_key_values=cache)
        return cache

    cache = run(spec, 1)   # the prompt alone
    kept = [cache.kept_counts(layer)[0] for layer in range(layers)]
    if method == "adakv":
        assert [sum(k) for k in kept] == [BUDGET * heads] * layers and any(len(set(k)) > 1 for k in kept)
    elif method in ("quest", "minicache"):
        assert kept == [[PROMPT_LEN] * heads] * layers
    else:
        assert kept == [[BUDGET] * heads] * layers
    if method in ("kivi", "think"):
        assert cache.kv_bytes() < run(METHODS["snapkv"], 1).kv_bytes()
    if method == "minicache":
        assert cache.kv_bytes() < run(dict(name="fullkv"), 1).kv_bytes()
    cache = run(spec)
    held = [cache.held_counts(layer)[0] for layer in range(layers)]
    if method == "decode_budget":
        assert all(BUDGET <= h <= BUDGET + 2 for row in held for h in row)
    if method == "quest":
        full = PROMPT_LEN + 7
        assert held == [[full] * heads] * layers
        assert cache.decode_read_bytes() < cache.kv_bytes()
        for layer in range(layers):   # whole pages of 4, at most the page budget's 16 tokens, per head
            pages = cache.layers[layer].chosen_pages
            assert pages.shape[-1] * 4 <= BUDGET and bool((pages >= 0).any())


@pytest.mark.parametrize("method", ["fullkv", "snapkv", "adakv"])
@pytest.mark.parametrize("model_type", list(MODEL_GLUE))
def test_a_left_padded_batch_of_three_is_each_prompt_alone(model_type, method):
    """Prompts of 40, 33 and 21 real tokens left-padded into one batch: each prompt's greedy tokens and every
    step's logits as when it runs alone (to float rounding)."""
    model = tiny_family(model_type)
    ids = prompt_ids(3, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :19] = 0
    spec = METHODS.get(method, dict(name=method))
    with compress(model, make_method(**spec)), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        for b in range(3):
            pad = int((mask[b] == 0).sum())
            alone_tokens, alone_logits = greedy(model, ids[b:b + 1, pad:], new_tokens=6)
            assert torch.equal(batch.sequences[b, PROMPT_LEN:], alone_tokens[0, PROMPT_LEN - pad:])
            torch.testing.assert_close(torch.stack([step[b] for step in batch.logits]), alone_logits,
                                       rtol=1e-5, atol=1e-5)
