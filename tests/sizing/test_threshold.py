"""Threshold eviction (the threshold sizing, the DMS rule): the held set of every layer and KV head after the
prefill and after each of 64 decode steps against a float64 simulation of the rule on a tiny random Llama (its
own forward, per-head masks); bytes equal the held count formula; a score exactly at the threshold stays, at prefill
and while decoding (scores by position, the held sets worked out from positions); a threshold below every score is
fullkv; the prefill-only variant keeps the window and every generated token; refusals, one line each."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pyramidkv import make_method
from pyramidkv.sizing import Threshold
from pyramidkv.capabilities import Selection
from pyramidkv.generation import generate
from pyramidkv.methods.base import Method
from tests.conftest import tiny_llama
from tests.helpers import TokenIds

PROMPT, WINDOW, SINKS, STEPS, THRESHOLD = 40, 8, 2, 64, 0.1


@dataclass(frozen=True)
class KeyAndInput(Method):
    """A per-token scorer for the test: a KV head h scores a token by its key's first channel plus channel h of
    its attention input (so the hidden states reach the scorer at prefill and while decoding)."""

    name = "key_and_input_test"
    needs_hidden = True
    token_scores = True

    def score(self, ctx):
        keys = ctx.keys[..., 0].float()                                   # [B, Hkv, n]
        return keys + ctx.hidden[..., :keys.shape[1]].float().transpose(1, 2)


@dataclass(frozen=True)
class ByPosition(Method):
    """A per-token scorer for the test: KV head h scores the token at position p ((p + h) mod 3) - 0.5, so that
    every third token of a head scores exactly 0.5 (a tie with a threshold of 0.5, by construction)."""

    name = "by_position_test"
    token_scores = True

    def score(self, ctx):
        heads = torch.arange(ctx.keys.shape[1], device=ctx.keys.device)
        return ((ctx.positions[:, None, :] + heads[None, :, None]) % 3).float() - 0.5   # [B, Hkv, n]


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_llama(layers=2, vocab=96, std=0.2)
    prompt = torch.randint(3, 96, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    yield model, prompt
    torch.set_num_threads(threads)


def simulate(model, tokens: list[int], prompt_len: int) -> list[list[list[set[int]]]]:
    """The rule in float64 from the model's weights: per forward (the prompt, then one token each) the held
    positions of every layer and KV head. The prompt attends causally over itself; then a KV head holds the
    first SINKS, the last WINDOW and the rest scored >= THRESHOLD; each later token, scored when it enters, is
    decided once the newest position is WINDOW past it. Each query head attends over its KV head's held set."""
    m = model.model
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    cache_k = [[] for _ in m.layers]
    cache_v = [[] for _ in m.layers]
    scores = [[] for _ in m.layers]     # per layer [Hkv, t] every token's score
    held = [[set() for _ in range(kv_heads)] for _ in m.layers]
    history, start = [], 0
    chunks = [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]
    with torch.no_grad():
        for chunk in chunks:
            q_len = len(chunk)
            h = m.embed_tokens(torch.tensor([chunk]))
            cos, sin = m.rotary_emb(h, torch.arange(start, start + q_len)[None])
            for layer, block in enumerate(m.layers):
                attn = block.self_attn
                x = block.input_layernorm(h)
                q = attn.q_proj(x).view(1, q_len, heads, -1).transpose(1, 2)
                k = attn.k_proj(x).view(1, q_len, kv_heads, -1).transpose(1, 2)
                v = attn.v_proj(x).view(1, q_len, kv_heads, -1).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                cache_k[layer].append(k)
                cache_v[layer].append(v)
                scores[layer].append(k[0, :, :, 0] + x[0, :, :kv_heads].T)   # [Hkv, q]
                keys, values = torch.cat(cache_k[layer], dim=2), torch.cat(cache_v[layer], dim=2)
                t = keys.shape[2]
                visible = torch.zeros(kv_heads, q_len, t, dtype=torch.bool)
                for kv in range(kv_heads):
                    visible[kv][:, sorted(held[layer][kv])] = True
                    visible[kv][:, start:start + q_len] = True
                visible &= torch.arange(t)[None, None, :] <= torch.arange(start, start + q_len)[None, :, None]
                mask = visible.repeat_interleave(group, dim=0)[None]                      # [1, Hq, q, t]
                logits = q @ keys.repeat_interleave(group, dim=1).transpose(-1, -2) / q.shape[-1] ** 0.5
                probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
                out = (probs @ values.repeat_interleave(group, dim=1)).transpose(1, 2).reshape(1, q_len, -1)
                h = h + attn.o_proj(out)
                h = h + block.mlp(block.post_attention_layernorm(h))
                every = torch.cat(scores[layer], dim=1)
                newest = start + q_len - 1
                for kv in range(kv_heads):
                    held[layer][kv] |= set(range(start, start + q_len))
                    # decided now: past the window, not a sink, and (at prefill) every earlier token
                    leaving = [p for p in held[layer][kv] if SINKS <= p <= newest - WINDOW
                               and (start == 0 or p == newest - WINDOW)]
                    held[layer][kv] -= {p for p in leaving if every[kv, p] < THRESHOLD}
            history.append([[set(s) for s in layer] for layer in held])
            start += q_len
    return history


