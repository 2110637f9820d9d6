"""The engine's seams stay narrow (issue "Capabilities become units"): a method is at most 16 settings (the
rest live on its units), methods/base.py reads in one sitting, the engine reads at most 20 names of a method,
and core reads a capability only through its unit, never a flat field of the method."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pyramidkv.core.context import CompressionMethod
from pyramidkv.methods.base import Method

PACKAGE = Path(__file__).resolve().parents[1] / "pyramidkv"


def protocol_names(protocol: type) -> list[str]:
    names = list(getattr(protocol, "__annotations__", {}))
    names += [n for n, v in vars(protocol).items() if callable(v) or isinstance(v, property)]
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


def flat_reads(text: str) -> list[str]:
    return re.findall(r"method\.(?:page_|cross_layer|key_)\w*", text)


def test_a_method_has_at_most_16_settings_and_its_base_file_260_lines():
    assert len(dataclasses.fields(Method)) <= 16, [f.name for f in dataclasses.fields(Method)]
    assert len((PACKAGE / "methods" / "base.py").read_text(encoding="utf-8").splitlines()) <= 260


def test_the_engine_reads_at_most_21_names_of_a_method():
    """20 before the sizing unit; the sizing replaced prompt_budget, and `units` lets the store kinds iterate the
    units the method holds instead of naming them."""
    names = protocol_names(CompressionMethod)
    assert "score" in names and "decode" in names     # the reader sees the protocol's names
    assert len(names) <= 21, names


def test_core_reads_no_capability_field_of_the_method():
    found = {str(p.relative_to(PACKAGE)): flat_reads(p.read_text(encoding="utf-8"))
             for p in sorted((PACKAGE / "core").glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}
    assert flat_reads("budgets = method.page_size * 2; method.pages.page_size") == ["method.page_size"]
