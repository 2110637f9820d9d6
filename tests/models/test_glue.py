"""The model glue: its RoPE against transformers' own, and MODEL_GLUE as the one list of architectures.

References: each architecture's own unpatched forward (the keys and values it caches, rotated by its modeling
file's apply_rotary_pos_emb); for the registry, an architecture transformers does not have (a Llama under another
model_type) registered in MODEL_GLUE alone, with no other edit, must load, patch and show on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from pyramidkv import compress, load_model, make_method
from pyramidkv.models.loading import check_model
from pyramidkv.models.patch import MODEL_GLUE
from pyramidkv.models.rope import RotateHalfGlue
from pyramidkv.runner.cli import add_model_and_method_args
from tests.models.families import SIZES, family_implementation_pairs, tiny_family

KVQUANT = dict(quant_method="kvquant", nbits=8, group_size=16, residual_length=16)


def tiny(model_type: str, attn: str | None = None, **settings):
    """A 2-layer random model of the family (GQA 4 query / 2 KV heads, head_dim 16; its own settings from
    tests/models/families.py), attention as transformers picks it unless `attn`: shared, never changed."""
    return tiny_family(model_type, attn, cached=True, **settings)


def key_projection(attention):
    """(module, output [B, n, Hkv*D] -> keys before RoPE [B, n, Hkv*D]): where the modeling file projects keys
    (k_proj, or the key slice of a fused qkv_proj, as Phi3Attention slices it)."""
    if hasattr(attention, "k_proj"):
        return attention.k_proj, lambda out: out
    start = attention.num_heads * attention.head_dim
    return attention.qkv_proj, lambda out: out[..., start:start + attention.num_key_value_heads * attention.head_dim]


def patch_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pyramidkv.models.patch"]


def own_forward(glue, model, n: int = 1300):
    """The unpatched forward of two random prompts of n tokens at RoPE positions in no order (each a
    permutation of 0..n-1: past the first table of 1,024), with what the glue makes of each attention
    module's input. Returns (positions [2, n], per layer: the keys before RoPE [2, Hkv, n, D] (key_projection),
    project_qkv's (q, k, v), the keys and values the model cached)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, SIZES["vocab_size"], (2, n), generator=generator)
    positions = torch.stack([torch.randperm(n, generator=generator) for _ in range(2)])
    projected, before_rope = {}, {}

    def grab(module, args, kwargs):
        projected[module.layer_idx] = glue.project_qkv(module, kwargs["hidden_states"], kwargs.get("position_ids"),
                                                       kwargs.get("position_embeddings"))

    def keep(layer, output):
        before_rope[layer] = output.view(2, n, SIZES["num_key_value_heads"], -1).transpose(1, 2)

    layers = model.model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in layers]
    for l, layer in enumerate(layers):
        module, keys_of = key_projection(layer.self_attn)
        hooks.append(module.register_forward_hook(lambda m, i, o, l=l, keys_of=keys_of: keep(l, keys_of(o))))
    try:
        with torch.no_grad():
            cached = model(ids, position_ids=positions, past_key_values=DynamicCache(), use_cache=True).past_key_values
    finally:
        for hook in hooks:
            hook.remove()
    return positions, [(before_rope[l], projected[l], cached[l]) for l in range(len(layers))]