def run(model, prompt, method, steps=STEPS):
    """(held positions per forward [layer][head], kv bytes per forward, the fed tokens, the final cache)."""
    held, sizes, fed, caches = [], [], [], []

    def record(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        held.append([[set(p.tolist()) for p in cache.held_positions(layer, 0)] for layer in range(2)])
        sizes.append(cache.kv_bytes())
        fed.extend(kwargs["input_ids"][0].tolist())
        caches[:] = [cache]

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        generate(model, TokenIds(), [prompt], method, steps + 1, stop_token_ids=[])
    finally:
        hook.remove()
    return held, sizes, fed, caches[0]


def test_held_sets_follow_the_rule_at_prefill_and_every_decode_step(tiny):
    model, prompt = tiny
    method = KeyAndInput(window_size=WINDOW, sizing=Threshold(threshold=THRESHOLD),
                         selection=Selection(num_sinks=SINKS))
    held, sizes, fed, cache = run(model, prompt, method)
    assert fed[:PROMPT] == prompt and len(held) == STEPS + 1
    expected = simulate(copy.deepcopy(model).double(), fed, PROMPT)
    for step, (got, want) in enumerate(zip(held, expected)):
        assert got == want, f"step {step}: held sets differ: {[[sorted(a ^ b) for a, b in zip(g, w)] for g, w in zip(got, want)]}"
    # bytes: every held key and value, float32, head dim 16
    counts = [sum(len(s) for layer in step for s in layer) for step in held]
    assert sizes == [c * 2 * 16 * 4 for c in counts]
    # not vacuous: heads differ, prompt-window and generated tokens were evicted while decoding, some were kept
    final = expected[-1]
    assert len({len(s) for layer in final for s in layer}) > 1
    assert any(p in range(PROMPT - WINDOW, PROMPT) for layer in expected[0] for s in layer for p in s)
    assert any(not {p for p in range(PROMPT - WINDOW, PROMPT)} <= s for layer in final for s in layer)
    generated = range(PROMPT, PROMPT + STEPS - WINDOW)
    assert any(0 < len(set(generated) & s) < len(generated) for layer in final for s in layer)
    assert sum(cache.decoding.evicted) > 0


def test_a_score_exactly_at_the_threshold_stays_at_prefill_and_while_decoding(tiny):
    """Scores -0.5, 0.5, 1.5 by position (ByPosition) and a threshold of 0.5: after the prefill and after each of
    16 decode steps, KV head h of every layer holds, of positions 0..newest, the sinks, the last WINDOW and every
    other position p with ((p + h) mod 3) - 0.5 >= 0.5, i.e. (p + h) mod 3 != 0, worked out here from positions
    alone: a token scored exactly at the threshold stays (evicted only strictly below)."""
    model, prompt = tiny
    method = ByPosition(window_size=WINDOW, sizing=Threshold(threshold=0.5),
                        selection=Selection(num_sinks=SINKS))
    held, _, _, cache = run(model, prompt, method, steps=16)
    for step, snapshot in enumerate(held):
        newest = PROMPT - 1 + step
        for layer in range(2):
            for head in range(2):
                expected = {p for p in range(newest + 1) if p < SINKS or p > newest - WINDOW or (p + head) % 3 != 0}
                assert snapshot[layer][head] == expected, \
                    f"step {step}, layer {layer}, head {head}: {sorted(snapshot[layer][head] ^ expected)} differ"
    # not vacuous: some position scored exactly at the threshold left the window while decoding
    assert any((p + head) % 3 == 1 for p in range(PROMPT - WINDOW, PROMPT + 16 - WINDOW) for head in range(2))
    assert sum(cache.decoding.evicted) > 0


def test_a_threshold_below_every_score_is_fullkv(tiny):
    model, prompt = tiny
    everything = KeyAndInput(window_size=WINDOW, sizing=Threshold(threshold=-1e9))
    held, sizes, fed, _ = run(model, prompt, everything, steps=16)
    full_held, full_sizes, full_fed, _ = run(model, prompt, make_method("fullkv"), steps=16)
    assert fed == full_fed and sizes == full_sizes
    assert held[-1] == [[set(range(PROMPT + 16))] * 2] * 2


def test_prefill_only_keeps_the_window_and_every_generated_token(tiny):
    model, prompt = tiny
    method = make_method("snapkv", threshold=0.3, threshold_decoding=False,
                         window_size=WINDOW)
    held, _, _, cache = run(model, prompt, method, steps=8)
    assert cache.decoding is None
    after_prefill = held[0]
    for step, snapshot in enumerate(held):
        for layer in range(2):
            for head in range(2):
                assert snapshot[layer][head] == after_prefill[layer][head] | set(range(PROMPT, PROMPT + step))
                assert set(range(PROMPT - WINDOW, PROMPT)) <= snapshot[layer][head]
    sizes = {len(s) for layer in after_prefill for s in layer}
    assert min(sizes) < PROMPT and len(sizes) > 1    # evicted, ragged


@pytest.mark.parametrize("settings, fragment", [
    (dict(threshold=0.1, threshold_decoding=False, budget=64), "budget is an outcome"),
    (dict(threshold=0.1, threshold_decoding=False, budget_ratio=0.5), "leave out budget_ratio"),
    (dict(threshold=0.0), "threshold_decoding=false"),
    (dict(threshold_decoding=False), "needs a threshold on snapkv's raw scores"),
    (dict(head_allocation="threshold", threshold_decoding=False), "needs a threshold on snapkv's raw scores"),
    (dict(threshold=-1e308, threshold_decoding=False), "at or below every score"),
    (dict(threshold=0.1, threshold_decoding=False, layer_allocation="pyramid"), "layer_allocation='uniform'"),
    (dict(threshold=0.1, threshold_decoding=False, head_allocation="adakv"), "head_allocation='uniform'"),
    (dict(threshold=0.1, threshold_decoding=False, merge="pivot"), "merge='pivot'"),
    (dict(threshold=0.1, threshold_decoding=False, random_fraction=0.2), "random_fraction=0.2"),
    (dict(threshold=0.1, threshold_decoding=False, cross_layer_merge=True), "cross_layer_merge"),
    (dict(threshold=float("nan"), threshold_decoding=False), "finite number"),
])
def test_refusals_are_one_line(settings, fragment):
    with pytest.raises(ValueError, match=fragment) as error:
        make_method("snapkv", **settings)
    assert "\n" not in str(error.value)


def test_fullkv_and_a_decode_rule_are_refused():
    with pytest.raises(ValueError, match="keeps every token"):
        make_method("fullkv", threshold=0.1, threshold_decoding=False)
    with pytest.raises(ValueError, match="does not combine with decode_budget"):
        KeyAndInput(sizing=Threshold(threshold=0.0), decode=make_method("snapkv", budget=64, decode_budget=64).decode)


def test_a_runner_records_what_was_achieved(tiny_model_dir, tmp_path):
    """RULER under threshold eviction: the folder says threshold (no nominal budget), each row the tokens every
    layer and head held, and its kept share; kv_bytes is the held count formula; results.json the mean share."""
    import json

    from pyramidkv.benchmarks.ruler.run import main

    argv = ["--model_path", tiny_model_dir, "--method", "snapkv", "--threshold",
            "0.3", "--threshold_decoding", "false", "--save_dir", str(tmp_path), "--num_threads", "1", "--device",
            "cpu", "--tasks", "vt", "--context_lengths", "1024", "--num_samples", "2"]
    assert main(argv) == 0
    (run,) = (tmp_path / f"{tiny_model_dir.rstrip('/').split('/')[-1]}_threshold").iterdir()
    rows = [json.loads(line) for line in (run / "vt_1024.jsonl").read_text().splitlines()]
    for row in rows:
        held = row["held_tokens"]
        assert len(held) == 2 and all(len(layer) == 2 for layer in held)
        assert row["kv_bytes"] == sum(map(sum, held)) * 2 * 16 * 4
        assert row["kept_share"] == pytest.approx(sum(map(sum, held)) / (4 * row["seen_tokens"]), abs=1e-6)
        assert 0 < row["kept_share"] < 1
    result = json.loads((run / "results.json").read_text())
    assert result["budget"] == "threshold"
    assert result["kept_share"]["vt@1024"] == pytest.approx(sum(r["kept_share"] for r in rows) / 2, abs=1e-6)
