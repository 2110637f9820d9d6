"""Methods whose own decode unit holds their budget while decoding (tova, rkv, triattention)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pyramidkv.capabilities import DecodeBudget


class DecodesAtItsBudget:
    """Mixed into a Method (before it) whose own decode unit (the `decode` field's default, a DecodeBudget with
    decode_budget None) holds the method's budget while decoding: tova, rkv, triattention. A token budget fills
    decode_budget in; that default at the budget is no change of settings (tova:budget=256 is labelled tova)."""

    decodes_at_budget = True
    decode_rule: ClassVar[str] = ""   # what it does while decoding, after its name in a refusal
    holder: ClassVar[str] = "a head"  # what holds decode_budget tokens: a head, or a layer (one set for every head)

    def validate(self) -> None:
        """The refusals every such method shares: no decode unit, a threshold sizing, a ratio without a count."""
        if self.decode is None:
            raise ValueError(f"{self.name} {self.decode_rule}; decode_budget=None would never evict: give "
                             f"decode_budget >= 1 or leave it out (the budget)")
        if self.sizing.outcome:
            raise ValueError(f"{self.name} {self.decode_rule}, to a token budget; it does not combine with threshold "
                             f"eviction (a count that is an outcome): give budget or budget_ratio")
        if self.decode.decode_budget is None and self.budget is None:
            raise ValueError(f"{self.name} with budget_ratio (max_capacity_prompts_ratio) {self.budget_ratio!r} needs "
                             f"decode_budget (the tokens {self.holder} holds while decoding, one number for every "
                             f"prompt); give decode_budget >= 1, or a budget instead of the ratio")
        super().validate()

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
