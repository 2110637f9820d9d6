"""One budget across the whole model (head_allocation=global): the kept sets are the top scores over every layer
and stored head (hand-worked cases, ties at the cut included; a z-scored scorer against a float64 computation), the
total is exact, and capped at the candidates there are on a model whose sliding-window layers see fewer than the
budget (worked by hand), a model with one layer splits as AdaKV without its floor, the bytes follow, and the peak
of the prefill (the layers scored so far hold only the best scores so far) is counted by hand. Refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.allocation.global_ import GlobalHeads, first_of_stable_sort, global_counts
from tests.conftest import tiny_llama

PROMPT = 48


def test_hand_worked_counts_follow_the_best_scores_over_layers_and_heads():
    """Two layers of two heads: the best of 12 scores are 9 (layer 0 head 1), 8 and 7 (layer 1 head 0), then three
    6s: layer 0 head 0 first (the lower layer), then of layer 1's two (same position) head 0 (the lower head)."""
    layer0 = torch.tensor([[1., 6., 2.], [9., 0., 3.]])
    layer1 = torch.tensor([[8., 7., 6.], [5., 4., 6.]])
    assert global_counts([layer0, layer1], 5) == [[1, 1], [3, 0]]
    assert global_counts([layer0, layer1], 6) == [[1, 1], [3, 1]]
    assert global_counts([layer0, layer1], 4) == [[1, 1], [2, 0]]
    assert GlobalHeads(score_scale="raw").selected_over_layers([layer0, layer1], 1) == [[1, 1], [2, 0]]


def test_hand_worked_ties_at_the_cut_go_to_the_more_recent_position():
    """Three equal 7s: layer 0 head 0 at position 0, layer 0 head 1 at position 2, layer 1 head 0 at position 0.
    Worked by hand from the rule (the lower layer, then the more recent position, then the lower head): layer 0's
    two come first, and of them position 2 (head 1, though head 0 is the lower head); then layer 1's; then the 6."""
    layer0 = torch.tensor([[7., 2., 4.], [1., 3., 7.]])
    layer1 = torch.tensor([[7., 0., 5.], [6., 0., 0.]])
    assert global_counts([layer0, layer1], 1) == [[0, 1], [0, 0]]
    assert global_counts([layer0, layer1], 2) == [[1, 1], [0, 0]]
    assert global_counts([layer0, layer1], 3) == [[1, 1], [1, 0]]
    assert global_counts([layer0, layer1], 4) == [[1, 1], [1, 1]]


