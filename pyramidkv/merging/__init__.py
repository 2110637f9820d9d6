"""Merging, the third axis of a method (after scoring and budget allocation): what happens to the
tokens a head evicts. `merge=None` drops them (plain eviction); a merge rule folds them into the
kept tokens: pivot | weighted (the public harness), mergingpress (merge-on-evict, values only),
cam (CaM). `make_method("snapkv", budget=128, merge="mergingpress", merge_fraction=0.75)`.
"""

from __future__ import annotations

from pyramidkv.merging.base import MergeGroup, MergeRule, merge_prompt
from pyramidkv.merging.cam import CamMerge
from pyramidkv.merging.mergingpress import MergingPress
from pyramidkv.merging.pivot import PivotMerge
from pyramidkv.merging.weighted import WeightedMerge

MERGE_RULES: dict[str, type[MergeRule]] = {cls.name: cls for cls in (PivotMerge, WeightedMerge, MergingPress, CamMerge)}


def make_merge_rule(name: str, **settings) -> MergeRule:
    key = name.lower() if isinstance(name, str) else name
    if key not in MERGE_RULES:
        raise ValueError(f"unknown merge rule {name!r}; choose one of: {', '.join(MERGE_RULES)}")
    return MERGE_RULES[key](**settings)


__all__ = ["MERGE_RULES", "MergeGroup", "MergeRule", "make_merge_rule", "merge_prompt", "CamMerge", "MergingPress",
           "PivotMerge", "WeightedMerge"]
