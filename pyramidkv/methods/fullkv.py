"""FullKV: no compression (the reference every method is compared against)."""

from dataclasses import dataclass

from pyramidkv.allocation.uniform import UniformHeads, UniformLayers
from pyramidkv.methods.base import Method
from pyramidkv.sizing import KeepAll, Sizing


@dataclass(frozen=True)
class FullKV(Method):
    name = "fullkv"
    sizing: Sizing = KeepAll()
    window_size: int = 0

    def validate(self) -> None:
        if not isinstance(self.sizing, KeepAll):
            given = ", ".join(f"{k}={v}" for k, v in self.sizing.settings().items() if v is not None)
            raise ValueError(f"{self.name} keeps every token; it takes no budget (got {given})")
        super().validate()
        if not isinstance(self.head_allocation, UniformHeads) or not isinstance(self.layer_allocation, UniformLayers):
            raise ValueError(f"{self.name} keeps every token; it takes no budget allocation (got head_allocation="
                             f"{self.head_allocation.name!r}, layer_allocation={self.layer_allocation.name!r})")
        if self.pages is not None and type(self) is FullKV:
            raise ValueError(f"{self.name} with a page budget is quest (Quest's page selection over the full cache); "
                             f"use --method quest (quest:page_budget=...)")
        if self.merge is not None:
            raise ValueError(f"{self.name} keeps every token, so it evicts none to merge; it takes no merge "
                             f"rule (got merge={self.merge.name!r})")
