"""MiniCache's cross-layer merging (Liu et al., NeurIPS 2024): one SLERP for two layers' K/V, and which layers pair.

For a pair of adjacent layers (l - 1, l), per token and stored head, separately for keys and values
(x = k or v, lower = layer l - 1, upper = layer l):

    mu_lower = |x_lower|, mu_upper = |x_upper|, u = x / mu,   Omega = arccos(u_lower . u_upper)
    e = sin((1 - t) Omega) / sin(Omega) u_lower + sin(t Omega) / sin(Omega) u_upper      (SLERP)

stored as one direction e (unit length) and the two magnitudes; restoring gives mu_lower e and mu_upper e.
When sin(Omega) is ~0 the SLERP limit (1 - t) u_lower + t u_upper is used, renormalised. The angular
distance d = Omega / pi ranks the token pairs for retention: per segment the ceil(retain x n) prompt
tokens with the largest d (ties: the later token) keep their original vectors for both layers; a
generated token is kept when its d exceeds every merged prompt token's d (never with retain 0).
"""

from __future__ import annotations

import math

import torch

# Below this sin(Omega) the two unit vectors are treated as parallel (the SLERP limit, a plain lerp).
PARALLEL = 1e-6


def merge_pair(lower: torch.Tensor, upper: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lower, upper: [T, D] one tensor (keys or values) of the two layers at the same tokens.

    Returns (direction [T, D] unit, magnitudes [T, 2] (lower, upper), distance [T] = Omega / pi), computed in
    float64 and returned in the input dtype (the distance in float64)."""
    lo, up = lower.double(), upper.double()
    mu_lo, mu_up = lo.norm(dim=-1, keepdim=True), up.norm(dim=-1, keepdim=True)
    u_lo = lo / mu_lo.clamp_min(torch.finfo(torch.float64).tiny)
    u_up = up / mu_up.clamp_min(torch.finfo(torch.float64).tiny)
    cos = (u_lo * u_up).sum(dim=-1, keepdim=True).clamp(-1.0, 1.0)
    omega = torch.arccos(cos)
    sin = torch.sin(omega)
    parallel = sin < PARALLEL
    safe = torch.where(parallel, torch.ones_like(sin), sin)
    slerp = torch.sin((1 - t) * omega) / safe * u_lo + torch.sin(t * omega) / safe * u_up
    direction = torch.where(parallel, (1 - t) * u_lo + t * u_up, slerp)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return (direction.to(lower.dtype), torch.cat([mu_lo, mu_up], dim=-1).to(lower.dtype), omega[:, 0] / math.pi)


def retained_tokens(distance: torch.Tensor, retain: float) -> tuple[torch.Tensor, float]:
    """distance [n] of one segment's prompt tokens -> (indices of the ceil(retain n) largest, ascending;
    ties to the later token; the threshold a generated token's distance must exceed to be kept)."""
    n = distance.shape[0]
    count = min(n, math.ceil(retain * n - 1e-9)) if retain > 0 else 0
    order = torch.sort(distance.flip(0), descending=True, stable=True).indices
    kept = (n - 1 - order[:count]).sort().values
    if count == 0:
        return kept, math.inf
    if count == n:
        return kept, -math.inf
    return kept, float(distance[n - 1 - order[count:]].max())


def layer_pairs(start: int | None, num_layers: int) -> dict[int, int]:
    """lower layer -> upper layer of every merged pair: (start, start + 1), (start + 2, start + 3), ... while
    the upper layer exists; start None = num_layers // 2 (the paper merges from the middle up)."""
    first = num_layers // 2 if start is None else start
    return {lower: lower + 1 for lower in range(first, num_layers - 1, 2)}
