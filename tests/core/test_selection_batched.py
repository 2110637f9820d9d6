"""select_kept_positions with one count for every head (one top-k over all heads at once) against a hand-written
ranking: per head, sinks, the window, and the best-scored candidates, ties to the more recent position."""

from __future__ import annotations

import pytest
import torch

from pyramidkv.core.selection import select_kept_positions


def by_hand(row: list[float], pad: int, budget: int, window: int, sinks: int) -> list[int]:
    n = len(row)
    first, stop = pad + sinks, n - window
    ranked = sorted(range(first, stop), key=lambda i: (-row[i], -i))[:budget - window - sinks]
    return list(range(pad, first)) + sorted(ranked) + list(range(stop, n))


@pytest.mark.parametrize("pad, budget, window, sinks", [(0, 12, 4, 0), (3, 9, 2, 2), (5, 6, 0, 0), (1, 4, 4, 0)])
def test_equal_budgets_keep_what_the_hand_ranking_keeps(pad, budget, window, sinks):
    torch.manual_seed(budget + pad)
    scores = torch.randint(0, 4, (5, 30)).float()        # few values: many ties, broken toward recent positions
    kept = select_kept_positions(scores, pad, [budget] * 5, window, sinks)
    assert len(kept) == 5
    for head, positions in enumerate(kept):
        assert positions.tolist() == by_hand(scores[head].tolist(), pad, budget, window, sinks), head


def test_a_random_share_and_unequal_budgets_still_take_the_per_head_rule():
    torch.manual_seed(0)
    scores = torch.randn(3, 40)
    kept = select_kept_positions(scores, 2, [6, 10, 8], 3)
    for head, (positions, budget) in enumerate(zip(kept, [6, 10, 8])):
        assert positions.tolist() == by_hand(scores[head].tolist(), 2, budget, 3, 0), head
    drawn = select_kept_positions(scores, 0, [20] * 3, 2, random_fraction=0.5,
                                  generator_for=lambda head: torch.Generator().manual_seed(head))
    assert [len(p) for p in drawn] == [20] * 3


@pytest.mark.parametrize("counts", [[4, 4, 4], [4, 2, 5]])
def test_gathering_the_kept_rows_copies_each_head_s_own_rows(counts):
    """KeptKV.gather (one index_select for all heads when the counts are equal) against row-by-row indexing."""
    from pyramidkv.core.kept import KeptKV

    torch.manual_seed(1)
    keys, values = torch.randn(3, 12, 8), torch.randn(3, 12, 8)
    positions = [torch.randperm(10)[:c].sort().values + 2 for c in counts]
    kept = KeptKV.gather(keys, values, positions, pad=2)
    want_k = torch.stack([keys[h, int(i)] for h, p in enumerate(positions) for i in p])
    want_v = torch.stack([values[h, int(i)] for h, p in enumerate(positions) for i in p])
    assert torch.equal(kept.keys, want_k) and torch.equal(kept.values, want_v)
    assert kept.lengths == counts and kept.positions.tolist() == [int(i) - 2 for p in positions for i in p]
