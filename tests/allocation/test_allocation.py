"""Budget allocators against independent references: hand-worked cases and numpy written from the
papers' formulas (nothing here calls pyramidkv's allocation code to compute an expected value)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyramidkv import make_method
from pyramidkv.allocation import ModelShape, apportion
from pyramidkv.allocation.zigzag import lmba

SHAPE = ModelShape(num_layers=2, num_query_heads=3, num_kv_heads=3)


# --- references ---------------------------------------------------------------------------------

def largest_remainder(exact, total, lower, upper):
    """Exact shares inside their bounds -> integers summing to total (ties: lower index first)."""
    exact = np.clip(np.asarray(exact, dtype=float), lower, upper)
    assert math.isclose(exact.sum(), total), "reference: shares must already sum to the total"
    counts = np.floor(exact + 1e-9).astype(int)
    order = np.lexsort((np.arange(len(exact)), -np.round(exact - counts, 9)))
    counts[order[: total - counts.sum()]] += 1
    return counts.tolist()


def adakv_reference(scores: np.ndarray, base: int, alpha: float) -> list[int]:
    """Ada-KV: c_h = head h's entries among the top H*base of all heads (ties: higher score, later position,
    lower head); head h gets alpha*base + (1-alpha)*c_h, apportioned to exactly H*base."""
    heads, m = scores.shape
    entries = [(-scores[h, j], -j, h) for h in range(heads) for j in range(m)]
    chosen = sorted(entries)[: heads * base]
    c = np.bincount([h for _, _, h in chosen], minlength=heads)
    return largest_remainder(alpha * base + (1 - alpha) * c, heads * base, [math.floor(alpha * base)] * heads,
                             [m] * heads)


def lmba_reference(scores: np.ndarray, threshold: float) -> float:
    per_head = []
    for row in np.clip(scores, 0, None):
        ordered = np.sort(row)[::-1]
        if ordered.sum() == 0:
            per_head.append(len(row))
            continue
        per_head.append(int(np.argmax(np.cumsum(ordered) >= threshold * ordered.sum() - 1e-12)) + 1)
    return float(np.mean(per_head))


# --- apportion ----------------------------------------------------------------------------------

def test_apportion_hand_worked():
    assert apportion([1.5, 1.5, 3.0], 6, [0, 0, 0], [9, 9, 9]) == [2, 1, 3]      # tie -> lower index
    # clipped at 3: the removed 7 go to the others in proportion to their shares (1 : 2)
    assert apportion([10.0, 1.0, 2.0], 13, [0, 0, 0], [3, 10, 10]) == [3, 3, 7]
    # raised to a lower bound of 2: the others give back in proportion
    assert apportion([0.0, 4.0, 4.0], 8, [2, 0, 0], [8, 8, 8]) == [2, 3, 3]
    with pytest.raises(ValueError, match="cannot apportion 10 within bounds"):
        apportion([5.0, 5.0], 10, [0, 0], [4, 4])


# --- AdaKV --------------------------------------------------------------------------------------

HAND = torch.tensor([
    [9.0, 8.0, 7.0, 1.0, 1.0, 1.0, 0.5, 0.5],     # a peaked head
    [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],     # all equal
    [0.0, 6.0, 0.0, 6.0, 2.0, 2.0, 2.0, 9.0],     # ties at 6 and 2
])


def test_adakv_hand_worked():
    # base 3, H 3: the top 9 of all 24 are 9, 9, 8, 7, 6, 6, 3 (x3 of the eight 3s, the latest first)
    # -> c = [3, 3, 3]? No: head 0 has 9, 8, 7; head 2 has 9, 6, 6; the 9th..: three 3s from head 1.
    method = make_method("adakv", budget=3 + 2, window_size=2, floor_ratio=0.0)
    assert method.head_allocation.selected_per_head(HAND, 3, 0, SHAPE) == [3, 3, 3]
    # base 2: the top 6 are 9, 9, 8, 7, 6, 6 -> c = [3, 0, 3]; alpha 0.5 -> 1 + 1.5, 1 + 0, 1 + 1.5 = 2.5, 1, 2.5
    method = make_method("adakv", budget=2 + 2, window_size=2, floor_ratio=0.5)
    assert method.head_allocation.selected_per_head(HAND, 2, 0, SHAPE) == [3, 1, 2]


def test_adakv_safeguard_first_is_kvpress_rule_by_hand():
    """kvpress's AdaKVPress on HAND with budget 2 + 2 protected (window 2): each head first keeps its best
    max(1, int(0.2 x 4)) = 1 token, the window counting in it, so no head protects a scored token; then the
    layer's best 6 over all heads: 9, 9, 8, 7, 6, 6 -> [3, 0, 3]. With floor_ratio 0.8: 3 each, 2 of them the
    window, so each head's best scored token first (9, 3, 9), then the best 3 of the rest (8, 7, 6) -> [3, 1, 2]."""
    first = make_method("adakv", budget=2 + 2, window_size=2, floor_ratio=0.2, safeguard="first").head_allocation
    assert first.selected_per_head(HAND, 2, 0, SHAPE, protected=2) == [3, 0, 3]
    strong = make_method("adakv", budget=2 + 2, window_size=2, floor_ratio=0.8, safeguard="first").head_allocation
    assert strong.selected_per_head(HAND, 2, 0, SHAPE, protected=2) == [3, 1, 2]


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("base", [1, 2, 3, 5, 8])
def test_adakv_matches_the_paper_formula(alpha, base):
    rng = np.random.default_rng(base)
    for scores in (HAND.numpy(), rng.random((4, 8)).round(1), np.ones((3, 8))):   # rounding -> many ties
        got = make_method("adakv", budget=base + 4, window_size=4, floor_ratio=alpha).head_allocation \
            .selected_per_head(torch.tensor(scores), base, 0, SHAPE)
        assert got == adakv_reference(scores, base, alpha)
        assert sum(got) == scores.shape[0] * base
        assert min(got) >= math.floor(alpha * base) and max(got) <= scores.shape[1]
        if alpha == 1.0:
            assert got == [base] * scores.shape[0]                      # floor_ratio 1 = uniform


