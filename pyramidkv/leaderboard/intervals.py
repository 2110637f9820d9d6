"""Paired bootstrap intervals of a score difference: how sure the leaderboard is that one entry beats another.

Two entries are compared on the same samples (the same task and sample key; RULER's and the needle's samples are
generated from fixed seeds, so every entry of a grid sees the same ones): per task, the per-sample score
differences. The statistic is the mean over tasks of the per-task mean difference (the page's score is the mean
over tasks of the task scores). One resample draws, within each task, as many differences as it has, with
replacement; RESAMPLES resamples from numpy's default_rng(SEED) give the percentile interval at LEVEL (95 %). A
difference whose interval holds 0 is one the samples cannot tell from none: the page marks it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

RESAMPLES, SEED, LEVEL = 2000, 0, 0.95


def paired_interval(strata: Sequence[Sequence[float]], resamples: int = RESAMPLES, seed: int = SEED,
                    level: float = LEVEL) -> Optional[tuple[float, float, float]]:
    """(mean difference, low, high) from per-task lists of paired differences; None when no task has any.

    The mean is the mean over the non-empty tasks of each task's mean difference; (low, high) its percentile
    bootstrap interval at `level`, resampling within each task."""
    import numpy as np

    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"resamples {resamples!r} must be >= 1 and level {level!r} in (0, 1)")
    groups = [np.asarray(s, dtype=np.float64) for s in strata if len(s)]
    if not groups:
        return None
    mean = math.fsum(math.fsum(g.tolist()) / len(g) for g in groups) / len(groups)
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for g in groups:
        means += g[rng.integers(0, len(g), size=(resamples, len(g)))].mean(axis=1)
    means /= len(groups)
    tail = (1.0 - level) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return mean, float(low), float(high)


def differences(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> list[list[float]]:
    """Per task both hold, the differences a - b of the samples both scored ({task: {sample key: score}})."""
    return [[a[t][k] - b[t][k] for k in a[t] if k in b[t]] for t in a if t in b]


def holds_zero(interval: Optional[tuple[float, float, float]]) -> bool:
    return interval is not None and interval[1] <= 0.0 <= interval[2]
