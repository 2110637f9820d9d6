"""Compress once, ask many: a context is prefilled and compressed once, the question excluded, then several
questions are answered from it (docs/shared_context.md).

The scorers' window is the end of the context (kvpress's pipeline). Each question is appended to the compressed
context as `--question_as_decode` appends one, in one forward (the length the batch's questions share; the rest one
token per decode step) in which every decode-time unit decides as if the tokens came one per step, then its answer
is generated greedily. Two modes:

  multi_request  before each question the cache is put back to the compressed context exactly (core/snapshot.py):
                 every question sees the same cache, so their order never matters;
  multi_turn     the conversation grows: each question and its answer stay in the cache (a decode budget keeps
                 compressing), and a later question is fed as its follow-up turn after the previous answer's last
                 token.

A batch of contexts is prefilled together (left-padded) under multi_request; under multi_turn each context runs
alone (a batch's rows that stop early would keep feeding tokens into their conversation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from pyramidkv.core.snapshot import restore, snapshot
from pyramidkv.generation.greedy import (
    _AnswerDone, _BytesAtStop, _FeedQuestions, _held, _left_padded, _prompt_then_decode, _token_lists, _vocab_size,
    default_stop_token_ids, feed_together,
)
from pyramidkv.methods.base import Method
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.models.patch import compress

MODES = ("multi_request", "multi_turn")
# The tokens of a question beyond the batch's shared length, and the answer, are one decode step per token: a bar with
# its rate and the time left shows once a call has run this many seconds (a short question ends before it would show).
PROGRESS_DELAY = 2.0


@dataclass
class Answer:
    """One question's answer and what it cost. Times are wall seconds on the model's device."""

    text: str
    answer_ids: list[int]       # the answer's tokens before the stop token
    turn: int                   # 1 for the first question of its context, then 2, 3, ...
    question_tokens: int        # tokens fed for the question (multi_turn: the follow-up turn and the previous
                                # answer's last token)
    new_tokens: int             # answer tokens before the stop token
    context_tokens: int         # the context's real tokens
    context_kv_bytes: int       # K/V bytes the compressed context holds (right after compression)
    kv_bytes: int               # K/V bytes held when the answer ended
    time_to_first_token: float  # from the question's start (turn 1: from the context's prefill) to its first token
    prefill_seconds: float      # the context's prefill and compression (the same for every turn of a context)
    held_tokens: Optional[list[list[int]]] = None   # head_allocation threshold: per layer and head, at the stop
    seen_tokens: Optional[int] = None

    # What a runner's prediction row reads of a `Generation` (generate's output), so either makes a row.
    @property
    def prompt_tokens(self) -> int:
        return self.context_tokens + self.question_tokens

    @property
    def kv_bytes_per_prompt(self) -> int:
        return self.kv_bytes


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    return mode


@torch.no_grad()
def answer_questions(model, tokenizer, contexts: Sequence, questions: Sequence[Sequence], method: Method,
                     max_new_tokens: int, mode: str = "multi_request", followups: Optional[Sequence[Sequence]] = None,
                     stop_token_ids: Optional[Sequence[int]] = None, min_new_tokens: int = 0,
                     decode_threads: Optional[int] = None, compressed=None,
                     on_compressed: Optional[Callable] = None) -> list[list[Answer]]:
    """Per context (a string or token ids), its questions (each a string or token ids, at least one per context)
    answered from the context compressed once by `method`: per context one `Answer` per question, in order.

    followups: multi_turn only, per context per question what is fed when it is asked as a later turn (a chat
    template's new user turn around the question); None: the question itself. Strings are tokenized without
    special tokens: the caller applies any chat template (pyramidkv.pipeline does). Stop tokens as in `generate`.

    compressed: one context only, its cache as compressed before (pyramidkv.load_cache): the prefill is skipped
    (prefill_seconds 0; turn 1's time to first token starts at the first question); it must hold exactly this
    context. on_compressed: called with the cache right after compression, before any question (save_cache).
    """
    check_mode(mode)
    for name, value, least in (("max_new_tokens", max_new_tokens, 1), ("min_new_tokens", min_new_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least} (a count of tokens), got {value!r}")
    vocab = _vocab_size(model)
    context_ids = _token_lists(tokenizer, contexts, "context", vocab)
    if isinstance(questions, (str, bytes)) or len(questions) != len(context_ids):
        raise ValueError(f"questions must hold one list of questions per context ({len(context_ids)}), got "
                         f"{questions!r:.60}")
    question_ids = [_questions_of(tokenizer, qs, i, vocab) for i, qs in enumerate(questions)]
    followup_ids = question_ids
    if followups is not None:
        if mode != "multi_turn":
            raise ValueError(f"followups are what a later turn feeds: mode multi_turn only, got mode {mode!r}")
        if len(followups) != len(context_ids) or any(len(f) != len(q) for f, q in zip(followups, question_ids)):
            raise ValueError("followups must hold one follow-up per question of each context")
        followup_ids = [_questions_of(tokenizer, fs, i, vocab) for i, fs in enumerate(followups)]
    for tokens in context_ids:
        method.check_prompt(len(tokens))
    stops = default_stop_token_ids(model, tokenizer) if stop_token_ids is None else [int(t) for t in stop_token_ids]
    if compressed is not None:
        if len(context_ids) != 1:
            raise ValueError(f"a compressed cache holds one context; got {len(context_ids)} contexts")
        held = compressed.prompt_len if compressed.pad_lens is not None else 0
        if held != len(context_ids[0]) or compressed.pad_lens != [0]:
            raise ValueError(f"the compressed cache holds a context of {held} tokens; this context has "
                             f"{len(context_ids[0])}")
    run = _Run(model, tokenizer, method, max_new_tokens, stops, min_new_tokens, decode_threads, compressed,
               on_compressed)
    if mode == "multi_request":
        return run.requests(context_ids, question_ids)
    return [run.turns(c, q, f) for c, q, f in zip(context_ids, question_ids, followup_ids)]


def _questions_of(tokenizer, questions, context: int, vocab: int) -> list[list[int]]:
    if isinstance(questions, (str, bytes)) or not hasattr(questions, "__len__") or len(questions) == 0:
        raise ValueError(f"context {context} has no questions: give a list of at least one question, got "
                         f"{questions!r:.60}")
    return _token_lists(tokenizer, questions, f"question of context {context}:", vocab)


class _FirstToken(StoppingCriteria):
    """Records when each row's first answer token (the first after its question) is out. Stops nothing."""

    def __init__(self, width: int, question_lens: list[int]):
        self.width, self.question_lens = width, question_lens
        self.at: dict[int, float] = {}

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        now = time.perf_counter()
        for row, fed in enumerate(self.question_lens):
            if row not in self.at and input_ids.shape[1] - self.width > fed:
                self.at[row] = now
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Progress(StoppingCriteria):
    """Advances a tqdm bar by one decode step each time generate asks. Stops nothing."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Run:
    """One call's settings; `requests` and `turns` drive the patched model."""

    def __init__(self, model, tokenizer, method, max_new_tokens, stops, min_new_tokens, decode_threads, compressed,
                 on_compressed):
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.max_new_tokens, self.stops, self.min_new_tokens = max_new_tokens, stops, min_new_tokens
        self.decode_threads, self.compressed, self.on_compressed = decode_threads, compressed, on_compressed
        self.saving = 0.0   # seconds on_compressed took: not part of a time to first token
        self.next_logits = None

    def prefill(self, patch, contexts: list[list[int]]):
        """The contexts prefilled and compressed into a new cache: (cache, input_ids, attention_mask, seconds)."""
        input_ids, mask, _, _ = _left_padded(self.model, self.tokenizer, contexts)
        if self.compressed is not None:
            return self.compressed, input_ids, mask, 0.0
        cache = patch.new_cache(contexts, self.tokenizer)
        positions = mask.long().cumsum(-1) - 1
        positions.masked_fill_(mask == 0, 1)    # as generate() gives a left-padded prompt
        start = time.perf_counter()
        with _prompt_then_decode(self.model, self.decode_threads):
            output = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                **{CACHE_ARGUMENT: cache}, use_cache=True)
        self.next_logits = output.logits[:, -1]     # [B, vocab]: the distribution of each context's next token
        seconds = time.perf_counter() - start
        if self.on_compressed is not None:
            self.on_compressed(cache)
            self.saving = time.perf_counter() - start - seconds
        return cache, input_ids, mask, seconds

    def ask(self, cache, sequence: torch.Tensor, mask: torch.Tensor, forced: list[list[int]]):
        """Continue every row from `sequence` [B, T] (its last token not in the cache yet: fed first), then its
        `forced` tokens, then its answer; mask: the context's attention mask (left padding). The forced tokens every
        row has go in one forward (`feed_together`), the rest one per decode step.
        -> (output [B, T + steps], the bytes-at-stop recorder, the first-token times)."""
        from tqdm import tqdm

        with _prompt_then_decode(self.model, self.decode_threads) as threads:
            sequence, forced = feed_together(self.model, cache, sequence, mask, forced, threads)
            width = sequence.shape[1]
            steps = max(len(f) for f in forced) + self.max_new_tokens
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], width - mask.shape[1])], dim=1)
            first = _FirstToken(width, [len(f) for f in forced])
            stop = _BytesAtStop(cache, width, [len(f) for f in forced], set(self.stops), self.max_new_tokens)
            left = max(len(f) for f in forced)   # question tokens left to feed one per step (beyond the shared length)
            bar = tqdm(total=steps, unit="step", desc=f"question ({left + 1} tokens) + answer" if left else "answer",
                       dynamic_ncols=True, leave=False, delay=PROGRESS_DELAY)
            with bar:
                output = self.model.generate(
                    input_ids=sequence, attention_mask=mask, **{CACHE_ARGUMENT: cache}, max_new_tokens=steps,
                    do_sample=False, temperature=None, top_p=None, top_k=None, num_beams=1, eos_token_id=None,
                    pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                    else self.tokenizer.eos_token_id,
                    logits_processor=LogitsProcessorList([_FeedQuestions(width, forced, self.stops,
                                                                         self.min_new_tokens)]),
                    stopping_criteria=StoppingCriteriaList([
                        _AnswerDone(width, forced, set(self.stops), self.max_new_tokens), stop, first, _Progress(bar)]))
        return output, stop, first

    def _answer(self, output, row: int, width: int, forced: int) -> tuple[str, list[int]]:
        """(text, tokens before the stop) of a row's answer."""
        answer = output[row, width + forced:].tolist()[:self.max_new_tokens]
        cut = next((i for i, tok in enumerate(answer) if tok in self.stops), len(answer))
        return self.tokenizer.decode(answer[:cut], skip_special_tokens=True), answer[:cut]

    def requests(self, contexts: list[list[int]], questions: list[list[list[int]]]) -> list[list[Answer]]:
        answers: list[list[Answer]] = [[] for _ in contexts]
        with compress(self.model, self.method) as patch:
            start = time.perf_counter()
            cache, input_ids, mask, prefill = self.prefill(patch, contexts)
            start += self.saving
            kept = [cache.kv_bytes(row) for row in range(len(contexts))]
            compressed = snapshot(cache)
            for turn in range(max(len(q) for q in questions)):
                if turn:
                    start = time.perf_counter()
                    restore(cache, compressed)
                # a context with fewer questions repeats its last one (its answer is not kept)
                asked = [q[min(turn, len(q) - 1)] for q in questions]
                first_tokens = torch.tensor([[q[0]] for q in asked], device=input_ids.device)
                output, stop, first = self.ask(cache, torch.cat([input_ids, first_tokens], dim=1), mask,
                                                [q[1:] for q in asked])
                width = input_ids.shape[1] + 1
                for row, question in enumerate(asked):
                    if turn >= len(questions[row]):
                        continue
                    text, new = self._answer(output, row, width, len(question) - 1)
                    answers[row].append(Answer(
                        text, new, turn + 1, len(question), len(new), len(contexts[row]), kept[row],
                        cache.final_kv_bytes(row), first.at.get(row, time.perf_counter()) - start, prefill,
                        *_held(cache, row, stop.held)))
        return answers

    def turns(self, context: list[int], questions: list[list[int]], followups: list[list[int]]) -> list[Answer]:
        answers: list[Answer] = []
        with compress(self.model, self.method) as patch:
            start = time.perf_counter()
            cache, sequence, mask, prefill = self.prefill(patch, [context])
            start += self.saving
            kept = cache.kv_bytes(0)
            for turn, (question, followup) in enumerate(zip(questions, followups)):
                if turn:
                    start = time.perf_counter()
                    forced = followup            # after the previous answer's last token, fed first
                    sequence = output
                else:
                    forced = question[1:]
                    sequence = torch.cat([sequence, torch.tensor([[question[0]]], device=sequence.device)], dim=1)
                output, stop, first = self.ask(cache, sequence, mask, [forced])
                text, new = self._answer(output, 0, sequence.shape[1], len(forced))
                answers.append(Answer(text, new, turn + 1, len(forced) + 1, len(new), len(context), kept,
                                      cache.final_kv_bytes(0), first.at.get(0, time.perf_counter()) - start, prefill,
                                      *_held(cache, 0, stop.held)))
                cache.stopped_bytes.clear()     # the next turn's answer records its own
        return answers
