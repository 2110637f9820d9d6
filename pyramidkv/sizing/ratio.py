"""A budget as a fraction of each prompt (`budget_ratio=0.25`, `--max_capacity_prompts_ratio 0.25`; kvpress's
`compression_ratio` is 1 - it): round(ratio x prompt length) tokens per layer and head. Any ratio in (0, 1)
(16:1 is 0.0625, 32:1 is 0.03125); 1 only with a decode budget, which compresses while decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pyramidkv.components import ModelShape
from pyramidkv.sizing.base import Sizing


@dataclass(frozen=True)
class Ratio(Sizing):
    """budget_ratio: the budget as a fraction of each prompt's length, in (0, 1) (1 only with a decode budget); it
        must give at least the window on every prompt."""

    name = "ratio"
    kind = "ratio"
    budget_kind = True
    setting_labels = {"budget_ratio": "budget_ratio (max_capacity_prompts_ratio)"}
    budget_ratio: Optional[float] = None

    def per_prompt(self, real_len: int, method) -> int:
        return max(method.protected_tokens, round(self.budget_ratio * real_len), 1)

    def folder_part(self, method) -> str:
        return f"r{self.budget_ratio:g}"

    def recorded(self, method):
        return f"r{self.budget_ratio:g}"

    def check_with(self, method) -> None:
        ratio = self.budget_ratio
        if ratio is None:
            raise ValueError(f"{method.name} needs exactly one of budget (max_capacity_prompts) or budget_ratio "
                             f"(max_capacity_prompts_ratio); got budget=None, budget_ratio=None")
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) must be in (0, 1], got {ratio!r}")
        if ratio == 1.0 and method.decode is None:
            raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) 1 keeps every prompt token: no prompt would be "
                             f"compressed (that is fullkv); allowed: 0 < budget_ratio < 1 (1 only with a decode_budget, "
                             f"which compresses while decoding)")

    def check_model(self, model: ModelShape, method) -> None:
        context = model.context_window
        if not context or method.decode is not None or method.protected_tokens >= context:
            return
        if min(context, self.per_prompt(context, method)) >= context:
            raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) {self.budget_ratio!r} keeps "
                             f"round({self.budget_ratio!r} x {context}) = {context} tokens of a prompt as long as the "
                             f"model's context window ({context} tokens), so no prompt would be compressed (that is "
                             f"fullkv); use a budget_ratio <= {(context - 1) / context:.6g}")

    def check_prompt(self, prompt_len: int, method) -> None:
        share, least = round(self.budget_ratio * prompt_len), max(method.window_size, 1)
        if share < least:
            raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) {self.budget_ratio:g} gives "
                             f"round({self.budget_ratio:g} x {prompt_len}) = {share} tokens on a {prompt_len}-token "
                             f"prompt, below the {least} the budget must hold (window_size {method.window_size}); use "
                             f"a ratio >= {least / prompt_len:.4g} or a smaller window_size")
