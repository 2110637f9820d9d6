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
    namers = [(name, unit) for name, unit in (("page_budget", method.pages), ("cross_layer_merge", method.layer_sharing),
                                              ("quant_method", method.quant_method)) if unit is not None]
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


def check_budget(method) -> None:
    """ValueError (one line) unless exactly one of budget and budget_ratio is set, in range, the budget holding the
    window and the sinks."""
    if (method.budget is None) == (method.budget_ratio is None):
        raise ValueError(f"{method.name} needs exactly one of budget (max_capacity_prompts) or budget_ratio "
                         f"(max_capacity_prompts_ratio); got budget={method.budget}, budget_ratio={method.budget_ratio}")
    if method.budget is not None:
        if method.budget < 1:
            raise ValueError(f"budget (max_capacity_prompts) must be an integer >= 1, got {method.budget!r}")
        if method.budget < method.protected_tokens:
            raise ValueError(f"budget (max_capacity_prompts) {method.budget} is smaller than window_size "
                             f"{method.window_size} + num_sinks {method.selection.num_sinks}; the budget includes the "
                             f"window and the sinks, so it must be >= {method.protected_tokens}")
    elif not (0.0 < method.budget_ratio <= 1.0):
        raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) must be in (0, 1], got {method.budget_ratio!r}")
    elif method.budget_ratio == 1.0 and method.decode is None:
        raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) 1 keeps every prompt token: no prompt would be "
                         f"compressed (that is fullkv); allowed: 0 < budget_ratio < 1 (1 only with a decode_budget, "
                         f"which compresses while decoding)")


def check_threshold(method, threshold) -> None:
    """ValueError (one line) unless a threshold is given on the method's scores and some score can fall below it:
    no default fits every scorer, so only a method whose own default is calibrated for its score (kvzap's) runs
    without one; a method that knows the range of its scores (`score_bounds`) refuses one outside it."""
    if threshold is None:
        raise ValueError(f"head_allocation='threshold' on {method.name} needs a threshold on {method.name}'s raw "
                         f"scores (no default fits every scorer: a token stays iff its score >= threshold); give one "
                         f"with threshold=X (--threshold X), a value inside the range of {method.name}'s scores")
    if method.score_bounds is None:
        return
    low, high = method.score_bounds
    if not low < threshold <= high:
        keeps = "every token (that is fullkv)" if threshold <= low else "no token outside the window and sinks"
        raise ValueError(f"threshold {threshold!r}: every score of {method.name} lies in [{low:g}, {high:g}], so it "
                         f"would keep {keeps}; allowed: {low:g} < threshold <= {high:g}")


def check_allocation(method) -> None:
    """ValueError (one line) if the head allocation cannot work with the method's other settings: one that spans
    every layer beside a layer allocation; threshold eviction (no budget) with a budget, a method keeping every
    token, a merge rule, or, deciding tokens while decoding, a scorer that reads more than the token or another
    decode-time rule."""
    heads = method.head_allocation
    if (heads.global_over_layers or heads.sets_budget) and method.layer_allocation.name != "uniform":
        raise ValueError(f"head_allocation={heads.name!r} decides every layer's tokens itself; it cannot be combined "
                         f"with layer_allocation={method.layer_allocation.name!r} (use layer_allocation='uniform')")
    if not heads.sets_budget:
        return
    if not method.needs_budget:
        raise ValueError(f"{method.name} keeps every token; head_allocation='threshold' evicts by score: use a scoring "
                         f"method (e.g. kvzap, snapkv) with it")
    for setting in ("budget", "budget_ratio"):
        if getattr(method, setting) is not None:
            raise ValueError(f"head_allocation='threshold' keeps each token whose score passes its threshold, so the "
                             f"budget is an outcome: leave out "
                             f"{method.setting_labels.get(setting, setting)}, got {getattr(method, setting)!r}")
    if method.merge is not None:
        raise ValueError(f"head_allocation='threshold' drops what fails its threshold; it does not combine with "
                         f"merge={method.merge.name!r}")
    if method.selection.random_fraction:
        raise ValueError(f"head_allocation='threshold' keeps exactly what passes its threshold; it does not combine "
                         f"with random_fraction={method.selection.random_fraction:g}")
    if method.layer_sharing is not None:
        raise ValueError("head_allocation='threshold' decides each layer by its own scores; it does not combine with "
                         "cross_layer_merge (a merged pair selects on the sum of two layers' scores)")
    check_threshold(method, heads.threshold)
    if not heads.threshold_decoding:
        return
    if not method.token_scores:
        raise ValueError(f"threshold_decoding decides each token when it leaves the window by the score it got on "
                         f"entering, which needs a score that reads the token alone; {method.name}'s reads other "
                         f"tokens' queries or keys: use threshold_decoding=false (decide the prompt only) or a per-token "
                         f"scorer (kvzap, qfilter, kvzip_head, duo_attention)")
    for setting, unit in (("decode_budget", method.decode), ("page_budget", method.pages),
                          ("cross_layer_merge", method.layer_sharing), ("quant_method", method.quant_method),
                          ("key_channel_ratio", method.channels)):
        if unit is not None:
            raise ValueError(f"threshold_decoding evicts tokens while decoding; it does not combine with {setting} "
                             f"(use threshold_decoding=false to decide the prompt only)")
