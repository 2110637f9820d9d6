"""ZigZagKV's layer allocation (Zhong et al., COLING 2025, "ZigZagKV: Dynamic KV Cache Compression
for Long-context Modeling based on Layer Uncertainty", arXiv 2412.09036).

LMBA of a head = the fewest top-scored tokens whose score mass (scores clamped at 0) reaches
`attention_threshold` of the head's total; a layer's LMBA is the mean over its heads. With s the
uniform selected count per layer and s_bound = b_bound_ratio x s:
    selected_l = s_bound + (s - s_bound) x L x LMBA_l / sum_k LMBA_k,
which sums to L x s. Shares are apportioned by largest remainder (exact total) and capped at the
prompt's candidates, the excess going to the other layers. Every layer's scores are needed before
any layer is gathered, so the cache keeps each layer's full K/V until the end of prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pyramidkv.allocation.base import LayerAllocation, apportion


def lmba(scores: torch.Tensor, threshold: float) -> float:
    """Mean over heads of the fewest top scores reaching `threshold` of the head's (clamped) score mass.

    scores: [H, m]. A head whose scores are all <= 0 counts m (nothing concentrates its attention)."""
    clamped = scores.float().clamp(min=0)
    total = clamped.sum(-1)                                       # [H]
    cumulative = clamped.sort(dim=-1, descending=True).values.cumsum(-1)
    reached = cumulative >= threshold * total[:, None] - 1e-12 * total[:, None]
    counts = reached.float().argmax(-1) + 1                       # first index reaching the mass
    counts = torch.where(total > 0, counts, torch.full_like(counts, scores.shape[-1]))
    return counts.float().mean().item()


@dataclass(frozen=True)
class ZigZagLayers(LayerAllocation):
    """ZigZagKV's layer budgets.

    attention_threshold: the score mass LMBA counts, in (0, 1].
    b_bound_ratio: each layer's guaranteed share of the uniform budget, in [0, 1].
    """

    name = "zigzag"
    needs_scores = True
    attention_threshold: float = 0.9
    b_bound_ratio: float = 0.2

    def validate(self) -> None:
        if not 0.0 < self.attention_threshold <= 1.0:
            raise ValueError(f"attention_threshold must be in (0, 1] (the score mass LMBA counts), "
                             f"got {self.attention_threshold!r}")
        if not 0.0 <= self.b_bound_ratio <= 1.0:
            raise ValueError(f"b_bound_ratio must be in [0, 1] (each layer's guaranteed share of the uniform "
                             f"budget), got {self.b_bound_ratio!r}")

    def selected_per_layer(self, selected, num_layers, prompt_len, candidates, layer_scores=None):
        if layer_scores is None or len(layer_scores) != num_layers:
            raise ValueError("zigzag needs every layer's scores")
        values = [lmba(scores, self.attention_threshold) for scores in layer_scores]
        total = math.fsum(values)
        bound = self.b_bound_ratio * selected
        if total <= 0:
            exact = [float(selected)] * num_layers
        else:
            exact = [bound + (selected - bound) * num_layers * v / total for v in values]
        return apportion(exact, num_layers * selected, [min(math.floor(bound), candidates)] * num_layers,
                         [candidates] * num_layers)
