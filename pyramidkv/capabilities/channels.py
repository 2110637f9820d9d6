"""ThinK's key channels (Xu et al., ICLR 2025, "ThinK: Thinner Key Cache by Query-Driven Pruning") as a unit
any method can add: after selection each stored head stores its older kept keys on its most important
channels only (the tensor code: pyramidkv/core/channels.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pyramidkv.capabilities.base import Capability, Conflict, fixed_budget, prompt_kept
from pyramidkv.components import ModelShape

CHANNEL_INDEX_BYTES = 8   # each stored head's kept channel indices are int64 (core/kept.py ThinRows)


@dataclass(frozen=True)
class ThinKChannels(Capability):
    """Query-driven key-channel pruning.

    key_channel_ratio: ThinK's key-channel pruning (lambda, the share of key channels pruned; 0: off):
        after selection each stored head keeps its D - floor(lambda D) channels with the largest
        ||Q_w[:, c]||^2 ||K_kept[:, c]||^2 and stores its kept keys that thin, values and generated
        tokens never pruned (docs/methods.md).
    key_recent_size: ThinK: the most recent kept tokens of each head whose keys stay full width.
    key_query_window: ThinK: the prompt's last queries that score the key channels (Q_w).
    """

    name = "think"
    axis = "channels"
    title = "ThinK key channels"
    switch = "key_channel_ratio"
    switch_off = 0.0
    conflicts = (
        Conflict("quant_method", lambda m: m.quant_method is not None
                 and m.quant_method.residual_length < m.channels.key_recent_size,
                 "the quantizer's residual_length {m.quant_method.residual_length} must be >= key_recent_size "
                 "{m.channels.key_recent_size}: the recent keys stay full width, so they cannot be quantized thin"),
    )
    key_channel_ratio: float = 0.4
    key_recent_size: int = 32
    key_query_window: int = 32

    def validate(self) -> None:
        if not 0.0 < self.key_channel_ratio < 1.0:
            raise ValueError(f"key_channel_ratio must be in [0, 1) (share of key channels pruned; 0: off), "
                             f"got {self.key_channel_ratio!r}")
        if self.key_recent_size < 0:
            raise ValueError(f"key_recent_size must be an integer >= 0 (most recent kept tokens left full width), "
                             f"got {self.key_recent_size!r}")
        if self.key_query_window < 1:
            raise ValueError(f"key_query_window must be an integer >= 1 (prompt queries that score the key "
                             f"channels), got {self.key_query_window!r}")

    def pruned(self, head_dim: int) -> int:
        """Key channels each stored head prunes: floor(lambda D)."""
        return int(self.key_channel_ratio * head_dim + 1e-9)

    def check_with(self, method) -> None:
        budget = fixed_budget(method)
        if budget is not None and self.key_recent_size >= budget:
            raise ValueError(f"key_recent_size {self.key_recent_size} keeps all {budget} tokens each head keeps "
                             f"(budget {budget}) full width: ThinK would thin no key; use key_recent_size < {budget}")

    def check_model(self, model: ModelShape, method=None) -> None:
        dim, pruned = model.head_dim, self.pruned(model.head_dim)
        if pruned == 0:
            raise ValueError(f"key_channel_ratio {self.key_channel_ratio:g} prunes floor({self.key_channel_ratio:g} x "
                             f"{dim}) = 0 of the model's {dim} key channels: every key stays full width and each head "
                             f"also stores its channel index (more than without ThinK); use key_channel_ratio >= "
                             f"{1 / dim:.4g} (1 of {dim})")
        context = getattr(model, "context_window", None)
        if context and self.key_query_window > context:
            raise ValueError(f"key_query_window {self.key_query_window} is longer than any prompt of this model "
                             f"(max_position_embeddings {context}); it would read the whole prompt under a label "
                             f"that says {self.key_query_window}; use key_query_window <= {context}")
        budget = fixed_budget(method)
        if budget is None or not model.dtype_bytes:   # 0: dtype unknown
            return
        thin = budget - self.key_recent_size
        saved = thin * pruned * model.dtype_bytes
        index = (dim - pruned) * CHANNEL_INDEX_BYTES
        if saved <= index:
            raise ValueError(f"key_channel_ratio {self.key_channel_ratio:g} at budget {budget}, key_recent_size "
                             f"{self.key_recent_size}: thinning {thin} keys by {pruned} of {dim} channels saves "
                             f"{saved} bytes per head, no more than its {dim - pruned}-channel index costs ({index} "
                             f"bytes): ThinK would store more than without it; prune more channels or thin more keys")

    def check_prompt(self, prompt_len: int, method=None) -> None:
        if self.key_query_window != type(self)().key_query_window and self.key_query_window > prompt_len:
            raise ValueError(f"key_query_window {self.key_query_window} is longer than the {prompt_len}-token prompt: "
                             f"the run would score the channels with all {prompt_len} queries under a label that says "
                             f"{self.key_query_window}; use key_query_window <= {prompt_len}")
        if method is None or fixed_budget(method) is not None:
            return
        kept = prompt_kept(method, prompt_len)
        if self.key_recent_size >= kept:
            raise ValueError(f"key_recent_size {self.key_recent_size} keeps all {kept} tokens each head keeps of the "
                             f"{prompt_len}-token prompt full width: ThinK would thin no key; use key_recent_size < "
                             f"{kept}")
