"""The layer store kinds, and which one a method's units need: the unit that needs one names it (`store_kind`:
page selection -> paged, a quantizer -> quantized, layer sharing -> paired); a method whose units name none gets
full_precision."""

from __future__ import annotations

from pyramidkv.core.context import CompressionMethod
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.merged_pair import PairedLayerStore
from pyramidkv.core.paged import PagedStore
from pyramidkv.core.quantized import QuantizedStore
from pyramidkv.core.store import LayerStore

STORES: dict[str, type[LayerStore]] = {"full_precision": FullPrecisionStore, "paged": PagedStore,
                                       "quantized": QuantizedStore, "paired": PairedLayerStore}


def store_abilities(method: CompressionMethod) -> tuple[str, ...]:
    """The optional store abilities a configuration needs: its units' (a decode budget: reselect), and attention
    statistics when a decode budget re-selects by them (H2O, Scissorhands)."""
    needed = tuple(ability for unit in method.units for ability in getattr(unit, "store_abilities", ()))
    if method.decode is not None and (method.accumulates_attention or method.history_window is not None):
        needed += ("attention_statistics",)
    return needed


def store_kind(method: CompressionMethod) -> str:
    """The store kind the method's units name (the first of them; a method refuses two different ones)."""
    return next((unit.store_kind for unit in method.units if getattr(unit, "store_kind", None)), "full_precision")
