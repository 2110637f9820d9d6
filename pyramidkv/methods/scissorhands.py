"""Scissorhands (Liu et al., NeurIPS 2023, "Scissorhands: Exploiting the Persistence of Importance
Hypothesis for LLM KV Cache Compression at Test Time"): a budgeted cache while decoding. A token is
unimportant at a step when its attention from that step's query is below the uniform level
1 / (tokens attended); over the last `history_window` steps each held token counts how often it was
unimportant, and when a head holds decode_budget + decode_interval tokens the decode_interval tokens
with the highest counts are dropped (ties: the older), the `window_size` most recent never. A prompt
longer than `budget` is cut the same way at the end of prefill, counting over its last history_window
rows, and those rows start the decode-time history. Needs `decode_budget` (the paper's budget B is
decode_budget + decode_interval, the drop size m is decode_interval).

Defaults: the paper's values for the history window, recent window and drop size could not be read
here (no official code exists); history_window 64 and window_size 32 are our choices, and m =
decode_interval (default 32); docs/methods.md says so.
"""

from dataclasses import dataclass

import torch

from pyramidkv.components import ModelShape
from pyramidkv.core.context import DecodeScoreContext, ScoreContext
from pyramidkv.core.scoring import window_attention
from pyramidkv.methods.base import Method


def unimportant_counts(rows: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """rows [..., w, m] attention (NaN: not there), levels [..., w] -> [..., m] how often a token was
    below its row's uniform level."""
    below = rows < levels[..., None]  # NaN compares False
    return below.sum(dim=-2)


@dataclass(frozen=True)
class Scissorhands(Method):
    """Counts of unimportance over a history window, dropping the most unimportant while decoding.

    history_window: the last queries (prompt rows, then decode steps) whose attention counts how often a
        token was unimportant; at most the model's context window (max_position_embeddings), the most
        queries a sequence has."""

    name = "scissorhands"
    global_scale = "raw"   # attention received: comparable across layers as it is
    decodes_at_budget = True   # it needs a decode_budget (validate)
    history_window: int = 64

    def validate(self) -> None:
        super().validate()
        if self.history_window < 1:
            raise ValueError(f"history_window must be an integer >= 1 (decode steps whose attention is counted), "
                             f"got {self.history_window!r}")
        if self.decode is None:
            raise ValueError("scissorhands compresses while decoding: it needs decode_budget (the budget B = "
                             "decode_budget + decode_interval, m = decode_interval), e.g. --decode_budget 256")

    def check_model(self, model: ModelShape) -> None:
        super().check_model(model)
        if model.context_window and self.history_window > model.context_window:
            raise ValueError(f"history_window {self.history_window} is longer than the model's context window "
                             f"({model.context_window} tokens), the most queries a sequence has; allowed: 1 <= "
                             f"history_window <= {model.context_window}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """Prefill: minus the unimportant counts over the prompt's last history_window rows. [B, Hq, n]"""
        n = ctx.keys.shape[2]
        rows = window_attention(ctx.queries, ctx.keys, ctx.real, self.history_window, ctx.pattern,
                                form=ctx.form)  # [B, Hq, w, n]
        w = rows.shape[2]
        causal = torch.arange(n, device=rows.device)[None, :] <= torch.arange(n - w, n, device=rows.device)[:, None]
        visible = causal[None] & ctx.real[:, None, :] & ctx.real[:, n - w:, None]     # [B, w, n]
        attended = visible.sum(dim=-1).float()
        levels = torch.where(attended > 0, 1.0 / attended, torch.full_like(attended, float("nan")))
        rows = rows.masked_fill(~visible[:, None], float("nan"))
        return -unimportant_counts(rows, levels[:, None]).float()

    def decode_score(self, ctx: DecodeScoreContext) -> torch.Tensor:
        """Minus the unimportant counts over the last history_window queries. [1, Hq, m]"""
        return -unimportant_counts(ctx.history, ctx.history_levels).float()
