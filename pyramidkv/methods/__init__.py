"""The method registry: one table drives the CLI, the tests and the docs."""

from __future__ import annotations

import dataclasses

from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.adakv import AdaKV, AdaPyramidKV
from pyramidkv.methods.base import Method
from pyramidkv.methods.cam import CAM
from pyramidkv.methods.fullkv import FullKV
from pyramidkv.methods.h2o import H2O
from pyramidkv.methods.headkv import HeadKV
from pyramidkv.methods.l2norm import L2Norm
from pyramidkv.methods.minference import MInferenceMethod
from pyramidkv.methods.minicache import MiniCache
from pyramidkv.methods.nacl import NACL
from pyramidkv.methods.pyramidkv import PyramidKV
from pyramidkv.methods.quest import Quest
from pyramidkv.methods.scissorhands import Scissorhands
from pyramidkv.methods.snapkv import SnapKV
from pyramidkv.methods.streamingllm import StreamingLLM
from pyramidkv.methods.think import ThinK
from pyramidkv.methods.zigzagkv import ZigZagKV

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (FullKV, StreamingLLM, H2O, SnapKV, PyramidKV, L2Norm, AdaKV, AdaPyramidKV, HeadKV,
                              ZigZagKV, CAM, ThinK, NACL, Scissorhands, Quest, MiniCache, MInferenceMethod)
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


def make_method(name: str, **settings) -> Method:
    """Build a method by name. Settings that the method does not have are an error, never ignored.

    Settings of the method's units go to them: `make_method("h2o", budget=128, head_allocation="adakv",
    floor_ratio=0.3)` builds AdaKVHeads(floor_ratio=0.3), `make_method("snapkv", budget=128,
    merge="mergingpress", merge_fraction=0.75)` MergingPress(merge_fraction=0.75), `make_method("snapkv",
    budget=256, quant_method="kivi", nbits=4)` KIVIQuantizer(nbits=4); a unit may be given by name or as an
    object.
    """
    from pyramidkv.allocation import make_head_allocation, make_layer_allocation
    from pyramidkv.merging import make_merge_rule
    from pyramidkv.quantization import make_quantizer
    from pyramidkv.sparse_prefill import make_sparse_prefill

    cls = get_method_class(name)
    allowed = method_options(name)
    own = {k: v for k, v in settings.items() if k in allowed}
    rest = {k: v for k, v in settings.items() if k not in allowed}
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for field, build in (("head_allocation", make_head_allocation), ("layer_allocation", make_layer_allocation),
                         ("merge", make_merge_rule), ("quant_method", make_quantizer),
                         ("prefill_attention", make_sparse_prefill)):
        chosen = own.get(field, defaults[field])
        if chosen is None:
            continue
        kind = build(chosen) if isinstance(chosen, str) else chosen
        mine = {k: rest.pop(k) for k in [k for k in rest if k in {f.name for f in dataclasses.fields(kind)}]}
        if mine:
            own[field] = dataclasses.replace(kind, **mine)
    from pyramidkv.merging import MERGE_RULES
    from pyramidkv.quantization import QUANTIZERS
    from pyramidkv.sparse_prefill import SPARSE_PREFILLS

    for key in rest:
        owners = [rule for rule, unit in MERGE_RULES.items() if key in {f.name for f in dataclasses.fields(unit)}]
        if owners and own.get("merge", defaults["merge"]) is None:
            raise ValueError(f"{key} is a setting of the merge rule {' / '.join(owners)}, but {cls.name} has no merge "
                             f"rule; choose one with merge={owners[0]!r} (--merge {owners[0]})")
        owners = [q for q, unit in QUANTIZERS.items() if key in {f.name for f in dataclasses.fields(unit)}]
        if owners and own.get("quant_method", defaults["quant_method"]) is None:
            raise ValueError(f"{key} is a setting of the quantizer {' / '.join(owners)}, but {cls.name} has no "
                             f"quant_method; choose one with quant_method={owners[0]!r} (--quant_method {owners[0]})")
        owners = [u for u, unit in SPARSE_PREFILLS.items() if key in {f.name for f in dataclasses.fields(unit)}]
        if owners and own.get("prefill_attention", defaults["prefill_attention"]) is None:
            raise ValueError(f"{key} is a setting of the prefill attention {' / '.join(owners)}, but {cls.name} has "
                             f"none; choose one with prefill_attention={owners[0]!r}")
    if rest:
        raise ValueError(f"{cls.name} has no setting {', '.join(map(repr, sorted(rest)))}; its settings are: "
                         f"{', '.join(allowed)}, plus those of its head_allocation, layer_allocation, merge "
                         f"rule, quant_method and prefill_attention ({_unit_settings_hint()})")
    return cls(**own)


def _unit_settings_hint() -> str:
    from pyramidkv.allocation import HEAD_ALLOCATIONS, LAYER_ALLOCATIONS
    from pyramidkv.merging import MERGE_RULES
    from pyramidkv.quantization import QUANTIZERS
    from pyramidkv.sparse_prefill import SPARSE_PREFILLS

    parts = []
    for table in (HEAD_ALLOCATIONS, LAYER_ALLOCATIONS, MERGE_RULES, QUANTIZERS, SPARSE_PREFILLS):
        for unit_name, unit in table.items():
            names = [f.name for f in dataclasses.fields(unit)]
            if names:
                parts.append(f"{unit_name}: {', '.join(names)}")
    return "; ".join(parts)


__all__ = ["METHODS", "Method", "ScoreContext", "make_method", "register_method", "get_method_class", "method_options"]
