"""The near-tie rule (tests/near_ties.py) on hand-made decisions: it accepts a kept set that differs only where the
scores are within float32 resolution of the cut, and fails everything else; and DecisionLog records what the
engine's selection did (checked against the kept sets the cache reports)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from tests.near_ties import RESOLUTION_ULPS, Decision, DecisionLog, Disagreement, from_mask, near_ties, to_mask, ulp32

POSITIONS = np.arange(10, 16)


def decision(scores, k: int, kind: str = "prefill", layer: int = 0, head: int = 0, positions=POSITIONS) -> Decision:
    """The top k of `scores` (ties to the later position, as core/selection.py documents), as the engine keeps it."""
    scores = np.asarray(scores, dtype=np.float64)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], -i))[:k]
    return Decision(kind, layer, 0, head, np.asarray(positions), scores, k, frozenset(int(positions[i]) for i in order))


def test_masks_round_trip():
    for positions in ([], [0], [7], list(range(300)), [1, 2, 3, 9, 200, 201], list(range(0, 500, 3))):
        assert from_mask(to_mask(positions)) == set(positions)


def test_equal_decisions_have_no_near_tie():
    a = decision([0.9, 0.1, 0.5, 0.4, 0.3, 0.2], 3)
    assert near_ties([a], [decision([0.9, 0.1, 0.5, 0.4, 0.3, 0.2], 3)]) == []


def test_a_swap_within_float32_resolution_is_a_near_tie():
    ulp = ulp32(0.5)
    ours = decision([0.9, 0.1, 0.5, 0.5 + ulp, 0.3, 0.2], 2)          # keeps positions 10, 13
    theirs = decision([0.9, 0.1, 0.5 + ulp, 0.5, 0.3, 0.2], 2)        # keeps positions 10, 12
    (tie,) = near_ties([ours], [theirs])
    assert tie.differing == {12, 13}


def test_a_swap_beyond_the_resolution_is_a_disagreement():
    gap = (RESOLUTION_ULPS + 2) * ulp32(0.5)
    ours = decision([0.9, 0.1, 0.5, 0.5 + gap, 0.3, 0.2], 2)
    theirs = decision([0.9, 0.1, 0.5 + gap, 0.5, 0.3, 0.2], 2)
    with pytest.raises(Disagreement, match="keeps \\[13\\] instead of \\[12\\]"):
        near_ties([ours], [theirs])


def test_other_candidates_or_counts_are_a_disagreement():
    scores = [0.9, 0.1, 0.5, 0.4, 0.3, 0.2]
    with pytest.raises(Disagreement, match="other candidates"):
        near_ties([decision(scores, 3)], [decision(scores, 2)])
    with pytest.raises(Disagreement, match="other candidates"):
        near_ties([decision(scores, 3)], [decision(scores, 3, positions=POSITIONS + 1)])
    with pytest.raises(Disagreement, match="different selections"):
        near_ties([decision(scores, 3)], [])


def test_after_a_near_tie_prefill_decisions_are_still_compared_and_decode_ones_are_not():
    ulp = ulp32(0.5)
    tie_ours = decision([0.9, 0.1, 0.5, 0.5 + ulp, 0.3, 0.2], 2)
    tie_theirs = decision([0.9, 0.1, 0.5 + ulp, 0.5, 0.3, 0.2], 2)
    other_layer = decision([0.9, 0.1, 0.5, 0.4, 0.3, 0.2], 3, layer=1)
    moved = decision([0.1, 0.9, 0.5, 0.4, 0.3, 0.2], 3, layer=1)
    with pytest.raises(Disagreement):
        near_ties([tie_ours, other_layer], [tie_theirs, moved])
    decode_ours = decision([0.9, 0.1, 0.5, 0.4, 0.3, 0.2], 3, kind="decode")
    decode_theirs = decision([0.1, 0.9, 0.5, 0.4, 0.3, 0.2], 3, kind="decode")
    assert len(near_ties([tie_ours, decode_ours], [tie_theirs, decode_theirs])) == 1
    with pytest.raises(Disagreement):     # no near-tie before it: a decode decision that differs is one
        near_ties([decode_ours], [decode_theirs])


def test_a_recorded_decision_keeps_the_fragile_positions_it_had_when_recorded():
    ulp = ulp32(0.5)
    recorded = Decision.from_row(decision([0.9, 0.1, 0.5 + ulp, 0.5, 0.3, 0.2], 2).row())
    assert recorded.scores is None and recorded.fragile() == {12, 13}
    ours = decision([0.9, 0.1, 0.5, 0.5 + ulp, 0.3, 0.2], 2)
    assert near_ties([ours], [recorded])[0].differing == {12, 13}
    # fragile on neither side: the record's scores were bit-equal (the tie-break's), ours far apart
    tie_broken = Decision.from_row(decision([0.9, 0.1, 0.5, 0.5, 0.3, 0.2], 2).row())
    with pytest.raises(Disagreement):
        near_ties([decision([0.9, 0.1, 0.6, 0.5, 0.3, 0.2], 2)], [tie_broken])


def test_the_log_records_the_engines_kept_sets(sharp_llama):
    """snapkv with budget 24, window 8 on a 40-token prompt: one decision per layer and KV head, ranking the 32
    candidates before the window, keeping 16 of them; with the window, what the cache reports as kept."""
    model, _, _ = sharp_llama
    ids = torch.arange(3, 43)[None]
    with compress(model, make_method("snapkv", budget=24, window_size=8)) as patch, torch.no_grad(), \
            DecisionLog() as log:
        cache = patch.new_cache()
        model(ids, past_key_values=cache, use_cache=True)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert [(d.kind, d.layer, d.head) for d in log.decisions] == \
        [("prefill", layer, head) for layer in range(layers) for head in range(heads)]
    for d in log.decisions:
        assert d.k == 16 and d.positions.tolist() == list(range(32))
        kept = cache.kept_kv(d.layer, 0)[d.head][0].tolist()
        assert sorted(d.kept | set(range(32, 40))) == kept


def test_a_swap_of_bit_equal_scores_is_the_tie_breaks_and_must_agree():
    """Two pooled copies of one score at the cut: the documented tie-break (the more recent wins) decides, which
    does not round, so another outcome is a disagreement however close the scores."""
    ours = decision([0.9, 0.1, 0.5, 0.5, 0.3, 0.2], 2)                 # keeps 13, the more recent of the two
    theirs = Decision(ours.kind, 0, 0, 0, POSITIONS, ours.scores, 2, frozenset({10, 12}))   # the earlier one
    with pytest.raises(Disagreement, match="keeps \\[13\\] instead of \\[12\\]"):
        near_ties([ours], [theirs])
