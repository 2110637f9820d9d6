"""Expected Attention (Devoto, Jeblick and Jégou, 2025, arXiv 2510.00636), "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution": each key scored by the attention the next queries are
expected to give it, from the prompt's own query statistics, times its value's norm.
`ada_expected_attention` is kvpress's leaderboard entry: AdaKV's head split, epsilon 1e-2.

Per layer: the mean mu and biased covariance Sigma of each query head's queries before RoPE (the first
`num_sinks` real rows left out), carried to the next `n_future_positions` positions by the mean RoPE matrix
R = mean_j R_j (mu' = R mu, Sigma' = R Sigma R^T); key i gets z_i = mu' . k_i / sqrt(D) + k_i^T Sigma' k_i / (2 D),
a softmax over the keys after the sinks (float32), and the score (p_i + epsilon) * ||v_i|| per query head, the
query group reduced by `gqa_reduce` (mean, as the authors' code). The sinks are kept in every head, inside the
budget (the authors' n_sink). docs/methods.md, "Expected Attention", has the differences from kvpress.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pyramidkv.allocation.adakv import AdaKVHeads
from pyramidkv.allocation.base import HeadAllocation
from pyramidkv.capabilities import Selection
from pyramidkv.core.context import DecodeScoreContext, ScoreContext
from pyramidkv.core.rotary import KeyRotation
from pyramidkv.core.scoring import probabilities
from pyramidkv.methods.base import Method


@functools.lru_cache(maxsize=16)
def mean_rotation(rotation: KeyRotation, first: int, count: int, dim: int, device) -> torch.Tensor:
    """[D, D] the mean of the RoPE matrices of positions first .. first + count - 1: M @ x = mean_j R_j x.
    RoPE is linear, so the rotation of the identity's rows gives each R_j transposed. Kept for the next calls
    (every layer of a prompt asks for the same; each cache has its own rotation object)."""
    positions = torch.arange(first, first + count, device=device)[:, None].expand(count, dim)   # [F, D]
    eye = torch.eye(dim, device=device).expand(count, dim, dim)
    return rotation.rotate(eye, positions).mean(dim=0).T


def _query_rows(ctx: ScoreContext, num_sinks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(queries before RoPE [B, Hq, q, D] float32, the rows the statistics count [B, q], per prompt the position
    of the next token [B]). At prefill the prompt rows (padding and the first num_sinks real rows not counted);
    at decode the buffered recent queries, at their true positions."""
    queries = ctx.queries
    if isinstance(ctx, DecodeScoreContext):
        held = ctx.positions[0]                                     # [H, m]
        rows = held[:, held.shape[1] - queries.shape[2]:].amax(dim=0)[None]   # [1, w]: the most recent tokens
        counted = rows >= num_sinks
        upcoming = held.amax()[None] + 1
    else:
        real = ctx.real                                             # [B, n]
        rows = ctx.positions
        counted = real & (real.cumsum(dim=-1) > num_sinks)
        upcoming = rows[:, -1] + 1                                  # left padding: the last row is real
    return ctx.rotation.rotate(queries, rows[:, None], inverse=True), counted, upcoming


@dataclass(frozen=True)
class ExpectedAttention(Method):
    """Expected Attention's scorer. kvpress's n_sink is `num_sinks` (default 4): those first real tokens are
    kept, count in the budget, and are left out of the query statistics and of the softmax. No window is kept
    (window_size 0), as in kvpress.

    n_future_positions: how many positions after the prompt the mean RoPE covers (kvpress: 512).
    use_covariance: add the covariance term k^T Sigma' k / (2 D) to each key's expected logit.
    use_vnorm: multiply each key's expected attention by its value's L2 norm.
    epsilon: added to the expected attention before the value norm (kvpress's default 0; 1e-2 on the
        leaderboard).
    """

    name = "expected_attention"
    needs_rotation = True
    window_size: int = 0
    selection: Selection = Selection(num_sinks=4)
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def validate(self) -> None:
        super().validate()
        if self.n_future_positions < 1:
            raise ValueError(f"n_future_positions must be an integer >= 1 (positions after the prompt the mean "
                             f"RoPE covers), got {self.n_future_positions!r}")
        if not self.epsilon >= 0.0:
            raise ValueError(f"epsilon must be a number >= 0 (added to the expected attention), "
                             f"got {self.epsilon!r}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.rotation is None:
            raise ValueError(f"{self.name} needs the model's RoPE (ScoreContext.rotation): score through a cache "
                             f"made by pyramidkv.compress")
        keys = ctx.keys.float()                                        # [B, H, m, D]
        bsz, heads, m, dim = keys.shape
        group = ctx.queries.shape[1] // heads
        queries, counted, upcoming = _query_rows(ctx, self.selection.num_sinks)
        weights = counted[:, None, :, None].float()                    # [B, 1, q, 1]
        total = weights.sum(dim=2).clamp(min=1.0)                       # [B, 1, 1]
        mean = (queries * weights).sum(dim=2) / total                   # [B, Hq, D]
        rotations = torch.stack([mean_rotation(ctx.rotation, int(first), self.n_future_positions, dim, keys.device)
                                 for first in upcoming])                # [B, D, D]
        future_mean = torch.einsum("bde,bhe->bhd", rotations, mean).view(bsz, heads, group, dim)
        logits = torch.einsum("bknd,bkgd->bkgn", keys, future_mean) / dim ** 0.5       # [B, H, g, m]
        if self.use_covariance:
            centred = (queries - mean[:, :, None]) * weights
            covariance = centred.transpose(-1, -2) @ centred / total[..., None]       # [B, Hq, D, D]
            future = rotations[:, None] @ covariance @ rotations[:, None].transpose(-1, -2)
            future = future.view(bsz, heads, group, dim, dim)
            logits = logits + torch.einsum("bknd,bkgde,bkne->bkgn", keys, future, keys) / (2 * dim)
        real = ctx.real if ctx.real.dim() == 3 else ctx.real[:, None]  # [B, 1 or H, m]
        scored = real & (real.cumsum(dim=-1) > self.selection.num_sinks)
        expected = probabilities(logits, scored[:, :, None]) + self.epsilon
        if self.use_vnorm:
            expected = expected * ctx.values.float().norm(dim=-1)[:, :, None]
        return expected.masked_fill(~scored[:, :, None], 0.0).reshape(bsz, heads * group, m)   # [B, Hq, m]


@dataclass(frozen=True)
class AdaExpectedAttention(ExpectedAttention):
    """The kvpress leaderboard's `expected_attention`: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)), AdaKV's
    split with kvpress's safeguard (each head's best 20% first)."""

    name = "ada_expected_attention"
    head_allocation: HeadAllocation = AdaKVHeads(safeguard="first")
    epsilon: float = 0.01
