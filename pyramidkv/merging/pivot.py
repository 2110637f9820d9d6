"""Pivot merging (the public PyramidKV harness's `--merge pivot`, after LOOK-M, Wan et al. 2024).

Each evicted token goes to the kept token whose key is most cosine-similar; the pair's average
(evicted + kept) / 2 is formed for keys AND values, and the kept slot stores the mean of itself
and every pair routed to it: kept_j <- (r_j + sum_i (d_i + r_j) / 2) / (1 + c_j), c_j the number
of evicted tokens routed to j. Keys change, so a merged key mixes RoPE phases of several positions,
as in the public code.
"""

from dataclasses import dataclass

import torch

from pyramidkv.merging.base import MergeGroup, MergeRule, most_similar_kept, weighted_fold


@dataclass(frozen=True)
class PivotMerge(MergeRule):
    name = "pivot"

    def merge(self, group: MergeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        _, target = most_similar_kept(group.evicted_keys, group.kept_keys)  # [H, e]
        weight = torch.ones(target.shape, dtype=torch.float32, device=target.device)
        out = []
        for kept, evicted in ((group.kept_keys, group.evicted_keys), (group.kept_values, group.evicted_values)):
            index = target[..., None].expand(-1, -1, kept.shape[-1])
            pairs = (evicted.float() + kept.float().gather(1, index)) / 2  # [H, e, D]
            out.append(weighted_fold(kept, pairs, target, weight))
        return out[0], out[1]
