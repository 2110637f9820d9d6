"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first `num_sinks` tokens (attention sinks, protected by the core like the window) and
the most recent `budget - num_sinks` tokens.

With `decode_budget`, the same rule during decoding: the cache
holds the sinks and the most recent tokens (the paper's rolling cache, re-trimmed every
`decode_interval` tokens).
"""

from dataclasses import dataclass

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.capabilities import Selection
from pyramidkv.methods.base import Method


@dataclass(frozen=True)
class StreamingLLM(Method):
    """StreamingLLM's rule: the first 4 prompt tokens (attention sinks) always kept, the rest of the budget
    to the most recent tokens."""

    name = "streamingllm"
    window_size: int = 0
    selection: Selection = Selection(num_sinks=4)

    def validate(self) -> None:
        super().validate()
        sinks = self.selection.num_sinks
        if self.budget is not None and self.budget <= sinks:
            raise ValueError(f"budget {self.budget} must exceed num_sinks {sinks} to keep any recent token")
        if self.decode is not None and self.decode.decode_budget <= sinks:
            raise ValueError(f"decode_budget {self.decode.decode_budget} must exceed num_sinks {sinks} to keep any "
                             f"recent token")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        # Recency as the score (the sinks are protected by the core): top-B = sinks + most recent B - s. The rank
        # among the real tokens (0 = the first), so a prompt scores the same padded or alone (a threshold reads it).
        bsz, heads, n, _ = ctx.keys.shape
        real = ctx.real if ctx.real.dim() == 3 else ctx.real[:, None]
        return (real.float().cumsum(dim=-1) - 1).expand(bsz, heads, n)
