"""CaM merging (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference").

An evicted token's value is merged into the kept tokens that follow it, with a probability set by
its attention relative to the cache's most attended tokens. With a = the observation window's
mean attention to each prompt token (per head), for an evicted token e at position >= ceil(r n)
(r = start_budget_ratio; earlier tokens are CaM's start tokens, never merged):
    p_e = clamp(a_e / max(a over the first ceil(r n) tokens and the window), 0, 1)
and each of the next m = merge_budget KEPT tokens after e receives m_e v_e / m, where
m_e = p_e (the expected merge: deterministic, the default) or m_e ~ Bernoulli(p_e) drawn from a
generator seeded by `seed` and the layer (`sampling=True`; reproducible run to run).
Keys are unchanged.

Against the public harness's CAM: the merge is vectorised (prefix sums over kept tokens, no loop
over positions), covers every prompt of a batch, is seeded, and goes only into tokens that are
kept (the harness adds into the next m positions, then drops most of them).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.merging.base import MergeGroup, MergeRule

SEED_LIMIT = 1 << 64


@dataclass(frozen=True)
class CamMerge(MergeRule):
    """CaM's merge rule.

    start_budget_ratio: share of the prompt's first tokens used as CaM's reference and never merged,
        in [0, 1).
    merge_budget: kept tokens each evicted value is spread over (none: the method's window size).
    sampling: draw each merge (Bernoulli) instead of merging its expectation.
    seed: seed of the draws, only with sampling; an integer in [0, 2**64).
    """

    name = "cam"
    only_with = {"seed": "sampling"}
    needs_attention = True
    start_budget_ratio: float = 0.1
    merge_budget: Optional[int] = None   # None: the method's window_size (the public harness's choice)
    sampling: bool = False
    seed: int = 0

    def validate(self) -> None:
        if not 0.0 <= self.start_budget_ratio < 1.0:
            raise ValueError(f"start_budget_ratio must be in [0, 1), got {self.start_budget_ratio!r}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64) (a torch generator seed), got {self.seed!r}")
        if self.merge_budget is not None and self.merge_budget < 1:
            raise ValueError(f"merge_budget must be an integer >= 1 (kept tokens each evicted value is spread "
                             f"over), got {self.merge_budget!r}")

    def check_method(self, method) -> None:
        if method.window_size < 1:
            raise ValueError(f"cam merging reads the observation window's attention, so {method.name} needs "
                             f"window_size >= 1 (--window_sizes), got window_size={method.window_size}")

    def seed_for(self, layer_idx: int) -> Optional[int]:
        # Reduced to 64 bits, the range torch seeds take (the same seed as before for seeds below 2**44).
        return (self.seed * 1_000_003 + layer_idx) % SEED_LIMIT if self.sampling else None

    def merge(self, group: MergeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        attention = group.attention.float()  # [H, n]
        heads, n = attention.shape
        k, dim = group.kept_values.shape[1], group.kept_values.shape[2]
        start = math.ceil(self.start_budget_ratio * n)  # CaM's start tokens: [0, start)
        window = min(group.window_size, n)
        reference = torch.cat([attention[:, :start], attention[:, n - window:]], dim=-1).amax(dim=-1)  # [H]
        evicted_attention = attention.gather(1, group.evicted_positions)  # [H, e]
        probability = torch.nan_to_num(evicted_attention / reference[:, None], nan=0.0, posinf=1.0, neginf=0.0)
        probability = probability.clamp(0.0, 1.0)
        if self.sampling:
            probability = torch.bernoulli(probability, generator=group.generator)
        probability = torch.where(group.evicted_positions >= start, probability, torch.zeros_like(probability))
        spread = self.merge_budget or group.window_size
        # The first kept token after each evicted one; it and the next spread - 1 kept tokens receive
        # p v / spread. A difference array over kept slots, summed cumulatively, adds it to all of them.
        first = torch.searchsorted(group.kept_positions, group.evicted_positions, right=True)  # [H, e]
        last = (first + spread).clamp(max=k)
        share = group.evicted_values.float() * (probability / spread)[..., None]  # [H, e, D]
        delta = torch.zeros(heads, k + 1, dim, dtype=torch.float32, device=share.device)
        delta.scatter_add_(1, first[..., None].expand(-1, -1, dim), share)
        delta.scatter_add_(1, last[..., None].expand(-1, -1, dim), -share)
        added = delta.cumsum(dim=1)[:, :k]
        received = (probability > 0).float()
        hits = torch.zeros(heads, k + 1, dtype=torch.float32, device=share.device)
        hits.scatter_add_(1, first, received).scatter_add_(1, last, -received)
        touched = hits.cumsum(dim=1)[:, :k] > 0.5
        merged = (group.kept_values.float() + added).to(group.kept_values.dtype)
        return group.kept_keys, torch.where(touched[..., None], merged, group.kept_values)
