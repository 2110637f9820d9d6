"""Sizings: how many tokens each head of a method keeps (sizing/base.py), one kind per file. A spec chooses the
kind by the setting it gives: budget -> tokens, budget_ratio -> ratio, threshold / threshold_decoding ->
threshold; a method that keeps everything has keep_all."""

from __future__ import annotations

import dataclasses

from pyramidkv.components import SettingTypeError
from pyramidkv.sizing.base import RECORDED, Sizing
from pyramidkv.sizing.keep_all import KeepAll, budget_reader
from pyramidkv.sizing.ratio import Ratio
from pyramidkv.sizing.threshold import LOWEST_SCORE, Threshold
from pyramidkv.sizing.tokens import Tokens

SIZINGS: dict[str, type[Sizing]] = {cls.name: cls for cls in (Tokens, Ratio, Threshold, KeepAll)}
# The settings of every kind (budget, budget_ratio, threshold, threshold_decoding) -> the kind each chooses.
SIZING_SETTINGS = {f.name: name for name, cls in SIZINGS.items() for f in dataclasses.fields(cls)}


def make_sizing(name: str, **settings) -> Sizing:
    key = name.lower() if isinstance(name, str) else name
    if key not in SIZINGS:
        raise ValueError(f"unknown sizing {name!r}; choose one of: {', '.join(SIZINGS)}")
    return SIZINGS[key](**settings)


def choose_sizing(current, given: dict, label=None, owner: str = "") -> Sizing:
    """The sizing the settings `given` ({budget: 128}) make of a method's `current` one (a Sizing or a kind's name):
    the kind they name, over the current one where it is that kind. ValueError (one line) for two kinds at once; a
    setting of the wrong type is named as the method's (`owner`: snapkv: budget ... must be an integer)."""
    label = label or (lambda name: name)
    current = make_sizing(current) if isinstance(current, str) else current
    if not given:
        return current
    kinds = {SIZING_SETTINGS[name] for name in given}
    if len(kinds) > 1:
        if "threshold" in kinds:
            budget = next(k for k in given if SIZING_SETTINGS[k] != "threshold")
            raise ValueError(f"threshold eviction keeps each token whose score passes its threshold, so the budget is "
                             f"an outcome: leave out {label(budget)}, got {given[budget]!r}")
        shown = ", ".join(f"{label(k)}={v!r}" for k, v in given.items())
        raise ValueError(f"{owner or 'a method'} needs exactly one of budget (max_capacity_prompts) or budget_ratio "
                         f"(max_capacity_prompts_ratio); got {shown}")
    kind = SIZINGS[kinds.pop()]
    try:
        return dataclasses.replace(current if type(current) is kind else kind(), **given)
    except SettingTypeError as error:
        raise SettingTypeError(f"{owner or kind.name}: {str(error).partition(': ')[2]}") from None


class FlatSizing(type):
    """A method takes its sizing's settings as its own when built (SnapKV(budget=128), dataclasses.replace(m,
    budget_ratio=0.5), KVzap(threshold=-4)): they choose the sizing kind (sizing.choose_sizing), and a threshold
    leaves the head allocation uniform unless one is given (it decides each head's tokens itself)."""

    def __call__(cls, *args, **kwargs):
        given = {name: kwargs.pop(name) for name in list(kwargs) if name in SIZING_SETTINGS}
        if given:
            default = cls.__dataclass_fields__["sizing"].default
            kwargs["sizing"] = choose_sizing(kwargs.get("sizing", default), given, owner=cls.name)
            if kwargs["sizing"].outcome:
                kwargs.setdefault("head_allocation", "uniform")
        return super().__call__(*args, **kwargs)


__all__ = ["FlatSizing", "KeepAll", "LOWEST_SCORE", "RECORDED", "Ratio", "SIZINGS", "Sizing", "Threshold", "Tokens",
           "SIZING_SETTINGS", "budget_reader", "choose_sizing", "make_sizing"]
