"""The paired bootstrap intervals (leaderboard/intervals.py) on cases whose answer is known in closed form or by
enumerating every resample, and their coverage on normal data of known mean."""

from __future__ import annotations

import numpy as np
import pytest

from pyramidkv.leaderboard.intervals import differences, holds_zero, paired_interval


def test_identical_scores_give_zero_and_a_constant_shift_gives_the_shift():
    assert paired_interval([[0.0, 0.0, 0.0]]) == (0.0, 0.0, 0.0)
    mean, low, high = paired_interval([[-25.0] * 5, [-25.0] * 3])
    assert (mean, low, high) == pytest.approx((-25.0, -25.0, -25.0))


def test_two_samples_by_enumeration():
    # differences (0, 1): a resample's mean is 0 (1/4), 0.5 (1/2) or 1 (1/4); the 2.5 % and 97.5 % points are 0, 1
    assert paired_interval([[0.0, 1.0]]) == pytest.approx((0.5, 0.0, 1.0))


def test_four_samples_by_enumeration():
    # differences (0, 0, 0, 3): k draws of the 3 ~ Binomial(4, 1/4); P(k = 4) = 1/256 < 2.5 % < P(k >= 3) = 13/256,
    # so the 97.5 % point is 3 x 3/4 = 2.25; P(k = 0) = 81/256 > 2.5 %: the 2.5 % point is 0
    assert paired_interval([[0.0, 0.0, 0.0, 3.0]]) == pytest.approx((0.75, 0.0, 2.25))


def test_tasks_are_resampled_apart_and_averaged():
    # task A: all +10 (no spread), task B: (0, 1) -> the mean of the task means: 5 + (0 .. 1) / 2
    assert paired_interval([[10.0] * 3, [0.0, 1.0]]) == pytest.approx((5.25, 5.0, 5.5))


def test_coverage_of_a_known_mean_is_near_95_percent():
    rng = np.random.default_rng(1)
    hits = sum(holds_zero(paired_interval([rng.normal(0.0, 1.0, 40).tolist()], resamples=1000, seed=s))
               for s in range(200))
    assert 0.88 * 200 <= hits <= 0.99 * 200      # the percentile bootstrap runs a little under 95 % at n = 40


def test_differences_pair_by_task_and_sample_key():
    a = {"t1": {"0": 100.0, "1": 0.0, "2": 50.0}, "t2": {"0": 0.0}}
    b = {"t1": {"0": 100.0, "1": 100.0}, "t3": {"0": 0.0}}
    assert differences(a, b) == [[0.0, -100.0]]
    assert paired_interval([]) is None and paired_interval([[]]) is None and not holds_zero(None)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="resamples 0 must be >= 1 and level 0.95"):
        paired_interval([[1.0]], resamples=0)
