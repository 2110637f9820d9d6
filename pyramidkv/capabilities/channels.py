"""ThinK's key channels (Xu et al., ICLR 2025, "ThinK: Thinner Key Cache by Query-Driven Pruning") as a unit
any method can add: after selection each stored head stores its older kept keys on its most important
channels only (the tensor code: pyramidkv/core/channels.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pyramidkv.capabilities.base import Capability, Conflict


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
