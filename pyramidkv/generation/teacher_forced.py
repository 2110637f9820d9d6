"""A prompt's reference answer scored teacher forced, and its greedy answer, from one compressed prefill.

The prompt is prefilled and compressed once; the cache is snapshotted (core/snapshot.py); the reference answer's
tokens are fed one per decode step, as an answer would be, recording the next-token distribution before each of
them; the cache is put back; then the greedy answer is generated from it exactly as `generate` would from the same
prompt (tested equal). The leaderboard (pyramidkv/leaderboard) compares these distributions with fullkv's:

    KL(P_fullkv || P_method) per reference token = sum_v p_full(v) (log p_full(v) - log p_method(v)),

averaged over the reference's tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pyramidkv.core.snapshot import restore, snapshot
from pyramidkv.generation.greedy import (
    Generation, _held, _token_ids, _vocab_size, blocks_free_now, default_stop_token_ids,
)
from pyramidkv.generation.shared import _Run
from pyramidkv.methods.base import Method
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.models.patch import compress


@dataclass
class Scored:
    """A prompt's greedy answer and its reference's next-token log-probabilities under one method."""

    generation: Optional[Generation]   # None when asked for the reference's distributions only
    logprobs: torch.Tensor             # [n, vocab] float32: row i is log P(next token) before reference token i
    prefill_seconds: float             # the prompt's forward, compression included
    step_seconds: float                # mean wall seconds of one teacher-forced decode step (0 for one token)


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row from log-probabilities `reference` (P) and `other` (Q), both [n, vocab]: [n] float64.
    Each row is normalized again in float64 first (a float32 log-softmax sums to 1 only within its rounding, which
    made KL of two near-equal rows come out a hair below 0), and what float64 rounding leaves below 0 is 0 (Gibbs'
    inequality). Terms where P is 0 count 0; where P > 0 and Q is 0 the divergence is inf."""
    if reference.shape != other.shape:
        raise ValueError(f"log-probabilities of shapes {tuple(reference.shape)} and {tuple(other.shape)} differ")
    p_log, q_log = (x.double() - x.double().logsumexp(-1, keepdim=True) for x in (reference, other))
    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))
    return terms.sum(-1).clamp_min(0.0)


@torch.no_grad()
def score_reference(model, tokenizer, prompt: Sequence[int], reference: Sequence[int], method: Method,
                    max_new_tokens: int = 0, stop_token_ids: Optional[Sequence[int]] = None,
                    min_new_tokens: int = 0, decode_threads: Optional[int] = None) -> Scored:
    """`reference`'s next-token log-probabilities after `prompt` (token ids) under `method`, teacher forced; with
    max_new_tokens >= 1 also the greedy answer from the same compressed prefill (stop tokens as in `generate`)."""
    vocab = _vocab_size(model)
    prompt = _token_ids(prompt, "prompt", vocab)
    reference = _token_ids(reference, "reference", vocab)
    if not prompt or not reference:
        raise ValueError(f"the {'prompt' if not prompt else 'reference'} is empty: both need at least one token")
    method.check_prompt(len(prompt))
    stops = default_stop_token_ids(model, tokenizer) if stop_token_ids is None else [int(t) for t in stop_token_ids]
    run = _Run(model, tokenizer, method, max_new_tokens - 1, stops, max(min_new_tokens - 1, 0), decode_threads,
               None, None)
    with compress(model, method) as patch:
        cache, input_ids, mask, prefill = run.prefill(patch, [prompt])
        first_logits = run.next_logits[0].float()
        kept = snapshot(cache) if max_new_tokens >= 1 else None
        rows, step_seconds = [first_logits], []
        for token in reference[:-1]:
            start = time.perf_counter()
            out = model(input_ids=torch.tensor([[token]], device=input_ids.device), **{CACHE_ARGUMENT: cache},
                        use_cache=True)
            step_seconds.append(time.perf_counter() - start)
            rows.append(out.logits[0, -1].float())
        logprobs = torch.log_softmax(torch.stack(rows), dim=-1).cpu()
        generation = None
        if max_new_tokens >= 1:
            restore(cache, kept)
            generation = _greedy_from_prefill(run, cache, input_ids, mask, first_logits, stops, min_new_tokens,
                                              max_new_tokens, len(prompt))
    return Scored(generation, logprobs, prefill, sum(step_seconds) / len(step_seconds) if step_seconds else 0.0)


def _greedy_from_prefill(run: _Run, cache, input_ids, mask, first_logits, stops, min_new_tokens, max_new_tokens,
                         prompt_tokens: int) -> Generation:
    """The greedy answer from a prefilled cache: the first token from the prefill's logits (stop tokens barred
    while min_new_tokens asks), the rest through model.generate as `generate` decodes them."""
    logits = first_logits.clone()
    if min_new_tokens > 0 and stops:
        logits[stops] = float("-inf")
    first = int(logits.argmax())
    answer = [first]
    if first not in stops and max_new_tokens > 1:
        output, stop, _ = run.ask(cache, torch.cat([input_ids, input_ids.new_tensor([[first]])], dim=1), mask, [[]])
        answer += output[0, input_ids.shape[1] + 1:].tolist()[:max_new_tokens - 1]
        held = (*_held(cache, 0, stop.held), stop.blocks.get(0) or blocks_free_now(cache, 0))
    else:
        held = (*_held(cache, 0, {}), blocks_free_now(cache, 0))
    cut = next((i for i, token in enumerate(answer) if token in stops), len(answer))
    text = run.tokenizer.decode(answer[:cut], skip_special_tokens=True)
    return Generation(text, prompt_tokens, cut, cache.final_kv_bytes(0), *held)
