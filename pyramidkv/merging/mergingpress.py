"""Merge-on-evict (kvpress MergingPress, NVIDIA kvpress PR #219, ranking fixed in PR #287).

Values only: keys are left untouched, so RoPE phases are never mixed. Each evicted token e goes to
the kept token t whose key is most cosine-similar (sim_e, float32) and is merged only if
sim_e >= similarity_threshold. With merge_fraction f < 1, only the round(f x eligible) eligible
tokens of highest similarity merge (per head; ties: the earlier position first). Weight
w_e = max(sim_e, 0) x |v_e| / (|v_e| + |v_t| + eps);  v_t <- (v_t + sum w_e v_e) / (1 + sum w_e).
Reported (RULER-4k, Qwen3-8B, key-norm scorer): +1.1 to +6.0 points over plain eviction, the gain
growing with the compression ratio.
"""

from dataclasses import dataclass

import torch

from pyramidkv.merging.base import MergeGroup, MergeRule, most_similar_kept, weighted_fold

NORM_EPS = 1e-6


@dataclass(frozen=True)
class MergingPress(MergeRule):
    """Merge-on-evict.

    similarity_threshold: merge only evicted tokens at least this cosine-similar to their target, in
        [-1, 1].
    merge_fraction: merge only this fraction of the eligible tokens, most similar first, in (0, 1].
    """

    name = "mergingpress"
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0

    def validate(self) -> None:
        if not -1.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold must be in [-1, 1] (a cosine similarity), "
                             f"got {self.similarity_threshold!r}")
        if not 0.0 < self.merge_fraction <= 1.0:
            raise ValueError(f"merge_fraction must be in (0, 1], got {self.merge_fraction!r}")

    def merge(self, group: MergeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        similarity, target = most_similar_kept(group.evicted_keys, group.kept_keys)  # [H, e]
        eligible = similarity >= self.similarity_threshold
        if self.merge_fraction < 1.0:
            eligible = eligible & self._top_fraction(similarity, eligible)
        values = group.kept_values
        evicted_norm = group.evicted_values.float().norm(dim=-1)  # [H, e]
        target_norm = values.float().norm(dim=-1).gather(1, target)  # [H, e]
        weight = similarity.clamp(min=0) * evicted_norm / (evicted_norm + target_norm + NORM_EPS)
        weight = torch.where(eligible, weight, torch.zeros_like(weight))
        return group.kept_keys, weighted_fold(values, group.evicted_values, target, weight)

    def _top_fraction(self, similarity: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
        """bool [H, e]: per head, the round(f x eligible count) eligible tokens of highest similarity."""
        heads, e = similarity.shape
        ranked = similarity.masked_fill(~eligible, float("-inf"))
        # Stable descending sort: among equal similarities the earlier position ranks first.
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(e, device=order.device).expand(heads, e))
        quota = torch.round(eligible.sum(dim=-1).float() * self.merge_fraction).long()  # [H], half to even
        return rank < quota[:, None]
