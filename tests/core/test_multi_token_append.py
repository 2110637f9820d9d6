"""Several new tokens in one forward on a prefilled (compressed) cache decide as if they came one per step: for every
decode-time unit and store kind, a question appended in ONE forward leaves the same held positions in every layer
and head, the same stored K/V (float tolerance) and the same logits at every question position and answer step as
the same question fed one token per forward (the reference: the decode path the rest of the suite checks), on a
float64 tiny random Llama. A left-padded batch appends each row as it appends alone."""

from __future__ import annotations

import copy

import pytest
import torch

from pyramidkv import make_method
from pyramidkv.core.decoding import DecodeCompressor
from pyramidkv.models.patch import compress
from tests.helpers import float64_tiny_llama, kvzap_artifact

CONTEXT, QUESTION, ANSWER = 40, 30, 6
# float64 throughout: one forward and q forwards differ by the order of the same sums (the file passes at this
# tolerance under ATEN_CPU_CAPABILITY=default, ATEN_CPU_CAPABILITY=avx2 and MKL_CBWR=COMPATIBLE); quantized
# stores take one token per piece, so their codes are those of one token per forward; a paged (Quest) store takes the
# whole question, each query choosing its pages over the bounds held at its step (float64 page scores: a page choice
# flips only on a tie within float64 rounding).
TOLERANCE = {"logits": 1e-9, "kv": 1e-9}

# Every decode-time unit and store kind: (settings, what must happen during the question for the case to test it).
CASES = {
    "fullkv": dict(name="fullkv"),
    "snapkv_decode_budget": dict(name="snapkv", budget=24, window_size=4, decode_budget=20, decode_interval=4),
    "h2o_decode": dict(name="h2o", budget=24, window_size=4, decode_budget=20, decode_interval=3),
    "tova": dict(name="tova", budget=24),
    "scissorhands_decode": dict(name="scissorhands", budget=24, window_size=4, decode_budget=20, decode_interval=5),
    "merge_decode": dict(name="snapkv", budget=24, window_size=4, decode_budget=20, decode_interval=4,
                         merge="mergingpress"),
    "kvzap_threshold": dict(name="kvzap", window_size=8, threshold=-1.5),
    "duo_attention_threshold": dict(name="duo_attention", window_size=8, num_sinks=2, threshold=0.5,
                                    threshold_decoding=True),
    "quest_pages": dict(name="quest", budget=16, page_size=4, page_dense_layers=1),
    "quest_keep_last_group_max": dict(name="quest", budget=12, page_size=3, page_dense_layers=0, page_min_count=2,
                                      page_keep_last=True, page_selection="group_max"),
    "quest_dense_then_paged": dict(name="quest", budget=48, page_size=4, page_dense_layers=0,
                                   page_selection="group_mean"),
    "kivi2": dict(name="snapkv", budget=24, window_size=8, quant_method="kivi", nbits=2, group_size=8,
                  residual_length=8),
    "gear": dict(name="snapkv", budget=24, window_size=8, quant_method="gear", nbits=4, group_size=8,
                 residual_length=8),
    "minicache_pairs": dict(name="minicache"),
}


@pytest.fixture(scope="module")
def model():
    with float64_tiny_llama() as tiny:
        yield tiny


@pytest.fixture(scope="module")
def tables(tmp_path_factory, model):
    folder = tmp_path_factory.mktemp("multi-token-tables")
    duo = folder / "full_attention_heads.tsv"   # 2 layers x 2 KV heads: one head of each layer streams
    duo.write_text("0.93\t0.08\n-0.01\t1.2\n")
    return {"kvzap_path": kvzap_artifact(copy.deepcopy(model).float(), folder / "kvzap.safetensors"),
            "duo_pattern": str(duo)}


def method_of(case: str, tables: dict):
    settings = dict(CASES[case])
    if settings["name"] == "kvzap":
        settings["kvzap_path"] = tables["kvzap_path"]
    if settings["name"] == "duo_attention":
        settings["duo_pattern"] = tables["duo_pattern"]
    return make_method(settings.pop("name"), **settings)


def tokens(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=generator).tolist() for n in lengths]


