"""ZigZagKV (Zhong et al., COLING 2025, arXiv 2412.09036): SnapKV scoring with per-layer budgets from
each layer's uncertainty (LMBA: the fewest tokens holding `attention_threshold` 0.9 of a head's score
mass), each layer guaranteed `b_bound_ratio` 0.2 of the uniform budget (`layer_allocation="zigzag"`).
Budgets are known only once every layer is scored, so the full K/V of each layer is held until the
end of prefill (the paper's order).
"""

from dataclasses import dataclass

from pyramidkv.allocation.base import LayerAllocation
from pyramidkv.allocation.zigzag import ZigZagLayers
from pyramidkv.methods.snapkv import SnapKV


@dataclass(frozen=True)
class ZigZagKV(SnapKV):
    name = "zigzagkv"
    layer_allocation: LayerAllocation = ZigZagLayers()
