"""NACL: proxy-token scores, sinks and window protected, a top share by score and a seeded random share
drawn without replacement from softmax(score): sizes, disjointness, the sampler's distribution,
reproducibility and batch independence."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from pyramidkv import make_method
from pyramidkv.core.selection import sample_without_replacement
from tests.engine_snapshot import assert_batch_equals_alone
from tests.helpers import prefill
from tests.prompts import STORY
from tests.reference import top_positions

BUDGET, WINDOW, SINKS, PROXY = 96, 16, 4, 24


def nacl(**settings):
    return make_method("nacl", budget=BUDGET, window_size=WINDOW, num_sinks=SINKS, proxy_size=PROXY, **settings)


def reference_scores(attentions, layer: int, kv_head: int, group: int) -> np.ndarray:
    """Proxy sums from eager attention: the last PROXY rows summed, averaged over the GQA group (gqa_reduce mean)."""
    rows = attentions[layer][kv_head * group:(kv_head + 1) * group, -PROXY:, :]   # [g, PROXY, n]
    return rows.sum(axis=1).mean(axis=0)


@pytest.fixture(scope="module")
def kept_by_seed(eager_setup):
    model, ids, attentions, _ = eager_setup
    return {seed: prefill(model, ids, nacl(random_seed=seed)) for seed in (0, 1)}


def split(positions: list[int], n: int) -> tuple[set, set, set]:
    """(sinks, window, middle) parts of one head's kept positions."""
    kept = set(positions)
    sinks, window = set(range(SINKS)), set(range(n - WINDOW, n))
    assert sinks <= kept and window <= kept
    return sinks, window, kept - sinks - window


def test_sizes_and_the_top_share(eager_setup, kept_by_seed):
    model, ids, attentions, _ = eager_setup
    n = ids.shape[1]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    selected = BUDGET - WINDOW - SINKS
    drawn = math.floor(7 / 19 * selected)
    cache = kept_by_seed[0]
    for layer in (0, 9, model.config.num_hidden_layers - 1):
        for h, positions in enumerate(cache.kept_positions(layer, 0)):
            assert len(positions) == BUDGET
            _, _, middle = split(positions.tolist(), n)
            scores = reference_scores(attentions, layer, h, group)[SINKS:n - WINDOW]
            top = {SINKS + j for j in top_positions(scores, selected - drawn)}
            # The top share is in; the random share is the rest of the middle, disjoint from it.
            missing = top - middle
            cut = np.sort(scores)[::-1][selected - drawn - 1]
            assert all(math.isclose(scores[p - SINKS], cut, rel_tol=1e-4) for p in missing)
            assert len(middle - top) >= drawn - len(missing) and len(middle) == selected


def test_no_random_share_equals_the_deterministic_reference(eager_setup):
    model, ids, attentions, _ = eager_setup
    n = ids.shape[1]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    cache = prefill(model, ids, nacl(random_fraction=0.0))
    for layer in range(model.config.num_hidden_layers):
        for h, positions in enumerate(cache.kept_positions(layer, 0)):
            _, _, middle = split(positions.tolist(), n)
            scores = reference_scores(attentions, layer, h, group)[SINKS:n - WINDOW]
            expected = {SINKS + j for j in top_positions(scores, BUDGET - WINDOW - SINKS)}
            cut = np.sort(scores)[::-1][BUDGET - WINDOW - SINKS - 1]
            for p in middle ^ expected:
                assert math.isclose(scores[p - SINKS], cut, rel_tol=1e-4), (layer, h, p)


def test_same_seed_same_draw_other_seed_other_draw(eager_setup, kept_by_seed):
    model, ids, _, _ = eager_setup
    again = prefill(model, ids, nacl(random_seed=0))
    layers = range(model.config.num_hidden_layers)
    first = [[p.tolist() for p in kept_by_seed[0].kept_positions(layer, 0)] for layer in layers]
    assert first == [[p.tolist() for p in again.kept_positions(layer, 0)] for layer in layers]
    assert first != [[p.tolist() for p in kept_by_seed[1].kept_positions(layer, 0)] for layer in layers]


def exact_inclusion(p: np.ndarray, k: int) -> np.ndarray:
    """Probability that each item is among k drawn one by one without replacement with weights p."""
    out = np.zeros(len(p))
    for order in itertools.permutations(range(len(p)), k):
        prob, left = 1.0, 1.0
        for i in order:
            prob *= p[i] / left
            left -= p[i]
        out[list(order)] += prob
    return out


def test_the_sampler_matches_sequential_sampling_without_replacement():
    """Inclusion frequencies over 20,000 seeded draws of 3 of 7 against the exact probabilities (enumerated),
    each within 4.5 standard errors (fixed seeds: the test is deterministic)."""
    scores = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, 3.0])
    p = torch.softmax(scores.double(), 0).numpy()
    exact = exact_inclusion(p, 3)
    draws = 20_000
    counts = np.zeros(7)
    for seed in range(draws):
        counts[sample_without_replacement(scores, 3, torch.Generator().manual_seed(seed)).numpy()] += 1
    frequency = counts / draws
    stderr = np.sqrt(exact * (1 - exact) / draws)
    assert np.all(np.abs(frequency - exact) <= 4.5 * stderr + 1e-12), (frequency, exact)
    assert counts.sum() == 3 * draws


