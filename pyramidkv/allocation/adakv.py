"""AdaKV's head allocation (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive
Budget Allocation for Efficient LLM Inference").

Per layer, with base = selected tokens per head and H stored heads:
  1. c_h = how many of the layer's top H x base candidate scores (over all heads at once) belong to
     head h (optionally each head's scores first scaled by sum(its top base) / sum(all), `normalize`);
  2. safeguard: head h gets floor_ratio x base + (1 - floor_ratio) x c_h (the paper's alpha blend;
     floor_ratio = 1 is uniform, 0 the pure global top-k).
The public code rounds each head on its own, so the layer total drifts from H x base; here the
shares are apportioned by largest remainder: the layer keeps exactly H x base selected tokens, each
head at least floor(floor_ratio x base). Ties in the global top-k: higher score, then the more
recent position, then the lower head index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pyramidkv.allocation.base import HeadAllocation, apportion


def global_topk_counts(scores: torch.Tensor, k: int) -> list[int]:
    """How many of the k best entries of scores [H, m] fall in each head (ties: recent position, then lower head)."""
    heads, m = scores.shape
    # Row r of `arranged` is position m-1-r, so a stable descending sort puts later positions, then lower
    # heads, first among equal scores.
    arranged = scores.flip(-1).transpose(0, 1).reshape(-1)          # [m * H]
    order = torch.sort(arranged, descending=True, stable=True).indices[:k]
    return torch.bincount(order % heads, minlength=heads).tolist()


@dataclass(frozen=True)
class AdaKVHeads(HeadAllocation):
    """AdaKV's split of a layer's budget over its heads.

    floor_ratio: the share of its uniform budget every head keeps at least, in [0, 1] (the paper's
        alpha; 1 = uniform).
    normalize: scale each head's scores by its top-budget mass before the global top-k.
    safeguard: how the floor is given: blend (the paper's alpha blend, above) or first (kvpress's AdaKVPress:
        each head keeps its best max(1, floor(floor_ratio x its whole budget)) first, its window and sinks
        among them, then the layer's best of the rest over all heads, up to H x base).
    """

    name = "adakv"
    floor_ratio: float = 0.2
    normalize: bool = False
    safeguard: str = "blend"

    def validate(self) -> None:
        if not 0.0 <= self.floor_ratio <= 1.0:
            raise ValueError(f"floor_ratio (--floor) must be in [0, 1] (the share of each head's uniform budget it "
                             f"keeps at least), got {self.floor_ratio!r}")
        if self.safeguard not in ("blend", "first"):
            raise ValueError(f"safeguard must be blend or first, got {self.safeguard!r}")

    def selected_per_head(self, scores, selected, layer_idx, model, protected=0):
        heads, candidates = scores.shape
        scores = scores.float()
        if self.normalize:
            top = scores.topk(min(selected, candidates), dim=-1).values.sum(-1, keepdim=True)
            total = scores.sum(-1, keepdim=True)
            scores = scores * torch.where(total > 0, top / total, torch.ones_like(total))
        if self.safeguard == "first":   # each head's best first (the protected among them), then the layer's best
            whole = selected + protected
            first = min(max(0, max(1, math.floor(self.floor_ratio * whole + 1e-9)) - protected), selected, candidates)
            rest = scores.sort(dim=-1, descending=True).values[:, first:]   # [H, candidates - first]
            return [first + c for c in global_topk_counts(rest, heads * (selected - first))]
        counts = global_topk_counts(scores, heads * selected)
        floor = self.floor_ratio * selected
        exact = [floor + (1 - self.floor_ratio) * c for c in counts]
        return apportion(exact, heads * selected, [math.floor(floor)] * heads, [candidates] * heads)
