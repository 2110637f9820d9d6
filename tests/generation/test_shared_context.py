"""Compress once, ask many (pyramidkv/generation/shared.py, pipeline.py) against independent references: `generate`
on each context + question concatenated (fullkv), the cache's K/V recorded right after compression, each context
run alone, a conversation written out token by token."""

from __future__ import annotations

import pytest
import torch

import pyramidkv
from pyramidkv import make_method
from pyramidkv.core import snapshot as snapshot_module
from pyramidkv.generation import generate
from pyramidkv.generation import shared
from pyramidkv.generation.chat import chat_frame, followup_frame
from pyramidkv.generation.shared import answer_questions

NEW = 6


def token_ids(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 5000, (n,), generator=g).tolist() for n in lengths]


CONTEXTS = token_ids(1, 150, 171)
QUESTIONS = [token_ids(2, 5, 9, 1), token_ids(3, 7, 2, 4)]


class LogitsRecorder:
    """The lm_head's output at every forward (the last position only: generation computes no other)."""

    def __init__(self, model):
        self.out: list[torch.Tensor] = []
        self.handle = model.get_output_embeddings().register_forward_hook(
            lambda module, args, output: self.out.append(output[:, -1].detach().clone()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_fullkv_answers_equal_generate_on_context_plus_question(sharp_llama):
    model, tokenizer, _ = sharp_llama
    with LogitsRecorder(model) as shared_logits:
        answers = answer_questions(model, tokenizer, CONTEXTS[:1], QUESTIONS[:1], make_method("fullkv"), NEW,
                                   stop_token_ids=[])[0]
    # forwards: the context, then per question its tokens but the last in one forward (none for a 1-token question),
    # the last, and NEW - 1 answer tokens
    per_question = [(len(q) > 1) + NEW for q in QUESTIONS[0]]
    assert len(shared_logits.out) == 1 + sum(per_question)
    ends = [1 + sum(per_question[:k + 1]) for k in range(len(per_question))]
    for k, question in enumerate(QUESTIONS[0]):
        with LogitsRecorder(model) as reference_logits:
            reference = generate(model, tokenizer, [CONTEXTS[0] + question], make_method("fullkv"), NEW,
                                 stop_token_ids=[])[0]
        assert answers[k].text == reference.text and len(answers[k].answer_ids) == NEW
        assert answers[k].turn == k + 1 and answers[k].kv_bytes == reference.kv_bytes_per_prompt
        ours = torch.cat(shared_logits.out[ends[k] - NEW:ends[k]])
        torch.testing.assert_close(ours, torch.cat(reference_logits.out), rtol=1e-4, atol=1e-4)


def stored(cache) -> list:
    return [[(p.clone(), k.clone(), v.clone()) for p, k, v in cache.stored_kv(layer, b)]
            for layer in range(cache.num_layers) for b in range(len(cache.pad_lens))]


def same(a, b) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(s, t) for u, w in zip(x, y)
                                                              for s, t in zip(u, w)) for x, y in zip(a, b))


@pytest.mark.parametrize("spec", [
    "snapkv:budget=64,window_size=8",
    "h2o:budget=64,window_size=8,decode_budget=64,decode_interval=4",   # the questions re-select the compressed part
    # appends fill the quantizer's residual
    "snapkv:budget=64,window_size=8,quant_method=kivi,nbits=2,group_size=16,residual_length=16",
])
def test_multi_request_rolls_back_to_the_compressed_context_bitwise(sharp_llama, monkeypatch, spec):
    model, tokenizer, _ = sharp_llama
    method = pyramidkv.methods.parse_method_spec(spec)
    seen = {}
    real_snapshot, real_restore = shared.snapshot, shared.restore

    def recording_snapshot(cache):
        seen["compressed"] = (stored(cache), cache.kv_bytes())
        return real_snapshot(cache)

    def checking_restore(cache, state):
        assert not same(stored(cache), seen["compressed"][0])        # the question changed the cache
        real_restore(cache, state)
        seen["restores"] = seen.get("restores", 0) + 1
        assert same(stored(cache), seen["compressed"][0]) and cache.kv_bytes() == seen["compressed"][1]
        assert cache.get_seq_length() == max(len(c) for c in CONTEXTS)

    monkeypatch.setattr(shared, "snapshot", recording_snapshot)
    monkeypatch.setattr(shared, "restore", checking_restore)
    batch = answer_questions(model, tokenizer, CONTEXTS, QUESTIONS, method, NEW, stop_token_ids=[])
    assert seen["restores"] == 2
    monkeypatch.setattr(shared, "snapshot", real_snapshot)
    monkeypatch.setattr(shared, "restore", real_restore)
    reversed_order = answer_questions(model, tokenizer, CONTEXTS, [q[::-1] for q in QUESTIONS], method, NEW,
                                      stop_token_ids=[])
    alone = [answer_questions(model, tokenizer, [c], [q], method, NEW, stop_token_ids=[])[0]
             for c, q in zip(CONTEXTS, QUESTIONS)]
    texts = {a.text for per in batch for a in per}
    assert len(texts) > 3                                      # the questions get different answers
    for per, rev, solo in zip(batch, reversed_order, alone):
        assert [(a.text, a.kv_bytes) for a in per] == [(a.text, a.kv_bytes) for a in rev[::-1]]
        assert [(a.text, a.kv_bytes, a.context_kv_bytes) for a in per] == \
               [(a.text, a.kv_bytes, a.context_kv_bytes) for a in solo]