def test_a_batch_of_three_equals_single_runs(smollm2, tokenizer, request):
    model, _ = smollm2
    prompts = [tokenizer(STORY * 2, add_special_tokens=False).input_ids, tokenizer(STORY, add_special_tokens=False).input_ids,
               tokenizer(STORY[:250], add_special_tokens=False).input_ids]
    method = nacl()
    assert_batch_equals_alone(model, tokenizer, method, prompts, 6, request)


@pytest.mark.parametrize("settings, message", [
    (dict(proxy_size=0), "proxy_size must be an integer >= 1"),
    (dict(random_fraction=1.0), r"random_fraction must be in \[0, 1\)"),
    (dict(num_sinks=-1), "num_sinks must be an integer >= 0"),
    (dict(budget=16), "budget .* is smaller than window_size 16 \\+ num_sinks 4"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    base = dict(budget=BUDGET, window_size=WINDOW, num_sinks=SINKS, proxy_size=PROXY)
    with pytest.raises(ValueError, match=message) as e:
        make_method("nacl", **{**base, **settings})
    assert "\n" not in str(e.value)


def test_the_proxy_pass_causal_by_default_and_the_official_non_causal_one():
    """Four tokens, two proxies (tokens 2 and 3), D = 2, by hand: causal, row 2's softmax covers keys 0..2 and
    row 3's keys 0..3; non-causal (the official flash_attn pass with causal=False) row 2's also covers key 3.
    Each score is the sum over the rows of softmax(q.k / sqrt(2)), computed here from the explicit products."""
    from pyramidkv.core.context import ScoreContext

    keys = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]]
    queries = [[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]

    def proxy_sums(causal: bool) -> list[float]:
        totals = [0.0] * 4
        for i in (2, 3):
            seen = range(i + 1) if causal else range(4)
            e = {j: math.exp(sum(a * b for a, b in zip(queries[i], keys[j])) / math.sqrt(2)) for j in seen}
            for j in seen:
                totals[j] += e[j] / sum(e.values())
        return totals

    ctx = ScoreContext(0, 1, torch.tensor([[queries]]), torch.tensor([[keys]]), torch.zeros(1, 1, 4, 2),
                       torch.ones(1, 4, dtype=torch.bool))
    causal = make_method("nacl", budget=3, window_size=0, num_sinks=0, proxy_size=2).score(ctx)[0, 0]
    official = make_method("nacl", budget=3, window_size=0, num_sinks=0, proxy_size=2,
                           proxy_causal=False).score(ctx)[0, 0]
    assert np.allclose(causal.double().numpy(), proxy_sums(True), atol=1e-6)
    assert np.allclose(official.double().numpy(), proxy_sums(False), atol=1e-6)
    assert abs(proxy_sums(True)[3] - proxy_sums(False)[3]) > 0.3   # the case tells the two passes apart


@pytest.mark.parametrize("seed", [0, 2 ** 40, 2 ** 63 - 1])
def test_every_documented_seed_runs_through_the_selection(random_llama, seed):
    """random_seed is documented as [0, 2^63): the per-head generator seeds mix it with the layer and head
    without overflowing torch's 64-bit seed (2 ** 40 and 2 ** 63 - 1 overflowed it before)."""
    model, tokenizer, _ = random_llama
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids[:, :120]
    method = make_method("nacl", budget=40, window_size=8, num_sinks=2, proxy_size=8, random_seed=seed)
    cache = prefill(model, ids, method)
    for layer in range(model.config.num_hidden_layers):
        assert all(len(p) == 40 for p in cache.kept_positions(layer, 0))


def test_heads_with_equal_scores_draw_their_own_random_share():
    """Two heads, equal flat scores over 200 candidates, 20 drawn each: their generators are seeded with the
    head's index, so the draws differ (a shared stream would draw the same 20 for both; by chance two
    independent uniform draws of 20 of 200 agree with probability 1 / C(200, 20))."""
    from pyramidkv.core.prefill import sampling_generator
    from pyramidkv.core.selection import select_kept_positions

    method = make_method("nacl", budget=40, window_size=0, num_sinks=0, random_fraction=0.5, random_seed=7)
    scores = torch.zeros(2, 200)
    for layer in (0, 3):
        kept = select_kept_positions(scores, 0, [40, 40], 0, 0, 0.5, lambda h: sampling_generator(method, layer, h))
        top = set(range(180, 200))   # the top share: of equal scores, the latest
        assert top <= set(kept[0].tolist()) and top <= set(kept[1].tolist())
        assert set(kept[0].tolist()) != set(kept[1].tolist())
