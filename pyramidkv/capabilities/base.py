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
  * `check_with(method)`, `check_model(model)`, `check_prompt(prompt_len)`: its checks that need the
    whole method, the model's shape or the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

from pyramidkv.components import Component, ModelShape


@dataclass(frozen=True)
class Conflict:
    """`setting` (a method setting, flat names included) refused next to the unit when `applies(method)`; `why`
    may name the method's values as `{m.<setting>}` (str.format with m = the method)."""

    setting: str
    applies: Callable[[object], bool]
    why: str


@dataclass(frozen=True)
class Capability(Component):
    flat = True
    axis: ClassVar[str] = ""                    # the method field that holds it
    title: ClassVar[str] = ""                   # how errors name it
    store_kind: ClassVar[Optional[str]] = None
    store_abilities: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[tuple[Conflict, ...]] = ()

    def check_with(self, method) -> None:
        """ValueError if the unit cannot do what it says inside `method` (beyond the conflict table)."""

    def check_model(self, model: ModelShape) -> None:
        """ValueError if the unit cannot do what it says on this model."""

    def check_prompt(self, prompt_len: int) -> None:
        """ValueError if the unit cannot do what it says on a prompt of prompt_len tokens."""


def shown(value) -> str:
    """A setting as refusals show it: a unit by its name."""
    return repr(getattr(value, "name", value) if isinstance(value, Component) else value)
