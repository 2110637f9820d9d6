"""`model_class` (load_model, --model_class: models/loading.py `config_as`) on both lines: a checkpoint loads as
another family of its weights layout, and what neither the line nor the layout has is refused in one line.

References: the unpatched model built in memory from the same weights (a tiny random Llama with SmolLM2's
tokenizer, tests/conftest.py's tiny_model_dir): the logits of the model loaded as Mistral or Qwen2 equal its own
(1e-6 absolute: the same weights through another class's code; Qwen2's q/k/v biases start at zero), and SnapKV
keeps the same positions in every layer and KV head.
"""

from __future__ import annotations

import pytest
import torch

from pyramidkv import compress, load_model, make_method
from pyramidkv.models.line import INTERFACE_LINE, VERSION
from pyramidkv.models.loading import config_as
from tests.conftest import FOR_SMOLLM2_TOKENIZER, save_copy, tiny_llama
from tests.tf5.families import CACHE_ARGUMENT

LOGITS_ATOL = 1e-6


def ids(vocab: int, length: int = 48) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(7))


def kept(model, prompt) -> list:
    """Per layer the positions SnapKV (budget 16, window 4) keeps per KV head, after the prompt."""
    with compress(model, make_method("snapkv", budget=16, window_size=4)) as patch, torch.no_grad():
        cache = patch.new_cache()
        model(prompt, **{CACHE_ARGUMENT: cache}, use_cache=True)
    return [[sorted(p.tolist()) for p in cache.layers[layer].kept_positions(0)]
            for layer in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("model_class", ["mistral", "qwen2"])
def test_a_llama_checkpoint_loads_as_another_family_of_its_layout(tiny_model_dir, model_class):
    model, tokenizer = load_model(tiny_model_dir, device="cpu", model_class=model_class)
    reference = tiny_llama(vocab=len(tokenizer), **FOR_SMOLLM2_TOKENIZER)
    assert model.config.model_type == model_class and type(model).__name__.lower().startswith(model_class)
    prompt = ids(len(tokenizer))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, reference(prompt).logits, rtol=0, atol=LOGITS_ATOL)
    assert kept(model, prompt) == kept(reference, prompt)


def llama3_scaled(tokenizer, folder) -> str:
    """A tiny Llama (vocabulary 96) with Llama 3's RoPE scaling (factor 8 over 256 positions of 1,024), saved with a
    tokenizer (load_model reads one; the ids given are below 96)."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256)
    model = tiny_llama.__wrapped__(max_position_embeddings=1024, rope_scaling=scaling, tie_word_embeddings=True)
    save_copy(model, folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION}: Mistral has no RoPE scaling there "
                                                f"(refused: test_rope_scaling_is_refused_where_the_class_lacks_it)")
def test_rope_scaling_carries_over_on_the_5x_line(tokenizer, tmp_path):
    """5.x families all read `rope_parameters`, so Llama 3's scaling applies as Mistral too: the logits are the
    Llama's, and not those of the same weights unscaled (so the scaling is not vacuous)."""
    folder = llama3_scaled(tokenizer, tmp_path)
    scaled, _ = load_model(folder, device="cpu")
    as_mistral, _ = load_model(folder, device="cpu", model_class="mistral")
    plain = tiny_llama(max_position_embeddings=1024, tie_word_embeddings=True)
    prompt = ids(96, 300)
    with torch.no_grad():
        want, got, unscaled = (m(prompt).logits for m in (scaled, as_mistral, plain))
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)
    assert (unscaled - want).abs().max() > 100 * LOGITS_ATOL


@pytest.mark.skipif(INTERFACE_LINE, reason="the 5.x line carries the scaling over (test_rope_scaling_carries_over)")
def test_rope_scaling_is_refused_where_the_class_lacks_it(tokenizer, tmp_path):
    folder = llama3_scaled(tokenizer, tmp_path)
    with pytest.raises(ValueError, match="sets rope_scaling, which MistralForCausalLM does not have") as refused:
        load_model(folder, device="cpu", model_class="mistral")
    assert "\n" not in str(refused.value)


# per line, the model classes it refuses and the words of each refusal
OTHER_LINE = {"gemma2": "is a family of the pinned line (transformers 4.44.2) only",
              "mixtral": "is a family of the pinned line (transformers 4.44.2) only",
              "qwen3": "no other family's weights load as it", "gemma3_text": "no other family's weights load as it"
              } if INTERFACE_LINE else {"qwen3": "is a family of the 5.x line only",
                                        "gemma3_text": "is a family of the 5.x line only",
                                        "renamed_llama": "unknown model_class"}


@pytest.mark.parametrize("model_class", list(OTHER_LINE))
def test_a_family_of_the_other_line_or_of_no_layout_is_refused_in_one_line(tiny_model_dir, model_class):
    """Gemma2 and Mixtral are the pinned line's only, Qwen3 and Gemma3 the 5.x line's (and there no other
    family's weights load as them: q/k norms); each refusal lists the classes the installed line takes."""
    with pytest.raises(ValueError, match=f"model_class '{model_class}'") as refused:
        load_model(tiny_model_dir, device="cpu", model_class=model_class)
    message = str(refused.value)
    assert OTHER_LINE[model_class] in message and "\n" not in message
    assert message.endswith("choose one of llama, mistral, qwen2, phi3" + ("" if INTERFACE_LINE else ", mixtral, gemma2"))


def test_a_layout_without_a_place_for_the_weights_is_refused(tiny_model_dir):
    """Llama's separate q/k/v and gate/up projections have no place in Phi-3's fused ones (both lines)."""
    with pytest.raises(ValueError, match="llama weights do not load as phi3: Phi3ForCausalLM has no") as refused:
        load_model(tiny_model_dir, device="cpu", model_class="phi3")
    assert "\n" not in str(refused.value)


@pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION} has no Qwen3")
def test_qwen3s_norms_have_no_place_in_llama():
    from tests.tf5.families import tiny

    with pytest.raises(ValueError, match="qwen3 weights do not load as llama: LlamaForCausalLM has no .*q_norm"):
        config_as(tiny("qwen3").config, "llama")
