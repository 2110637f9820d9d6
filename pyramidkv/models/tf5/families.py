"""The families of the 5.x line: what the attention interface does not give, per `config.model_type`.

The interface gives the engine every layer's q, k, v after RoPE (and after the q/k norms of Qwen3 and Gemma3),
the mask, and the form's scale, window and soft-cap (models/tf5/form.py). What it does not give is a row here:

  rotation   how to rotate keys outside the model (RoPE on keys at given positions, and undone), which methods and
             quantizers that work on keys before RoPE need: "model" = the decoder's one rotary module in the
             rotate_half convention (models/rope.py's HalfRotation); "layer_type" = that module called with each
             layer's type (Gemma3: a local base on sliding layers, a global one on full layers), one rotation per
             type, each layer's chosen by core/rotary.py's `layer_rotation`; None = refused, with `why`.
  refused    the family cannot run through the engine at all, and why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.models.glue import decoder
from pyramidkv.models.line import PINNED
from pyramidkv.models.rope import HalfRotation, position_ids_table


@dataclass(frozen=True)
class Family:
    rotation: Optional[str] = "model"
    why_no_rotation: str = ""
    refused: str = ""


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "qwen3_moe": Family(),   # Qwen3's attention; the experts are in the MLP, which the engine does not see
    "phi3": Family(),
    "gemma3_text": Family(rotation="layer_type"),
    "gpt_oss": Family(refused="its attention adds per-head sinks (s_aux) to the softmax, which the engine's "
                              "stores do not apply"),
    "qwen3_next": Family(refused="its linear-attention layers (gated DeltaNet) keep a recurrent state, not keys and "
                                 "values, which the engine's stores cannot hold or compress"),
}


def family(model_type: str) -> Family:
    """The family's row, or a one-line refusal naming the supported ones (and the pinned line's)."""
    row = FAMILIES.get(model_type)
    if row is None:
        raise ValueError(f"unsupported model type {model_type!r} on the 5.x line; supported: {', '.join(FAMILIES)} "
                         f"(the pinned transformers {PINNED} line supports others: requirements.txt)")
    if row.refused:
        raise ValueError(f"{model_type} is refused on the 5.x line: {row.refused}")
    return row


def key_rotation(model, method_name: str) -> HalfRotation:
    """RoPE on keys outside the model, from the decoder's rotary module (5.x: one per model, called as
    rotary_emb(x, position_ids))."""
    row = family(model.config.model_type)
    if row.rotation is None:
        raise ValueError(f"{method_name} works on keys before RoPE, and {model.config.model_type}: "
                         f"{row.why_no_rotation}")
    rotary = decoder(model).rotary_emb
    rope = getattr(model.config, "rope_parameters", None) or {}
    partial = getattr(model.config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ValueError(f"{method_name} works on keys before RoPE, and this {model.config.model_type} rotates part "
                         f"of each head (partial_rotary_factor): the key rotation needs a glue row")
    if row.rotation == "layer_type":
        return LayerTypeRotation(rotary, model.config.layer_types)
    return HalfRotation(functools.partial(position_ids_table, rotary))


def layer_type_table(rotary_emb, layer_type: str, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [size, D] of positions 0..size-1 for one layer type, from a rotary module called as Gemma3's is on
    5.x: rotary_emb(x, position_ids [1, size], layer_type), computed where its frequencies are."""
    home = next(rotary_emb.buffers()).device
    probe = torch.zeros(1, device=home, dtype=torch.float32)
    cos, sin = rotary_emb(probe, torch.arange(size, device=home)[None], layer_type)
    return cos[0].to(device), sin[0].to(device)


class LayerTypeRotation:
    """RoPE that differs by layer type: one HalfRotation per type (its own base and scaling), layer by layer
    through `for_layer` (core/rotary.py's `layer_rotation`). It has no rotation of its own: a caller that does not
    say the layer fails instead of rotating by the wrong base."""

    def __init__(self, rotary_emb, layer_types: list[str]):
        self.layer_types = list(layer_types)
        self.by_type = {kind: HalfRotation(functools.partial(layer_type_table, rotary_emb, kind))
                        for kind in dict.fromkeys(layer_types)}

    def for_layer(self, layer: int) -> HalfRotation:
        return self.by_type[self.layer_types[layer]]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        raise RuntimeError("this model's RoPE differs by layer type: rotate through for_layer(layer)")
