"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

Score = accumulated attention each key receives from every prompt query
(column sums of the causal attention matrix), computed by the prefill attention pass itself
(query chunks, no [n, n] matrix per head; its output equals the model's kernel to float rounding).
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
    global_scale = "raw"   # attention received: comparable across layers as it is
    accumulates_attention = True
    needs_column_sums = True

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.column_sums is not None:
            return ctx.column_sums
        return attention_column_sums(ctx.queries, ctx.keys, ctx.real, pattern=ctx.pattern, form=ctx.form)

    def decode_score(self, ctx) -> torch.Tensor:
        return ctx.accumulated
