"""Budget allocation, the second axis of a method (after scoring): how a prompt's budget is split
across layers (uniform | pyramid | zigzag) and across the heads of a layer (uniform | adakv | headkv), or
over every layer and head at once (global). (Threshold eviction has no budget to split: it is a sizing,
pyramidkv/sizing/threshold.py.)

Each allocator is a small frozen dataclass with its defaults; `make_method(..., head_allocation=
"adakv", floor_ratio=0.3)` builds one by name and routes its settings to it.
"""

from __future__ import annotations

from pyramidkv.allocation.adakv import AdaKVHeads
from pyramidkv.allocation.base import Allocation, HeadAllocation, LayerAllocation, ModelShape, apportion
from pyramidkv.allocation.global_ import GlobalHeads
from pyramidkv.allocation.headkv import HeadKVHeads
from pyramidkv.allocation.pyramid import PyramidLayers
from pyramidkv.allocation.uniform import UniformHeads, UniformLayers
from pyramidkv.allocation.zigzag import ZigZagLayers

HEAD_ALLOCATIONS: dict[str, type[HeadAllocation]] = {
    cls.name: cls for cls in (UniformHeads, AdaKVHeads, HeadKVHeads, GlobalHeads)
}
LAYER_ALLOCATIONS: dict[str, type[LayerAllocation]] = {
    cls.name: cls for cls in (UniformLayers, PyramidLayers, ZigZagLayers)
}


def _make(kind: str, table: dict, name: str, settings: dict):
    key = name.lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(table)}")
    return table[key](**settings)


def make_head_allocation(name: str, **settings) -> HeadAllocation:
    return _make("head_allocation", HEAD_ALLOCATIONS, name, settings)


def make_layer_allocation(name: str, **settings) -> LayerAllocation:
    return _make("layer_allocation", LAYER_ALLOCATIONS, name, settings)


__all__ = [
    "Allocation", "HeadAllocation", "LayerAllocation", "ModelShape", "apportion", "HEAD_ALLOCATIONS",
    "LAYER_ALLOCATIONS", "make_head_allocation", "make_layer_allocation", "UniformHeads", "UniformLayers",
    "AdaKVHeads", "HeadKVHeads", "GlobalHeads", "PyramidLayers", "ZigZagLayers",
]
