"""Scissorhands: the held tokens after every decode step equal a float64 step-by-step simulation that keeps
every attention row; the bound; a hand-worked case; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.core.cache import CompressedCache
from pyramidkv.core.selection import select_kept_positions
from pyramidkv.methods.scissorhands import unimportant_counts
from tests.helpers import prefill
from tests.prompts import STORY

BUDGET, WINDOW, HISTORY, DECODE_BUDGET, INTERVAL, STEPS = 64, 8, 16, 40, 8, 30


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def keep_best(positions: list[int], score: np.ndarray, keep: int) -> list[int]:
    """The most recent WINDOW positions plus the best `keep - WINDOW` others by score (ties: the more recent)."""
    order = sorted(range(len(positions) - WINDOW), key=lambda i: (-score[i], -positions[i]))
    chosen = sorted(order[:keep - WINDOW]) + list(range(len(positions) - WINDOW, len(positions)))
    return [positions[i] for i in chosen]


class Head:
    """One KV head of one layer, simulated in float64: held tokens, their keys, and every attention row
    of the last HISTORY queries (per query head of the group), each with its uniform level."""

    def __init__(self, prompt_queries: np.ndarray, prompt_keys: np.ndarray):
        n = prompt_keys.shape[0]
        self.keys = {p: prompt_keys[p] for p in range(n)}
        self.rows = []   # (level, {position: [g] attention})
        for i in range(n - HISTORY, n):
            a = softmax(prompt_queries[:, i] @ prompt_keys[:i + 1].T / 8.0)       # [g, i + 1]
            self.rows.append((1.0 / (i + 1), {p: a[:, p] for p in range(i + 1)}))
        self.held = list(range(n))
        if n > BUDGET:
            self.held = keep_best(self.held, self.score(), BUDGET)
        self.compress_if_full()

    def score(self) -> np.ndarray:
        """Minus the unimportant counts, averaged over the query group, per held token."""
        counts = np.zeros((len(self.held), len(next(iter(self.rows[0][1].values())))))
        for level, row in self.rows:
            for i, p in enumerate(self.held):
                if p in row:
                    counts[i] += row[p] < level
        return -counts.mean(axis=1)

    def compress_if_full(self) -> None:
        if len(self.held) >= DECODE_BUDGET + INTERVAL:
            self.held = keep_best(self.held, self.score(), DECODE_BUDGET)

    def step(self, position: int, query: np.ndarray, key: np.ndarray) -> None:
        self.keys[position] = key
        self.held.append(position)
        a = softmax(query @ np.stack([self.keys[p] for p in self.held]).T / 8.0)  # [g, held]
        self.rows = (self.rows + [(1.0 / len(self.held), {p: a[:, i] for i, p in enumerate(self.held)})])[-HISTORY:]
        self.compress_if_full()


def test_held_tokens_follow_a_float64_simulation_step_by_step(smollm2, monkeypatch):
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    n = ids.shape[1]
    method = make_method("scissorhands", budget=BUDGET, window_size=WINDOW, history_window=HISTORY,
                         decode_budget=DECODE_BUDGET, decode_interval=INTERVAL)
    layers = (0, 13, model.config.num_hidden_layers - 1)
    seen = {layer: [] for layer in layers}  # the (queries, keys) the model handed the cache, float64
    real_prefill, real_step = CompressedCache.prefill, CompressedCache.decode_step

    def spy_prefill(self, layer, queries, keys, values, *rest):
        if layer in seen:
            seen[layer].append((queries[0].double().numpy(), keys[0].double().numpy()))
        return real_prefill(self, layer, queries, keys, values, *rest)

    def spy_step(self, layer, queries, keys, values, position_ids=None, hidden=None):
        if layer in seen:
            seen[layer].append((queries[0].double().numpy(), keys[0].double().numpy()))
        return real_step(self, layer, queries, keys, values, position_ids, hidden)

    monkeypatch.setattr(CompressedCache, "prefill", spy_prefill)
    monkeypatch.setattr(CompressedCache, "decode_step", spy_step)
    held = {layer: [] for layer in layers}  # per step, per KV head, the engine's held positions
    with torch.no_grad(), compress(model, method) as patch:
        cache = patch.new_cache()
        out = model(ids, past_key_values=cache, use_cache=True)
        for step in range(STEPS + 1):
            for layer in layers:
                held[layer].append([p.tolist() for p in cache.held_positions(layer, 0)])
                assert max(cache.held_counts(layer)[0]) <= DECODE_BUDGET + INTERVAL
            if step < STEPS:
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert sum(cache.decoding.compressions) > 2 * len(layers)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer in layers:
        (prompt_queries, prompt_keys), *steps = seen[layer]
        heads = [Head(prompt_queries[h * group:(h + 1) * group], prompt_keys[h]) for h in range(len(prompt_keys))]
        assert [head.held for head in heads] == held[layer][0], (layer, "after prefill")
        for step, (queries, keys) in enumerate(steps, start=1):
            for h, head in enumerate(heads):
                head.step(n + step - 1, queries[h * group:(h + 1) * group, 0], keys[h, 0])
            assert [head.held for head in heads] == held[layer][step], (layer, step)


def test_a_hand_worked_case_of_six_tokens():
    """Six held tokens, three past queries. Level 1/6 for all rows. Token attention per row:
        row 1: [.40 .05 .20 .05 .10 .20]   below 1/6: tokens 1, 3, 4
        row 2: [.30 .10 .10 .30 .05 .15]   below: 1, 2, 4, 5
        row 3: [.50 .02 .03 .05 .20 .20]   below: 1, 2, 3
    Counts: [0, 3, 2, 2, 2, 1]. Keep 3 with the most recent 1 protected: token 5 (recent), then the
    lowest counts among 0..4: token 0 (0), then a tie at 2 among 2, 3, 4 goes to the most recent: 4."""
    rows = torch.tensor([[.40, .05, .20, .05, .10, .20], [.30, .10, .10, .30, .05, .15],
                         [.50, .02, .03, .05, .20, .20]])                       # [w, m]
    levels = torch.full((3,), 1 / 6)
    counts = unimportant_counts(rows[None, None], levels[None, None])[0, 0]
    assert counts.tolist() == [0, 3, 2, 2, 2, 1]
    kept = select_kept_positions(-counts.float()[None], 0, [3], window_size=1)[0]
    assert kept.tolist() == [0, 4, 5]
    rows[0, 3] = float("nan")  # token 3 was not there at the first step: that row does not count for it
    assert unimportant_counts(rows, levels).tolist() == [0, 3, 2, 1, 2, 1]


@pytest.mark.parametrize("settings, message", [
    (dict(history_window=0), "history_window must be an integer >= 1"),
    (dict(decode_budget=None), "scissorhands compresses while decoding: it needs decode_budget"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    base = dict(budget=64, decode_budget=48)
    with pytest.raises(ValueError, match=message) as e:
        make_method("scissorhands", **{**base, **settings})
    assert "\n" not in str(e.value)


def test_history_window_is_bounded_by_the_context_window_before_generate(random_llama):
    """The random Llama has max_position_embeddings 8192: no sequence has more queries, so a longer history
    is refused in one line when compress() checks the model (2 ** 62 overflowed a tensor size in generate);
    8192 itself runs."""
    from pyramidkv.generation import generate

    model, tokenizer, _ = random_llama
    assert model.config.max_position_embeddings == 8192
    ids = [list(range(10, 90))]
    for window in (8193, 2 ** 62):
        method = make_method("scissorhands", budget=32, window_size=4, decode_budget=32, history_window=window)
        with pytest.raises(ValueError, match=rf"history_window {window} is longer than the model's context window "
                                             r"\(8192 tokens\).*allowed: 1 <= history_window <= 8192"):
            generate(model, tokenizer, ids, method, max_new_tokens=2)
    method = make_method("scissorhands", budget=32, window_size=4, decode_budget=32, history_window=8192)
    assert generate(model, tokenizer, ids, method, max_new_tokens=2, stop_token_ids=[])[0].new_tokens == 2


def test_prefill_counts_over_exactly_history_window_rows(eager_setup):
    """The prefill choice, left as it is: budget 48 with decode_budget 48 + decode_interval 8 stays below the
    re-selection bound 56, so the held tokens right after prefill are the prefill selection. Reference from
    transformers' eager attention (float64): per query head, the rows of the last 16 prompt queries, a token
    counted when below its row's level 1 / (row + 1); counts averaged over the GQA group; the 8 most recent
    kept, then the 40 lowest counts (ties: the more recent)."""
    model, ids, attentions, _ = eager_setup
    n, history, window, budget = ids.shape[1], 16, 8, 48
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    method = make_method("scissorhands", budget=budget, window_size=window, history_window=history,
                         decode_budget=48, decode_interval=8)
    cache = prefill(model, ids, method)
    for layer in range(0, model.config.num_hidden_layers, 3):
        for h, positions in enumerate(cache.held_positions(layer, 0)):
            rows = attentions[layer][h * group:(h + 1) * group, n - history:, :]      # [g, 16, n]
            levels = 1.0 / np.arange(n - history + 1, n + 1)                          # row i attends i + 1 tokens
            visible = np.arange(n)[None, :] <= np.arange(n - history, n)[:, None]     # [16, n]
            counts = ((rows < levels[None, :, None]) & visible[None]).sum(axis=1).mean(axis=0)
            best = sorted(range(n - window), key=lambda p: (counts[p], -p))[:budget - window]
            assert positions.tolist() == sorted(best) + list(range(n - window, n)), (layer, h)
