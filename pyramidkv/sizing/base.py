"""What a sizing is: how many tokens each head of a method keeps of a prompt, as one unit on one method field.

A method holds one sizing in `Method.sizing`; its kinds are one file each: `Tokens` (a budget in tokens,
`budget=128`), `Ratio` (a fraction of each prompt, `budget_ratio=0.25`), `KeepAll` (nothing evicted: fullkv,
minicache, minference, and quest, whose page unit reads a budget per step) and `Threshold` (each head keeps
what its scores pass, `threshold=-3`: the count is an outcome). The unit is flat: its settings read as the
method's own (`budget`, `budget_ratio`, `threshold`, `threshold_decoding`), so specs, flags, folder names and
run records stay as they were; giving a kind's setting chooses that kind (`kvzap:budget=256` is kvzap at a
token budget).

Each kind answers:
  * `per_prompt(real_len, method)`: the tokens per layer and head of a prompt of real_len tokens (the engine's
    per-prompt count; window and sinks included);
  * `folder_part(method)` and `recorded(method)`: the budget part of the run folder's name (`128`, `r0.25`,
    `threshold`, `full`) and the value results record (128, "r0.25", "threshold", None);
  * `reads_budget_flag(units)`: whether the runners' budget flag (--max_capacity_prompts) sets it, and
    `budget_names(units)`: the unit settings the budget names stand for (quest's page budget);
  * `outcome`: whether the count is an outcome of the scores, not a setting (the rows record what was held);
  * `decode_threshold()`: what the engine applies while decoding (a threshold, or None);
  * `check_with(method)`, `check_model(model, method)`, `check_prompt(prompt_len, method)`, and its
    `conflicts` table: what it cannot compose with, one line each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

from pyramidkv.components import Component, Conflict, ModelShape

# The settings every kind's record shows (run_meta.json's method section has had them since the first runs).
RECORDED = ("budget", "budget_ratio")


@dataclass(frozen=True)
class Sizing(Component):
    flat = True
    kind: ClassVar[str] = ""
    evicts: ClassVar[bool] = True             # False: every prompt token is kept (KeepAll)
    outcome: ClassVar[bool] = False           # True: each head keeps what its scores pass (Threshold)
    budget_kind: ClassVar[bool] = False       # True: the runners' budget flag (--max_capacity_prompts) sets it
    conflicts: ClassVar[tuple[Conflict, ...]] = ()

    # --- what the engine and the runners ask --------------------------------------------------------
    def per_prompt(self, real_len: int, method) -> int:
        """The tokens each head of a layer keeps of a prompt of real_len tokens (window and sinks included)."""
        raise NotImplementedError

    def fixed_count(self) -> Optional[int]:
        """The per-prompt count when it is one number for every prompt (a token budget); None otherwise."""
        return None

    def folder_part(self, method) -> str:
        """The budget part of a run folder's name ({model}_{this})."""
        raise NotImplementedError

    def recorded(self, method):
        """The budget as results.json records it."""
        raise NotImplementedError

    def reads_budget_flag(self, units) -> bool:
        """Whether the runners' budget flag sets this sizing (or, `budget_names`, the unit that reads it)."""
        return self.budget_kind or bool(self.budget_names(units))

    def budget_names(self, units) -> dict[str, str]:
        """{budget / budget_ratio: the setting of one of `units` it names} where a unit reads the budget (none)."""
        return {}

    def decode_threshold(self) -> Optional[float]:
        """The threshold the engine applies to each token leaving the recent window while decoding (None: none)."""
        return None

    # --- how it reads as the method's own settings ----------------------------------------------------
    def settings(self) -> dict:
        """Its settings as the method describes them: budget and budget_ratio always, the kind's others after."""
        out = {name: None for name in RECORDED}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return out

    @classmethod
    def flat_view(cls, unit: "Sizing | None") -> dict:
        """components.flat_settings' hook: the unit's own settings (a sizing is never off)."""
        return {} if unit is None else unit.settings()

    def changes(self, default: "Sizing") -> list[tuple[str, object]]:
        """(setting, value) a spec writes for this sizing on a method whose default is `default`: against the
        default where the kind is the default's, else against the kind's own defaults."""
        if type(self) is type(default):
            return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                    if getattr(self, f.name) != getattr(default, f.name)]
        return self.changed_settings()

    def label_parts(self, default: "Sizing", unlabelled) -> list[tuple[str, object]]:
        """(setting, value) the run folder's method label shows: none at the method's default; else each setting
        off its kind's own default (the budget settings are the folder's budget part, not the label's)."""
        if self == default:
            return []
        return [(name, value) for name, value in self.changed_settings() if name not in unlabelled]

    # --- checks ------------------------------------------------------------------------------------------
    def check_with(self, method) -> None:
        """ValueError (one line) if the sizing cannot do what it says inside `method`."""
        for conflict in self.conflicts:
            if conflict.applies(method):
                raise ValueError(conflict.why.format(m=method))

    def check_model(self, model: ModelShape, method) -> None:
        """ValueError if the sizing cannot do what it says on this model."""

    def check_prompt(self, prompt_len: int, method) -> None:
        """ValueError if the sizing cannot do what it says on a prompt of prompt_len tokens."""
