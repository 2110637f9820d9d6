"""Tiny random models of the families the 5.x line runs (models/tf5/families.py), built through AutoConfig by
`config.model_type`, so that the same builder serves both lines: a family the installed transformers lacks
(Qwen3, Gemma3 on 4.44.2) is skipped with the line that has it.

Every model: hidden 64, 4 query / 2 KV heads of head_dim 16, MLP 128, 512 positions, vocab 96 (or another where a
test needs a real tokenizer's ids), weights drawn after torch.manual_seed(0) inside a forked generator.
"""

from __future__ import annotations

import pytest
import torch

from pyramidkv.models.line import INTERFACE_LINE, VERSION

SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
SETTINGS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},   # q_norm / k_norm on each head before RoPE
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),   # Qwen3's attention, MoE MLPs
    "mistral": dict(sliding_window=24),   # every layer slides (W = 24 < the 40-token prompts)
    "phi3": dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),   # fused qkv_proj
    # sliding and global layers, each type with its own RoPE base; a query scalar other than head_dim
    "gemma3_text": dict(num_hidden_layers=4, layer_types=GEMMA3_LAYERS, sliding_window=16, query_pre_attn_scalar=24,
                        pad_token_id=0),
}
FAMILIES = list(SETTINGS)
CACHE_ARGUMENT = "cache" if INTERFACE_LINE else "past_key_values"   # generate()'s name for a cache we pass


def implementation(model_type: str) -> str:
    """sdpa, except eager for Gemma3 (its recommended one) and for Phi-3 on 4.44.2 (no sdpa there)."""
    return "eager" if model_type == "gemma3_text" or (model_type == "phi3" and not INTERFACE_LINE) else "sdpa"


def tiny(model_type: str, attn: str | None = None, **overrides):
    """A fresh random eval model of the family, or a skip naming the line that has the family."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in transformers {VERSION}: it runs on the 5.x line (make test-tf5)")
    config = AutoConfig.for_model(model_type, **{**SIZES, **SETTINGS[model_type], **overrides})
    config._attn_implementation = attn or implementation(model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def windows(model) -> list:
    """Per layer the window the model's mask applies (None: global), from its config, for hand counts."""
    config = model.config
    types = getattr(config, "layer_types", None) or ["sliding_attention" if getattr(config, "sliding_window", None)
                                                     else "full_attention"] * config.num_hidden_layers
    return [config.sliding_window if kind == "sliding_attention" else None for kind in types]
