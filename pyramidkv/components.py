"""The base of every pluggable unit of a method (allocators, merge rules, quantizers).

A unit is a frozen dataclass whose fields are its settings, with their defaults there and
nowhere else. Settings are checked by type (`check_setting_types`) and range (`validate`)
when the unit is built; `describe()` is what run_meta.json records and `label()` what an
output folder name shows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Component:
    name: ClassVar[str] = ""

    def describe(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}

    def changed_settings(self) -> list[tuple[str, object]]:
        """(setting, value) for every setting that differs from its default, in field order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]

    def label(self) -> str:
        """The name plus every changed setting (for folder names): adakv-floor_ratio=0.5."""
        return "-".join([self.name] + [f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
                                       for name, value in self.changed_settings()])

    def validate(self) -> None:
        """Range checks; raise ValueError naming the setting, the value and what is allowed."""

    def __post_init__(self) -> None:
        from pyramidkv.methods.base import check_setting_types

        check_setting_types(self, self.name)
        self.validate()
