"""Nothing evicted (fullkv, minicache's layer pairs, minference's sparse prefill, quest): every prompt token is
kept. A unit that reads a budget per decode step instead (Quest's pages: `reads_budget`) takes the budget names,
so `quest:budget=64` is quest reading 64 tokens of pages per step and its run folder is `{model}_64`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pyramidkv.sizing.base import Sizing


def budget_reader(units):
    """The unit of `units` that reads a budget per step (`reads_budget`: {budget name: its setting}), or None."""
    return next((unit for unit in units if unit is not None and getattr(unit, "reads_budget", None)), None)


@dataclass(frozen=True)
class KeepAll(Sizing):
    name = "keep_all"
    kind = "keep_all"
    evicts = False

    def per_prompt(self, real_len: int, method) -> int:
        return real_len

    def budget_names(self, units) -> dict[str, str]:
        reader = budget_reader(units)
        return dict(reader.reads_budget) if reader is not None else {}

    def _read(self, method):
        """(budget, budget_ratio) of the unit that takes the budget names on this method (one it has by default:
        fullkv with page_budget is refused, minference's pages read no budget of the method's)."""
        defaults = {f.name: f.default for f in dataclasses.fields(method)}
        lender = budget_reader(defaults.values())
        reader = None if lender is None else getattr(method, lender.axis)
        if reader is None:
            return None, None
        return (reader.setting(reader.reads_budget[name]) for name in ("budget", "budget_ratio"))

    def folder_part(self, method) -> str:
        budget, ratio = self._read(method)
        return str(budget) if budget is not None else f"r{ratio:g}" if ratio is not None else "full"

    def recorded(self, method):
        budget, ratio = self._read(method)
        return budget if budget is not None else f"r{ratio:g}" if ratio is not None else None
