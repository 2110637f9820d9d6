"""L2Norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): keys with a LOW L2 norm draw high attention, so keep the lowest-norm keys.

Defaults follow the paper and its code (`l2_compress(..., skip_layers=[0, 1])`): the first
`skip_layers` layers, whose attention does not follow the norm pattern, keep the whole prompt,
and no recent window is forced (`window_size=0`). A skipped layer stores every prompt token,
so the cache holds more than layers x budget tokens; `skip_layers=0` compresses every layer.
"""

from dataclasses import dataclass

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method


@dataclass(frozen=True)
class L2Norm(Method):
    """L2Norm's scorer.

    skip_layers: the first layers keep the whole prompt (the paper leaves 2 uncompressed); must be
        smaller than the model's layer count.
    """

    name = "l2norm"
    window_size: int = 0
    skip_layers: int = 2

    def validate(self) -> None:
        super().validate()
        if self.skip_layers < 0:
            raise ValueError(f"skip_layers must be an integer >= 0 (the first layers left uncompressed), "
                             f"got {self.skip_layers}")

    def check_model(self, model) -> None:
        super().check_model(model)
        if self.skip_layers >= model.num_layers:
            raise ValueError(f"skip_layers {self.skip_layers} leaves none of the model's {model.num_layers} layers "
                             f"compressed (l2norm would keep the whole prompt); allowed: 0 <= skip_layers < "
                             f"{model.num_layers}")

    def whole_layers(self, num_layers: int) -> range:
        return range(self.skip_layers)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return -ctx.keys.float().norm(dim=-1)  # [B, Hkv, n]
