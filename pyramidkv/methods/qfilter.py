"""Q-Filters (Godey et al., 2025, arXiv 2503.02812), "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
Compression": the post-RoPE queries of a head lean one way; each cached key is scored by its projection on that
direction, with no attention computed. Per layer and KV head a filter f [D] (calibrated once per model by
scripts/calibrate_qfilter.py: the majority-signed first right singular vector of the query heads' post-RoPE
queries, negated, averaged over the KV group); a key k scores -<f, k> (higher = keep), so the score of a token
reads that token's key alone. The authors keep the last `window_size` tokens (their README's window_length 64);
kvpress's QFilterPress keeps none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method
from pyramidkv.methods.calibrated import artifact_path, checked_artifact

KIND = "qfilter"


def _filters(where, tensors: dict, record: dict, model: ModelShape) -> torch.Tensor:
    """[L, Hkv, D] float32 filters of a file, checked to fit the model."""
    filters = tensors.get("filters")
    expected = (model.num_layers, model.num_kv_heads, model.head_dim)
    if filters is None or tuple(filters.shape) != expected:
        found = None if filters is None else tuple(filters.shape)
        raise ValueError(f"calibration file {where} holds filters of shape {found}; this model needs {expected} "
                         f"(layers, KV heads, head dim)")
    return filters.float()


@dataclass(frozen=True)
class QFilter(Method):
    """Q-Filters' scorer.

    qfilter_path: the filters file (scripts/calibrate_qfilter.py makes one, [layers, KV heads, head dim]);
        none: the file shipped for the model.
    """

    name = "qfilter"
    token_scores: ClassVar[bool] = True
    path_settings = ("qfilter_path",)
    window_size: int = 64
    qfilter_path: Optional[str] = None

    def check_model(self, model: ModelShape) -> None:
        """The filters made on this model (refused in one line for another model or a misshapen file)."""
        super().check_model(model)
        checked_artifact(KIND, self.qfilter_path, model, _filters)

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        if self.qfilter_path is not None or model is None or not model.name:
            return {}
        try:
            path = artifact_path(KIND, None, model)
        except ValueError:   # none for this model: check_model refuses it
            return {}
        return {f"qfilter_path=packaged {path.name}": str(path)}

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """-<f, k> per key: [B, H, n] for keys [B, H, n, D] (H the KV heads, or the query heads of the query_head
        layout at decode, each reading its KV head's filter)."""
        filters = checked_artifact(KIND, self.qfilter_path, ctx.model, _filters)          # [L, Hkv, D]
        layer = filters[ctx.layer_idx].to(ctx.keys.device)                                  # [Hkv, D]
        heads = ctx.keys.shape[1]
        if heads != layer.shape[0]:
            layer = layer.repeat_interleave(heads // layer.shape[0], dim=0)
        return -torch.einsum("bhnd,hd->bhn", ctx.keys.float(), layer)
