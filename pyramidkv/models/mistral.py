"""Mistral glue (transformers 4.44.2): the rotate_half family's projections and RoPE, with Mistral's classes."""

from transformers.models.mistral import modeling_mistral

from pyramidkv.models.rope import RotateHalfGlue

GLUE = RotateHalfGlue(
    causal_lm=modeling_mistral.MistralForCausalLM,
    attention_classes=(modeling_mistral.MistralAttention,),  # eager; the sdpa and flash classes subclass it
    apply_rotary_pos_emb=modeling_mistral.apply_rotary_pos_emb,
    unapplied_settings=("sliding_window",),        # decoding attends over everything the cache holds
    refused_settings=("rope_scaling", "attention_bias", "mlp_bias"),  # Mistral has no RoPE scaling, no biases
    config_overrides={"sliding_window": None},     # weights of a family without a window gain none
)
