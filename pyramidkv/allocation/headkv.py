"""HeadKV's head allocation (Fu et al., 2024, "Not All Heads Matter: A Head-Level KV Cache Compression
Method with Integrated Retrieval and Reasoning").

A precomputed importance score per (layer, query head) (`scripts/head_scores.py`; HeadKV's JSON
layout `{"layer-head": [scores]}`, a head's score = the mean of its list), normalised to sum 1 over
all L x H heads, splits the budget over every head of the model at once. With s selected tokens per
head on average: each head keeps at least min = s - floor(s / head_beta) and the rest of the
L x H x s pool goes by score share. In the kv_head layout the query heads' scores are averaged per
KV group. The public harness adds the window on top of an average of s + window (its totals drift
above the uniform total); here the shares are apportioned by largest remainder so the total over all
layers and heads is exactly L x H x s (+ the window per head), each head within [min, candidates].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from pyramidkv.allocation.base import HeadAllocation, ModelShape, apportion


@lru_cache(maxsize=16)
def _table(path: Optional[str], model: ModelShape) -> np.ndarray:
    """[L, Hq] head scores for the model: from `path`, else the packaged table for the model's name."""
    from pyramidkv.allocation.head_tables import check_head_scores, default_head_scores_path, load_head_scores

    source = path if path is not None else str(default_head_scores_path(model.name))
    table = load_head_scores(source)
    check_head_scores(table, model.num_layers, model.num_query_heads, source)
    return table


@lru_cache(maxsize=64)
def _plan(path: Optional[str], model: ModelShape, stored_heads: int, selected: int, candidates: int,
          head_beta: float) -> tuple[tuple[int, ...], ...]:
    """Selected tokens per (layer, stored head) for one prompt shape."""
    table = _table(path, model)
    if stored_heads != table.shape[1]:
        group = table.shape[1] // stored_heads
        table = table.reshape(table.shape[0], stored_heads, group).mean(-1)   # kv_head layout
    shares = table.reshape(-1) / table.sum()
    size = shares.size
    minimum = min(selected - math.floor(selected / head_beta), candidates)
    pool = size * selected - size * minimum
    counts = apportion([minimum + float(x) * pool for x in shares], size * selected, [minimum] * size,
                       [candidates] * size)
    return tuple(tuple(counts[i:i + stored_heads]) for i in range(0, size, stored_heads))


@dataclass(frozen=True)
class HeadKVHeads(HeadAllocation):
    """HeadKV's split of the budget over every head of the model.

    head_scores: head-importance table (HeadKV's JSON layout); none: the table shipped for the model
        (scripts/head_scores.py makes one).
    head_beta: each head keeps at least s - s // head_beta selected tokens (>= 1).
    """

    name = "headkv"
    global_over_layers = True
    head_scores: Optional[str] = None      # path of a head-score table; None = the packaged one for the model
    head_beta: float = 1.01
    path_settings = ("head_scores",)

    def validate(self) -> None:
        if not self.head_beta >= 1.0:
            raise ValueError(f"head_beta must be >= 1 (each head keeps at least s - s // head_beta), "
                             f"got {self.head_beta!r}")

    def selected_per_head(self, scores, selected, layer_idx, model, protected=0):
        return list(_plan(self.head_scores, model, scores.shape[0], selected, scores.shape[1],
                          self.head_beta)[layer_idx])

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        from pyramidkv.allocation.head_tables import default_head_scores_path

        if self.head_scores is not None or model is None or not model.name:
            return {}
        path = default_head_scores_path(model.name)
        return {f"head_scores=packaged {path.name}": str(path)}

    def check_model(self, model: ModelShape) -> None:
        """Load and check the table now (a missing or misshapen table fails before any prompt runs)."""
        _table(self.head_scores, model)
