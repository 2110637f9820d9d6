"""Quest's page selection (Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference") as a unit any method can add: per stored head and decode step, attention reads only the
tokens of the most critical pages of what the layer holds (the tensor code: pyramidkv/core/pages.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pyramidkv.capabilities.base import Capability, Conflict, fixed_budget, prompt_kept
from pyramidkv.components import ModelShape

PAGE_SELECTIONS = ("query_head", "group_max", "group_mean")


@dataclass(frozen=True)
class QuestPages(Capability):
    """Decode-time page retrieval; nothing is evicted.

    page_budget: Quest's decode-time page retrieval (none: off): per stored head and decode step, attention
        reads only the tokens of the pages with the highest criticality U_p = sum_c max(q_c m_c, q_c M_c)
        (m, M: the element-wise min and max key of a page of page_size held tokens), K = min(max(
        page_min_count, floor(page_budget / page_size)), pages) of them. Nothing is evicted.
    page_budget_ratio: Quest: the page budget as a fraction of each prompt's length (at least one page), instead
        of page_budget.
    page_size: Quest: held tokens per page.
    page_min_count: Quest: the fewest pages attended per step; at most the pages of the model's context
        window, ceil(max_position_embeddings / page_size).
    page_keep_last: Quest: the newest token's page is always attended.
    page_dense_layers: Quest: the first layers, which attend densely (the official code: 2).
    page_selection: Quest: query_head (each query head its own pages, as the official code), group_max or
        group_mean (U reduced over the GQA group: one page set per stored head).
    """

    name = "quest"
    axis = "pages"
    title = "Quest page selection"
    switch = "page_budget"
    store_kind = "paged"
    reads_budget = {"budget": "page_budget", "budget_ratio": "page_budget_ratio"}
    # Decode-time attention statistics (H2O, Scissorhands with decode_budget) are refused by the paged store,
    # which lacks that ability: they would count attention Quest never computed.
    conflicts = (Conflict("key_channel_ratio", lambda m: m.channels is not None, "Quest pages full-width keys"),)
    page_budget: Optional[int] = None
    page_budget_ratio: Optional[float] = None
    page_size: int = 16
    page_min_count: int = 3
    page_keep_last: bool = False
    page_dense_layers: int = 2
    page_selection: str = "query_head"

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1 (tokens per Quest page), got {self.page_size!r}")
        if self.page_min_count < 1:
            raise ValueError(f"page_min_count must be an integer >= 1, got {self.page_min_count!r}")
        if self.page_dense_layers < 0:
            raise ValueError(f"page_dense_layers must be an integer >= 0, got {self.page_dense_layers!r}")
        if self.page_selection not in PAGE_SELECTIONS:
            raise ValueError(f"page_selection must be one of {'|'.join(PAGE_SELECTIONS)}, got {self.page_selection!r}")
        if self.page_budget is not None and self.page_budget_ratio is not None:
            raise ValueError(f"give one of page_budget or page_budget_ratio, got page_budget={self.page_budget} and "
                             f"page_budget_ratio={self.page_budget_ratio}")
        if self.page_budget is not None and self.page_budget < self.page_size:
            raise ValueError(f"page_budget {self.page_budget} is smaller than one page (page_size {self.page_size}); "
                             f"the budget counts the tokens of the attended pages")
        if self.page_budget_ratio is not None and not 0.0 < self.page_budget_ratio < 1.0:
            raise ValueError(f"page_budget_ratio must be in (0, 1) (1 reads every page of the prompt: Quest would "
                             f"select nothing, that is fullkv), got {self.page_budget_ratio!r}")
        if self.page_budget is not None:
            self._check_pages(self.page_budget, "page_budget")

    @property
    def least_tokens(self) -> int:
        return self.page_min_count * self.page_size

    def _check_pages(self, tokens: int, what: str) -> None:
        """A page budget is read as whole pages, at least page_min_count of them: any other value would run as
        the one it rounds to under a label that says another."""
        if tokens < self.least_tokens:
            raise ValueError(f"{what} {tokens} is below page_min_count {self.page_min_count} pages of page_size "
                             f"{self.page_size} = {self.least_tokens} tokens, which Quest reads anyway (every budget "
                             f"below {self.least_tokens} is the same run); use page_budget >= {self.least_tokens}")
        if tokens % self.page_size:
            low = tokens - tokens % self.page_size
            raise ValueError(f"{what} {tokens} is not a whole number of pages of page_size {self.page_size}: Quest "
                             f"reads floor({tokens} / {self.page_size}) = {low // self.page_size} pages ({low} tokens);"
                             f" use {low} or {low + self.page_size}")

    def budget_for(self, real_len: int) -> int:
        """Tokens of the pages attended per stored head and decode step, for a prompt of real_len tokens."""
        if self.page_budget is not None:
            return self.page_budget
        return max(self.page_size, round(self.page_budget_ratio * real_len))

    def check_with(self, method) -> None:
        if self.page_budget is None and self.page_budget_ratio is None:
            raise ValueError(f"{method.name} needs a page budget: page_budget (tokens of the pages each decode step "
                             f"reads) or page_budget_ratio")
        budget = fixed_budget(method)
        if budget is not None and self.page_budget is not None:
            held = budget if method.decode is None else min(budget, method.decode.decode_budget + method.decode.decode_interval)
            if self.page_budget >= held:
                raise ValueError(f"page_budget {self.page_budget} reads every page of the {held} tokens each head holds "
                                 f"after compression (budget {budget}), so Quest selects nothing (until that many "
                                 f"tokens are generated); use page_budget < {held}")

    def check_prompt(self, prompt_len: int, method=None) -> None:
        if self.page_budget_ratio is not None:
            tokens = round(self.page_budget_ratio * prompt_len)
            if tokens < self.least_tokens:
                raise ValueError(f"page_budget_ratio {self.page_budget_ratio:g} gives round({self.page_budget_ratio:g} x "
                                 f"{prompt_len}) = {tokens} tokens on a {prompt_len}-token prompt, below page_min_count "
                                 f"{self.page_min_count} pages of {self.page_size} = {self.least_tokens}, which Quest "
                                 f"reads anyway; " + (f"use page_budget_ratio >= {self.least_tokens / prompt_len:.4g}"
                                                      if self.least_tokens <= prompt_len else
                                                      "the prompt holds fewer pages: lower page_min_count"))
        if method is None or not method.sizing.evicts or fixed_budget(method) is not None:
            return
        kept = prompt_kept(method, prompt_len)
        tokens = self.budget_for(prompt_len)
        if kept < prompt_len and tokens >= kept:
            raise ValueError(f"the page budget ({tokens} tokens) reads every page of the {kept} tokens each head keeps "
                             f"of the {prompt_len}-token prompt, so Quest selects nothing; use a smaller page budget")

    def check_model(self, model: ModelShape, method=None) -> None:
        if model.context_window and self.page_min_count > -(-model.context_window // self.page_size):
            most = -(-model.context_window // self.page_size)
            raise ValueError(f"page_min_count {self.page_min_count} is more pages than the model's context window "
                             f"holds ({model.context_window} tokens = {most} pages of page_size {self.page_size}); "
                             f"allowed: 1 <= page_min_count <= {most}")
        layers = model.num_layers
        if self.page_dense_layers >= layers:
            raise ValueError(f"page_dense_layers {self.page_dense_layers} leaves no layer of this {layers}-layer "
                             f"model to Quest; use at most {layers - 1}")
