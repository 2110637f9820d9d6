"""Mistral glue (transformers 4.44.2): the rotate_half family's projections and RoPE, with Mistral's classes.
Its config's sliding_window (v0.1: 4096) restricts every layer, in the mask under eager and sdpa and in the
kernel under flash-attn: each layer holds at most that window."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.mistral import modeling_mistral

from pyramidkv.models.glue import flash_windows
from pyramidkv.models.rope import RotateHalfGlue


@dataclass(frozen=True, kw_only=True)
class MistralGlue(RotateHalfGlue):
    def layer_windows(self, config, implementation="eager"):
        return flash_windows(config, implementation, keys_in_mask=True)


GLUE = MistralGlue(
    causal_lm=modeling_mistral.MistralForCausalLM,
    attention_classes=(modeling_mistral.MistralAttention,),  # eager; the sdpa and flash classes subclass it
    apply_rotary_pos_emb=modeling_mistral.apply_rotary_pos_emb,
    refused_settings=("rope_scaling", "attention_bias", "mlp_bias"),  # Mistral has no RoPE scaling, no biases
    config_overrides={"sliding_window": None},     # weights of a family without a window gain none
)
