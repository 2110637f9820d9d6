"""TOVA: the last query's attention averaged over all query heads, one kept set per layer, against a float64
reference on the default model in both GQA layouts; while decoding, the official rule (append the new token,
evict the one the new query attends least, the new token included) step by step against a float64
simulation of a tiny random Llama over 64 steps; its refusals, one line each."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pyramidkv import make_method
from pyramidkv.core.context import ScoreContext
from pyramidkv.generation import generate
from tests.conftest import tiny_llama
from tests.helpers import TokenIds, prefill
from tests.reference import assert_same_selection, prompt_queries_and_keys, top_positions

BUDGET = 64


@pytest.fixture(scope="module")
def queries_and_keys(eager_setup):
    model, ids, _, _ = eager_setup
    return prompt_queries_and_keys(model, ids)


@pytest.mark.parametrize("layout", ["kv_head", "query_head"])
def test_prefill_scores_and_one_kept_set_per_layer(eager_setup, queries_and_keys, layout):
    model, ids, attentions, _ = eager_setup
    method = make_method("tova", budget=BUDGET, gqa_layout=layout)
    cache = prefill(model, ids, method)
    queries, keys = queries_and_keys
    n = ids.shape[1]
    heads = model.config.num_attention_heads if layout == "query_head" else model.config.num_key_value_heads
    for layer in range(model.config.num_hidden_layers):
        expected = attentions[layer][:, -1, :].mean(axis=0)        # [n]: the last row, mean over the 9 heads
        q, k = (torch.from_numpy(x).float()[None] for x in (queries[layer], keys[layer]))
        score = method.score(ScoreContext(layer, 30, q, k, k, torch.ones(1, n, dtype=torch.bool)))[0]
        np.testing.assert_allclose(score.double().numpy(), np.broadcast_to(expected, score.shape), rtol=1e-4,
                                   atol=1e-7)
        kept = [p.tolist() for p in cache.kept_positions(layer, 0)]
        assert len(kept) == heads and all(p == kept[0] for p in kept), "one kept set for every head"
        assert len(kept[0]) == BUDGET
        assert_same_selection(set(kept[0]), expected, BUDGET, rel_tol=1e-4)


# ---- decoding: the official rule simulated in float64 ------------------------------------------------
PROMPT, DECODE_BUDGET, STEPS = 48, 32, 64


def simulate(model, tokens: list[int], prompt_len: int, budget: int) -> list[list[set[int]]]:
    """The official TOVA cache in float64, from the model's weights: per forward (the prompt, then one token each)
    the kept positions of every layer. Each layer attends over its kept positions and the new ones, then keeps
    the `budget` positions the last new query attends most (mean over query heads; ties: the more recent)."""
    m = model.model
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    layers = len(m.layers)
    cache_k = [[] for _ in range(layers)]
    cache_v = [[] for _ in range(layers)]
    kept = [set() for _ in range(layers)]
    history = []
    chunks = [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]
    start = 0
    with torch.no_grad():
        for chunk in chunks:
            q_len = len(chunk)
            positions = torch.arange(start, start + q_len)[None]
            h = m.embed_tokens(torch.tensor([chunk]))
            cos, sin = m.rotary_emb(h, positions)
            for layer, block in enumerate(m.layers):
                attn = block.self_attn
                x = block.input_layernorm(h)
                q = attn.q_proj(x).view(1, q_len, heads, -1).transpose(1, 2)
                k = attn.k_proj(x).view(1, q_len, kv_heads, -1).transpose(1, 2)
                v = attn.v_proj(x).view(1, q_len, kv_heads, -1).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                cache_k[layer].append(k)
                cache_v[layer].append(v)
                keys = torch.cat(cache_k[layer], dim=2).repeat_interleave(group, dim=1)     # [1, Hq, t, D]
                values = torch.cat(cache_v[layer], dim=2).repeat_interleave(group, dim=1)
                t = keys.shape[2]
                visible = torch.zeros(q_len, t, dtype=torch.bool)
                held = sorted(kept[layer]) + list(range(start, start + q_len))
                visible[:, held] = True
                visible &= torch.arange(t)[None, :] <= torch.arange(start, start + q_len)[:, None]
                logits = (q @ keys.transpose(-1, -2)) / q.shape[-1] ** 0.5
                probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)   # float64
                out = (probs @ values).transpose(1, 2).reshape(1, q_len, -1)
                h = h + attn.o_proj(out)
                h = h + block.mlp(block.post_attention_layernorm(h))
                row = probs[0, :, -1, :].mean(dim=0).numpy()                                  # [t]
                candidates = np.array(held)
                if len(held) > budget:
                    chosen = top_positions(row[candidates], budget)
                    kept[layer] = {int(candidates[j]) for j in chosen}
                else:
                    kept[layer] = set(held)
            history.append([set(s) for s in kept])
            start += q_len
    return history


@pytest.fixture(scope="module")
def tiny():
    """(model, prompt), torch on one thread: on these sizes more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_llama(layers=2, vocab=96, std=0.2)
    prompt = torch.randint(3, 96, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    yield model, prompt
    torch.set_num_threads(threads)


def test_decoding_evicts_one_token_per_step_as_the_official_rule(tiny):
    model, prompt = tiny
    method = make_method("tova", budget=DECODE_BUDGET)   # the default: decode_budget = budget, one eviction a step
    held, fed = [], []

    def record(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        held.append([set(cache.held_positions(layer, 0)[0].tolist()) for layer in range(2)])
        assert all(len({tuple(p.tolist()) for p in cache.held_positions(layer, 0)}) == 1 for layer in range(2))
        fed.extend(kwargs["input_ids"][0].tolist())

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        generate(model, TokenIds(), [prompt], method, STEPS + 1, stop_token_ids=[])
    finally:
        hook.remove()
    assert fed[:PROMPT] == prompt and len(held) == STEPS + 1
    expected = simulate(copy.deepcopy(model).double(), fed, PROMPT, DECODE_BUDGET)
    for step, (got, want) in enumerate(zip(held, expected)):
        assert got == want, f"step {step}: layer kept sets differ: {[sorted(a ^ b) for a, b in zip(got, want)]}"
    # The new token itself was evicted at some step (else the test would not see that case).
    assert any(PROMPT + s - 1 not in expected[s][layer] for s in range(1, STEPS + 1) for layer in range(2))


@pytest.mark.parametrize("settings, fragment", [
    (dict(budget=32, decode_budget=None), "decode_budget=None would never evict"),
    (dict(budget_ratio=0.5), "needs decode_budget"),
    (dict(budget=32, head_allocation="adakv"), "head_allocation must be 'uniform'"),
    (dict(budget=32, decode_budget=0), "decode_budget must be an integer >= 1"),
    (dict(budget=32, decode_interval=0), "decode_interval must be an integer >= 1"),
])
def test_refusals_are_one_line(settings, fragment):
    with pytest.raises(ValueError) as refusal:
        make_method("tova", **settings)
    assert fragment in str(refusal.value) and "\n" not in str(refusal.value)


def test_a_schedule_longer_than_the_context_is_refused():
    """decode_budget + decode_interval beyond the model's context: the cache would never evict while decoding."""
    from pyramidkv.components import ModelShape

    method = make_method("tova", budget=32, decode_budget=400, decode_interval=512)
    with pytest.raises(ValueError, match="never re-select") as refusal:
        method.check_model(ModelShape(2, 4, 2, context_window=512))
    assert "\n" not in str(refusal.value)
