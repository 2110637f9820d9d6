"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

SnapKV scoring with budgets that shrink linearly with depth. Published rule,
with s = budget - window_size selected tokens per layer on average:
    min = s / beta, max = 2 s - min, linear from max (layer 0) to min (layer L-1).
As in the public code, a prompt of n tokens caps max at n - window_size (min = 2 s - max,
so the mean stays s), and a prompt shorter than 2 s falls back to uniform budgets.
The public harness rounds the step down and overshoots the total (+9.8% at budget 128
on 30 layers); here the per-layer counts are apportioned by largest remainder so the total
over layers equals exactly L * s (the uniform total) in every case.
"""

from dataclasses import dataclass
import math
from typing import Optional

from pyramidkv.methods.snapkv import SnapKV


def pyramid_layer_counts(selected: int, num_layers: int, beta: float, max_count: Optional[int] = None) -> list[int]:
    """Integer selected-token counts per layer, linear max -> min, summing to num_layers * selected.

    max_count caps the first layer's share (the prompt's candidates); min then rises to keep the mean.
    """
    if num_layers == 1:
        return [selected]
    low = selected / beta
    high = 2 * selected - low
    if max_count is not None and high > max_count:
        high, low = max_count, 2 * selected - max_count
    step = (high - low) / (num_layers - 1)
    exact = [high - layer * step for layer in range(num_layers)]
    counts = [math.floor(x) for x in exact]
    shortfall = num_layers * selected - sum(counts)
    # Largest fractional parts first; ties go to the lower (larger-budget) layer.
    order = sorted(range(num_layers), key=lambda layer: (-(exact[layer] - counts[layer]), layer))
    for layer in order[:shortfall]:
        counts[layer] += 1
    return counts


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    beta: float = 20.0

    def validate(self) -> None:
        super().validate()
        if not self.beta >= 1:
            raise ValueError(f"beta must be >= 1 (min layer budget = (budget - window) / beta), got {self.beta!r}")

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int) -> list[int]:
        selected = budget - self.window_size
        if prompt_len < 2 * selected:
            return [budget] * num_layers  # too short for a pyramid (the public code's fallback)
        counts = pyramid_layer_counts(selected, num_layers, self.beta, max_count=prompt_len - self.window_size)
        return [self.window_size + c for c in counts]