def test_adakv_normalize_scales_each_head_by_its_top_mass():
    scores = torch.tensor([[4.0, 4.0, 0.0, 0.0], [3.0, 1.0, 1.0, 1.0]])
    # ratios (base 1): 4/8 and 3/6 -> both 0.5: the ranking is unchanged
    plain = make_method("adakv", budget=1 + 1, window_size=1, floor_ratio=0.0).head_allocation
    norm = make_method("adakv", budget=1 + 1, window_size=1, floor_ratio=0.0, normalize=True).head_allocation
    assert plain.selected_per_head(scores, 1, 0, SHAPE) == norm.selected_per_head(scores, 1, 0, SHAPE) == [2, 0]
    scores = torch.tensor([[4.0, 4.0, 4.0, 4.0], [3.0, 0.0, 0.0, 0.0]])
    # base 1: ratios 4/16 and 3/3 -> head 0 scaled to [1, 1, 1, 1], head 1 stays [3, 0, 0, 0]: the best
    # slot goes to head 1 (3), the second to head 0 (1 > 0); unscaled, head 0's 4s take both
    assert plain.selected_per_head(scores, 1, 0, SHAPE) == [2, 0]
    assert norm.selected_per_head(scores, 1, 0, SHAPE) == [1, 1]


# --- ZigZagKV -----------------------------------------------------------------------------------

def test_lmba_hand_worked():
    scores = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25], [-1.0, 0.0, 0.0, 0.0]])
    # head 0: 0.5, 0.8, 0.9 -> 3; head 1: 0.25 x 4 reaches 0.9 at 4; head 2: no mass -> 4
    assert lmba(scores, 0.9) == pytest.approx((3 + 4 + 4) / 3)
    assert lmba(scores[:1], 0.5) == 1.0


