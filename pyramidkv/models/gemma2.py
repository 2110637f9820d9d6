"""Gemma2 glue (transformers 4.44.2): q/k/v projections and rotate_half RoPE computed inside the attention module
(as Mistral's), and an attention of its own: logits q . k * query_pre_attn_scalar ** -0.5, soft-capped to
attn_logit_softcapping * tanh(logit / attn_logit_softcapping) under eager (the sdpa kernel of 4.44.2 applies no
cap; flash-attn >= 2.6 does), and a sliding window of config.sliding_window on every even layer (0, 2, ...)
alternating with global ones. Its generate() would allocate a HybridCache; the patch starts from an empty cache
instead (models/patch.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers.models.gemma2 import modeling_gemma2

from pyramidkv.models.rope import RotateHalfGlue


def flash_softcap() -> bool:
    """Whether 4.44.2's Gemma2 flash-attn path passes the soft-cap (flash-attn >= 2.6.0)."""
    from transformers.utils import is_flash_attn_greater_or_equal
    return is_flash_attn_greater_or_equal("2.6.0")


@dataclass(frozen=True, kw_only=True)
class Gemma2Glue(RotateHalfGlue):
    def layer_windows(self, config, implementation="eager"):
        window = config.sliding_window + (implementation == "flash_attention_2")   # flash: window_size (W, W)
        return tuple(window if layer % 2 == 0 else None for layer in range(config.num_hidden_layers))

    def attention_form(self, config, implementation):
        cap = config.attn_logit_softcapping
        applied = implementation == "eager" or (implementation == "flash_attention_2" and flash_softcap())
        return replace(super().attention_form(config, implementation), scale=config.query_pre_attn_scalar ** -0.5,
                       softcap=cap if applied else None)


GLUE = Gemma2Glue(
    causal_lm=modeling_gemma2.Gemma2ForCausalLM,
    attention_classes=(modeling_gemma2.Gemma2Attention,),  # eager; the sdpa and flash classes subclass it
    apply_rotary_pos_emb=modeling_gemma2.apply_rotary_pos_emb,
)
