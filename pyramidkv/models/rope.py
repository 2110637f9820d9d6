"""The Llama family's glue: q_proj / k_proj / v_proj, and RoPE in the rotate_half convention.

rotate_half pairs channel c with channel c + D/2: x at position p becomes x * cos(p) + turn(x) * sin(p),
turn(x) = [-x[D/2:], x[:D/2]], with cos and sin [D] from the model's own rotary module (so its base, scaling
and dtype are the model's). Undoing it is the same with -sin, divided by cos^2 + sin^2 (1, except under a
scaling with an attention factor, which multiplies both: Phi-3's LongRoPE, Llama's yarn and longrope). Llama
and Mistral (llama.py, mistral.py) are this glue with their own classes; a family that differs only in a
detail overrides that method: `project` (a fused qkv_proj), `rotate_qk` and `rope_table` (a rotary module or
apply_rotary_pos_emb called another way: `LengthRopeGlue`, Qwen2's and Mixtral's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pyramidkv.models.glue import ModelGlue, decoder


# (size, device) -> cos, sin [size, D] of positions 0..size-1, as the model computes them
RopeTable = Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]


def position_ids_table(rotary_emb, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The table of a rotary module called as Llama's is in 4.44.2: rotary_emb(x, position_ids [1, size]),
    computed where the module's frequencies are (a model spread over devices) and brought to `device`."""
    home = next(rotary_emb.buffers(), torch.zeros(0)).device
    ids = torch.arange(size, device=home).unsqueeze(0)
    probe = torch.zeros(1, device=home, dtype=torch.float32)
    cos, sin = rotary_emb(probe, ids)
    return cos[0].to(device), sin[0].to(device)


def length_table(rotary_emb, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The table of a rotary module called with a length, as Qwen2's and Mixtral's are in 4.44.2:
    rotary_emb(x, seq_len=size) -> cos, sin [size, D] (rows of its cached table, grown past it as the model
    grows it)."""
    return rotary_emb(torch.zeros(1, device=device, dtype=torch.float32), seq_len=size)


class HalfRotation:
    """RoPE on keys outside the model (core/rotary.py's `KeyRotation`), rotate_half convention.

    cos / sin [P, D] (float32) of positions 0..P-1 come from the model (`table`), computed once for at
    least 1,024 positions and recomputed, twice as many, when a larger position is asked for; one table per
    device asked for (a model spread over devices). Undoing a scaled table divides by cos^2 + sin^2 (its
    attention factor, squared; an unscaled one is undone with -sin alone).
    """

    def __init__(self, table: RopeTable):
        self.table = table
        # device -> (cos, sin, magnitude: cos^2 + sin^2 where the table is scaled, else None)
        self.tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = {}

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        needed = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin, magnitude = self.tables.get(positions.device, (None, None, None))
        if cos is None or cos.shape[0] < needed:
            size = max(needed, 2 * (0 if cos is None else cos.shape[0]), 1024)
            cos, sin = (t.float() for t in self.table(size, positions.device))
            magnitude = cos.square() + sin.square()   # 1 to float32 rounding unless scaled (or bf16)
            magnitude = None if torch.allclose(magnitude, torch.ones_like(magnitude), atol=1e-5) else magnitude
            self.tables[positions.device] = cos, sin, magnitude
        index = positions.long()
        return cos[index], sin[index], None if magnitude is None else magnitude[index]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., T, D] rotated (inverse: un-rotated) to positions [..., T], in float32."""
        cos, sin, magnitude = self.lookup(positions)
        x = x.float()
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        if not inverse:
            return x * cos + turned * sin
        undone = x * cos - turned * sin
        return undone if magnitude is None else undone / magnitude


@dataclass(frozen=True, kw_only=True)
class RotateHalfGlue(ModelGlue):
    """A Llama-family architecture.

    apply_rotary_pos_emb: the modeling file's `(q, k, cos, sin) -> (q, k)`, so queries and keys are rotated
        by the very function the unpatched model calls (bit-identical prefill).
    """

    apply_rotary_pos_emb: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def project_qkv(self, module, hidden_states, position_ids, position_embeddings):
        q, k, v = self.project(module, hidden_states)
        q, k = self.rotate_qk(module, q, k, v, position_ids, position_embeddings)
        return q, k, v

    def project(self, module, hidden_states):
        """q [B, Hq, n, D], k and v [B, Hkv, n, D] before RoPE: three separate projections."""
        bsz, n, _ = hidden_states.shape
        q = module.q_proj(hidden_states).view(bsz, n, module.num_heads, module.head_dim).transpose(1, 2)
        k = module.k_proj(hidden_states).view(bsz, n, module.num_key_value_heads, module.head_dim).transpose(1, 2)
        v = module.v_proj(hidden_states).view(bsz, n, module.num_key_value_heads, module.head_dim).transpose(1, 2)
        return q, k, v

    def rotate_qk(self, module, q, k, v, position_ids, position_embeddings):
        """q and k with RoPE applied by the modeling file's function, cos / sin as the decoder or module has them."""
        if position_embeddings is None:  # Mistral computes RoPE inside the module; Llama receives it
            cos, sin = module.rotary_emb(v, position_ids)
        else:
            cos, sin = position_embeddings
        return self.apply_rotary_pos_emb(q, k, cos, sin)

    def rope_table(self, model) -> RopeTable:
        """The model's cos / sin by position, from its first attention module's rotary module."""
        return functools.partial(position_ids_table, decoder(model).layers[0].self_attn.rotary_emb)

    def key_rotation(self, model) -> HalfRotation:
        return HalfRotation(self.rope_table(model))


@dataclass(frozen=True, kw_only=True)
class LengthRopeGlue(RotateHalfGlue):
    """A Llama-family architecture whose rotary module takes a length and returns the rows of its table, and
    whose apply_rotary_pos_emb picks the positions' rows (Qwen2, Mixtral in 4.44.2)."""

    def rotate_qk(self, module, q, k, v, position_ids, position_embeddings):
        # the model asks for kv_seq_len rows; rows past the positions asked for are never read
        cos, sin = module.rotary_emb(v, seq_len=int(position_ids.max()) + 1)
        return self.apply_rotary_pos_emb(q, k, cos, sin, position_ids)

    def rope_table(self, model) -> RopeTable:
        return functools.partial(length_table, decoder(model).layers[0].self_attn.rotary_emb)
