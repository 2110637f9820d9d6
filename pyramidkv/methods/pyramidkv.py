"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

SnapKV scoring with budgets that shrink linearly with depth (`layer_allocation="pyramid"`, see
pyramidkv/allocation/pyramid.py): with s = budget - window_size selected tokens per layer on
average, min = s / beta, max = 2 s - min, linear from layer 0 to L-1; on a prompt of n tokens max is
capped at n - window_size (min = 2 s - max) and a prompt shorter than 2 s gets uniform budgets, as
in the public code. The total over layers is exactly L * s (the public harness overshoots by 9.8%
at budget 128 on 30 layers).
"""

from dataclasses import dataclass

from pyramidkv.allocation.base import LayerAllocation
from pyramidkv.allocation.pyramid import PyramidLayers
from pyramidkv.methods.snapkv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    layer_allocation: LayerAllocation = PyramidLayers()
