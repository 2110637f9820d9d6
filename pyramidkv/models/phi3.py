"""Phi-3 / Phi-3.5 glue (transformers 4.44.2): the rotate_half family with a fused qkv_proj, and a rotary
module that may choose its frequencies by the positions of the call.

RoPE. 4.44.2's Phi3Config turns rope_scaling types "su" and "yarn" into "longrope", and the attention builds
Phi3RotaryEmbedding (no rope_scaling) or Phi3LongRoPEScaledRotaryEmbedding (the Su and Yarn classes are never
built). LongRoPE divides the frequencies by long_factor when the call's longest position p_max satisfies
p_max + 1 > original_max_position_embeddings (L), by short_factor otherwise, and multiplies cos and sin by
sqrt(1 + ln(s) / ln(L)), s = max_position_embeddings / L (when s > 1).

Key rotation rule (stores that keep keys before RoPE): a key at position p is rotated as the model rotates it
when p is the newest position of its forward: short_factor for p < L, long_factor for p >= L. That is the
model's own rotation of every decoded key and of every key of a prompt of at most L tokens; it differs only for
the keys at positions below L of a forward that reaches past L (a prompt longer than L, or a padded batch whose
longest prompt is), which the model rotates with long_factor. The cache rotates back with the same rule, so
attention still sees the model's keys exactly; a pre-RoPE store holds, for those keys, the model's pre-RoPE key
turned by p * (w_long - w_short).

Sliding window: the mini configs set sliding_window (2047; 262144 in the 128k ones); 4.44.2 applies it under
flash_attention_2 alone (every layer); eager attends over everything (Llama's causal mask). Phi-3 has no sdpa
attention in 4.44.2 (`_supports_sdpa = False`): loading refuses it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers.models.phi3 import modeling_phi3

from pyramidkv.models.glue import decoder, flash_windows
from pyramidkv.models.rope import RopeTable, RotateHalfGlue


def newest_position_table(rotary_emb, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [size, D] of positions 0..size-1, each row as Phi-3's rotary module makes it in a call whose
    newest position is that row's: positions below original_max_position_embeddings in one call (short
    factor), the rest in another (long factor). A module without factors gives every row in one call."""
    split = min(getattr(rotary_emb, "original_max_position_embeddings", size), size)
    probe = torch.zeros(1, device=device, dtype=torch.float32)
    parts = [rotary_emb(probe, torch.arange(start, stop, device=device).unsqueeze(0))
             for start, stop in ((0, split), (split, size)) if stop > start]
    return torch.cat([cos[0] for cos, _ in parts]), torch.cat([sin[0] for _, sin in parts])


@dataclass(frozen=True, kw_only=True)
class Phi3Glue(RotateHalfGlue):
    def layer_windows(self, config, implementation="eager"):
        return flash_windows(config, implementation)

    def project(self, module, hidden_states):
        """q, k, v before RoPE: qkv_proj's output split as Phi3Attention splits it (queries, keys, values)."""
        bsz, n, _ = hidden_states.shape
        qkv = module.qkv_proj(hidden_states)
        q_size, kv_size = module.num_heads * module.head_dim, module.num_key_value_heads * module.head_dim
        q = qkv[..., :q_size].view(bsz, n, module.num_heads, module.head_dim).transpose(1, 2)
        k = qkv[..., q_size:q_size + kv_size].view(bsz, n, module.num_key_value_heads, module.head_dim).transpose(1, 2)
        v = qkv[..., q_size + kv_size:].view(bsz, n, module.num_key_value_heads, module.head_dim).transpose(1, 2)
        return q, k, v

    def rope_table(self, model) -> RopeTable:
        return functools.partial(newest_position_table, decoder(model).layers[0].self_attn.rotary_emb)


GLUE = Phi3Glue(
    causal_lm=modeling_phi3.Phi3ForCausalLM,
    attention_classes=(modeling_phi3.Phi3Attention,),  # eager; the flash class subclasses it
    apply_rotary_pos_emb=modeling_phi3.apply_rotary_pos_emb,
)