def run(model, method, contexts: list[list[int]], questions: list[list[int]], pieces: list[int]):
    """Prefill the left-padded contexts, feed the questions in forwards of `pieces` tokens, then ANSWER greedy steps.
    -> (logits [B, QUESTION + ANSWER, V] of every question position and answer step, the answer tokens,
    per prompt per layer per stored head (held positions, stored keys, stored values) at the end of the question)."""
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[0] * (width - len(c)) + c for c in contexts])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    question = torch.tensor(questions)
    logits, answer = [], []
    with compress(model, method) as patch, torch.no_grad():
        cache = patch.new_cache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)

        def feed(new):
            nonlocal mask
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            at = (mask.cumsum(-1) - 1)[:, -new.shape[1]:]
            return model(new, attention_mask=mask, position_ids=at, past_key_values=cache, use_cache=True).logits

        done = 0
        for piece in pieces:
            logits.append(feed(question[:, done:done + piece]))
            done += piece
        state = [[[(p.tolist(), k.clone(), v.clone()) for p, k, v in cache.stored_kv(layer, b)]
                  for layer in range(len(cache.layers))] for b in range(len(contexts))]
        for _ in range(ANSWER):
            answer.append(logits[-1][:, -1].argmax(-1, keepdim=True))
            logits.append(feed(answer[-1]))
    return torch.cat(logits, dim=1), torch.cat(answer, dim=1).tolist(), state, cache


def assert_same(got, want, tolerance=None):
    """got and want from run() (the same prompts); tolerance: one for logits and K/V alike (None: TOLERANCE)."""
    (logits, answer, state, _), (logits_ref, answer_ref, state_ref, _) = got, want
    assert answer == answer_ref, "answer tokens differ"
    torch.testing.assert_close(logits, logits_ref, rtol=0, atol=tolerance or TOLERANCE["logits"])
    for b in range(len(answer)):
        for layer, (heads, heads_ref) in enumerate(zip(state[b], state_ref[b])):
            for head, ((p, k, v), (p_ref, k_ref, v_ref)) in enumerate(zip(heads, heads_ref)):
                where = f"prompt {b}, layer {layer}, head {head}"
                assert p == p_ref, f"{where}: held positions differ: {sorted(set(p) ^ set(p_ref))}"
                for got_kv, want_kv, part in ((k, k_ref, "keys"), (v, v_ref, "values")):
                    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=tolerance or TOLERANCE["kv"],
                                               msg=lambda m: f"{where}: stored {part}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_forward_equals_one_token_per_forward(model, tables, case):
    method = method_of(case, tables)
    contexts, questions = tokens([CONTEXT], 1), tokens([QUESTION], 2)
    one_by_one = run(model, method, contexts, questions, [1] * QUESTION)
    at_once = run(model, method, contexts, questions, [QUESTION])
    assert_same(at_once, one_by_one)
    cache = one_by_one[3]
    decided = getattr(cache.decoding, "compressions", None)
    if cache.decoding is not None:   # the question made the unit decide (else the case would test nothing)
        assert sum(decided) > 0, f"{case}: no decision during the question"
    if case.startswith("quest"):
        assert any(getattr(store, "chosen_pages", None) is not None for store in cache.layers), "every page read"


@pytest.mark.parametrize("case", ["quest_pages", "quest_dense_then_paged"])
def test_quest_attends_the_question_in_one_piece(model, tables, case, monkeypatch):
    """The paged store takes the whole question in one piece per layer (not one token per piece), choosing pages
    for some of its queries (quest_dense_then_paged: its first 7 queries see at most 48 tokens, every page)."""
    from pyramidkv.core.paged import PagedStore
    pieces, original = [], PagedStore.attend

    def counted(self, queries):
        pieces.append(queries.shape[2])
        return original(self, queries)

    monkeypatch.setattr(PagedStore, "attend", counted)
    run(model, method_of(case, tables), tokens([CONTEXT], 1), tokens([QUESTION], 2), [QUESTION])
    paged = 2 - CASES[case]["page_dense_layers"]   # the tiny model's 2 layers, less the dense ones
    assert pieces == [QUESTION] * paged + [1] * (ANSWER * paged), pieces


def test_a_decode_budget_fires_inside_the_forward(model, tables, monkeypatch):
    """The forward is cut where the decode budget fires: several re-selections inside one forward of 30 tokens,
    each at the same held count as one token per forward."""
    method = method_of("snapkv_decode_budget", tables)
    fired = []
    original = DecodeCompressor._compress

    def counted(self, layer_idx, fire):
        fired.append((layer_idx, max(max(h) for h in self.stores[layer_idx].held_counts())))
        return original(self, layer_idx, fire)

    monkeypatch.setattr(DecodeCompressor, "_compress", counted)
    contexts, questions = tokens([CONTEXT], 1), tokens([QUESTION], 2)
    run(model, method, contexts, questions, [QUESTION])
    at_once, fired[:] = list(fired), []
    run(model, method, contexts, questions, [1] * QUESTION)
    for layer in (0, 1):   # one forward runs layer 0's pieces before layer 1's; per layer the same sequence
        assert [h for l, h in at_once if l == layer] == [h for l, h in fired if l == layer]
    assert len(at_once) >= 2 * 5, at_once
    assert all(held <= 24 for _, held in at_once), "a head went past decode_budget + decode_interval"


