"""The families of the 5.x line: what the attention interface does not give, per `config.model_type`.

The interface gives the engine every layer's q, k, v after RoPE (and after the q/k norms of Qwen3 and Gemma3),
the mask, and the form's scale, window and soft-cap (models/tf5/form.py). What it does not give is a row here:

  rotation   how to rotate keys outside the model (RoPE on keys at given positions, and undone), which methods and
             quantizers that work on keys before RoPE need: "model" = the decoder's one rotary module in the
             rotate_half convention (models/rope.py's HalfRotation); None = refused, with `why`.
  refused    the family cannot run through the engine at all, and why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from pyramidkv.models.glue import decoder
from pyramidkv.models.line import PINNED
from pyramidkv.models.rope import HalfRotation, position_ids_table


@dataclass(frozen=True)
class Family:
    rotation: Optional[str] = "model"
    why_no_rotation: str = ""
    refused: str = ""


PER_LAYER_ROPE = "its RoPE differs per layer type (local and global bases): the key rotation needs a glue row"
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "phi3": Family(),
    "gemma3_text": Family(rotation=None, why_no_rotation=PER_LAYER_ROPE),
    "gpt_oss": Family(refused="its attention adds per-head sinks (s_aux) to the softmax, which the engine's "
                              "stores do not apply"),
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
    return HalfRotation(functools.partial(position_ids_table, rotary))
