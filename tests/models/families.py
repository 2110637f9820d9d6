"""Tiny random models of every family in MODEL_GLUE, for tests that must take seconds.

FAMILY_CONFIGS: per config.model_type, the settings of a 2-layer model (hidden 64, GQA 4 query / 2 KV heads,
head_dim 16, vocab 96, 8,192 positions) in that family's config class; a family that needs more (Mixtral's
experts, Phi-3's special token ids inside the vocabulary) adds them here, nowhere else.
"""

from __future__ import annotations

from pyramidkv.models.patch import MODEL_GLUE, family_implementations
from tests.conftest import tiny_llama

SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=8192, rope_theta=10000.0)
FAMILY_SETTINGS = {
    "llama": {},
    "mistral": dict(sliding_window=None),   # v0.2 and later (tests/models/test_sliding_windows.py: v0.1's)
    "qwen2": {},
    "phi3": dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, original_max_position_embeddings=4096),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # a query scalar other than head_dim, and a cap the tiny model's logits can reach
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, pad_token_id=0),
}
FAMILY_CONFIGS = {model_type: {**SIZES, **settings} for model_type, settings in FAMILY_SETTINGS.items()}
# The families whose weights layout is Llama's (q/k/v/o, gate/up/down), so that SmolLM2 loads as them
# (load_model's model_class); Phi-3 (fused qkv_proj, gate_up_proj) and Mixtral (experts) do not.
LLAMA_LAYOUT = ("llama", "mistral", "qwen2")
# The families the tests that load SmolLM2's real weights run as: Qwen2 (Llama's weights plus zero q/k/v biases,
# tests/models/test_families.py) would add five minutes of 135M-parameter runs to the suite for the same code.
SMOLLM2_AS = ("llama", "mistral")
# What makes each family's config set a sliding window of W (Qwen2: on layers from max_window_layers on)
WINDOW_SETTINGS = {"qwen2": dict(use_sliding_window=True, max_window_layers=1)}


def family_config(model_type: str, attn_implementation: str = "eager", **overrides):
    glue = MODEL_GLUE[model_type]
    return glue.config_class(**{**FAMILY_CONFIGS[model_type], **overrides}, attn_implementation=attn_implementation)


def tiny_family(model_type: str, attn_implementation: str | None = "eager", cached: bool = False, **overrides):
    """A random eval model of the family (seed 0) from FAMILY_CONFIGS, overrides on top (attn_implementation None:
    transformers' choice), from tests/conftest.py's tiny_llama. `cached`: the shared one, never to be changed
    (hashable overrides); else a fresh one, for a test that hands it settings such as rope_scaling or runs
    transformers' generate (which keeps a cache on the model for Gemma2)."""
    build = tiny_llama if cached else tiny_llama.__wrapped__
    return build(family=model_type, attn=attn_implementation, **{**FAMILY_CONFIGS[model_type], **overrides})


def implementations(model_type: str) -> list[str]:
    """eager, and sdpa where the family has it (flash_attention_2 needs CUDA)."""
    return [name for name in family_implementations(MODEL_GLUE[model_type]) if name != "flash_attention_2"]


def family_implementation_pairs() -> list[tuple[str, str]]:
    """(model_type, implementation) for every family of MODEL_GLUE and each implementation it has on CPU."""
    return [(model_type, name) for model_type in MODEL_GLUE for name in implementations(model_type)]