@pytest.mark.parametrize("case", ["fullkv", "snapkv_decode_budget", "kivi2", "quest_keep_last_group_max"])
def test_a_left_padded_batch_appends_each_row_as_alone(model, tables, case):
    """A batch of three contexts (two left-padded) with one question each, appended in one forward: the same as the
    batch fed one token per forward, and each row the same as that row alone. Against the row alone the tolerance is
    float32's: the decode attention over prompts that hold different counts runs in float32 (core/layout.py), one
    prompt alone in the model's dtype (measured 2.1e-6 on the logits, the same token by token)."""
    method = method_of(case, tables)
    contexts, questions = tokens([CONTEXT, 29, 35], 3), tokens([QUESTION] * 3, 4)
    batch = run(model, method, contexts, questions, [QUESTION])
    assert_same(batch, run(model, method, contexts, questions, [1] * QUESTION))
    for row in range(3):
        alone = run(model, method, [contexts[row]], [questions[row]], [QUESTION])
        assert_same((batch[0][row:row + 1], [batch[1][row]], [batch[2][row]], None), alone, tolerance=1e-5)


def test_uneven_pieces_equal_one_forward(model, tables):
    """A question cut anywhere (pieces of 7, 1, 13, 9) gives what one forward gives: nothing depends on where the
    caller cut it."""
    method = method_of("h2o_decode", tables)
    contexts, questions = tokens([CONTEXT], 5), tokens([QUESTION], 6)
    assert_same(run(model, method, contexts, questions, [7, 1, 13, 9]),
                run(model, method, contexts, questions, [QUESTION]))


def test_quest_pieces_are_cut_at_max_piece(model, tables, monkeypatch):
    """A question longer than the paged store's max_piece goes in pieces of max_piece (then the rest), and gives what
    one token per forward gives."""
    from pyramidkv.core.paged import PagedStore
    pieces, original = [], PagedStore.attend

    def counted(self, queries):
        pieces.append(queries.shape[2])
        return original(self, queries)

    monkeypatch.setattr(PagedStore, "attend", counted)
    monkeypatch.setattr(PagedStore, "max_piece", 7)
    method, contexts, questions = method_of("quest_pages", tables), tokens([CONTEXT], 1), tokens([QUESTION], 2)
    at_once = run(model, method, contexts, questions, [QUESTION])
    assert pieces[:5] == [7, 7, 7, 7, 2], pieces
    assert_same(at_once, run(model, method, contexts, questions, [1] * QUESTION))


def test_quest_piece_reads_the_union_of_its_queries_pages(model, tables, monkeypatch):
    """After a question in one forward the paged layer's read bytes are the K/V of the union of the pages the
    question's tokens chose one per forward (each page's tokens at the end of the question) + every page's metadata."""
    from pyramidkv.core.paged import PagedStore
    seen, original = [], PagedStore.attend

    def recorded(self, queries):
        out = original(self, queries)
        pages = None if self.chosen_pages is None else self.chosen_pages.clone()
        seen.append((queries.shape[2], pages, self.table.pages().clone(), list(self.last_read)))
        return out

    monkeypatch.setattr(PagedStore, "attend", recorded)
    method, contexts, questions = method_of("quest_pages", tables), tokens([CONTEXT], 1), tokens([QUESTION], 2)
    run(model, method, contexts, questions, [1] * QUESTION)
    steps, seen[:] = seen[:QUESTION], []
    run(model, method, contexts, questions, [QUESTION])
    assert seen[0][0] == QUESTION
    size, final, dim = 4, CONTEXT + QUESTION, model.config.hidden_size // model.config.num_attention_heads
    expected = 0
    for s, pages in enumerate(steps[-1][2].tolist()):
        union = set()
        for _, chosen, held_pages, _ in steps:   # a dense step (chosen None) reads every page held
            union |= set(range(held_pages[s])) if chosen is None else {p for p in chosen[s].flatten().tolist() if p >= 0}
        expected += sum(min(size, final - p * size) for p in union) * 2 * dim * 8 + pages * 2 * dim * 8
    assert seen[0][3] == [expected]
