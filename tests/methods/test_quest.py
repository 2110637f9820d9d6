"""Quest's decode-time page retrieval: the criticality bound, the page table's updates, every page read =
full attention, page choice and output against a float64 dense reference on the model for 32 decode
steps (both GQA layouts and every page selection), composition with SnapKV in a batch, honest bytes,
bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyramidkv import make_method
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.paged import PagedStore
from pyramidkv.core.pages import PageSettings, PageTable, choose_pages, pages_to_attend
from pyramidkv.models.patch import model_shape
from tests.engine_snapshot import assert_batch_equals_alone, assert_same_run, record
from tests.prompts import STORY, passkey_prompt
from tests.reference import quest_attention, quest_criticality, quest_page_bounds, quest_pages


def test_criticality_is_an_upper_bound_of_every_key_of_the_page():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        n, dim, size = int(torch.randint(1, 90, (1,), generator=generator)), 8, int(torch.randint(1, 9, (1,),
                                                                                                  generator=generator))
        keys = torch.randn(n, dim, generator=generator, dtype=torch.float64) * 3
        query = torch.randn(dim, generator=generator, dtype=torch.float64) * 2
        table = PageTable(size, [keys])
        scores = table.criticality(query[None, None])[0, 0].double()
        for p in range(-(-n // size)):
            best = (keys[p * size:(p + 1) * size] @ query).max()
            assert scores[p] >= best - 1e-5 * (1 + abs(best)), (trial, p)


def test_hand_made_case_page_choice():
    """S = 2, D = 2: keys (1, 0), (0, 1) | (-1, 0), (0, -1) | (2, 2), q = (1, -1).
    U_0 = max(0, 1) + max(0, -1) = 1 + 0 = 1; U_1 = max(-1, 0) + max(1, 0) = 1; U_2 = 2 - 2 = 0.
    K = 1: the tie between pages 0 and 1 goes to the later page, 1; with keep_last page 2 is forced."""
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [2.0, 2.0]])
    table = PageTable(2, [keys])
    scores = table.criticality(torch.tensor([[[1.0, -1.0]]]))
    assert scores[0, 0].tolist() == [1.0, 1.0, 0.0]
    chosen, valid = choose_pages(scores, table.pages(), torch.tensor([1]), keep_last=False)
    assert chosen[0, 0, :1].tolist() == [1] and valid.all()
    chosen, valid = choose_pages(scores, table.pages(), torch.tensor([2]), keep_last=True)
    assert chosen[0, 0].tolist() == [2, 1]
    # K = min(max(page_min_count, floor(budget / S)), pages)
    settings = PageSettings(size=2, min_count=3, keep_last=False, selection="query_head")
    assert pages_to_attend(torch.tensor([3, 10, 10]), torch.tensor([2, 4, 14]), settings).tolist() == [3, 3, 7]


def test_appending_a_token_updates_only_the_last_page():
    generator = torch.Generator().manual_seed(1)
    keys = [torch.randn(21, 4, generator=generator), torch.randn(16, 4, generator=generator)]
    table = PageTable(8, keys)
    before = (table.mins.clone(), table.maxs.clone())
    new = torch.randn(2, 4, generator=generator)
    table.append(new)
    # Segment 0 (21 tokens, last page 2 holds 5): only page 2 changes, to the min/max with the new key.
    assert torch.equal(table.mins[0, :2], before[0][0, :2]) and torch.equal(table.maxs[0, :2], before[1][0, :2])
    assert torch.equal(table.mins[0, 2], torch.minimum(keys[0][16:].amin(0), new[0]))
    assert torch.equal(table.maxs[0, 2], torch.maximum(keys[0][16:].amax(0), new[0]))
    # Segment 1 (16 tokens, two full pages): the new key opens page 2, its min = max = the key.
    assert torch.equal(table.mins[1, :2], before[0][1, :2]) and torch.equal(table.maxs[1, :2], before[1][1, :2])
    assert torch.equal(table.mins[1, 2], new[1]) and torch.equal(table.maxs[1, 2], new[1])
    assert table.counts.tolist() == [22, 17] and table.pages().tolist() == [3, 3]
    # and equals a table rebuilt from scratch
    rebuilt = PageTable(8, [torch.cat([k, n[None]]) for k, n in zip(keys, new)])
    for a, b in ((table.mins, rebuilt.mins), (table.maxs, rebuilt.maxs)):
        assert torch.equal(a[:, :3], b[:, :3])


def test_a_segment_that_kept_nothing_has_no_page_until_its_first_token():
    """Threshold eviction with no window can leave a head empty (found by the batch matrix: l2norm, threshold,
    pages): it holds no page, and the next token opens its page 0 with min = max = that key."""
    generator = torch.Generator().manual_seed(2)
    keys = [torch.randn(10, 4, generator=generator), torch.zeros(0, 4)]
    table = PageTable(8, keys)
    assert table.pages().tolist() == [2, 0]
    new = torch.randn(2, 4, generator=generator)
    table.append(new)
    assert table.pages().tolist() == [2, 1]
    assert torch.equal(table.mins[1, 0], new[1]) and torch.equal(table.maxs[1, 0], new[1])
    assert torch.equal(table.mins[0, 1], torch.minimum(keys[0][8:].amin(0), new[0]))


def _store(kept_keys, kept_values, settings, budgets):
    kept = [KeptKV.from_heads([(k, v, torch.arange(len(k))) for k, v in zip(keys, values)])
            for keys, values in zip(kept_keys, kept_values)]
    return PagedStore(kept, [len(k[0]) for k in kept_keys], settings, budgets)


def test_reading_every_page_equals_full_attention():
    """One prompt reads all its pages (budget >= its tokens) while the other does not, so the gathered
    path runs: the first prompt's output equals float64 full attention; on the model a page budget above
    the prompt gives fullkv's logits bit for bit (every step is the dense attention then)."""
    generator = torch.Generator().manual_seed(2)
    dim, heads, g = 8, 2, 3
    lengths = [37, 70]
    keys = [[torch.randn(n, dim, generator=generator) for _ in range(heads)] for n in lengths]
    values = [[torch.randn(n, dim, generator=generator) for _ in range(heads)] for n in lengths]
    store = _store(keys, values, PageSettings(4, 1, False, "query_head"), [64, 8])
    new_k, new_v = torch.randn(2, heads, 1, dim, generator=generator), torch.randn(2, heads, 1, dim, generator=generator)
    store.append(new_k, new_v, torch.tensor([37, 70]))
    queries = torch.randn(2, heads * g, 1, dim, generator=generator)
    out = store.attend(queries)
    assert store.chosen_pages is not None   # the gathered path ran
    for h in range(heads):
        k = torch.cat([keys[0][h], new_k[0, h]]).double()
        v = torch.cat([values[0][h], new_v[0, h]]).double()
        for j in range(g):
            q = queries[0, h * g + j, 0].double()
            expected = torch.softmax(k @ q / math.sqrt(dim), dim=0) @ v
            assert torch.allclose(out[0, h * g + j, 0].double(), expected, atol=1e-6)


