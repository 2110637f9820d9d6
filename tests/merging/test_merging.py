"""Merge rules against independent numpy references written from the formulas (../shared/ADAPTIVE.md,
"Merging evicted tokens"), on small hand-made keys and values with known similarities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyramidkv import make_method
from pyramidkv.merging import CamMerge, MergeGroup, MergingPress, PivotMerge, WeightedMerge, merge_prompt
from tests.reference import ref_cam, ref_mergingpress, ref_pivot, ref_route, ref_weighted


# ---- hand-made case ------------------------------------------------------------------------------
def hand_made():
    """Head 0: exact ties and several tokens routed to one survivor; head 1: random with negative cosines."""
    kept_keys_0 = [[1, 0, 0], [0, 1, 0], [1, 0, 0]]                 # slots 0 and 2 point the same way
    evicted_keys_0 = [[2, 0.5, 0], [0.5, 3, 0], [-1, -1, 0],        # -> 0;  -> 1;  all cosines negative, tie -> 0
                      [0, 0, 1], [1, 0, 0], [3, 0, 0]]              # cos 0 everywhere -> 0; exact ties -> 0
    rng = np.random.default_rng(7)
    kept_keys_1 = rng.normal(size=(3, 3))
    evicted_keys_1 = -np.abs(rng.normal(size=(6, 3))) * np.sign(kept_keys_1.sum(0))  # mostly negative cosines
    kept_keys = np.stack([kept_keys_0, kept_keys_1]).astype(np.float32)
    evicted_keys = np.stack([evicted_keys_0, evicted_keys_1]).astype(np.float32)
    kept_values = rng.normal(size=(2, 3, 3)).astype(np.float32)
    evicted_values = rng.normal(size=(2, 6, 3)).astype(np.float32)
    return kept_keys, kept_values, evicted_keys, evicted_values


def group_of(kept_keys, kept_values, evicted_keys, evicted_values, kept_positions=None, evicted_positions=None,
             attention=None, window=0, generator=None):
    heads, k = kept_keys.shape[:2]
    e = evicted_keys.shape[1]
    if kept_positions is None:
        kept_positions = np.tile(np.arange(e, e + k), (heads, 1))
        evicted_positions = np.tile(np.arange(e), (heads, 1))
    t = torch.from_numpy
    return MergeGroup(t(kept_keys), t(kept_values), t(np.asarray(kept_positions)).long(), t(evicted_keys),
                      t(evicted_values), t(np.asarray(evicted_positions)).long(),
                      None if attention is None else t(np.asarray(attention, dtype=np.float32)), window, generator)


def test_hand_made_routing_has_ties_shared_targets_and_negative_cosines():
    """The case exercises what it claims (checked with the reference, not the code under test)."""
    kept_keys, _, evicted_keys, _ = hand_made()
    sims, targets = ref_route(evicted_keys[0].astype(np.float64), kept_keys[0].astype(np.float64))
    assert targets == [0, 1, 0, 0, 0, 0]
    assert sims[2] < 0 and sims[3] == 0
    sims1, _ = ref_route(evicted_keys[1].astype(np.float64), kept_keys[1].astype(np.float64))
    assert (sims1 < 0).any()


@pytest.mark.parametrize("rule", ["pivot", "weighted"])
def test_pivot_and_weighted_match_reference(rule):
    kept_keys, kept_values, evicted_keys, evicted_values = hand_made()
    unit = PivotMerge() if rule == "pivot" else WeightedMerge()
    keys, values = unit.merge(group_of(kept_keys, kept_values, evicted_keys, evicted_values))
    for h in range(2):
        sims, targets = ref_route(evicted_keys[h].astype(np.float64), kept_keys[h].astype(np.float64))
        for got, kept, evicted in ((keys, kept_keys, evicted_keys), (values, kept_values, evicted_values)):
            if rule == "pivot":
                want = ref_pivot(kept[h].astype(np.float64), evicted[h].astype(np.float64), targets)
            else:
                want = ref_weighted(kept[h].astype(np.float64), evicted[h].astype(np.float64), targets, (sims + 1) / 2)
            np.testing.assert_allclose(got[h].numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threshold,fraction", [(0.0, 1.0), (0.0, 0.5), (-1.0, 1.0), (-1.0, 0.5), (0.3, 0.75)])
def test_mergingpress_matches_reference(threshold, fraction):
    kept_keys, kept_values, evicted_keys, evicted_values = hand_made()
    keys, values = MergingPress(similarity_threshold=threshold, merge_fraction=fraction).merge(
        group_of(kept_keys, kept_values, evicted_keys, evicted_values))
    assert torch.equal(keys, torch.from_numpy(kept_keys))  # keys untouched, bit for bit
    for h in range(2):
        want = ref_mergingpress(*(x[h].astype(np.float64) for x in (kept_keys, kept_values, evicted_keys,
                                                                       evicted_values)), threshold, fraction)
        np.testing.assert_allclose(values[h].numpy(), want, rtol=1e-5, atol=1e-6)
    assert not np.isnan(values.numpy()).any()


def test_mergingpress_threshold_above_every_similarity_is_plain_eviction():
    kept_keys, kept_values, evicted_keys, evicted_values = hand_made()
    evicted_keys[0, 4:] = [[1, 0.1, 0], [1, 0, 0.2]]  # no evicted key parallel to a kept one: every cosine < 1
    keys, values = MergingPress(similarity_threshold=1.0).merge(group_of(kept_keys, kept_values, evicted_keys,
                                                                         evicted_values))
    assert torch.equal(values, torch.from_numpy(kept_values)) and torch.equal(keys, torch.from_numpy(kept_keys))


def test_mergingpress_fraction_keeps_the_most_similar_half():
    """A case where the chosen half is known by hand: cosines 0.9, 0.1, 0.5, 0.7 -> the 0.9 and 0.7 tokens merge."""
    kept_keys = np.array([[[1, 0]]], dtype=np.float32)
    cosines = [0.9, 0.1, 0.5, 0.7]
    evicted_keys = np.array([[[c, math.sqrt(1 - c * c)] for c in cosines]], dtype=np.float32)
    kept_values = np.array([[[1.0, 1.0]]], dtype=np.float32)
    evicted_values = np.array([[[10, 0], [0, 10], [20, 0], [0, 20]]], dtype=np.float32)
    _, values = MergingPress(merge_fraction=0.5).merge(group_of(kept_keys, kept_values, evicted_keys, evicted_values))
    weights = {i: cosines[i] * np.linalg.norm(evicted_values[0, i]) / (np.linalg.norm(evicted_values[0, i]) +
                                                                       math.sqrt(2) + 1e-6) for i in (0, 3)}
    want = (kept_values[0, 0] + sum(w * evicted_values[0, i] for i, w in weights.items())) / (1 + sum(weights.values()))
    np.testing.assert_allclose(values[0, 0].numpy(), want, rtol=1e-5)


def test_merge_prompt_leaves_a_head_that_evicts_nothing_as_it_is():
    """Ragged heads of one prompt with left padding: head 0 keeps every real token, head 1 keeps 3 of 6."""
    rng = np.random.default_rng(3)
    pad, real_len, dim = 2, 6, 4
    keys = torch.from_numpy(rng.normal(size=(2, pad + real_len, dim)).astype(np.float32))
    values = torch.from_numpy(rng.normal(size=(2, pad + real_len, dim)).astype(np.float32))
    positions = [torch.arange(pad, pad + real_len), torch.tensor([3, 6, 7])]
    out_keys, out_values = merge_prompt(MergingPress(), keys, values, positions, pad, None, 0, None)
    assert torch.equal(out_keys[0], keys[0, pad:]) and torch.equal(out_values[0], values[0, pad:])
    kept = [1, 4, 5]
    evicted = [0, 2, 3]  # prompt coordinates; padding (padded positions 0, 1) is never a source
    real_keys, real_values = keys[1, pad:].double().numpy(), values[1, pad:].double().numpy()
    want = ref_mergingpress(real_keys[kept], real_values[kept], real_keys[evicted], real_values[evicted], 0.0, 1.0)
    assert torch.equal(out_keys[1], keys[1, [3, 6, 7]])
    np.testing.assert_allclose(out_values[1].numpy(), want, rtol=1e-5, atol=1e-6)


# ---- CaM ---------------------------------------------------------------------------------------
def cam_case():
    """12 real tokens, window 3 (9, 10, 11); kept 0, 4, 6 + window; evicted 1, 2, 3, 5, 7, 8."""
    rng = np.random.default_rng(11)
    kept_positions = np.array([[0, 4, 6, 9, 10, 11]])
    evicted_positions = np.array([[1, 2, 3, 5, 7, 8]])
    attention = np.array([[0.30, 0.50, 0.10, 0.00, 0.02, 0.15, 0.03, 0.06, 0.80, 0.05, 0.04, 0.60]])
    kept_values = rng.normal(size=(1, 6, 4)).astype(np.float32)
    evicted_values = rng.normal(size=(1, 6, 4)).astype(np.float32)
    keys = rng.normal(size=(1, 6, 4)).astype(np.float32)
    evicted_keys = rng.normal(size=(1, 6, 4)).astype(np.float32)
    return keys, kept_values, evicted_keys, evicted_values, kept_positions, evicted_positions, attention


@pytest.mark.parametrize("spread", [None, 2, 4])
@pytest.mark.parametrize("start_ratio", [0.1, 0.3])
def test_cam_expected_merge_matches_reference(spread, start_ratio):
    keys, kept_values, evicted_keys, evicted_values, kept_pos, evicted_pos, attention = cam_case()
    group = group_of(keys, kept_values, evicted_keys, evicted_values, kept_pos, evicted_pos, attention, window=3)
    out_keys, values = CamMerge(start_budget_ratio=start_ratio, merge_budget=spread).merge(group)
    assert torch.equal(out_keys, torch.from_numpy(keys))
    want = ref_cam(kept_pos[0], kept_values[0].astype(np.float64), evicted_pos[0], evicted_values[0].astype(np.float64),
                   attention[0], 3, start_ratio, spread or 3)
    np.testing.assert_allclose(values[0].numpy(), want, rtol=1e-5, atol=1e-6)
    # Hand check of one slot (start ratio 0.1 -> start tokens 0, 1; reference max(0.30, 0.50, 0.05, 0.04, 0.60) =
    # 0.6, not position 8's 0.80 just before the window): with spread 2, kept position 4 receives half of evicted 2
    # (p = 0.1 / 0.6) and of evicted 3 (p = 0); position 1 < start never merges.
    if spread == 2 and start_ratio == 0.1:
        hand = kept_values[0, 1] + (0.1 / 0.6) * evicted_values[0, 1] / 2
        np.testing.assert_allclose(values[0, 1].numpy(), hand, rtol=1e-5)


def test_cam_sampling_with_certain_probabilities_equals_the_expected_merge():
    """p is 0 or 1 for every evicted token: every Bernoulli draw is then known."""
    keys, kept_values, evicted_keys, evicted_values, kept_pos, evicted_pos, _ = cam_case()
    attention = np.array([[0.5, 0.9, 0.0, 0.7, 0.1, 0.0, 0.2, 0.6, 0.0, 0.3, 0.2, 0.1]])
    generator = torch.Generator().manual_seed(0)
    group = group_of(keys, kept_values, evicted_keys, evicted_values, kept_pos, evicted_pos, attention, 3, generator)
    _, sampled = CamMerge(sampling=True).merge(group)
    draws = [1.0 if attention[0, p] >= 0.5 else 0.0 for p in evicted_pos[0]]
    want = ref_cam(kept_pos[0], kept_values[0].astype(np.float64), evicted_pos[0], evicted_values[0].astype(np.float64),
                   attention[0], 3, 0.1, 3, draws)
    np.testing.assert_allclose(sampled[0].numpy(), want, rtol=1e-5, atol=1e-6)


def test_cam_sampling_reproduces_with_a_seed_and_varies_across_seeds():
    rng = np.random.default_rng(5)
    k, e, dim = 40, 400, 8
    positions = rng.permutation(k + e)
    kept_pos, evicted_pos = np.sort(positions[:k])[None], np.sort(positions[k:])[None]
    kept_pos[0, -3:] = [k + e - 3, k + e - 2, k + e - 1]
    evicted_pos = np.setdiff1d(np.arange(k + e), kept_pos[0])[None]
    attention = np.full((1, k + e), 0.5)
    attention[0, -1] = 1.0  # every p = 0.5
    args = (rng.normal(size=(1, k, dim)).astype(np.float32), rng.normal(size=(1, k, dim)).astype(np.float32),
            rng.normal(size=(1, e, dim)).astype(np.float32), rng.normal(size=(1, e, dim)).astype(np.float32),
            kept_pos, evicted_pos, attention, 3)
    runs = [CamMerge(sampling=True).merge(group_of(*args, torch.Generator().manual_seed(s)))[1] for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


# ---- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize("settings,message", [
    ({"merge": "average"}, "unknown merge rule 'average'; choose one of: pivot, weighted, mergingpress, cam"),
    ({"merge": "mergingpress", "similarity_threshold": 1.5}, "similarity_threshold must be in [-1, 1]"),
    ({"merge": "mergingpress", "similarity_threshold": -1.01}, "similarity_threshold must be in [-1, 1]"),
    ({"merge": "mergingpress", "merge_fraction": 0.0}, "merge_fraction must be in (0, 1]"),
    ({"merge": "mergingpress", "merge_fraction": 1.2}, "merge_fraction must be in (0, 1]"),
    ({"merge_fraction": 0.5}, "merge_fraction is a setting of the merge rule mergingpress"),
    ({"merge": "cam", "merge_budget": 0}, "merge_budget must be an integer >= 1"),
    ({"merge": "pivot", "similarity_threshold": 0.5}, "similarity_threshold is a setting of the merge rule mergingpress, not of pivot"),
])
def test_bad_merge_settings_are_refused(settings, message):
    with pytest.raises(ValueError) as error:
        make_method("snapkv", budget=64, **settings)
    assert message in str(error.value)


def test_fullkv_takes_no_merge_rule():
    with pytest.raises(ValueError, match="fullkv keeps every token, so it evicts none to merge"):
        make_method("fullkv", merge="pivot")


def test_cam_merging_needs_an_observation_window():
    with pytest.raises(ValueError, match="needs window_size >= 1"):
        make_method("streamingllm", budget=64, merge="cam")
    with pytest.raises(ValueError, match="cam is SnapKV-style scoring plus CaM's merge rule"):
        make_method("cam", budget=64, merge="pivot")


def test_merge_rule_objects_and_names_are_the_same_setting():
    assert make_method("h2o", budget=64, merge="mergingpress", merge_fraction=0.5) == \
        make_method("h2o", budget=64, merge=MergingPress(merge_fraction=0.5))
    assert make_method("cam", budget=64).merge == CamMerge()
    assert make_method("snapkv", budget=64).merge is None
