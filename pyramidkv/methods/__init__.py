"""The method registry: one table drives the CLI, the tests and the docs."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.adakv import AdaKV, AdaPyramidKV
from pyramidkv.methods.base import Method
from pyramidkv.methods.expected_attention import AdaExpectedAttention, ExpectedAttention
from pyramidkv.methods.cam import CAM
from pyramidkv.methods.duo_attention import DuoAttention
from pyramidkv.methods.fullkv import FullKV
from pyramidkv.methods.h2o import H2O
from pyramidkv.methods.headkv import HeadKV
from pyramidkv.methods.keydiff import KeyDiff
from pyramidkv.methods.kvzap import KVzap
from pyramidkv.methods.kvzip import KVzip
from pyramidkv.methods.kvzip_head import KVzipHead
from pyramidkv.methods.l2norm import L2Norm
from pyramidkv.methods.minference import MInferenceMethod
from pyramidkv.methods.minicache import MiniCache
from pyramidkv.methods.nacl import NACL
from pyramidkv.methods.pyramidkv import PyramidKV
from pyramidkv.methods.qfilter import QFilter
from pyramidkv.methods.quest import Quest
from pyramidkv.methods.rkv import RKV
from pyramidkv.methods.scissorhands import Scissorhands
from pyramidkv.methods.settings import (budget_flag_applies, build_method, method_from_spec, method_spec, sizing_of,
                                        split_spec)
from pyramidkv.methods.snapkv import SnapKV
from pyramidkv.methods.streamingllm import StreamingLLM
from pyramidkv.methods.think import ThinK
from pyramidkv.methods.tova import TOVA
from pyramidkv.methods.triattention import TriAttention
from pyramidkv.methods.zigzagkv import ZigZagKV

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (FullKV, StreamingLLM, H2O, SnapKV, PyramidKV, L2Norm, AdaKV, AdaPyramidKV, HeadKV,
                              ZigZagKV, CAM, ThinK, NACL, Scissorhands, RKV, Quest, MiniCache, MInferenceMethod, KVzip,
                              ExpectedAttention, AdaExpectedAttention, KeyDiff, TOVA, KVzap, DuoAttention, QFilter,
                              KVzipHead, TriAttention)
}


def method_options(name: str) -> list[str]:
    """The settings a method accepts (its dataclass fields)."""
    return [f.name for f in dataclasses.fields(get_method_class(name))]


def get_method_class(name: str) -> type[Method]:
    key = name.lower()
    if key not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[key]


def register_method(cls: type[Method]) -> type[Method]:
    """Add a method class to METHODS under its `name`, so make_method, the CLI flags and the method
    listing find it; returns the class (usable as a decorator). The class must be a frozen
    dataclass subclassing Method with a lowercase `name` that is not registered yet."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"register_method takes a subclass of pyramidkv Method, got {cls!r}")
    if "__dataclass_params__" not in vars(cls) or not cls.__dataclass_params__.frozen:  # its own decorator
        raise TypeError(f"{cls.__qualname__} must be declared with @dataclass(frozen=True)")
    name = cls.name
    if not isinstance(name, str) or not name or name != name.lower() or not name.isidentifier():
        raise ValueError(f"{cls.__qualname__}.name must be a lowercase identifier, got {name!r}")
    if name in METHODS:
        raise ValueError(f"a method named {name!r} is already registered ({METHODS[name].__qualname__}); "
                         f"choose another name")
    METHODS[name] = cls
    return cls


@functools.cache
def _behaviour(cls: type[Method]) -> tuple:
    """What a method class computes beyond its settings: every attribute its classes define that is no field
    and no name (the scorer, the budget rules, the class-level flags), by identity."""
    fields = {f.name for f in dataclasses.fields(cls)}
    names = sorted({n for klass in cls.__mro__ for n in vars(klass)
                    if not n.startswith("__") and n not in fields and n not in ("name", "validate")})
    return tuple(fields), tuple((n, id(getattr(cls, n, None))) for n in names)


def _distance(value, default) -> float:
    """How far a field is from its default: 0 equal, 0.5 a unit of the default's kind with other settings, 1."""
    if value == default:
        return 0.0
    return 0.5 if value is not None and type(value) is type(default) and dataclasses.is_dataclass(value) else 1.0


def canonical(method: Method) -> Method:
    """The method under the name that says what it computes: among the registered methods that compute the
    same as its class (same scorer and rules, only other defaults) and take its settings, the one whose fields
    differ least from its defaults (a unit of the default's kind with other settings counts half, another
    unit one; then the fewest defaults of its own class set otherwise, then the most derived class, then
    registration order). So one computation has one name, one label and one results folder: snapkv with
    layer_allocation=pyramid is pyramidkv, fullkv with cross_layer_merge=true is minicache, minicache with
    cross_layer_merge=false is fullkv, adakv with head_allocation=global is snapkv with it."""
    values = {f.name: getattr(method, f.name) for f in dataclasses.fields(method)}
    behaviour = _behaviour(type(method))
    base_defaults = {f.name: f.default for f in dataclasses.fields(Method)}
    best, best_count = method, None
    for cls in METHODS.values():
        if _behaviour(cls) != behaviour:
            continue
        if cls is type(method):
            candidate = method
        else:
            try:
                candidate = cls(**values)
            except (ValueError, TypeError):
                continue
        fields = dataclasses.fields(candidate)
        overridden = sum(f.default != base_defaults.get(f.name, f.default) and getattr(candidate, f.name) != f.default
                         for f in fields)   # a default the class chose itself, set otherwise
        count = (sum(_distance(getattr(candidate, f.name), f.default) for f in fields), overridden, -len(cls.__mro__))
        if best_count is None or count < best_count:
            best, best_count = candidate, count
    return best


def make_method(name: str, **settings) -> Method:
    """Build a method by name. Settings that the method does not have are an error, never ignored, and so are
    settings that have no effect (decode_interval without decode_budget, a merge seed without sampling).

    Settings of the method's units go to them: `make_method("h2o", budget=128, head_allocation="adakv",
    floor_ratio=0.3)` builds AdaKVHeads(floor_ratio=0.3), `make_method("snapkv", budget=128,
    merge="mergingpress", merge_fraction=0.75)` MergingPress(merge_fraction=0.75), `make_method("snapkv",
    budget=256, quant_method="kivi", nbits=4)` KIVIQuantizer(nbits=4); a unit may be given by name or as an
    object. A name units on two axes share is written with its axis (`merge_seed`, `quant_seed`) when both
    are chosen (pyramidkv/methods/settings.py).
    """
    return canonical(build_method(get_method_class(name), settings))


def parse_method_spec(spec: str, budget: Optional[int] = None, **defaults) -> Method:
    """The method a spec names: `parse_method_spec("snapkv:budget=128,merge=cam,merge_sampling=true")`.
    `budget` and `defaults` fill settings the spec leaves out (see settings.method_from_spec)."""
    name, items = split_spec(spec)
    try:
        return canonical(method_from_spec(get_method_class(name), items, budget, **defaults))
    except ValueError as e:
        raise ValueError(f"method spec {spec!r}: {e}") from None


__all__ = ["METHODS", "Method", "budget_flag_applies", "sizing_of", "ScoreContext", "make_method", "register_method", "get_method_class", "method_options",
           "parse_method_spec", "method_spec", "canonical"]
