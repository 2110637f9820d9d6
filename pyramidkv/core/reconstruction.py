"""Scoring by context reconstruction (KVzip, Kim et al., 2025, arXiv 2505.23416): after the prompt's prefill the
model is made to repeat its context, and each context key is scored by the most attention any repeat query gives
it. The repeat passes run on the full prompt K/V (every layer waits uncompressed until they end) and leave no
trace in the cache.

One prompt is  [prefix | context | suffix]: the template before the user's text, the text to reconstruct, what
follows it (the end of the turn and the assistant header, or nothing); prefix and suffix are never evicted. The
context is cut into chunks; chunk c is repeated by one forward of its repeat input (the instruction, the end of
chunk c - 1 where c > 0, the assistant header, the chunk's tokens). The repeat reads what the authors' repeat reads:
their cache holds only the prefix and the context when it is scored (the suffix and the question come after
compression), so every repeat input starts at the suffix's first position and attends causally over the prefix's
and the context's keys and its own, never the suffix's. That attention's output is what the next layer reads, as in
the model, and the scores of chunk c's keys are taken from another softmax, over [prefix keys, chunk c's keys, the
repeat's keys] (the authors' extent: other chunks are not in its denominator), maximised over the m queries:

    score[h, j] = max_i softmax_{K'}(q_i . k / sqrt(D))[j]      for j in chunk c,  [Hq, chunk]

A prompt whose suffix is fed after compression (`--question_as_decode`) is scored on the same keys at the same
positions, so both protocols keep the same context entries.
float32 throughout (the authors take the softmax in the model dtype). The group's maximum (gqa_reduce max) makes
a KV head's score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pyramidkv.components import AttentionForm

QUERY_BLOCK = 256   # repeat queries per block of the probe attention (bounds the [Hq, block, n + m] logits)


@dataclass
class RepeatChunk:
    """One chunk of a prompt's context and the input that makes the model repeat it.

    ids: the repeat input's token ids; start, stop: the chunk's positions in the prompt (0 = first real token)."""

    ids: list[int]
    start: int
    stop: int


@dataclass
class ReconstructionPlan:
    """What one prompt's reconstruction runs: its protected prefix and suffix (tokens) and its chunks."""

    prefix: int
    suffix: int
    chunks: list[RepeatChunk]


@dataclass
class Reconstruction:
    """The repeat passes of a batch: per prompt its plan, and per layer the scores [B, Hq, n] the passes give
    (padded coordinates; 0 outside the context). `current` is (prompt, chunk) while a repeat input runs."""

    plans: list[ReconstructionPlan]
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    current: Optional[tuple[int, RepeatChunk]] = None
    repeat_tokens: int = 0    # tokens the repeat passes ran, all prompts (the prefill's extra work)

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               prompt_keys: torch.Tensor, prompt_values: torch.Tensor, pad: int, form: AttentionForm) -> torch.Tensor:
        """One layer of a repeat input. queries [1, Hq, m, D] (scaled: q . k / sqrt(D) is the logit), keys, values
        [1, Hkv, m, D] the repeat's; prompt_keys, prompt_values [H, n, D] the prompt's row (stored heads: Hkv, or
        Hq repeated), pad its padding; form: the model's attention form (its logits). Returns the attention output
        [1, Hq, m, D] and records the chunk's scores."""
        b, chunk = self.current
        plan = self.plans[b]
        _, num_q, m, dim = queries.shape
        group_k = num_q // keys.shape[1]
        group_p = num_q // prompt_keys.shape[0]
        every_k = torch.cat([prompt_keys[:, pad:].repeat_interleave(group_p, 0), keys[0].repeat_interleave(group_k, 0)], 1)
        every_v = torch.cat([prompt_values[:, pad:].repeat_interleave(group_p, 0),
                             values[0].repeat_interleave(group_k, 0)], 1)
        n = prompt_keys.shape[1] - pad
        unread = torch.zeros(n + m, dtype=torch.bool, device=queries.device)
        unread[n - plan.suffix:n] = True   # the suffix: not in the cache the authors' repeat reads
        every_k, every_v = every_k.float().transpose(1, 2), every_v.float()
        out = torch.empty(num_q, m, dim, dtype=torch.float32, device=queries.device)
        best = torch.zeros(num_q, chunk.stop - chunk.start, dtype=torch.float32, device=queries.device)
        for first in range(0, m, QUERY_BLOCK):
            rows = torch.arange(first, min(first + QUERY_BLOCK, m), device=queries.device)
            logits = form.cap(torch.matmul(queries[0, :, rows].float(), every_k) / dim ** 0.5)  # [Hq, r, n+m]
            later = torch.arange(n + m, device=queries.device)[None, :] > n + rows[:, None]   # causal in the repeat
            probs = torch.softmax(logits.masked_fill(later | unread, float("-inf")), -1)
            out[:, rows] = torch.matmul(probs, every_v)
            # the softmax over K' = [prefix, chunk, repeat] is the same weights renormalised over those columns
            extent = probs[..., :plan.prefix].sum(-1) + probs[..., chunk.start:chunk.stop].sum(-1) + probs[..., n:].sum(-1)
            best = torch.maximum(best, (probs[:, :, chunk.start:chunk.stop] / extent[..., None]).amax(1))
        if layer not in self.scores:
            self.scores[layer] = torch.zeros(len(self.plans), num_q, pad + n, dtype=torch.float32, device=keys.device)
        self.scores[layer][b, :, pad + chunk.start:pad + chunk.stop] = best
        return out[None].to(queries.dtype)
