"""One long generation, one decode step at a time: its tokens (greedy, or sampled from a seeded stream), the cache's
K/V bytes after every step, and the decode time. The reasoning benchmark's path (pyramidkv/benchmarks/reasoning),
where a trace is compared with fullkv's step by step.

The prefill is `_Run.prefill` (the one `generate` and `score_reference` use) and each step is the model's forward on
one token, exactly as `teacher_forced.score_reference` feeds a reference: fed fullkv's own trace back, fullkv gives
the same next-token distributions bit for bit (tested).

Sampling is by inverse CDF: step i draws u_i ~ U[0, 1) from a generator seeded with `Sampling.seed`, and takes the
first token (in vocabulary order) whose cumulative probability exceeds u_i. Two methods run with one seed draw the
same u_i, so their traces stay equal while their distributions are close and part where they differ: a departure
step means the same thing greedy or sampled.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pyramidkv.generation.greedy import _token_ids, _vocab_size, default_stop_token_ids
from pyramidkv.generation.shared import _Run
from pyramidkv.methods.base import Method
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.models.patch import compress


@dataclass(frozen=True)
class Sampling:
    """Seeded sampling (none: greedy).

    temperature: the logits are divided by it before the softmax (> 0).
    top_p: nucleus sampling: only the most probable tokens whose probabilities add up to top_p are drawn from
        (0 < top_p <= 1; 1: all).
    seed: the seed of the uniform stream each step draws from (one draw per step).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (the logits are divided by it), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (the probability mass drawn from), got {self.top_p!r}")


@dataclass
class Trace:
    """A generation's tokens and what each step cost."""

    tokens: list[int]              # every generated token, the stop token included when one ended the trace
    text: str                      # the tokens before the stop, decoded
    prompt_tokens: int
    kv_bytes: list[int]            # K/V bytes held after the prefill, then after each decode step's forward
    prefill_seconds: float         # wall seconds of the prompt's forward, compression included
    decode_seconds: float          # wall seconds of the decode steps' forwards
    decode_cpu_seconds: float      # this thread's CPU seconds of the same (time.thread_time)
    logprobs: Optional[torch.Tensor] = None   # [len(tokens), vocab] float32 log P(next) before each token, if asked
    stopped: bool = False          # a stop token ended it (the last of `tokens`)

    @property
    def new_tokens(self) -> int:
        """Tokens before the stop."""
        return len(self.text_tokens)

    @property
    def text_tokens(self) -> list[int]:
        return self.tokens[:-1] if self.stopped else self.tokens


def next_token(logits: torch.Tensor, sampling: Optional[Sampling], generator: Optional[torch.Generator]) -> int:
    """The next token from one row of logits [vocab]: the argmax, or an inverse-CDF draw (module docstring)."""
    if sampling is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered            # mass of the more probable tokens
        dropped = order[before >= sampling.top_p]       # the most probable token is always kept (before = 0)
        probs[dropped] = 0
        probs = probs / probs.sum()
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cumulative = probs.cumsum(0)
    token = int(torch.searchsorted(cumulative, u, right=True))
    if token >= probs.numel():          # the sum rounded below u: the last token that can be drawn
        token = int(probs.nonzero()[-1])
    return token


@contextmanager
def _threads(count: Optional[int]):
    before = torch.get_num_threads()
    if count is not None and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@torch.no_grad()
def decode_trace(model, tokenizer, prompt: Sequence[int], method: Method, max_new_tokens: int,
                 stop_token_ids: Optional[Sequence[int]] = None, sampling: Optional[Sampling] = None,
                 record_logprobs: bool = False, decode_threads: Optional[int] = None) -> Trace:
    """`prompt` (token ids) prefilled under `method`, then up to max_new_tokens tokens decoded one step at a time
    (greedy, or by `sampling`), stopping after a stop token (by default the model's end tokens)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if sampling is not None:
        sampling.validate()
    prompt = _token_ids(prompt, "prompt", _vocab_size(model))
    if not prompt:
        raise ValueError("the prompt is empty: it needs at least one token")
    method.check_prompt(len(prompt))
    stops = set(default_stop_token_ids(model, tokenizer) if stop_token_ids is None else map(int, stop_token_ids))
    generator = None if sampling is None else torch.Generator().manual_seed(sampling.seed)
    run = _Run(model, tokenizer, method, max_new_tokens, sorted(stops), 0, decode_threads, None, None)
    tokens, rows, wall, cpu = [], [], 0.0, 0.0
    with compress(model, method) as patch:
        cache, input_ids, _, prefill = run.prefill(patch, [prompt])
        logits = run.next_logits[0].float()
        kv_bytes = [cache.kv_bytes(0)]
        with _threads(decode_threads):
            while True:
                if record_logprobs:
                    rows.append(logits)
                token = next_token(logits, sampling, generator)
                tokens.append(token)
                if token in stops or len(tokens) == max_new_tokens:
                    break
                start, start_cpu = time.perf_counter(), time.thread_time()
                out = model(input_ids=torch.tensor([[token]], device=input_ids.device), **{CACHE_ARGUMENT: cache},
                            use_cache=True)
                wall += time.perf_counter() - start
                cpu += time.thread_time() - start_cpu
                logits = out.logits[0, -1].float()
                kv_bytes.append(cache.kv_bytes(0))
    stopped = tokens[-1] in stops
    text = tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
    logprobs = torch.log_softmax(torch.stack(rows), dim=-1).cpu() if record_logprobs else None
    return Trace(tokens, text, len(prompt), kv_bytes, prefill, wall, cpu, logprobs, stopped)
