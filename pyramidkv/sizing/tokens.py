"""A budget in tokens (`budget=128`, `--max_capacity_prompts 128`): each head of a layer keeps that many tokens
of a prompt longer than it, window and sinks included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pyramidkv.components import ModelShape
from pyramidkv.sizing.base import Sizing


@dataclass(frozen=True)
class Tokens(Sizing):
    """budget: tokens kept per layer per head of each prompt, observation window and sinks included (the
        public harness's max_capacity_prompts)."""

    name = "tokens"
    kind = "tokens"
    budget_kind = True
    setting_labels = {"budget": "budget (max_capacity_prompts)"}
    budget: Optional[int] = None

    def per_prompt(self, real_len: int, method) -> int:
        return self.budget

    def fixed_count(self) -> Optional[int]:
        return self.budget

    def folder_part(self, method) -> str:
        return str(self.budget)

    def recorded(self, method):
        return self.budget

    def check_with(self, method) -> None:
        if self.budget is None:
            raise ValueError(f"{method.name} needs exactly one of budget (max_capacity_prompts) or budget_ratio "
                             f"(max_capacity_prompts_ratio); got budget=None, budget_ratio=None")
        if self.budget < 1:
            raise ValueError(f"budget (max_capacity_prompts) must be an integer >= 1, got {self.budget!r}")
        if self.budget < method.protected_tokens:
            raise ValueError(f"budget (max_capacity_prompts) {self.budget} is smaller than window_size "
                             f"{method.window_size} + num_sinks {method.selection.num_sinks}; the budget includes the "
                             f"window and the sinks, so it must be >= {method.protected_tokens}")

    def check_model(self, model: ModelShape, method) -> None:
        context = model.context_window
        if context and self.budget >= context:
            raise ValueError(f"budget (max_capacity_prompts) {self.budget} is at least the model's context window "
                             f"({context} tokens): no prompt would be compressed (that is fullkv); use a budget below "
                             f"{context}")
