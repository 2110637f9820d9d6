"""CaM (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference") as the
public PyramidKV harness runs it: tokens ranked by the observation window's attention summed over
the window (SnapKV's score without pooling, `kernel_size=1`), the top `budget - window_size` kept
with the window, and the evicted tokens' values merged into the kept tokens that follow them
(`merge="cam"`, pyramidkv/merging/cam.py). CaM's merge rule also works with any other method
(`--method snapkv --merge cam`).
"""

from dataclasses import dataclass
from typing import Optional

from pyramidkv.merging.base import MergeRule
from pyramidkv.merging.cam import CamMerge
from pyramidkv.methods.snapkv import SnapKV


@dataclass(frozen=True)
class CAM(SnapKV):
    name = "cam"
    kernel_size: int = 1
    merge: Optional[MergeRule] = CamMerge()

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.merge, CamMerge):
            got = None if self.merge is None else self.merge.name
            raise ValueError(f"cam is SnapKV-style scoring plus CaM's merge rule; it takes merge='cam' (got "
                             f"merge={got!r}); for another merge rule use --method snapkv --kernel_sizes 1 --merge ...")
