"""Chunked prefill (core/chunked.py, generation/chunked.py): the multi-token forward on a compressed cache against
the model's own forward, each chunk's kept set against a float64 SnapKV reference worked from what the layer held,
the peak K/V bytes against the bound (the layer budgets + one chunk), and the refusals."""

import pytest
import torch

from pyramidkv.core.chunked import ChunkedPrefill, PrefillChunks
from pyramidkv.generation import generate
from pyramidkv.generation.chunked import chunk_bounds, prefill_in_chunks
from pyramidkv.methods import make_method
from pyramidkv.models.patch import compress
from tests.conftest import tiny_llama
from tests.helpers import TokenIds


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (1, n), generator=generator)


def test_chunks_cover_the_prompt_and_only_the_first_is_short():
    assert chunk_bounds(99, 16) == [(0, 3)] + [(s, s + 16) for s in range(3, 99, 16)]
    assert chunk_bounds(32, 16) == [(0, 16), (16, 32)]
    assert chunk_bounds(5, 16) == [(0, 5)]


@pytest.mark.parametrize("size", [8, 13])
def test_nothing_evicted_gives_the_models_own_logits(size):
    """A budget over the prompt keeps every token: each chunk's queries attend to the earlier chunks and causally to
    their own, so the last token's logits are the unpatched model's over the whole prompt."""
    model, ids = tiny_llama(layers=2, std=0.2), prompt(70)
    reference = model(ids).logits[0, -1].double()
    with compress(model, make_method("snapkv", budget=500, window_size=8)) as patch:
        cache = patch.new_cache()
        prefill_in_chunks(model, cache, ids, size)
        last = torch.tensor([[69]])
        out = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, position_ids=last,
                    cache_position=last[0]).logits[0, -1].double()
    assert cache.kept_counts(0) == [[69, 69]]
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-4)


