"""Threshold eviction (`threshold=-3`), the rule of DMS (Łańcucki et al., 2025, arXiv 2506.05345) as kvpress's
DMSPress applies it to any scorer: a token that has left the recent window (the method's `window_size`) stays in a
stored head iff its score there is >= `threshold` (evicted iff strictly below), with the raw scores, no
normalisation. The count is an outcome, not a setting: each layer and head holds what passes, so the cache is
ragged and physically that size; runs report the achieved share per layer and head (never a nominal budget).

At prefill every prompt token before the window is decided at once. With `threshold_decoding` (the default) each
later token, the prompt's window included, is decided when it leaves the window (exactly `window_size` steps after
it arrived), by the score it was given when it entered (core/threshold.py); this needs a scorer whose score of a
token reads that token alone (`Method.token_scores`: KVzap, Q-Filters, head tables). Without it the window and
every generated token stay (kvpress's default, `decoding=False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.components import Conflict
from pyramidkv.sizing.base import Sizing

# The lowest finite score a scorer can give (scores are float32, or bfloat16 / float16 whose ranges lie inside it):
# a threshold at or below it keeps every token.
LOWEST_SCORE = float(torch.finfo(torch.float32).min)

_DECIDES = "the threshold decides every layer's and head's tokens itself"


@dataclass(frozen=True)
class Threshold(Sizing):
    """Threshold eviction: each stored head keeps the tokens scored >= threshold, besides the window and sinks.

    threshold: a token out of the recent window stays iff its score >= threshold (the scorer's raw scale:
        KVzap's log scores, a head table's values); no default fits every scorer, so it must be given unless
        the method's own default is calibrated for its score (kvzap's -3, duo_attention's 0.5).
    threshold_decoding: also while decoding: each token is decided as it leaves the recent window, by the
        score it got on entering (needs a per-token scorer); false: the prompt's window and every
        generated token are kept.
    """

    name = "threshold"
    kind = "threshold"
    outcome = True
    # What a threshold cannot compose with: (when it applies, the one line that says why).
    conflicts = (
        Conflict("layer_allocation", lambda m: m.layer_allocation.name != "uniform",
                 f"threshold eviction: {_DECIDES}; it cannot be combined with layer_allocation="
                 "{m.layer_allocation.name!r} (use layer_allocation='uniform')"),
        Conflict("head_allocation", lambda m: m.head_allocation.name != "uniform",
                 f"threshold eviction: {_DECIDES}; it cannot be combined with head_allocation="
                 "{m.head_allocation.name!r} (use head_allocation='uniform')"),
        Conflict("merge", lambda m: m.merge is not None,
                 "threshold eviction drops what fails its threshold; it does not combine with merge={m.merge.name!r}"),
        Conflict("random_fraction", lambda m: bool(m.selection.random_fraction),
                 "threshold eviction keeps exactly what passes its threshold; it does not combine with "
                 "random_fraction={m.selection.random_fraction:g}"),
        Conflict("cross_layer_merge", lambda m: m.layer_sharing is not None,
                 "threshold eviction decides each layer by its own scores; it does not combine with cross_layer_merge "
                 "(a merged pair selects on the sum of two layers' scores)"),
    )
    # What deciding tokens while decoding cannot compose with: another decode-time rule or store.
    decoding_conflicts = (("decode_budget", "decode"), ("page_budget", "pages"), ("cross_layer_merge", "layer_sharing"),
                          ("quant_method", "quant_method"), ("key_channel_ratio", "channels"))
    threshold: Optional[float] = None
    threshold_decoding: bool = True

    def validate(self) -> None:
        if self.threshold is None:   # check_with says that one must be given, naming the method
            return
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or self.threshold != self.threshold or abs(self.threshold) == float("inf"):
            raise ValueError(f"threshold must be a finite number (a token stays iff its score >= threshold), "
                             f"got {self.threshold!r}")
        if self.threshold <= LOWEST_SCORE:
            raise ValueError(f"threshold {self.threshold!r} is at or below every score a scorer can give (the lowest "
                             f"float32 is {LOWEST_SCORE:.7g}): every token would be kept (that is fullkv); allowed: a "
                             f"threshold above {LOWEST_SCORE:.7g}, inside the range of the method's scores")

    def per_prompt(self, real_len: int, method) -> int:
        return method.selection.num_sinks   # every token but the sinks may go (the window's are decided later)

    def folder_part(self, method) -> str:
        return "threshold"

    def recorded(self, method):
        return "threshold"

    def decode_threshold(self) -> Optional[float]:
        return self.threshold if self.threshold_decoding else None

    def selected_per_head(self, scores: torch.Tensor) -> list[int]:
        """scores [H, candidates]: per head the candidates scored >= threshold."""
        return (scores >= self.threshold).sum(dim=-1).tolist()

    def check_with(self, method) -> None:
        super().check_with(method)
        name = method.name
        if self.threshold is None:
            raise ValueError(f"threshold eviction on {name} needs a threshold on {name}'s raw scores (no default fits "
                             f"every scorer: a token stays iff its score >= threshold); give one with threshold=X "
                             f"(--threshold X), a value inside the range of {name}'s scores")
        if method.score_bounds is not None:
            low, high = method.score_bounds
            if not low < self.threshold <= high:
                keeps = "every token (that is fullkv)" if self.threshold <= low else \
                    "no token outside the window and sinks"
                raise ValueError(f"threshold {self.threshold!r}: every score of {name} lies in [{low:g}, {high:g}], "
                                 f"so it would keep {keeps}; allowed: {low:g} < threshold <= {high:g}")
        if not self.threshold_decoding:
            return
        if not method.token_scores:
            raise ValueError(f"threshold_decoding decides each token when it leaves the window by the score it got on "
                             f"entering, which needs a score that reads the token alone; {name}'s reads other "
                             f"tokens' queries or keys: use threshold_decoding=false (decide the prompt only) or a "
                             f"per-token scorer (kvzap, qfilter, kvzip_head, duo_attention)")
        for setting, field in self.decoding_conflicts:
            if getattr(method, field) is not None:
                raise ValueError(f"threshold_decoding evicts tokens while decoding; it does not combine with {setting} "
                                 f"(use threshold_decoding=false to decide the prompt only)")
