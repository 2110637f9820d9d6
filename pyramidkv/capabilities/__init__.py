"""Capability units: the axes of a method besides scoring, allocation, merging, quantization and sparse
prefill. Each axis is one method field holding a flat unit (None: off): the selection rule's knobs, a decode
budget, Quest's page selection, ThinK's key channels, MiniCache's layer sharing.
"""

from __future__ import annotations

from pyramidkv.capabilities.base import Capability, Conflict
from pyramidkv.capabilities.channels import ThinKChannels
from pyramidkv.capabilities.decode import DecodeBudget
from pyramidkv.capabilities.pages import PAGE_SELECTIONS, QuestPages
from pyramidkv.capabilities.selection import Selection
from pyramidkv.capabilities.sharing import MiniCacheSharing

# axis (the method field) -> {unit name: class}
CAPABILITIES: dict[str, dict[str, type[Capability]]] = {
    cls.axis: {cls.name: cls} for cls in (Selection, DecodeBudget, ThinKChannels, QuestPages, MiniCacheSharing)
}


def capability_class(axis: str) -> type[Capability]:
    """The first unit of an axis (what a method's flat settings name when the axis is off)."""
    return next(iter(CAPABILITIES[axis].values()))


def make_capability(axis: str, name: str, **settings) -> Capability:
    table = CAPABILITIES[axis]
    key = name.lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"unknown {axis} {name!r}; choose one of: {', '.join(table)}")
    return table[key](**settings)


__all__ = ["CAPABILITIES", "Capability", "Conflict", "DecodeBudget", "MiniCacheSharing", "PAGE_SELECTIONS",
           "QuestPages", "Selection", "ThinKChannels", "capability_class", "make_capability"]
