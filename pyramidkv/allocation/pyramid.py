"""PyramidKV's layer allocation (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling").

With s selected tokens per layer on average: min = s / beta, max = 2 s - min, linear from max
(layer 0) to min (layer L-1). As in the public code, a prompt with c = n - window candidates caps
max at c (min = 2 s - max, so the mean stays s), and a prompt with fewer than 2 s tokens falls
back to uniform. The public harness rounds the step down and overshoots the total (+9.8% at
budget 128 on 30 layers); here the shares are apportioned by largest remainder, so the total over
layers is exactly L * s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyramidkv.allocation.base import LayerAllocation, apportion


def pyramid_shares(selected: int, num_layers: int, beta: float, max_count: float) -> list[float]:
    """Real per-layer shares, linear from max to min, mean `selected`, max capped at max_count."""
    if num_layers == 1:
        return [float(selected)]
    low = selected / beta
    high = 2 * selected - low
    if high > max_count:
        high, low = max_count, 2 * selected - max_count
    step = (high - low) / (num_layers - 1)
    return [high - layer * step for layer in range(num_layers)]


@dataclass(frozen=True)
class PyramidLayers(LayerAllocation):
    """PyramidKV's layer budgets.

    beta: the last layer selects (budget - window) / beta tokens, the first 2 (budget - window) minus
        that (>= 1).
    """

    name = "pyramid"
    beta: float = 20.0

    def validate(self) -> None:
        if not self.beta >= 1:
            raise ValueError(f"beta must be >= 1 (min layer budget = (budget - window) / beta), got {self.beta!r}")

    def selected_per_layer(self, selected, num_layers, prompt_len, candidates, layer_scores=None):
        if prompt_len < 2 * selected:
            return [selected] * num_layers  # too short for a pyramid (the public code's fallback)
        shares = pyramid_shares(selected, num_layers, self.beta, candidates)
        return apportion(shares, num_layers * selected, [0] * num_layers, [candidates] * num_layers)
