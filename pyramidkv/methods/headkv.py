"""HeadKV (Fu et al., 2024, "Not All Heads Matter: A Head-Level KV Cache Compression Method with
Integrated Retrieval and Reasoning"): SnapKV scoring with the budget split over every head of the
model from a head-importance table (`head_allocation="headkv"`; `head_scores` path, CLI
`--head_path`, default: the table shipped for the model, made by scripts/head_scores.py;
`head_beta` 1.01).
"""

from dataclasses import dataclass

from pyramidkv.allocation.base import HeadAllocation
from pyramidkv.allocation.headkv import HeadKVHeads
from pyramidkv.methods.snapkv import SnapKV


@dataclass(frozen=True)
class HeadKV(SnapKV):
    name = "headkv"
    head_allocation: HeadAllocation = HeadKVHeads()
