"""Quest (Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"):
nothing is evicted; at every decode step each stored head attends exactly over the tokens of its pages
with the highest criticality U_p = sum_c max(q_c m_c, q_c M_c) (m, M: the page's element-wise min and
max key, pages of `page_size` 16 tokens), `budget` = the tokens of those pages. Layers 0 and 1 attend
densely, at least 3 pages are read, each query head picks its own pages: the official accuracy path.
The same selection composes with any method through `page_budget` (make_method("snapkv", budget=256,
page_budget=64): Quest over a SnapKV-compressed cache); docs/methods.md has the rules.
"""

from dataclasses import dataclass
from typing import Optional

from pyramidkv.methods.base import Method


@dataclass(frozen=True)
class Quest(Method):
    name = "quest"
    window_size: int = 0

    @property
    def selects_pages(self) -> bool:
        return True

    def prompt_budget(self, real_len: int) -> int:
        """Nothing is evicted: every prompt is kept whole."""
        return real_len

    def decode_page_budget(self, real_len: int) -> Optional[int]:
        if self.budget is not None:
            return self.budget
        return max(self.page_size, round(self.budget_ratio * real_len))

    def validate(self) -> None:
        super().validate()
        if self.page_budget is not None:
            raise ValueError(f"quest's page budget is its budget (max_capacity_prompts); page_budget is for adding "
                             f"Quest to another method (got page_budget={self.page_budget})")
        if self.budget is not None and self.budget < self.page_size:
            raise ValueError(f"budget {self.budget} is smaller than one page (page_size {self.page_size}); quest's "
                             f"budget counts the tokens of the attended pages")
        for setting, default in (("merge", None), ("decode_budget", None), ("num_sinks", 0), ("random_fraction", 0.0)):
            if getattr(self, setting) != default:
                raise ValueError(f"quest evicts nothing; it takes no {setting} (got {getattr(self, setting)!r}); add "
                                 f"page_budget to an eviction method instead")
        for setting in ("head_allocation", "layer_allocation"):
            if getattr(self, setting).name != "uniform":
                raise ValueError(f"quest evicts nothing; it takes no {setting} (got {getattr(self, setting).name!r})")
