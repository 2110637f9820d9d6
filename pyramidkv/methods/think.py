"""ThinK (Xu et al., ICLR 2025, "ThinK: Thinner Key Cache by Query-Driven Pruning"): SnapKV token
selection, then per stored head the key channels pruned by the query-driven criterion
norm(Q_w[:, c])^2 * norm(K_kept[:, c])^2 (`key_channel_ratio` lambda = 0.4 of the channels, scored
with the prompt's last 32 queries); the keys of every kept token but the 32 most recent are stored that
much thinner (pyramidkv/core/channels.py). The official defaults: SnapKV window 32, kernel 7, max
pooling. The channel axis composes with any method (`key_channel_ratio` on snapkv, h2o, adakv, ...).
"""

from dataclasses import dataclass
from typing import Optional

from pyramidkv.capabilities import ThinKChannels

from pyramidkv.methods.snapkv import SnapKV


@dataclass(frozen=True)
class ThinK(SnapKV):
    """SnapKV plus ThinK's key channels, with the official defaults (lambda = 0.4 of the channels pruned)."""

    name = "think"
    channels: Optional[ThinKChannels] = ThinKChannels()
