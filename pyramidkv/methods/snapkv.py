"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Score = attention of the last `window_size` prompt queries to each earlier key,
summed over the window and smoothed by 1-D pooling (kernel `kernel_size`,
stride 1, `pooling` max|avg). Keeps the top `budget - window_size` plus the window.
With GQA in the `kv_head` layout the query group's scores are reduced (`gqa_reduce`)
before pooling, as the public PyramidKV and AdaKV code do (`gqa_pooling="after_reduce"`);
`"before_reduce"` pools each query head first (with max pooling the two orders differ).
"""

from dataclasses import dataclass

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.core.scoring import pool_scores, reduce_query_groups, window_attention
from pyramidkv.methods.base import Method

GQA_POOLING_ORDERS = ("after_reduce", "before_reduce")


@dataclass(frozen=True)
class SnapKV(Method):
    """SnapKV's scorer.

    kernel_size: width of the 1-D pooling over the window scores (odd; 1 = no pooling).
    pooling: max or avg pooling.
    gqa_pooling: kv_head layout only: after_reduce pools the query group's reduced scores (the public
        code's order), before_reduce pools each query head first.
    """

    name = "snapkv"
    global_scale = "raw"   # attention received: comparable across layers as it is
    kernel_size: int = 7
    pooling: str = "max"
    gqa_pooling: str = "after_reduce"

    def validate(self) -> None:
        super().validate()
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd integer, got {self.kernel_size!r}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.gqa_pooling not in GQA_POOLING_ORDERS:
            raise ValueError(f"gqa_pooling must be one of {'|'.join(GQA_POOLING_ORDERS)}, got {self.gqa_pooling!r}")
        if self.window_size < 1:
            raise ValueError(f"{self.name} needs window_size >= 1 (the observation window), got {self.window_size}")

    def check_prompt(self, prompt_len: int) -> None:
        super().check_prompt(prompt_len)
        candidates = prompt_len - min(self.window_size, prompt_len)
        compressed = prompt_len > self.prompt_budget(prompt_len)
        if compressed and self.kernel_size > 1 and candidates > 1 and self.kernel_size // 2 >= candidates - 1:
            raise ValueError(f"kernel_size {self.kernel_size} is wider than the prompt: on a {prompt_len}-token prompt "
                             f"the {candidates} tokens before the window all pool to the same score (every score "
                             f"ties); use kernel_size < {2 * candidates - 1} (odd)")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        n = ctx.keys.shape[2]
        w = min(self.window_size, n)
        attention = window_attention(ctx.queries, ctx.keys, ctx.real, w, ctx.pattern, form=ctx.form)  # [B, Hq, w, n]
        prefix_scores = attention[..., : n - w].sum(dim=2)  # [B, Hq, n - w]
        if self.gqa_layout == "kv_head" and self.gqa_pooling == "after_reduce":
            prefix_scores = reduce_query_groups(prefix_scores, ctx.keys.shape[1], self.gqa_reduce)  # [B, Hkv, n - w]
        pooled = pool_scores(prefix_scores, self.kernel_size, self.pooling)
        # Window positions are always kept; give them a score so shapes stay [B, H, n].
        window_scores = torch.zeros(*pooled.shape[:2], w, dtype=pooled.dtype, device=pooled.device)
        return torch.cat([pooled, window_scores], dim=-1)