def test_page_budget_above_the_prompt_is_fullkv(smollm2):
    """Every page read: fullkv's tokens and held positions, its logits to float rounding (the paged store attends
    through its own buffers, and holds its pages' key bounds beside the K/V: more bytes)."""
    model, tokenizer = smollm2
    prompt = tokenizer(STORY, add_special_tokens=False).input_ids
    full = record(model, tokenizer, make_method("fullkv"), [prompt], 8)
    quest = record(model, tokenizer, make_method("quest", budget=4096), [prompt], 8)
    assert_same_run(quest, full, same_bytes=False)


class Recorder:
    """Wraps PagedStore.attend: per call the queries, the output, the pages chosen and the held K/V."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = PagedStore.attend

        def attend(store, queries):
            out = real(store, queries)
            held = [[(k.double().numpy(), v.double().numpy()) for k, v, _ in store.held(b)]
                    for b in range(len(store.kept))]
            chosen = None if store.chosen_pages is None else store.chosen_pages.clone()
            self.calls.append((queries.double().numpy(), out.double().numpy(), chosen, held, store.budgets.tolist()))
            return out

        monkeypatch.setattr(PagedStore, "attend", attend)


def check_against_reference(calls, settings: dict, group: int):
    size, min_count = settings.get("page_size", 16), settings.get("page_min_count", 3)
    selection, keep_last = settings.get("page_selection", "query_head"), settings.get("page_keep_last", False)
    compared = 0
    for queries, out, chosen, held, budgets in calls:
        heads = len(held[0])
        for b, per_head in enumerate(held):
            for h, (keys, values) in enumerate(per_head):
                s = b * heads + h
                mins, maxs = quest_page_bounds(keys, size)
                pages = len(mins)
                k = min(max(min_count, budgets[s] // size), pages)
                rows = [queries[b, h * group + j, 0] for j in range(group)]
                scores = [quest_criticality(q, mins, maxs) for q in rows]
                if selection == "group_max":
                    scores = [np.max(scores, axis=0)] * group
                elif selection == "group_mean":
                    scores = [np.mean(scores, axis=0)] * group
                for j, q in enumerate(rows):
                    forced = (pages - 1,) if keep_last else ()
                    expected = quest_pages(scores[j], k, forced)
                    if chosen is None:
                        assert k == pages
                        got = list(range(pages))
                    else:
                        row = chosen[s, 0 if chosen.shape[1] == 1 else j]
                        got = [p for p in row.tolist() if p >= 0]
                        cut = sorted(scores[j], reverse=True)[k - 1]
                        for p in set(got) ^ set(expected):   # only a near-tie at the cut may differ
                            assert p not in forced and math.isclose(scores[j][p], cut, rel_tol=1e-5), (s, j, p)
                    reference = quest_attention(q, keys, values, got, size)
                    np.testing.assert_allclose(out[b, h * group + j, 0], reference, rtol=1e-4, atol=2e-5)
                    compared += 1
    return compared


@pytest.mark.parametrize("settings", [
    {"gqa_layout": "kv_head"},
    {"gqa_layout": "query_head"},
    {"gqa_layout": "kv_head", "page_selection": "group_max"},
    {"gqa_layout": "kv_head", "page_selection": "group_mean", "page_keep_last": True, "page_min_count": 1},
], ids=["kv_head", "query_head", "kv_head-group_max", "kv_head-group_mean-keep_last"])
def test_pages_and_output_equal_a_float64_reference_on_the_model(smollm2, monkeypatch, settings):
    """32 decode steps of a ~420-token prompt, budget 64 (4 pages of 16 of ~28): at every step, layer >= 2,
    prompt, stored head and query head, the chosen pages and the attention output equal the float64 dense
    reference (mask outside the chosen pages)."""
    model, tokenizer = smollm2
    prompt = tokenizer(STORY * 2, add_special_tokens=False).input_ids
    recorder = Recorder(monkeypatch)
    method = make_method("quest", budget=64, **settings)
    record(model, tokenizer, method, [prompt], 32)
    layers = model.config.num_hidden_layers
    assert len(recorder.calls) == (layers - 2) * 31   # the first new token is sampled from the prefill
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    compared = check_against_reference(recorder.calls, settings, 1 if settings["gqa_layout"] == "query_head" else group)
    assert compared == (layers - 2) * 31 * model.config.num_attention_heads


def test_composed_with_snapkv_a_batch_of_three_equals_single_runs(random_llama, request):
    model, tokenizer, _ = random_llama  # a batch computes each prompt alone whatever the weights
    prompts = [tokenizer(p, add_special_tokens=False).input_ids
               for p in (passkey_prompt(52817, 16), STORY, "<|im_start|>user\nName a colour.<|im_end|>\n")]
    method = make_method("snapkv", budget=128, window_size=16, page_budget=48, page_size=8)
    assert_batch_equals_alone(model, tokenizer, method, prompts, 12, request)


def test_held_and_read_bytes(smollm2):
    """Held = K/V + a min and a max vector per page; read per step = the K/V of the chosen pages' tokens +
    every page's metadata in paged layers, everything held in the dense layers 0-1."""
    model, tokenizer = smollm2
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    prompt = tokenizer(STORY * 2, add_special_tokens=False).input_ids
    n, steps, size = len(prompt), 5, 16
    method = make_method("quest", budget=64, page_selection="group_max")
    with torch.no_grad():
        from pyramidkv import compress
        with compress(model, method) as patch:
            cache = patch.new_cache()
            out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
            for _ in range(steps):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    held = n + steps
    pages = -(-held // size)
    row = 2 * dim * 4  # a key and a value, float32
    kv = cfg.num_hidden_layers * cfg.num_key_value_heads * held * row
    metadata = (cfg.num_hidden_layers - 2) * cfg.num_key_value_heads * pages * row
    assert cache.kv_bytes_breakdown(0) == {"residual": kv, "page_metadata": metadata}
    read = 2 * cfg.num_key_value_heads * held * row + metadata
    for layer in range(2, cfg.num_hidden_layers):
        chosen = cache.layers[layer].chosen_pages                      # [S, 1, 4]: group_max, one set per head
        assert chosen.shape[1:] == (1, 4)
        tokens = [sum(min(size, held - p * size) for p in set(c[0].tolist())) for c in chosen]
        read += sum(tokens) * row
    assert cache.decode_read_bytes(0) == read


@pytest.mark.parametrize("settings,message", [
    (dict(name="snapkv", budget=64, page_budget=32, page_size=0), "page_size must be an integer >= 1"),
    (dict(name="snapkv", budget=64, page_budget=8), "page_budget 8 is smaller than one page"),
    (dict(name="quest", budget=8), "budget 8 is smaller than one page"),
    (dict(name="snapkv", budget=64, page_size=8), "page_size=8 only applies with page_budget"),
    (dict(name="snapkv", budget=64, page_budget=48, quant_method="kivi"), "does not combine with quant_method"),
    (dict(name="h2o", budget=64, page_budget=48, decode_budget=64), "decode-time attention statistics"),
    (dict(name="quest", budget=64, page_budget=32), "page_budget and budget name the same setting \\(page_budget\\)"),
    (dict(name="quest", budget=64, decode_budget=64), "quest evicts nothing"),
    (dict(name="snapkv", budget=64, page_budget=32, page_selection="max"), "page_selection must be one of"),
])
def test_bad_settings_fail_with_one_line(settings, message):
    settings = dict(settings)
    with pytest.raises(ValueError, match=message) as error:
        make_method(settings.pop("name"), **settings)
    assert "\n" not in str(error.value)


def test_page_min_count_is_bounded_by_the_pages_of_the_context_window(random_llama):
    """8192 positions in pages of 16 are 512 pages: a larger minimum is refused in one line when compress()
    checks the model (2 ** 63 overflowed torch.clamp in generate); 512 itself runs."""
    from pyramidkv.generation import generate

    model, tokenizer, _ = random_llama
    assert model.config.max_position_embeddings == 8192
    ids = [list(range(10, 90))]
    for count in (513, 2 ** 63):
        method = make_method("quest", page_budget_ratio=0.5, page_size=16, page_min_count=count)
        with pytest.raises(ValueError, match=rf"page_min_count {count} is more pages than the model's context window "
                                             r"holds \(8192 tokens = 512 pages of page_size 16\); allowed: 1 <= "
                                             r"page_min_count <= 512"):
            method.check_model(model_shape(model.config, 4))
        with pytest.raises(ValueError, match=f"below page_min_count {count} pages") as error:   # the prompt's check
            generate(model, tokenizer, ids, method, max_new_tokens=2)
        assert "\n" not in str(error.value)
    method = make_method("quest", page_budget=8192, page_size=16, page_min_count=512)   # 512 whole pages
    assert generate(model, tokenizer, ids, method, max_new_tokens=2, stop_token_ids=[])[0].new_tokens == 2
