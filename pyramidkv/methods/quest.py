"""Quest (Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"):
nothing is evicted; at every decode step each stored head attends exactly over the tokens of its pages
with the highest criticality U_p = sum_c max(q_c m_c, q_c M_c) (m, M: the page's element-wise min and
max key, pages of `page_size` 16 tokens), `page_budget` = the tokens of those pages (its alias
`budget`, `--max_capacity_prompts`, since quest keeps everything: pyramidkv/sizing/keep_all.py). Layers 0 and 1 attend densely, at least 3 pages are read, each
query head picks its own pages: the official accuracy path. The same selection composes with any method
through its page unit (make_method("snapkv", budget=256, page_budget=64): Quest over a
SnapKV-compressed cache; pyramidkv/capabilities/pages.py); docs/methods.md has the rules.
"""

from dataclasses import dataclass
from typing import Optional

from pyramidkv.capabilities import QuestPages
from pyramidkv.methods.base import Method
from pyramidkv.sizing import KeepAll, Sizing


@dataclass(frozen=True)
class Quest(Method):
    name = "quest"
    unlabelled = ("budget", "budget_ratio", "page_budget", "page_budget_ratio")
    sizing: Sizing = KeepAll()
    window_size: int = 0
    pages: Optional[QuestPages] = QuestPages()

    def validate(self) -> None:
        super().validate()
        for setting, default in (("merge", None), ("decode", None), ("selection", type(self.selection)())):
            if getattr(self, setting) != default:
                raise ValueError(f"quest evicts nothing; it takes no {setting} (got {getattr(self, setting)!r}); add "
                                 f"page_budget to an eviction method instead")
        for setting in ("head_allocation", "layer_allocation"):
            if getattr(self, setting).name != "uniform":
                raise ValueError(f"quest evicts nothing; it takes no {setting} (got {getattr(self, setting).name!r})")
        if not isinstance(self.sizing, KeepAll):
            raise ValueError(f"quest evicts nothing; its budget is the page budget it reads per step (budget / "
                             f"budget_ratio, page_budget / page_budget_ratio), got {self.sizing.settings()}")
        if self.pages is None:
            raise ValueError("quest is its page selection; it cannot be turned off (use fullkv)")
