"""TOVA (Oren, Hassid, Adi, Schwartz, 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104): keep the
tokens the newest query attends to most.

Score = the last query's attention row (softmax over every real key, itself included, with the model's
soft-cap), averaged over ALL query heads of the layer: one row per layer, the same on every stored head, so
every head of a layer keeps the same positions (ties: the more recent wins, identically on every head).
Prefill keeps the top `budget` of the prompt. While decoding, the official rule: once a layer holds
`budget` tokens, each step appends the new token and then evicts exactly one, the lowest by the new query's
row (the new token itself may go). That is the decode budget (pyramidkv/core/decoding.py) at decode_budget =
budget, decode_interval = 1, the query buffer 1 and no window, TOVA's default here. kvpress's schedule
(TOVAPress inside DecodingPress: every 512 steps back to 2048 tokens, the newest kept) is
`window_size=1, decode_budget=2048, decode_interval=512` (docs/methods.md, "TOVA").
"""

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.allocation.uniform import UniformHeads
from pyramidkv.capabilities import DecodeBudget
from pyramidkv.core.context import ScoreContext
from pyramidkv.core.scoring import window_attention
from pyramidkv.methods.base import Method
from pyramidkv.methods.own_decode import DecodesAtItsBudget

# The official decode rule: decode_budget the method's budget (filled in when built), one eviction per step,
# read from the newest query alone.
PER_STEP = DecodeBudget(decode_budget=None, decode_interval=1, decode_query_window=1)


@dataclass(frozen=True)
class TOVA(DecodesAtItsBudget, Method):
    """TOVA's scorer: the last query's attention averaged over every query head of the layer; by default it
    evicts one token per decode step once a layer holds the budget (decode_budget defaults to the budget)."""

    name = "tova"
    decode_rule = "evicts while decoding (one token per step once a layer holds its budget)"
    holder = "a layer"
    window_size: int = 0
    decode: Optional[DecodeBudget] = PER_STEP

    def validate(self) -> None:
        if not isinstance(self.head_allocation, UniformHeads):
            raise ValueError(f"tova keeps one set for every head of a layer (its score is the same on all of them); "
                             f"head_allocation must be 'uniform', got {self.head_allocation.name!r}")
        super().validate()

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, H, n]: the last query's attention averaged over all query heads, copied to every head."""
        row = window_attention(ctx.queries, ctx.keys, ctx.real, 1, ctx.pattern, form=ctx.form)  # [B, Hq, 1, n]
        return self.newest_row_score(row[:, :, 0]).expand(-1, ctx.keys.shape[1], -1)

    @staticmethod
    def newest_row_score(rows: torch.Tensor) -> torch.Tensor:
        """rows [B, Hq, n]: the newest query's attention per query head -> [B, 1, n] their mean, every head's score.
        At the per-step rule the engine reads it from the step's own attention rows (core/drop_one.py)."""
        return rows.mean(dim=1, keepdim=True)