def test_a_context_with_fewer_questions_gets_only_its_own(sharp_llama):
    model, tokenizer, _ = sharp_llama
    method = make_method("snapkv", budget=64, window_size=8)
    out = answer_questions(model, tokenizer, CONTEXTS, [QUESTIONS[0][:1], QUESTIONS[1]], method, NEW,
                           stop_token_ids=[])
    alone = answer_questions(model, tokenizer, CONTEXTS[:1], [QUESTIONS[0][:1]], method, NEW, stop_token_ids=[])
    assert [len(per) for per in out] == [1, 3] and out[0][0].text == alone[0][0].text


def test_multi_turn_holds_the_decode_budget_over_5_turns(sharp_llama):
    model, tokenizer, _ = sharp_llama
    budget, interval = 48, 4
    method = make_method("snapkv", budget=64, window_size=8, decode_budget=budget, decode_interval=interval)
    questions = token_ids(4, 6, 3, 8, 2, 5)
    held = []

    def observe(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        held.append(max(max(max(c) for c in cache.held_counts(layer)) for layer in range(cache.num_layers)))

    handle = model.register_forward_hook(observe, with_kwargs=True)
    try:
        answers = answer_questions(model, tokenizer, CONTEXTS[:1], [questions], method, 10, mode="multi_turn",
                                   stop_token_ids=[])[0]
    finally:
        handle.remove()
    assert [a.turn for a in answers] == [1, 2, 3, 4, 5]
    # forwards: the context; per turn the question (after the previous answer's last token) but its last token in
    # one forward, then 10 answer forwards (the question's last token first)
    assert len(held) == 1 + 5 * (1 + 10)
    assert max(held) <= budget + interval and held[-1] >= budget  # the bound holds; the conversation fills it


def test_multi_turn_under_fullkv_is_the_conversation_written_out(sharp_llama):
    model, tokenizer, _ = sharp_llama
    questions, followups = token_ids(5, 4, 6, 3), token_ids(6, 5, 7, 2)
    answers = answer_questions(model, tokenizer, CONTEXTS[:1], [questions], make_method("fullkv"), NEW,
                               mode="multi_turn", followups=[followups], stop_token_ids=[])[0]
    conversation = CONTEXTS[0] + questions[0]
    for turn, answer in enumerate(answers):
        if turn:
            conversation += followups[turn]
        reference = generate(model, tokenizer, [conversation], make_method("fullkv"), NEW, stop_token_ids=[])[0]
        assert answer.text == reference.text
        conversation += answer.answer_ids


def test_pipeline_frames_with_the_chat_template_and_registers_with_transformers(sharp_llama):
    import transformers

    model, tokenizer, _ = sharp_llama
    context, questions = "The vault code is 4417. " * 12, ["What is the code?", "Repeat the code."]
    pipe = transformers.pipeline("kv-compression", model=model, tokenizer=tokenizer)
    assert isinstance(pipe, pyramidkv.KVCompressionPipeline)
    out = pipe(context, questions=questions, method="snapkv:budget=48,window_size=8", max_new_tokens=NEW)
    head, tail = chat_frame(tokenizer)
    first = out["stats"][0]
    assert [s["turn"] for s in out["stats"]] == [1, 2] and first["context_kv_bytes"] < first["kv_bytes"]
    for question, answer in zip(questions, out["answers"]):
        context_ids = tokenizer(head + context, add_special_tokens=False).input_ids
        question_ids = tokenizer(question + tail, add_special_tokens=False).input_ids
        reference = generate(model, tokenizer, [context_ids], make_method("snapkv", budget=48, window_size=8), NEW,
                             questions=[question_ids])[0]
        assert answer == reference.text
    turns = pyramidkv.pipeline(model, tokenizer)(context, questions=questions, max_new_tokens=NEW, mode="multi_turn")
    between, after = followup_frame(tokenizer)
    assert between.startswith("\n") and after == tail and len(turns["answers"]) == 2
    batch = pipe([context, "Another text. " * 9], questions=[questions, ["Why?"]], max_new_tokens=NEW)
    assert [len(b["answers"]) for b in batch] == [2, 1] and batch[0]["answers"][0] == pipe(
        context, question=questions[0], max_new_tokens=NEW)["answers"][0]


@pytest.mark.parametrize("call,error", [
    (dict(questions=[]), "context 0 has no questions"),
    (dict(questions=["ok", "  "]), "question 1 of context 0 is empty"),
    (dict(questions=["ok"], mode="multi_requests"),
     "unknown mode 'multi_requests'; allowed: multi_request, multi_turn"),
    (dict(), "no questions"),
    (dict(questions=["ok"], question="ok"), "not both"),
    (dict(questions=["ok"], method="snapkv:budget=0"), "budget"),
    (dict(questions=["ok"], colour="red"), "unexpected keyword argument .colour."),
])
def test_pipeline_refuses_bad_input_in_one_line(sharp_llama, call, error):
    model, tokenizer, _ = sharp_llama
    pipe = pyramidkv.pipeline(model, tokenizer)
    with pytest.raises((ValueError, TypeError), match=error) as info:
        pipe("Some context.", **call)
    assert "\n" not in str(info.value)



@pytest.mark.parametrize("context,call,error", [
    (None, dict(questions=["ok"]), "context must be a string or a list of strings, got None"),     # a TypeError
    (7, dict(questions=["ok"]), "context must be a string or a list of strings, got 7"),
    (b"Some bytes", dict(questions=["ok"]), "context is bytes .* not text: decode it first"),       # was 10 contexts
    ("Some context.", dict(questions="Who?"), "questions is one string .'Who.'., not a list of questions"),
    ("Some context.", dict(questions=["ok"], max_new_tokens=2.5), "max_new_tokens must be an integer >= 1 .*2.5"),
    ("Some context.", dict(questions=["ok"], max_new_tokens=True), "max_new_tokens must be an integer >= 1"),
    ("Some context.", dict(questions=["ok"], max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    ("Some context.", dict(questions=["ok"], min_new_tokens=-1), "min_new_tokens must be an integer >= 0"),
])
def test_pipeline_refuses_a_value_of_the_wrong_type_in_one_line(sharp_llama, context, call, error):
    """Issue 40, item 8: each ended in a TypeError inside generate, or was read as something else."""
    model, tokenizer, _ = sharp_llama
    with pytest.raises(ValueError, match=error) as info:
        pyramidkv.pipeline(model, tokenizer)(context, **call)
    assert "\n" not in str(info.value)


def test_a_question_fed_token_by_token_shows_its_progress(sharp_llama, capsys, monkeypatch):
    """Issue 40, item 10: what goes one decode step per token (a 3,000-token question ran 8 minutes silently) shows a
    bar counting the steps, with the rate and the time left, once the call has run PROGRESS_DELAY seconds (0 here).
    A batch's questions go in one forward for the length they share (10 tokens here): the longer one's other 30
    tokens, then the answers, are the steps."""
    model, tokenizer, _ = sharp_llama
    monkeypatch.setattr(shared, "PROGRESS_DELAY", 0.0)
    questions = [[CONTEXTS[1][:40]], [CONTEXTS[1][50:60]]]
    answer_questions(model, tokenizer, [CONTEXTS[0], CONTEXTS[1]], questions,
                     make_method("snapkv", budget=64, window_size=8), NEW)
    err = capsys.readouterr().err
    steps = 40 - 10 + NEW                               # the shared 10 (the last of them fed first) in one forward
    assert "question (31 tokens) + answer" in err and f"/{steps} [" in err and "<" in err, err[-300:]

def test_snapshot_restore_shares_no_tensor_with_the_cache(sharp_llama):
    """A restore hands the cache fresh copies: decoding after it cannot write into the snapshot."""
    model, tokenizer, _ = sharp_llama
    method = make_method("snapkv", budget=64, window_size=8)
    with pyramidkv.compress(model, method) as patch:
        cache = patch.new_cache()
        ids = torch.tensor([CONTEXTS[0]])
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        state = snapshot_module.snapshot(cache)
        snapshot_module.restore(cache, state)
        ptrs = {t.untyped_storage().data_ptr() for t in _tensors(state)}
        assert ptrs and not ptrs & {t.untyped_storage().data_ptr() for t in _tensors(cache.__dict__)}
        assert cache.method is method


def _tensors(obj, seen=None):
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("pyramidkv"):
        yield from _tensors(vars(obj), seen)
