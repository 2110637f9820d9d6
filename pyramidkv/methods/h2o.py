"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

Score = accumulated attention each key receives from every prompt query
(column sums of the causal attention matrix), computed in query chunks.
Keeps the top `budget - window_size` heavy hitters plus the recent window.

With `decode_budget`, the paper's decoding-time eviction: the cache keeps adding the attention
each new query gives every held token (prompt tokens start from their prefill column sums), and
every `decode_interval` tokens each head keeps its `decode_budget - window_size` heaviest
hitters by that accumulated attention plus the recent window.
"""

from dataclasses import dataclass

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.core.scoring import attention_column_sums
from pyramidkv.methods.base import Method


@dataclass(frozen=True)
class H2O(Method):
    name = "h2o"
    accumulates_attention = True

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return attention_column_sums(ctx.queries, ctx.keys, ctx.real, pattern=ctx.pattern)

    def decode_score(self, ctx) -> torch.Tensor:
        return ctx.accumulated
