"""Methods whose own decode unit holds their budget while decoding (tova, rkv, triattention)."""

from __future__ import annotations

import dataclasses

from pyramidkv.capabilities import DecodeBudget


class DecodesAtItsBudget:
    """Mixed into a Method (before it) whose own decode unit (the `decode` field's default, a DecodeBudget with
    decode_budget None) holds the method's budget while decoding: tova, rkv, triattention. A token budget fills
    decode_budget in; that default at the budget is no change of settings (tova:budget=256 is labelled tova)."""

    decodes_at_budget = True

    def __post_init__(self) -> None:
        budget = self.budget
        if (isinstance(self.decode, DecodeBudget) and self.decode.decode_budget is None and isinstance(budget, int)
                and not isinstance(budget, bool) and budget >= 1):
            object.__setattr__(self, "decode", dataclasses.replace(self.decode, decode_budget=budget))
        super().__post_init__()

    def changed_settings(self) -> list[tuple[str, object]]:
        own = dataclasses.replace(type(self).__dataclass_fields__["decode"].default, decode_budget=self.budget)
        return [(setting, value) for setting, value in super().changed_settings()
                if not (setting == "decode" and value == own)]
