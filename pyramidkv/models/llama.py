"""Llama glue (transformers 4.44.2): the rotate_half family's projections and RoPE, with Llama's classes."""

from transformers.models.llama import modeling_llama

from pyramidkv.models.rope import RotateHalfGlue

GLUE = RotateHalfGlue(
    causal_lm=modeling_llama.LlamaForCausalLM,
    attention_classes=(modeling_llama.LlamaAttention,),  # eager; the sdpa and flash classes subclass it
    apply_rotary_pos_emb=modeling_llama.apply_rotary_pos_emb,
)
