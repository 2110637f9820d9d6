"""What a budget allocator is, and the one integer apportionment every allocator ends with.

An allocator answers one question with real-valued shares; `apportion` turns the shares into
integer token counts whose sum is exactly the uniform total, inside per-entry bounds.

Counts here are SELECTED tokens (the observation window excluded): the core adds the window
to every head, so "budget" = window + selected, as everywhere in pyramidkv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from pyramidkv.components import Component, ModelShape


@dataclass(frozen=True)
class Allocation(Component):
    """Base of the allocators: a frozen dataclass whose fields are its settings (defaults live there)."""

    def check_model(self, model: ModelShape) -> None:
        """ValueError if the allocator cannot work on this model (checked before any prompt runs)."""


@dataclass(frozen=True)
class LayerAllocation(Allocation):
    """How many tokens each layer selects."""

    needs_scores: ClassVar[bool] = False   # True: the layer shares depend on every layer's scores

    def selected_per_layer(self, selected: int, num_layers: int, prompt_len: int, candidates: int,
                           layer_scores: Optional[Sequence[torch.Tensor]] = None) -> list[int]:
        """Selected tokens per layer, summing to num_layers * selected, each in [0, candidates].

        prompt_len: the prompt's real length; candidates: its selectable tokens (length minus window);
        layer_scores: per layer [H, candidates] scores, given only when needs_scores."""
        raise NotImplementedError


@dataclass(frozen=True)
class HeadAllocation(Allocation):
    """How a layer's selected tokens are split across its stored heads."""

    global_over_layers: ClassVar[bool] = False  # True: shares are fixed over all layers and heads at once
    needs_scores: ClassVar[bool] = False        # True: the split depends on every layer's scores (selected_over_layers)
    # True: its counts are each head's share of the best scores over every layer, so a layer may drop at once what is
    # not among the best of the layers scored so far (core/running_top.py; selected_over_layers takes empty [H, 0]
    # scores for the layers not scored yet)
    running_top: ClassVar[bool] = False

    def selected_per_head(self, scores: torch.Tensor, selected: int, layer_idx: int, model: ModelShape,
                          protected: int = 0) -> list[int]:
        """scores: [H, candidates] of one prompt and layer (higher = keep); protected: the tokens each head keeps
        besides (window, sinks). Returns H counts summing to H * selected, each in [0, candidates]."""
        raise NotImplementedError


def apportion(exact: Sequence[float], total: int, lower: Sequence[int], upper: Sequence[int]) -> list[int]:
    """Integer counts close to `exact` that sum to `total`, with lower[i] <= count[i] <= upper[i].

    Shares are first clipped to their bounds; what clipping removed (or added) is spread over the
    entries still inside their bounds in proportion to their shares, until nothing moves. The real
    shares are then rounded by largest remainder (ties: lower index first).
    """
    size = len(exact)
    if not (len(lower) == len(upper) == size):
        raise ValueError("apportion: exact, lower and upper must have the same length")
    if any(lo > hi for lo, hi in zip(lower, upper)) or not sum(lower) <= total <= sum(upper):
        raise ValueError(f"cannot apportion {total} within bounds summing to [{sum(lower)}, {sum(upper)}]")
    shares = [min(max(float(x), lo), hi) for x, lo, hi in zip(exact, lower, upper)]
    for _ in range(size + 1):
        gap = total - math.fsum(shares)
        if abs(gap) < 1e-9:
            break
        room = [i for i in range(size) if (shares[i] < upper[i] if gap > 0 else shares[i] > lower[i])]
        weight = math.fsum(shares[i] for i in room)
        for i in room:
            step = gap * (shares[i] / weight if weight > 0 else 1 / len(room))
            shares[i] = min(max(shares[i] + step, lower[i]), upper[i])
    counts = [min(max(math.floor(x + 1e-9), lo), hi) for x, lo, hi in zip(shares, lower, upper)]
    shortfall = total - sum(counts)
    order = sorted(range(size), key=lambda i: (-round(shares[i] - counts[i], 9), i))
    step = 1 if shortfall > 0 else -1
    if step < 0:
        order.reverse()
    for i in order * 2:     # a second pass covers entries whose remainder was 0
        if shortfall == 0:
            break
        if lower[i] <= counts[i] + step <= upper[i]:
            counts[i] += step
            shortfall -= step
    if shortfall:
        raise AssertionError("apportion: could not meet the total within the bounds")
    return counts
