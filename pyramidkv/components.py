"""The settings base of every unit of pyramidkv: methods, allocators, merge rules and quantizers.

A unit is a frozen dataclass whose fields are its settings, with their defaults there and nowhere
else. When a unit is built its settings are checked by type (the field annotations: `True` is not
an integer, `"0.5"` is not a number) and by range (`validate`, written by the unit). `describe()`
is what run_meta.json records, `label()` what a run-folder name shows, `changed_settings()` the
settings that differ from the defaults; units nested in a unit (a method's allocators) are
described and labelled by their own `describe()` / `label()`.

This module imports nothing of pyramidkv (floor 0 of the layering in docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import ClassVar


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type (a ValueError too, so callers catching bad settings catch it)."""


def _type_error(owner: str, setting: str, value, expected: str) -> SettingTypeError:
    return SettingTypeError(f"{owner}: {setting} must be {expected}, got {value!r} ({type(value).__name__})")


def check_setting_type(owner: str, setting: str, value, annotation) -> None:
    """Check one setting against its annotation: int (not bool), float (finite, int allowed), str,
    bool, a class (an instance of it), or Optional[...] of those. Raises SettingTypeError naming
    the owner, the setting and the value."""
    if typing.get_origin(annotation) is typing.Union:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return
        annotation = options[0]
    if annotation is bool:
        if not isinstance(value, bool):
            raise _type_error(owner, setting, value, "True or False")
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(owner, setting, value, "an integer")
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _type_error(owner, setting, value, "a finite number")
    elif annotation is str:
        if not isinstance(value, str):
            raise _type_error(owner, setting, value, "a string")
    elif isinstance(annotation, type) and not isinstance(value, annotation):
        raise _type_error(owner, setting, value, f"a {annotation.__name__}")


def _text(value) -> str:
    """A setting as a folder name shows it: floats with :g, no '/' and no spaces."""
    if isinstance(value, Component):
        return value.label()
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text.replace("/", "-").replace(" ", "")


@dataclass(frozen=True)
class Component:
    name: ClassVar[str] = ""
    # The key under which describe() records the name ("method" for methods, as run_meta.json has it).
    kind_key: ClassVar[str] = "name"
    # label() joins the name and the changed settings with this ("adakv-floor_ratio=0.5",
    # "snapkv_window_size=8").
    label_separator: ClassVar[str] = "-"
    # Settings label() leaves out (a method's budget is its own part of the folder name).
    unlabelled: ClassVar[tuple[str, ...]] = ()
    # How errors name a setting, where the command line knows it by another name.
    setting_labels: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            check_setting_type(self.name or type(self).__name__, self.setting_labels.get(f.name, f.name),
                               getattr(self, f.name), hints[f.name])
        self.validate()

    def validate(self) -> None:
        """Range checks; raise ValueError naming the setting, the value and what is allowed."""

    def describe(self) -> dict:
        """The full configuration: the name and every setting (nested units as their own describe())."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {self.kind_key: self.name,
                **{k: v.describe() if isinstance(v, Component) else v for k, v in settings.items()}}

    def changed_settings(self) -> list[tuple[str, object]]:
        """(setting, value) for every setting that differs from its default, in field order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]

    def label(self) -> str:
        """The name plus every changed setting, for folder names: adakv-floor_ratio=0.5,
        snapkv_window_size=8_pooling=avg. A nested unit of its default kind shows just its changed
        settings (pyramidkv_beta=10); one of another kind its label (head_allocation=adakv-floor_ratio=0.3)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        parts = [self.name]
        for setting, value in self.changed_settings():
            if setting in self.unlabelled:
                continue
            if isinstance(value, Component) and type(value) is type(defaults[setting]):
                parts.extend(f"{name}={_text(v)}" for name, v in value.changed_settings())
            else:
                parts.append(f"{setting}={_text(value)}")
        return self.label_separator.join(parts)
