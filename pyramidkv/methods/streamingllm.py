"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first `num_sinks` tokens (attention sinks) and the most recent
`budget - num_sinks` tokens.

With `decode_budget`, the same rule during decoding: the cache
holds the sinks and the most recent tokens (the paper's rolling cache, re-trimmed every
`decode_interval` tokens).
"""

from dataclasses import dataclass

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method


@dataclass(frozen=True)
class StreamingLLM(Method):
    """StreamingLLM's rule.

    num_sinks: the first prompt tokens always kept (attention sinks); the rest of the budget goes to
        the most recent tokens.
    """

    name = "streamingllm"
    window_size: int = 0
    num_sinks: int = 4

    def validate(self) -> None:
        super().validate()
        if self.num_sinks < 0:
            raise ValueError(f"num_sinks must be an integer >= 0, got {self.num_sinks!r}")
        if self.budget is not None and self.budget <= self.num_sinks:
            raise ValueError(f"budget {self.budget} must exceed num_sinks {self.num_sinks} to keep any recent token")
        if self.decode_budget is not None and self.decode_budget <= self.num_sinks:
            raise ValueError(f"decode_budget {self.decode_budget} must exceed num_sinks {self.num_sinks} to keep any "
                             f"recent token")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        # Recency as the score, sinks above everything: top-B = sinks + most recent B - s.
        bsz, n = ctx.real.shape
        first_real = (~ctx.real).sum(dim=1, keepdim=True)  # [B, 1]
        offset = torch.arange(n, device=ctx.real.device)[None, :] - first_real  # 0 at the first real token
        score = offset.float()
        score = torch.where((offset >= 0) & (offset < self.num_sinks), torch.full_like(score, float(n + 1)), score)
        return score[:, None, :].expand(bsz, ctx.keys.shape[1], n)