def test_zigzag_matches_the_paper_formula():
    rng = np.random.default_rng(0)
    layers = [rng.random((3, 40)) ** p for p in (1, 4, 8, 16)]       # sharper and sharper layers
    method = make_method("zigzagkv", budget=20 + 8, window_size=8)
    got = method.layer_allocation.selected_per_layer(20, 4, 48, 40, [torch.tensor(s) for s in layers])
    values = np.array([lmba_reference(s, 0.9) for s in layers])
    exact = 0.2 * 20 + (20 - 0.2 * 20) * 4 * values / values.sum()
    assert got == largest_remainder(exact, 80, [4] * 4, [40] * 4)
    assert sum(got) == 80 and got[0] > got[-1]                       # flatter layers get more


def test_zigzag_caps_a_layer_at_the_prompt_and_keeps_the_total():
    flat, sharp = torch.ones(2, 30), torch.zeros(2, 30)
    sharp[:, 0] = 1.0
    got = make_method("zigzagkv", budget=20 + 8, window_size=8, b_bound_ratio=0.0).layer_allocation \
        .selected_per_layer(20, 2, 38, 30, [flat, sharp])
    # exact: 40 * 30 / 31 = 38.7 and 1.3 -> capped at 30, the rest (10) to the sharp layer
    assert got == [30, 10]


# --- allocation errors --------------------------------------------------------------------------

@pytest.mark.parametrize("settings,message", [
    (dict(head_allocation="ada"), r"unknown head allocation 'ada'; choose one of: uniform, adakv, headkv"),
    (dict(layer_allocation="linear"), r"unknown layer allocation 'linear'; choose one of: uniform, pyramid, zigzag"),
    (dict(head_allocation="adakv", floor_ratio=1.5), r"floor_ratio \(--floor\) must be in \[0, 1\]"),
    (dict(head_allocation="adakv", floor_ratio=-0.1), r"floor_ratio \(--floor\) must be in \[0, 1\]"),
    (dict(layer_allocation="zigzag", attention_threshold=0.0), r"attention_threshold must be in \(0, 1\]"),
    (dict(layer_allocation="zigzag", attention_threshold=1.2), r"attention_threshold must be in \(0, 1\]"),
    (dict(layer_allocation="zigzag", b_bound_ratio=2.0), r"b_bound_ratio must be in \[0, 1\]"),
    (dict(floor_ratio=0.5), r"floor_ratio is a setting of the head allocation adakv, not of uniform"),
    (dict(head_allocation="headkv", layer_allocation="pyramid"), r"cannot be combined with layer_allocation='pyramid'"),
    (dict(head_allocation="headkv", head_beta=0.5), r"head_beta must be >= 1"),
])
def test_bad_allocation_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        make_method("snapkv", budget=128, **settings)


def test_fullkv_takes_no_allocation():
    with pytest.raises(ValueError, match="fullkv keeps every token; it takes no budget allocation"):
        make_method("fullkv", head_allocation="adakv")


def test_run_folders_tell_allocations_apart():
    """Two configurations of one sweep never share a folder; the method's own allocator keeps short names."""
    from pyramidkv.runner.labels import run_dir

    names = {
        ("adakv", ()): "adakv",
        ("adakv", (("floor_ratio", 0.5),)): "adakv_floor_ratio=0.5",
        ("snapkv", (("head_allocation", "adakv"),)): "adakv",     # the same computation: one name (canonical)
        ("h2o", (("head_allocation", "adakv"), ("floor_ratio", 0.3))): "h2o_head_allocation=adakv-floor_ratio=0.3",
        ("snapkv", (("layer_allocation", "zigzag"),)): "zigzagkv",
        ("snapkv", (("head_allocation", "adakv"), ("layer_allocation", "zigzag"))): "adakv_layer_allocation=zigzag",
        ("pyramidkv", (("beta", 10.0),)): "pyramidkv_beta=10",
        ("headkv", (("head_scores", "/tables/llama.json"),)): "headkv_head_scores=-tables-llama.json",
    }
    for (name, settings), folder in names.items():
        assert run_dir("out", "m", make_method(name, budget=128, **dict(settings))).name == folder
