"""MiniCache's layer sharing (Liu et al., NeurIPS 2024, "MiniCache: KV Cache Compression in Depth Dimension
for Large Language Models") as a unit any method can add: adjacent layers from the middle up store one
shared direction per token (the tensor code: pyramidkv/core/cross_layer.py, core/merged_pair.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from pyramidkv.capabilities.base import Capability, Conflict
from pyramidkv.components import ModelShape

INDEX_BYTES = 8   # a retained token's index is int64 (core/merged_pair.py)


@dataclass(frozen=True)
class MiniCacheSharing(Capability):
    """Cross-layer merging of adjacent layer pairs.

    cross_layer_start: MiniCache: the first layer merged (none: the middle layer).
    cross_layer_t: MiniCache: the SLERP interpolation t between the two layers' directions.
    cross_layer_retain: MiniCache: the share of token pairs with the largest angular distance (keys and
        values separately) that keep their original vectors in both layers.
    """

    name = "minicache"
    axis = "layer_sharing"
    title = "cross-layer merging (MiniCache)"
    switch = "cross_layer_merge"
    switch_off = False
    store_kind = "paired"
    conflicts = (
        Conflict("key_channel_ratio", lambda m: m.channels is not None, "thin keys are per layer"),
        Conflict("layer_allocation", lambda m: m.layer_allocation.name != "uniform",
                 "a merged pair keeps one token set, so its two layers need the same budget"),
        Conflict("head_allocation", lambda m: m.head_allocation.global_over_layers,
                 "its per-layer head table would split a merged pair"),
    )
    cross_layer_start: Optional[int] = None
    cross_layer_t: float = 0.6
    cross_layer_retain: float = 0.05

    def validate(self) -> None:
        if not 0.0 <= self.cross_layer_t <= 1.0:
            raise ValueError(f"cross_layer_t must be in [0, 1] (SLERP weight of the upper layer), "
                             f"got {self.cross_layer_t!r}")
        if not 0.0 <= self.cross_layer_retain <= 1.0:
            raise ValueError(f"cross_layer_retain must be in [0, 1] (share of token pairs kept unmerged), "
                             f"got {self.cross_layer_retain!r}")
        if self.cross_layer_start is not None and self.cross_layer_start < 0:
            raise ValueError(f"cross_layer_start must be a layer index >= 0 (or None: the middle layer), "
                             f"got {self.cross_layer_start!r}")

    def pairs(self, num_layers: int) -> dict[int, int]:
        """lower layer -> upper layer of every merged pair: (start, start + 1), (start + 2, start + 3), ... while
        the upper layer exists; start None = num_layers // 2 (the paper merges from the middle up)."""
        first = num_layers // 2 if self.cross_layer_start is None else self.cross_layer_start
        return {lower: lower + 1 for lower in range(first, num_layers - 1, 2)}

    def normalized(self, model: ModelShape) -> "MiniCacheSharing":
        if self.cross_layer_start == model.num_layers // 2:
            return dataclasses.replace(self, cross_layer_start=None)
        return self

    def check_model(self, model: ModelShape, method=None) -> None:
        dim, element = model.head_dim, model.dtype_bytes
        # Per token pair, in values of the model dtype: merged 2D directions + 4 magnitudes + a retained share of
        # both layers' keys and values (4D) and their int64 indices, against 4D unmerged (core/merged_pair.py).
        most = (2 * dim - 4) / (4 * dim + 2 * INDEX_BYTES / element) if element else 1.0   # 0: dtype unknown
        if self.cross_layer_retain >= most:
            raise ValueError(f"cross_layer_retain {self.cross_layer_retain:g}: keeping that share of the token pairs "
                             f"unmerged (their originals in both layers, plus the merged directions and magnitudes) "
                             f"stores at least as much as not merging on this model (head_dim {dim}); use "
                             f"cross_layer_retain < {most:.4f}")
        layers = model.num_layers
        form = model.form
        sliding = [l for lower in self.pairs(layers) for l in (lower, lower + 1)
                   if l < layers and form.window(l) is not None]
        if sliding or form.capped:
            what = f"sliding-window layers ({', '.join(map(str, sliding))})" if sliding else "a soft-capped attention"
            raise ValueError(f"cross_layer_merge: this model has {what}, which a merged layer pair cannot hold (its "
                             f"store neither drops what leaves a window nor caps logits); MiniCache runs on models "
                             f"whose paired layers are global and uncapped")
        if self.cross_layer_start is not None and self.cross_layer_start >= layers - 1:
            raise ValueError(f"cross_layer_start {self.cross_layer_start} leaves no layer pair to merge in this "
                             f"{layers}-layer model (layers 0..{layers - 1}); use at most {layers - 2}")
