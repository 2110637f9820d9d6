"""One budget across the whole model (`head_allocation="global"`): the selected tokens of a prompt are the top
scores over every layer and stored head at once, so each layer and head keeps what its scores earn, as KVzip's
one threshold over all layers, heads and positions does (Kim et al., 2025, arXiv 2505.23416).

The total is the uniform one, exactly: L x H x (budget - window - sinks) selected tokens (ties: the lower layer,
then the more recent position, then the lower head; within one layer the order of AdaKV's split). Every layer's
scores are known only after the last layer, but what is not among the best of the layers scored so far can never be
kept, so each layer holds only that while the prefill runs (`running_top`: core/running_top.py).

Scores of different layers must be comparable. `score_scale="method"` takes the scorer's own rule
(`Method.global_scale`): "raw" for scores that are attention a query gives a key (KVzip's maxima, SnapKV's
window sums, H2O's column sums), "zscore" for the others (a key norm, a cosine, a probability times a value norm):
each layer's candidate scores are standardised over all its heads and positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pyramidkv.allocation.base import HeadAllocation

SCORE_SCALES = ("method", "raw", "zscore")


def standardized(scores: torch.Tensor) -> torch.Tensor:
    """scores [H, c] of one layer, minus their mean over heads and positions, over their standard deviation
    (float64, unbiased; a layer whose scores are all equal gives zeros)."""
    values = scores.double()
    if values.numel() < 2:
        return values - values.mean() if values.numel() else values
    spread = values.std()
    centred = values - values.mean()
    return centred / spread if spread > 0 else centred


def first_of_stable_sort(values: torch.Tensor, total: int) -> torch.Tensor:
    """Bool mask [N] of the `total` entries a stable descending sort of values [N] puts first (equal values in their
    order), found by the total-th largest value instead of a sort (NaN: by the sort)."""
    chosen = torch.zeros_like(values, dtype=torch.bool)
    if total == 0:
        return chosen
    if total == values.numel() or bool(values.isnan().any()):
        chosen[torch.sort(values, descending=True, stable=True).indices[:total]] = True
        return chosen
    cut = torch.kthvalue(values, values.numel() - total + 1).values
    chosen = values > cut
    chosen[(values == cut).nonzero().squeeze(1)[: total - int(chosen.sum())]] = True
    return chosen


def global_counts(layer_scores: Sequence[torch.Tensor], total: int) -> list[list[int]]:
    """How many of the `total` best entries of every layer's scores [H, c_layer] fall in each (layer, head).
    Ties: the lower layer, then the more recent position, then the lower head."""
    arranged = [s.double().flip(-1).transpose(0, 1).reshape(-1) for s in layer_scores]   # position desc, head
    sizes = [s.numel() for s in arranged]
    if not 0 <= total <= sum(sizes):
        raise ValueError(f"cannot keep {total} of {sum(sizes)} candidates")
    chosen = first_of_stable_sort(torch.cat(arranged), total)
    counts, start = [], 0
    for scores, size in zip(layer_scores, sizes):
        counts.append(chosen[start: start + size].view(-1, scores.shape[0]).sum(0).tolist())
        start += size
    return counts


@dataclass(frozen=True)
class GlobalHeads(HeadAllocation):
    """One budget over every layer and head of the model.

    score_scale: how the layers' scores are made comparable: method (the scorer's own rule, its
        `global_scale`), raw (as scored), zscore (standardised per layer over its heads and positions).
    """

    name = "global"
    global_over_layers = True
    needs_scores = True
    running_top = True
    score_scale: str = "method"

    def validate(self) -> None:
        if self.score_scale not in SCORE_SCALES:
            raise ValueError(f"score_scale must be one of {'|'.join(SCORE_SCALES)}, got {self.score_scale!r}")

    def scale(self, method_scale: str) -> str:
        """"raw" or "zscore": the rule that applies with a scorer whose own rule is `method_scale`."""
        return method_scale if self.score_scale == "method" else self.score_scale

    def selected_over_layers(self, layer_scores: Sequence[torch.Tensor], selected: int,
                             method_scale: str = "raw") -> list[list[int]]:
        """Per layer and stored head the selected tokens; layer_scores: per layer [H, c_layer] candidate scores
        of one prompt; the total is len(layer_scores) x H x selected (every candidate where fewer exist)."""
        if self.scale(method_scale) == "zscore":
            layer_scores = [standardized(s) for s in layer_scores]
        heads = layer_scores[0].shape[0]
        total = min(len(layer_scores) * heads * selected, sum(s.numel() for s in layer_scores))
        return global_counts(layer_scores, total)

    def selected_per_head(self, scores, selected, layer_idx, model, protected=0):
        raise RuntimeError("head_allocation='global' splits the budget over all layers at once "
                           "(selected_over_layers): the prefill pipeline calls it once every layer is scored")
