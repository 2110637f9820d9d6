"""Weighted merging (the public PyramidKV harness's `--merge weighted`, KVMerger-style).

Each evicted token d_i goes to the kept token whose key is most cosine-similar (cos_i) with
weight w_i = (cos_i + 1) / 2 in [0, 1]; for keys and values alike
kept_j <- (r_j + sum_{i -> j} w_i d_i) / (1 + sum_{i -> j} w_i).
"""

from dataclasses import dataclass

import torch

from pyramidkv.merging.base import MergeGroup, MergeRule, most_similar_kept, weighted_fold


@dataclass(frozen=True)
class WeightedMerge(MergeRule):
    name = "weighted"

    def merge(self, group: MergeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        similarity, target = most_similar_kept(group.evicted_keys, group.kept_keys)  # [H, e]
        weight = (similarity + 1) / 2
        return (weighted_fold(group.kept_keys, group.evicted_keys, target, weight),
                weighted_fold(group.kept_values, group.evicted_values, target, weight))