@pytest.mark.parametrize("model_type", list(MODEL_GLUE))
def test_key_rotation_is_the_rope_of_the_models_own_forward(model_type):
    """The keys the unpatched model caches (rotated by its modeling file's apply_rotary_pos_emb) are the
    glue's rotation of k_proj's output at their positions, and un-rotating them gives that output back."""
    glue = MODEL_GLUE[model_type]
    model = tiny(model_type)
    positions, layers = own_forward(glue, model)
    rotation = glue.key_rotation(model)
    at = positions[:, None].expand(-1, SIZES["num_key_value_heads"], -1)   # [2, Hkv, n]
    for raw, _, (keys, _) in layers:
        torch.testing.assert_close(rotation.rotate(raw, at), keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rotation.rotate(keys, at, inverse=True), raw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", list(MODEL_GLUE))
def test_unrotating_undoes_rotating(model_type):
    glue = MODEL_GLUE[model_type]
    rotation = glue.key_rotation(tiny(model_type))
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 11, 16, generator=generator)
    positions = torch.randint(0, 2000, (2, 3, 11), generator=generator)
    turned = rotation.rotate(x, positions)
    assert not torch.allclose(turned, x)   # positions > 0 do rotate
    torch.testing.assert_close(rotation.rotate(turned, positions, inverse=True), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotation.rotate(rotation.rotate(x, positions, inverse=True), positions), x,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", list(MODEL_GLUE))
def test_projection_gives_the_keys_and_values_the_model_caches(model_type):
    """project_qkv on each attention module's input: the keys and values of the unpatched forward, exactly."""
    glue = MODEL_GLUE[model_type]
    _, layers = own_forward(glue, tiny(model_type), n=200)
    for _, (_, keys, values), (cached_keys, cached_values) in layers:
        assert torch.equal(keys, cached_keys) and torch.equal(values, cached_values)


@pytest.mark.parametrize("model_type, attn", family_implementation_pairs())
def test_without_a_cache_the_patched_model_runs_its_own_attention(model_type, attn):
    """use_cache=False inside compress(): each implementation's own forward, called with the arguments its
    decoder gives (Mistral's eager attention takes no position_embeddings)."""
    glue = MODEL_GLUE[model_type]
    model = tiny(model_type, attn)
    assert model.config._attn_implementation == attn
    ids = torch.randint(0, SIZES["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        with compress(model, make_method("snapkv", budget=8, window_size=4)), pytest.warns(UserWarning):
            got = model(ids, use_cache=False).logits
    assert torch.equal(got, expected)


@pytest.mark.parametrize("model_type", list(MODEL_GLUE))
def test_patching_warns_for_each_setting_its_glue_does_not_apply(model_type, caplog, monkeypatch):
    """No family declares an unapplied setting now (Mistral's window is applied): every row patches silently,
    and a row that declares one (Mistral's glue with its sliding_window declared unapplied) warns naming it."""
    glue = MODEL_GLUE[model_type]
    model = tiny(model_type)
    with caplog.at_level(logging.WARNING, logger="pyramidkv.models.patch"):
        compress(model, make_method("fullkv")).remove()
    assert patch_warnings(caplog) == [] and glue.unapplied_settings == ()
    if model_type != "mistral":
        return
    caplog.clear()
    monkeypatch.setitem(MODEL_GLUE, "mistral", dataclasses.replace(glue, unapplied_settings=("sliding_window",)))
    model = tiny(model_type, sliding_window=64)
    with caplog.at_level(logging.WARNING, logger="pyramidkv.models.patch"):
        compress(model, make_method("fullkv")).remove()
    assert patch_warnings(caplog) == ["config.sliding_window=64 is not applied to the compressed cache during decoding"]


# ---- a new architecture: one row in MODEL_GLUE, no other edit ------------------------------------------------
class RenamedLlamaConfig(LlamaConfig):
    model_type = "renamed_llama"


class RenamedLlamaForCausalLM(LlamaForCausalLM):
    config_class = RenamedLlamaConfig


@dataclass(frozen=True, kw_only=True)
class CountingGlue(RotateHalfGlue):
    """Llama's glue that counts what the package asks of it, key rotations by direction."""

    calls: Counter = field(default_factory=Counter)

    def project_qkv(self, module, hidden_states, position_ids, position_embeddings):
        self.calls["project_qkv"] += 1
        return super().project_qkv(module, hidden_states, position_ids, position_embeddings)

    def key_rotation(self, model):
        rotation, calls = super().key_rotation(model), self.calls
        self.calls["key_rotation"] += 1

        class Counted:
            def rotate(self, x, positions, inverse=False):
                calls["unrotate" if inverse else "rotate"] += 1
                return rotation.rotate(x, positions, inverse)

        return Counted()


def renamed_glue() -> CountingGlue:
    return CountingGlue(causal_lm=RenamedLlamaForCausalLM, attention_classes=(modeling_llama.LlamaAttention,),
                        apply_rotary_pos_emb=modeling_llama.apply_rotary_pos_emb,
                        unapplied_settings=("pretraining_tp",))


def model_class_choices() -> list[str]:
    parser = argparse.ArgumentParser()
    add_model_and_method_args(parser)
    return next(a for a in parser._actions if a.dest == "model_class").choices


def test_a_glue_registered_in_model_glue_is_checked_loaded_patched_and_offered(tiny_model_dir, monkeypatch, caplog):
    with pytest.raises(ValueError, match="unknown model_class 'renamed_llama'"):
        check_model(tiny_model_dir, device="cpu", model_class="renamed_llama")
    assert "renamed_llama" not in model_class_choices()

    glue = renamed_glue()
    monkeypatch.setitem(MODEL_GLUE, "renamed_llama", glue)
    assert model_class_choices() == list(MODEL_GLUE) and "renamed_llama" in model_class_choices()
    _, config, _, _ = check_model(tiny_model_dir, device="cpu", model_class="renamed_llama")
    assert type(config) is RenamedLlamaConfig and config.architectures == ["RenamedLlamaForCausalLM"]
    renamed, tokenizer = load_model(tiny_model_dir, device="cpu", model_class="renamed_llama")
    llama, _ = load_model(tiny_model_dir, device="cpu")
    assert type(renamed) is RenamedLlamaForCausalLM and renamed.config.model_type == "renamed_llama"

    ids = tokenizer("The bees of Marta " * 12, return_tensors="pt", add_special_tokens=False).input_ids
    # KVQuant quantizes keys before RoPE: the cache rotates them through the glue's key_rotation
    for method in (make_method("snapkv", budget=32, window_size=8), make_method("fullkv", **KVQUANT)):
        texts = []
        for model in (llama, renamed):
            with caplog.at_level(logging.WARNING, logger="pyramidkv.models.patch"), compress(model, method):
                texts.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                            min_new_tokens=20, do_sample=False))
        assert torch.equal(texts[0], texts[1])
    calls = glue.calls
    assert calls["project_qkv"] == 2 * 2 * 20   # two runs, two layers, a prompt forward and 19 decode steps
    assert calls["key_rotation"] == 1 and calls["unrotate"] > 0 and calls["rotate"] > 0
    assert patch_warnings(caplog) == ["config.pretraining_tp=1 is not applied to the compressed cache during decoding"] * 2


def test_the_engine_names_no_architecture_and_no_rope_convention():
    """core/ receives q, k, v and a KeyRotation: no model family, rotary module or rotate_half in its source."""
    from pathlib import Path

    import pyramidkv.core

    core = Path(pyramidkv.core.__file__).parent
    words = ("llama", "mistral", "rotary_emb", "rotate_half", "model_type")
    found = [(path.name, word) for path in sorted(core.glob("*.py")) for word in words
             if word in path.read_text(encoding="utf-8").lower()]
    assert found == []