def snapkv_reference(keys, queries, positions, budget: int, window: int, kernel: int) -> list[set[int]]:
    """Per KV head, the positions SnapKV keeps of a layer's union (keys [H, m, D], queries [Hq, c, D] of its last c
    tokens, positions [H, m]), in float64: the last `window` queries' softmax over the keys (causal inside the
    window), summed over them, averaged over the query group, max-pooled (kernel 1 here: pooling makes exact ties), top budget - window plus the window."""
    heads, m, dim = keys.shape
    group, w = queries.shape[0] // heads, window
    kept = []
    for h in range(heads):
        total = torch.zeros(m, dtype=torch.float64)
        for j in range(group):
            for i in range(w):   # the query of union index m - w + i
                q = queries[h * group + j, queries.shape[1] - w + i].double()
                logits = keys[h].double() @ q / dim ** 0.5
                logits[m - w + i + 1:] = float("-inf")
                total += torch.softmax(logits, dim=0)
        prefix = (total / group)[: m - w]
        pooled = torch.stack([prefix[max(0, i - kernel // 2): i + kernel // 2 + 1].max() for i in range(m - w)])
        order = torch.argsort(pooled, descending=True)
        top = order[: budget - w]
        gap = pooled[order[budget - w - 1]] - pooled[order[budget - w]]
        assert gap > 1e-9, "a near tie at the cut: pick another seed"
        kept.append({int(positions[h, i]) for i in top.tolist() + list(range(m - w, m))})
    return kept


def test_each_chunk_keeps_what_a_float64_snapkv_keeps_of_the_layer_it_held(monkeypatch):
    model, ids = tiny_llama(layers=2, std=0.2), prompt(90, seed=1)
    method = make_method("snapkv", budget=20, window_size=6, kernel_size=1)
    seen, original = [], ChunkedPrefill.reselect

    def recording(self, cache, layer_idx, queries):
        store = cache.layers[layer_idx]
        held = store.held(0)
        keys = torch.stack([k for k, _, _ in held]).clone()
        positions = torch.stack(store.held_positions(0)).clone()
        original(self, cache, layer_idx, queries)
        seen.append((keys, queries[0].clone(), positions, [set(p.tolist()) for p in store.kept_positions(0)]))

    monkeypatch.setattr(ChunkedPrefill, "reselect", recording)
    with compress(model, method) as patch:
        prefill_in_chunks(model, patch.new_cache(), ids, 16)
    assert len(seen) == 2 * (len(chunk_bounds(89, 16)) - 1)
    assert [keys.shape[1] for keys, *_ in seen] == [9 + 16] * 2 + [20 + 16] * (len(seen) - 2)
    for keys, queries, positions, kept in seen:
        if keys.shape[1] <= 20:   # the first chunk and the second fit the budget: kept whole
            assert kept == [set(p.tolist()) for p in positions]
        else:
            assert kept == snapkv_reference(keys, queries, positions, 20, 6, 1)


def column_sums64(queries, keys, first: int) -> torch.Tensor:
    """[Hq, m] float64: each key's softmax attention summed over the queries [Hq, c, D] of union indices first.. (keys
    [H, m, D]; query i sees every key up to index first + i)."""
    heads, m, dim = keys.shape
    group = queries.shape[0] // heads
    out = torch.zeros(queries.shape[0], m, dtype=torch.float64)
    for r in range(queries.shape[0]):
        logits = queries[r].double() @ keys[r // group].double().T / dim ** 0.5   # [c, m]
        visible = torch.arange(m)[None, :] <= torch.arange(first, first + queries.shape[1])[:, None]
        out[r] = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).sum(dim=0)
    return out


def top_with_window(scores, m: int, budget: int, window: int) -> set[int]:
    order = torch.argsort(scores[: m - window], descending=True)
    assert scores[order[budget - window - 1]] - scores[order[budget - window]] > 1e-9, "a near tie: another seed"
    return set(order[: budget - window].tolist()) | set(range(m - window, m))


def test_h2o_chunks_add_their_column_sums_to_what_the_kept_tokens_gathered(monkeypatch):
    """Two chunks of 32, budget 20, window 4: chunk 1 keeps its top by its own column sums; chunk 2 scores kept +
    new by its queries' column sums over them plus the sums the kept tokens had: against float64 sums."""
    model, ids = tiny_llama(layers=2, std=0.2), prompt(65, seed=5)
    method = make_method("h2o", budget=20, window_size=4)
    firsts, seconds = {}, []
    with compress(model, method) as patch:
        cache = patch.new_cache()
        whole, reselect = cache.prefill, ChunkedPrefill.reselect

        def first_chunk(layer_idx, queries, keys, values, *args, **kwargs):
            firsts[layer_idx] = (queries[0].clone(), keys[0].clone())
            return whole(layer_idx, queries, keys, values, *args, **kwargs)

        def second_chunk(self, cache, layer_idx, queries):
            store = cache.layers[layer_idx]
            held = (torch.stack([k for k, _, _ in store.held(0)]).clone(), torch.stack(store.held_positions(0)).clone())
            kept_before = [set(p.tolist()) for p in store.kept_positions(0)]
            reselect(self, cache, layer_idx, queries)
            seconds.append((layer_idx, held, queries[0].clone(), kept_before,
                            [set(p.tolist()) for p in store.kept_positions(0)]))

        cache.prefill = first_chunk
        monkeypatch.setattr(ChunkedPrefill, "reselect", second_chunk)
        prefill_in_chunks(model, cache, ids, 32)
    assert [s[0] for s in seconds] == [0, 1]
    for layer_idx, (keys, positions), queries, kept_before, kept_after in seconds:
        q1, k1 = firsts[layer_idx]
        sums1 = column_sums64(q1, k1, 0)                        # [Hq, 32]
        group = q1.shape[0] // k1.shape[0]
        for h in range(k1.shape[0]):
            assert kept_before[h] == top_with_window(sums1[h * group:(h + 1) * group].mean(0), 32, 20, 4)
        sums2 = column_sums64(queries, keys, 20)                # [Hq, 52]: 20 kept, then the chunk
        for r in range(sums2.shape[0]):
            sums2[r, :20] += sums1[r, positions[r // group, :20]]
        for h in range(keys.shape[0]):
            union = top_with_window(sums2[h * group:(h + 1) * group].mean(0), 52, 20, 4)
            assert kept_after[h] == {int(positions[h, i]) for i in union}


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "h2o"])
def test_peak_prefill_bytes_are_the_layer_budgets_plus_one_chunk(name):
    model, ids, size = tiny_llama(layers=4), prompt(120, seed=2), 16
    method = make_method(name, budget=24, window_size=8)
    row = 2 * 2 * 16 * 4   # K and V of one token of one layer: 2 KV heads, head dim 16, float32
    with compress(model, method) as patch:
        cache = patch.new_cache()
        prefill_in_chunks(model, cache, ids, size)
        budgets = cache.layer_budgets_used()
        assert [sum(c) / len(c) for c in (cache.kept_counts(layer)[0] for layer in range(4))] == budgets
        bound = (sum(budgets) + size) * row
        assert cache.peak_prefill_kv_bytes == bound   # the last layer of a chunk: every budget + that chunk
        assert bound < 120 * 4 * row // 2             # under half of fullkv's
    with compress(model, method) as patch:   # the whole prompt at once: the byte accounting of today, unchanged
        whole = patch.new_cache()
        model(input_ids=ids, past_key_values=whole, use_cache=True)
        assert whole.peak_prefill_kv_bytes == sum(budgets) * row


def test_a_batch_is_chunked_prompt_by_prompt():
    model, method = tiny_llama(layers=2), make_method("snapkv", budget=16, window_size=4)
    prompts = [prompt(40, seed=3)[0].tolist(), prompt(57, seed=4)[0].tolist()]
    together = generate(model, TokenIds(), prompts, method, max_new_tokens=3, stop_token_ids=[], prefill_chunk_size=8)
    alone = [generate(model, TokenIds(), [p], method, max_new_tokens=3, stop_token_ids=[], prefill_chunk_size=8)[0]
             for p in prompts]
    assert together == alone
    assert [g.kv_bytes_per_prompt for g in together] == [2 * (16 + 1 + 2) * 2 * 2 * 16 * 4] * 2
    # 39 and 56 tokens before the last: chunks of 8, the first 7 and 8 long (5 and 7 chunks)
    assert [g.prefill_chunks for g in together] == [5, 7]
    assert [g.peak_prefill_kv_bytes for g in together] == [(2 * 16 + 8) * 2 * 2 * 16 * 4] * 2   # budgets + a chunk


def test_the_rows_say_when_a_chunk_size_left_the_prompt_whole():
    """A chunk size at or above the prompt's length prefills it in one forward: the row says 1 chunk (a sweep over
    chunk sizes sees which of its runs were chunked at all); without the option the rows carry no chunk fields."""
    from pyramidkv.runner.batching import block_fields

    model, method, ids = tiny_llama(layers=2), make_method("snapkv", budget=16, window_size=4), prompt(40)[0].tolist()
    one, = generate(model, TokenIds(), [ids], method, max_new_tokens=2, stop_token_ids=[], prefill_chunk_size=64)
    plain, = generate(model, TokenIds(), [ids], method, max_new_tokens=2, stop_token_ids=[])
    assert (one.prefill_chunks, one.text) == (1, plain.text)
    assert block_fields(one)["prefill_chunks"] == 1 and "peak_prefill_kv_bytes" in block_fields(one)
    assert plain.prefill_chunks is None and "prefill_chunks" not in block_fields(plain)


@pytest.mark.parametrize("size, method, words", [
    (0, make_method("snapkv", budget=64), "must be an integer >= 1, got 0"),
    (True, make_method("snapkv", budget=64), "must be an integer >= 1, got True"),
    (16, make_method("snapkv", budget=64, window_size=32), "shorter than snapkv's window_size 32"),
    (64, make_method("kvzip", budget=64), "not defined for kvzip: KVzip's scores"),
    (64, make_method("adakv", budget=64), "not defined for adakv: its heads keep different counts"),
    (64, make_method("snapkv", budget=64, head_allocation="global"), "fixed over every layer's scores"),
    (64, make_method("zigzagkv", budget=64), "fixed over every layer's scores"),
    (64, make_method("kvzap"), "threshold eviction"),
    (64, make_method("snapkv", budget=64, merge="cam"), "a merge rule"),
    (64, make_method("snapkv", budget=64, quant_method="kivi"), "quantized"),
    (64, make_method("think", budget=64), "ThinK"),
    (64, make_method("snapkv", budget=64, decode_budget=64), "decode-time units"),
])
def test_refused_in_one_line_naming_the_value_or_the_method(size, method, words):
    with pytest.raises(ValueError, match="prefill_chunk_size") as error:
        PrefillChunks(size).check(method)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_questions_and_sliding_windows_are_refused():
    method = make_method("snapkv", budget=16, window_size=4)
    with pytest.raises(ValueError, match="questions fed as decode steps are not chunked"):
        generate(tiny_llama(layers=2), TokenIds(), [[5] * 30], method, max_new_tokens=2, questions=[[6, 7]],
                 prefill_chunk_size=8)
    sliding = tiny_llama(layers=2, family="mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window layer"):
        generate(sliding, TokenIds(), [[5] * 30], method, max_new_tokens=2, prefill_chunk_size=8)
