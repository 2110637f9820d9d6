"""The seam between pyramidkv and one model architecture: a `ModelGlue`, one per family (models/<arch>.py).

Everything the package does with a model that depends on its architecture goes through the glue:

  project_qkv(module, hidden, ...)  q, k, v of an attention module, RoPE applied (the patched attention);
  key_rotation(model)               RoPE on keys at given positions, and undone (the cache, for stores that
                                    keep keys before RoPE: core/rotary.py's `KeyRotation`);
  attention_form(config, impl)      its attention's scale, logit soft-cap and per-layer sliding windows (a
                                    components.AttentionForm): built once per patched model, handed to its
                                    caches inside the ModelShape, read by every store and scorer;
  config_as(config)                 another family's config re-expressed as this one (load_model's
                                    `model_class`);
  causal_lm, attention_classes      the model class loaded and the attention modules patched;
  unapplied_settings                config settings the compressed cache does not apply (patching warns).

`MODEL_GLUE` (models/patch.py) lists the glues by `config.model_type`; loading, patching, the command line
and the tests read it, so a family is one glue file and one row there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.rotary import KeyRotation

# Entries of a config's to_dict() that name its family rather than describe the model.
FAMILY_ENTRIES = ("model_type", "architectures", "transformers_version")


def flash_windows(config, implementation: str, keys_in_mask: bool = False, first_layer: int = 0
                  ) -> tuple[Optional[int], ...]:
    """The windows of a family whose layers (from first_layer on) slide by `config.sliding_window`: under
    flash-attn W + 1 keys (4.44.2 passes window_size (W, W)); under eager / sdpa W keys where the family's
    causal mask applies the window (keys_in_mask: Mistral), else none (Qwen2, Phi-3, Mixtral use Llama's)."""
    window = getattr(config, "sliding_window", None)
    if window is not None and implementation == "flash_attention_2":
        window += 1
    elif not keys_in_mask:
        window = None
    return tuple(window if layer >= first_layer else None for layer in range(config.num_hidden_layers))


def decoder(model):
    """The decoder (the module holding `layers`) of a causal LM, or the model itself when it is one."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise TypeError(f"{type(model).__name__} has no decoder layers to patch")
    return inner


@dataclass(frozen=True, kw_only=True)
class ModelGlue:
    """One architecture as pyramidkv drives it (transformers 4.44.2); a family implements `project_qkv` and
    `key_rotation` (models/rope.py does both for the Llama family's q/k/v projections and RoPE).

    causal_lm: the transformers causal-LM class (its `config_class` is the family's config).
    attention_classes: the attention modules patched (the eager class: the sdpa and flash classes subclass it).
    unapplied_settings: config settings the compressed cache does not apply during decoding; patching a model
        that sets one (not None) logs a warning naming it (Mistral's sliding_window).
    refused_settings: settings of another family's config that this family's weights layout or RoPE lacks:
        `config_as` refuses a config that sets one.
    config_overrides: values `config_as` sets over those of the other family's config (so that it gains
        nothing that family does not have).
    """

    causal_lm: type
    attention_classes: tuple[type, ...]
    unapplied_settings: tuple[str, ...] = ()
    refused_settings: tuple[str, ...] = ()
    config_overrides: dict = field(default_factory=dict)

    @property
    def config_class(self) -> type:
        return self.causal_lm.config_class

    def project_qkv(self, module, hidden_states: torch.Tensor, position_ids, position_embeddings
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Hq, n, D], k and v [B, Hkv, n, D] of hidden_states [B, n, hidden], RoPE applied, as the
        attention module's own forward computes them (position_embeddings: the (cos, sin) the decoder passes
        its layers, None where the module computes them itself)."""
        raise NotImplementedError

    def layer_windows(self, config, implementation: str = "eager") -> tuple[Optional[int], ...]:
        """Per layer, the sliding window the unpatched model applies under `implementation` (a query at position
        p attends to keys at positions p - W + 1 .. p: W tokens, itself included; flash-attn's window_size
        (s, s) is W = s + 1), None for a global layer. The cache holds no more than that on a sliding layer
        (docs/models.md, "Sliding windows")."""
        return (None,) * config.num_hidden_layers

    def attention_form(self, config, implementation: str) -> AttentionForm:
        """The family's attention under `implementation`, as its modeling file computes it: here scale None
        (1 / sqrt(head_dim), a division as the Llama files do), no soft-cap, and the `layer_windows`, a window at or
        beyond the context window (max_position_embeddings) counting as global: it never binds. A family with a
        scale or soft-cap of its own overrides this (Gemma2: query_pre_attn_scalar ** -0.5, and
        attn_logit_softcapping where that implementation applies it)."""
        context = getattr(config, "max_position_embeddings", 0) or 0
        windows = tuple(w if w is not None and not (context and w >= context) else None
                        for w in self.layer_windows(config, implementation))
        return AttentionForm(windows=windows if any(w is not None for w in windows) else ())

    def key_rotation(self, model) -> KeyRotation:
        """The model's RoPE applied to keys at given positions, and undone; fresh per cache (it may grow a
        table as positions grow)."""
        raise NotImplementedError

    def config_as(self, config):
        """`config`, another family's with the same weights layout, as this family's config."""
        values = {k: v for k, v in config.to_dict().items() if k not in FAMILY_ENTRIES}
        refused = [name for name in self.refused_settings if values.get(name)]
        if refused:
            raise ValueError(f"this {config.model_type} config sets {', '.join(refused)}, which "
                             f"{self.causal_lm.__name__} does not have")
        new = self.config_class(**{**values, **self.config_overrides})
        new.architectures = [self.causal_lm.__name__]
        return new
