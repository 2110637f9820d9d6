"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference"): SnapKV scoring with each layer's budget split unevenly across its heads
(`head_allocation="adakv"`: a global top-k over the layer's heads blended with a uniform floor,
`floor_ratio` 0.2). AdaKV's code averages the window rows where SnapKV sums them; both rank tokens,
within a head and across heads, identically. `ada_pyramidkv` puts the same split inside PyramidKV's
per-layer budgets, as the AdaKV repository offers.
"""

from dataclasses import dataclass

from pyramidkv.allocation.adakv import AdaKVHeads
from pyramidkv.allocation.base import HeadAllocation, LayerAllocation
from pyramidkv.allocation.pyramid import PyramidLayers
from pyramidkv.methods.snapkv import SnapKV


@dataclass(frozen=True)
class AdaKV(SnapKV):
    name = "adakv"
    head_allocation: HeadAllocation = AdaKVHeads()


@dataclass(frozen=True)
class AdaPyramidKV(SnapKV):
    """AdaKV inside PyramidKV's per-layer budgets (the AdaKV repository's "Ada-PyramidKV")."""

    name = "ada_pyramidkv"
    head_allocation: HeadAllocation = AdaKVHeads()
    layer_allocation: LayerAllocation = PyramidLayers()
