"""What a capability unit is: a flat unit on its own axis of a method, with what it cannot compose with.

A capability (Quest's page selection, ThinK's key channels, MiniCache's layer sharing, a decode budget)
is a frozen dataclass whose fields are named as the method's own settings (`page_size`,
`key_recent_size`): a method holds it in one field (None: off) and labels and describes its settings
inline (pyramidkv/components.py, flat units). It declares

  * `store_kind`: the layer store it needs (None: any; "paged", "paired", ...). Two units naming
    different kinds cannot compose;
  * `store_abilities`: the optional store abilities it needs ("reselect", "attention_statistics");
    the method refuses a configuration whose store lacks one (pyramidkv/core/store.py);
  * `conflicts`: what else it cannot compose with, and why: a table `Method.validate` walks;
  * `check_with(method)`, `check_model(model, method)`, `check_prompt(prompt_len, method)`: its checks
    that need the whole method, the model's shape or the prompt's length. A setting whose effective
    value makes the unit a no-op, or makes it store more than the method without it, is refused there:
    the run would be filed under a label that says something it did not do;
  * `normalized(model)`: the unit with a setting given at what its default resolves to on this model
    written as the default (cross_layer_start=15 of a 30-layer model is the default None), so one
    configuration has one label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from pyramidkv.components import Component, Conflict, ModelShape


@dataclass(frozen=True)
class Capability(Component):
    flat = True
    axis: ClassVar[str] = ""                    # the method field that holds it
    title: ClassVar[str] = ""                   # how errors name it
    store_kind: ClassVar[Optional[str]] = None
    store_abilities: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[tuple[Conflict, ...]] = ()
    # {budget setting: the unit's own} when the unit reads a budget per step on a method that keeps every token
    # (Quest's pages: quest:budget=64 is page_budget=64; pyramidkv/sizing/keep_all.py)
    reads_budget: ClassVar[dict[str, str]] = {}

    def check_with(self, method) -> None:
        """ValueError if the unit cannot do what it says inside `method` (beyond the conflict table)."""

    def check_model(self, model: ModelShape, method=None) -> None:
        """ValueError if the unit cannot do what it says on this model (inside `method`, when given)."""

    def check_prompt(self, prompt_len: int, method=None) -> None:
        """ValueError if the unit cannot do what it says on a prompt of prompt_len tokens."""

    def normalized(self, model: ModelShape) -> "Capability":
        return self


def fixed_budget(method) -> "int | None":
    """The tokens each head of an evicting method keeps of a long prompt, when that is one number for every
    prompt (a budget, not a ratio); None otherwise."""
    return None if method is None else method.sizing.fixed_count()


def prompt_kept(method, prompt_len: int) -> int:
    """The tokens each head of `method` keeps of a prompt of prompt_len tokens (its uniform share)."""
    return min(prompt_len, method.prompt_budget(prompt_len))


def shown(value) -> str:
    """A setting as refusals show it: a unit by its name."""
    return repr(getattr(value, "name", value) if isinstance(value, Component) else value)
