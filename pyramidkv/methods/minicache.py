"""MiniCache (Liu et al., NeurIPS 2024, "MiniCache: KV Cache Compression in Depth Dimension for Large
Language Models"): the full cache with cross-layer merging. From the middle layer up, each pair of
adjacent layers stores per token and stored head one shared direction for its keys and one for its
values (SLERP of the two layers' unit vectors at t = 0.6) and both layers' magnitudes; the 5 % of token
pairs with the largest angular distance keep their original vectors (pyramidkv/core/cross_layer.py,
docs/methods.md). The official repository holds only a project page: this follows the paper's rule as
stated there, with the public reconstruction's top-fraction retention. The axis composes with eviction:
make_method("snapkv", budget=256, cross_layer_merge=True) selects once per pair on the summed scores.
"""

from dataclasses import dataclass
from typing import Optional

from pyramidkv.capabilities import MiniCacheSharing

from pyramidkv.methods.fullkv import FullKV


@dataclass(frozen=True)
class MiniCache(FullKV):
    name = "minicache"
    layer_sharing: Optional[MiniCacheSharing] = MiniCacheSharing()