def test_the_best_entries_by_their_cut_value_are_the_first_of_a_stable_sort():
    """first_of_stable_sort (the total-th largest value, then equal values in order) against torch's stable sort, on
    random vectors with many ties, -0.0 beside 0.0, -inf and NaN, for every total."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 60, (1,), generator=g))
        values = torch.randint(0, 4, (n,), generator=g).double() if trial % 2 else torch.randn(n, generator=g).double()
        values[:: 5 + trial % 3] = [float("-inf"), -0.0, float("nan")][trial % 3]
        for total in range(n + 1):
            expected = torch.zeros(n, dtype=torch.bool)
            expected[torch.sort(values, descending=True, stable=True).indices[:total]] = True
            assert torch.equal(first_of_stable_sort(values, total), expected), (trial, total)


def tiny(layers: int):
    """A random Llama of `layers` layers (GQA 4 / 2), seeded by its layer count: shared, never changed."""
    return tiny_llama(layers=layers, vocab=128, seed=layers, max_position_embeddings=256)


def prefilled(model, method):
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), compress(model, method) as patch:
        cache = patch.new_cache()
        model(ids, past_key_values=cache, use_cache=True)
    return cache


def test_one_layer_splits_as_adakv_without_a_floor():
    model = tiny(1)
    ours = prefilled(model, make_method("snapkv", budget=20, window_size=4, head_allocation="global"))
    adakv = prefilled(model, make_method("adakv", budget=20, window_size=4, floor_ratio=0.0))
    for a, b in zip(ours.kept_positions(0), adakv.kept_positions(0)):
        assert torch.equal(a, b)
    assert len({len(p) for p in ours.kept_positions(0)}) > 1


@pytest.mark.parametrize("scorer, scale", [("snapkv", "raw"), ("l2norm", "zscore")])
def test_total_is_exact_and_sets_are_the_best_over_the_model(scorer, scale):
    """The selected tokens (window excluded) of all layers and heads are the L x H x (budget - window) best
    scores, the scores as the scorer gives them (snapkv: attention) or standardised per layer over its heads and
    positions (l2norm: minus a key norm), computed here in float64 from the keys the cache holds whole."""
    model, budget, window = tiny(3), 20, 4
    method = make_method(scorer, budget=budget, window_size=window, head_allocation="global",
                         **({"skip_layers": 0} if scorer == "l2norm" else {}))
    cache = prefilled(model, method)
    layers, heads = 3, 2
    counts = [[len(p) - window for p in cache.kept_positions(layer)] for layer in range(layers)]
    assert sum(map(sum, counts)) == layers * heads * (budget - window)
    assert len({c for row in counts for c in row}) > 1
    assert cache.kv_bytes() == sum(len(p) for layer in range(layers) for p in cache.kept_positions(layer)) * 2 * 16 * 4
    # by hand: when the last layer is scored, the two before hold their window (2 x 2 x 4 tokens) and the best
    # 96 = 3 x 2 x 16 of their 2 x 2 x 44 candidates, the last one its whole prompt (2 x 48); 128 bytes a token
    assert cache.peak_prefill_kv_bytes == (2 * heads * window + layers * heads * (budget - window) + heads * PROMPT) * 128
    if scorer != "l2norm":
        return
    full = prefilled(model, make_method("fullkv"))
    scores = []
    for layer in range(layers):
        norms = np.stack([-k.double().norm(dim=-1).numpy()[: PROMPT - window] for _, k, _ in full.kept_kv(layer)])
        scores.append((norms - norms.mean()) / norms.std(ddof=1))
    total = layers * heads * (budget - window)
    cut = np.sort(np.concatenate([s.reshape(-1) for s in scores]))[::-1][total - 1]
    for layer in range(layers):
        for h, positions in enumerate(cache.kept_positions(layer)):
            chosen = {int(p) for p in positions if p < PROMPT - window}
            assert chosen == set(np.flatnonzero(scores[layer][h] >= cut).tolist()), (layer, h)


def test_sliding_layers_with_a_budget_above_their_window_cap_the_total_at_the_candidates():
    """Gemma2 (4 layers, window W = 16 on layers 0 and 2), a 40-token prompt, budget 36, window 4: the uniform total
    4 x 2 x 32 = 256 exceeds the candidates there are (a sliding layer has W - 1 - 4 = 11 per head, a global one
    40 - 4 = 36: 2 x 2 x 11 + 2 x 2 x 36 = 188), so every candidate is kept: worked by hand, a global layer holds
    all 40 positions, a sliding one the last W - 1 = 15."""
    from transformers import Gemma2Config

    from pyramidkv.models.patch import MODEL_GLUE, model_shape

    window, prompt = 16, 40
    config = Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                          sliding_window=window, attn_implementation="eager")
    torch.manual_seed(0)
    model = MODEL_GLUE["gemma2"].causal_lm(config).eval()
    assert model_shape(model.config).form.windows == (window, None, window, None)
    ids = torch.randint(1, 96, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), compress(model, make_method("snapkv", budget=36, window_size=4,
                                                      head_allocation="global")) as patch:
        cache = patch.new_cache()
        model(ids, past_key_values=cache, use_cache=True)
    for layer in range(4):
        first = prompt - window + 1 if layer % 2 == 0 else 0
        assert [p.tolist() for p in cache.kept_positions(layer)] == [list(range(first, prompt))] * 2, layer


@pytest.mark.parametrize("name, settings, message", [
    ("snapkv", dict(budget=20, head_allocation="global", layer_allocation="pyramid"), "cannot be combined with"),
    ("fullkv", dict(head_allocation="global"), "takes no budget allocation"),
    ("snapkv", dict(budget=20, head_allocation="global", score_scale="softmax"), "score_scale must be one of"),
])
def test_refusals(name, settings, message):
    with pytest.raises(ValueError, match=message) as error:
        make_method(name, **settings)
    assert "\n" not in str(error.value)
