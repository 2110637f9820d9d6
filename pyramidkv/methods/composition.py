"""What a method's units can compose with: each capability's own checks and declared conflicts, then the layer
store the units name (`store_kind`) and the abilities they need of it (pyramidkv/core/store.py). Every refusal
is one line naming both settings and why; nothing here is a hand-written pair of axes."""

from __future__ import annotations

import dataclasses

from pyramidkv.capabilities.base import shown
from pyramidkv.core.store_kinds import STORES, store_abilities, store_kind

# What each store ability means, for refusals.
ABILITY_TEXT = {"reselect": "re-select while decoding", "attention_statistics": "keep decode-time attention statistics"}


def refused_unit(method, setting: str):
    """The unit behind a setting of `Method.refuses`: an axis field's value, or the capability whose switch it is."""
    if setting in {f.name for f in dataclasses.fields(method)}:
        return getattr(method, setting)
    axis = next((axis for axis, cls in method.flat_units.items() if cls.switch == setting), None)
    if axis is None:
        raise ValueError(f"{method.name}.refuses names {setting!r}, neither a method field nor a capability's switch")
    return getattr(method, axis)


def check_refused(method) -> None:
    """ValueError (one line) if a setting the method declares it does not combine with (`refuses`) is on."""
    for setting, why in method.refuses.items():
        if refused_unit(method, setting) is not None:
            raise ValueError(f"{method.name} does not combine with {setting} ({why}); leave {setting} out")


def check_units(method) -> None:
    """ValueError (one line) if the method's units cannot compose."""
    check_refused(method)
    for unit in method.capabilities:
        unit.check_with(method)
        for conflict in unit.conflicts:
            if conflict.applies(method):
                raise ValueError(f"{unit.title} does not combine with {conflict.setting}="
                                 f"{shown(method.setting(conflict.setting))} ({conflict.why.format(m=method)}); use one of them")
    namers = [(name, unit) for name, unit in method.held_units() if getattr(unit, "store_kind", None)]
    if len(namers) > 1:
        (_, first), (second, other) = namers[:2]
        raise ValueError(f"{first.title} does not combine with {second}={shown(method.setting(second))} ({first.title} "
                         f"keeps the layer in the {first.store_kind} store, {second} in the {other.store_kind} store); "
                         f"use one of them")
    kind = store_kind(method)
    for ability in store_abilities(method):
        if ability not in STORES[kind].abilities:
            asker = method.decode.title if method.decode is not None else method.name
            setting = namers[0][0]
            raise ValueError(f"{asker} does not combine with {setting}={shown(method.setting(setting))}: the {kind} "
                             f"store it needs cannot {ABILITY_TEXT[ability]}; use one of them")


def check_nothing_evicted(method) -> None:
    """A method that keeps every prompt token has no window to protect and no scores to reduce over a query group:
    those settings would only rename the run. (gqa_layout stays: query_head stores K/V per query head, the
    published baselines' memory, and Quest's pages are then chosen per query head's copy.)"""
    defaults = {f.name: f.default for f in dataclasses.fields(method)}
    for setting in ("window_size", "gqa_reduce"):
        if getattr(method, setting) != defaults[setting]:
            raise ValueError(f"{method.name} keeps every prompt token, so {setting} has no effect (it only shapes which "
                             f"tokens an evicting method keeps); got {setting}={getattr(method, setting)!r}, leave it out")


def check_allocation(method) -> None:
    """ValueError (one line) if a head allocation that spans every layer is beside a layer allocation. (What a
    sizing cannot compose with is its own table: pyramidkv/sizing.)"""
    heads = method.head_allocation
    if heads.global_over_layers and method.layer_allocation.name != "uniform":
        raise ValueError(f"head_allocation={heads.name!r} decides every layer's tokens itself; it cannot be combined "
                         f"with layer_allocation={method.layer_allocation.name!r} (use layer_allocation='uniform')")
