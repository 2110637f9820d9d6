"""The 5.x seam itself: the key rotation a family row gives (against the model's own keys), the refusals (one line
each), and the patch leaving the model as it found it. Under the pinned line these do not apply (its rotation is
each glue's, tested in tests/models/test_families.py): skipped there."""

from __future__ import annotations

import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.models.line import INTERFACE_LINE, VERSION
from tests.tf5.families import FAMILIES, tiny
from tests.tf5.test_families import ids

pytestmark = pytest.mark.skipif(not INTERFACE_LINE, reason=f"the 5.x line's seam; transformers {VERSION} is the "
                                                           f"pinned line (make test-tf5 runs these)")


def raw_keys(model, prompt) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer the keys before RoPE [1, Hkv, n, D] (after Qwen3's and Gemma3's k_norm), from hooks on the
    projections, and the keys the unpatched model cached (after RoPE)."""
    from transformers import DynamicCache

    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    found, hooks = [], []
    for layer in model.model.layers:
        attention = layer.self_attn
        if hasattr(attention, "k_norm"):
            source, part = attention.k_norm, None
        elif hasattr(attention, "k_proj"):
            source, part = attention.k_proj, None
        else:   # Phi-3's fused qkv_proj: q, then k, then v
            start = model.config.num_attention_heads * dim
            source, part = attention.qkv_proj, slice(start, start + heads * dim)

        def keep(module, args, output, part=part):
            keys = output if part is None else output[..., part]
            if keys.dim() == 4 and keys.shape[1:3] == (heads, prompt.shape[1]):   # Gemma3 norms [1, Hkv, n, D]
                found.append(keys)
            else:   # [1, n, Hkv, D] or [1, n, Hkv * D]
                found.append(keys.reshape(1, -1, heads, dim).transpose(1, 2))
        hooks.append(source.register_forward_hook(keep))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    return found, [cache.layers[layer].keys for layer in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_key_rotation_turns_keys_before_rope_into_the_models_own(model_type):
    """Per layer (Gemma3: three sliding layers of the local base, a global one of the global base), the rotation
    the engine gets for that layer (`layer_rotation`) turns the keys before RoPE into those the model cached."""
    from pyramidkv.core.rotary import layer_rotation
    from pyramidkv.models.tf5.families import key_rotation

    model, prompt = tiny(model_type), ids()
    before, after = raw_keys(model, prompt)
    rotation = key_rotation(model, "test")
    positions = torch.arange(prompt.shape[1]).expand(1, model.config.num_key_value_heads, -1)
    for layer, (raw, cached) in enumerate(zip(before, after)):
        raw, held = raw[:, :, -cached.shape[2]:], positions[..., -cached.shape[2]:]   # a sliding layer keeps its window
        own = layer_rotation(rotation, layer)
        torch.testing.assert_close(own.rotate(raw, held), cached.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(own.rotate(cached, held, inverse=True), raw.float(), rtol=1e-5, atol=1e-5)


def test_gemma3s_two_rope_bases_differ_and_no_rotation_serves_every_layer():
    """The per-type check above is not vacuous: the local and the global rotation move the same keys apart, and
    the rotation object itself refuses to rotate without a layer."""
    from pyramidkv.core.rotary import layer_rotation
    from pyramidkv.models.tf5.families import key_rotation

    model = tiny("gemma3_text")
    rotation = key_rotation(model, "test")
    x, positions = torch.ones(1, 1, 8, 16), torch.arange(8).expand(1, 1, -1)
    local, glob = (layer_rotation(rotation, layer).rotate(x, positions) for layer in (0, 3))
    assert (local - glob).abs().max() > 0.1
    with pytest.raises(RuntimeError, match="rotate through for_layer"):
        rotation.rotate(x, positions)


def test_gemma3_stores_keys_before_rope_and_gives_back_the_models_own():
    """KVQuant at 8 bits stores Gemma3's keys before RoPE, by each layer's own rotation: the keys it holds, rotated
    back, are the unpatched model's cached keys to 8-bit error (one wrong base would be off by the rotation)."""
    model, prompt = tiny("gemma3_text"), ids()
    _, after = raw_keys(model, prompt)
    method = make_method("fullkv", quant_method="kvquant", nbits=8, group_size=16)
    with compress(model, method) as patch, torch.no_grad():
        cache = patch.new_cache()
        model(prompt, cache=cache, use_cache=True)
    quantized = [layer for layer in range(model.config.num_hidden_layers)
                 if type(cache.layers[layer]).__name__ == "QuantizedStore"]
    assert 3 in quantized   # the global layer (a sliding one may hold full precision)
    for layer in quantized:
        cached = after[layer][0].float()                                     # [Hkv, n, D]
        held = torch.stack([keys for _, keys, _ in cache.stored_kv(layer)])[:, -cached.shape[1]:].float()
        scale = cached.abs().max()
        torch.testing.assert_close(held, cached, rtol=0, atol=0.02 * float(scale))


def test_refusals_are_one_line():
    """A family rotating part of each head refuses methods that store keys before RoPE; a hybrid with linear-attention
    layers (Qwen3-Next) is refused; a family not in the table,
    and an implementation the interface does not extend, are refused naming what is supported."""
    model = tiny("phi3", partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="rotates part of each head") as refused:
        compress(model, make_method("fullkv", quant_method="kvquant", nbits=8, group_size=16))
    assert "\n" not in str(refused.value)
    from transformers import AutoConfig, AutoModelForCausalLM

    other = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2' on the 5.x line"):
        compress(other, make_method("fullkv"))
    hybrid = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_next", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(ValueError, match="qwen3_next is refused on the 5.x line: its linear-attention layers") as refused:
        compress(hybrid, make_method("fullkv"))
    assert "\n" not in str(refused.value)
    flex = tiny("llama", attn="flex_attention")
    with pytest.raises(ValueError, match="is not supported on the 5.x line"):
        compress(flex, make_method("fullkv"))


def test_the_patch_leaves_the_model_as_it_was():
    model = tiny("qwen3")
    hooks = sum(len(m.self_attn._forward_pre_hooks) for m in model.model.layers)
    with compress(model, make_method("snapkv", budget=16, window_size=4)):
        assert model.config._attn_implementation == "pyramidkv_sdpa"
    assert model.config._attn_implementation == "sdpa"
    assert sum(len(m.self_attn._forward_pre_hooks) for m in model.model.layers) == hooks
    with pytest.raises(RuntimeError, match="attn_implementation is not pyramidkv's"):   # a cache with no patch
        from pyramidkv.models.tf5.cache import InterfaceCache
        from pyramidkv.models.patch import model_shape

        cache = InterfaceCache(make_method("fullkv"), model_shape(model.config, 4))
        with torch.no_grad():
            model(ids(), cache=cache, use_cache=True)
