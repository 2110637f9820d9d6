"""KVzip's context-independent head-level variant (Kim et al., 2025, arXiv 2505.23416), "KVzip: Query-Agnostic KV
Cache Compression with Context Reconstruction", the authors' `--level head`: each KV head gets one score, the most
KVzip pair score (kvzip's repeat-pass attention, maximised over the query group) any context position of a
calibration sample got there (scripts/kvzip_head_scores.py; several samples: their elementwise maximum), and every
token of a head scores its head's score. No repeat pass runs at inference.

With one threshold (threshold=X, pyramidkv/sizing/threshold.py) a head above it keeps the whole prompt outside the window and one
below keeps none of it: the authors' rule (kept heads keep all of the context, the others none). With
head_allocation "global" (the default, as kvzip) the best heads are kept whole and one boundary head keeps only
part: its most recent tokens (the tie order inside a head is by position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.allocation.base import HeadAllocation, ModelShape
from pyramidkv.allocation.global_ import GlobalHeads
from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method
from pyramidkv.methods.calibrated import artifact_path, checked_artifact

KIND = "kvzip-head"


def _head_scores(where, tensors: dict, record: dict, model: ModelShape) -> torch.Tensor:
    """[L, Hkv] float32 head scores of a file, checked to fit the model."""
    scores = tensors.get("head_scores")
    expected = (model.num_layers, model.num_kv_heads)
    if scores is None or tuple(scores.shape) != expected:
        found = None if scores is None else tuple(scores.shape)
        raise ValueError(f"calibration file {where} holds head scores of shape {found}; this model needs {expected} "
                         f"(layers, KV heads)")
    return scores.float()


@dataclass(frozen=True)
class KVzipHead(Method):
    """KVzip's head-level scorer: a head's calibrated score on each of its tokens.

    kvzip_head_path: the head-score file (scripts/kvzip_head_scores.py makes one, [layers, KV heads]); none:
        the file shipped for the model.
    """

    name = "kvzip_head"
    token_scores: ClassVar[bool] = True
    global_scale = "raw"
    score_bounds = (0.0, 1.0)   # a head's score is an attention weight (a softmax entry)
    path_settings = ("kvzip_head_path",)
    window_size: int = 0
    head_allocation: HeadAllocation = GlobalHeads()
    kvzip_head_path: Optional[str] = None

    def validate(self) -> None:
        super().validate()
        if self.merge is not None and self.protected_tokens == 0:
            raise ValueError(f"kvzip_head with window_size 0 and no sinks may keep none of a head's tokens, and "
                             f"merge={self.merge.name!r} folds evicted tokens into kept ones; set window_size or "
                             f"num_sinks >= 1, or leave merge out")

    def check_model(self, model: ModelShape) -> None:
        """The head scores made on this model (refused in one line for another model or a misshapen file)."""
        super().check_model(model)
        checked_artifact(KIND, self.kvzip_head_path, model, _head_scores)

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        if self.kvzip_head_path is not None or model is None or not model.name:
            return {}
        try:
            path = artifact_path(KIND, None, model)
        except ValueError:   # none for this model: check_model refuses it
            return {}
        return {f"kvzip_head_path=packaged {path.name}": str(path)}

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, H, n]: each head's score on all of its n tokens (H the KV heads, or the query heads of the query_head
        layout at decode, each with its KV head's score)."""
        table = checked_artifact(KIND, self.kvzip_head_path, ctx.model, _head_scores)      # [L, Hkv]
        heads = table[ctx.layer_idx].to(ctx.keys.device)                                      # [Hkv]
        b, h, n, _ = ctx.keys.shape
        if h != heads.shape[0]:
            heads = heads.repeat_interleave(h // heads.shape[0])
        return heads[None, :, None].expand(b, h, n).clone()
