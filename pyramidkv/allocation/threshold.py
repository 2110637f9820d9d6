"""Threshold eviction (`head_allocation="threshold"`), the rule of DMS (Łańcucki et al., 2025, arXiv 2506.05345) as
kvpress's DMSPress applies it to any scorer: a token that has left the recent window (the method's `window_size`)
stays in a stored head iff its score there is >= `threshold` (evicted iff strictly below), with the raw scores, no
normalisation. Budgets are an outcome, not a setting: each layer and head holds what passes, so the cache is
ragged and physically that size; runs report the achieved share per layer and head (never a nominal budget).

At prefill every prompt token before the window is decided at once. With `threshold_decoding` (the default) each
later token, the prompt's window included, is decided when it leaves the window (exactly `window_size` steps after
it arrived), by the score it was given when it entered (core/threshold.py); this needs a scorer whose score of a
token reads that token alone (`Method.token_scores`: KVzap, Q-Filters, head tables). Without it the window and
every generated token stay (kvpress's default, `decoding=False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.allocation.base import HeadAllocation

# The lowest finite score a scorer can give (scores are float32, or bfloat16 / float16 whose ranges lie inside it):
# a threshold at or below it keeps every token.
LOWEST_SCORE = float(torch.finfo(torch.float32).min)


@dataclass(frozen=True)
class ThresholdHeads(HeadAllocation):
    """Threshold eviction: each stored head keeps the tokens scored >= threshold, besides the window and sinks.

    threshold: a token out of the recent window stays iff its score >= threshold (the scorer's raw scale:
        KVzap's log scores, a head table's values); no default fits every scorer, so it must be given unless
        the method's own default is calibrated for its score (kvzap's -3, duo_attention's 0.5).
    threshold_decoding: also while decoding: each token is decided as it leaves the recent window, by the
        score it got on entering (needs a per-token scorer); false: the prompt's window and every
        generated token are kept.
    """

    name = "threshold"
    sets_budget: ClassVar[bool] = True   # no budget: each head keeps what its scores pass
    threshold: Optional[float] = None
    threshold_decoding: bool = True

    def validate(self) -> None:
        if self.threshold is None:   # the method checks that one is given (composition.check_allocation)
            return
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or self.threshold != self.threshold or abs(self.threshold) == float("inf"):
            raise ValueError(f"threshold must be a finite number (a token stays iff its score >= threshold), "
                             f"got {self.threshold!r}")
        if self.threshold <= LOWEST_SCORE:
            raise ValueError(f"threshold {self.threshold!r} is at or below every score a scorer can give (the lowest "
                             f"float32 is {LOWEST_SCORE:.7g}): every token would be kept (that is fullkv); allowed: a "
                             f"threshold above {LOWEST_SCORE:.7g}, inside the range of the method's scores")

    def selected_per_head(self, scores, selected, layer_idx, model, protected=0):
        """scores [H, candidates]: per head the candidates scored >= threshold (`selected` is not read)."""
        return (scores >= self.threshold).sum(dim=-1).tolist()
