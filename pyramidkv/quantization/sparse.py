"""Sparse outliers: the largest-magnitude entries of a vector, kept exactly (fp16) with their index.

Count: k = ceil(fraction * n) entries of a vector of n (fraction * n is first rounded to 6 decimals,
so 0.07 of 100 is 7, not 8); fraction 0 keeps none. Ties in magnitude: the lower index first.
"""

from __future__ import annotations

import math

import torch


def outlier_count(fraction: float, n: int) -> int:
    return min(n, math.ceil(round(fraction * n, 6)))


def top_magnitude(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., n] -> (index int64 [..., k] in descending magnitude, mask bool [..., n] True at them)."""
    order = torch.sort(-x.float().abs(), dim=-1, stable=True).indices[..., :k]
    mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    mask.scatter_(-1, order, True)
    return order, mask
