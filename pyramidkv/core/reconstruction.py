"""Scoring by context reconstruction (KVzip, Kim et al., 2025, arXiv 2505.23416): after the prompt's prefill the
model is made to repeat its context, and each context key is scored by the most attention any repeat query gives
it. A layer's repeat passes read its whole prompt K/V (which waits for them: core/reconstructing.py; models/repeat.py
runs them layer by layer) and leave no trace in the cache.

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

How it is computed: the queries are grouped by stored head ([H, g * m, D] against [H, n + m, D]: the prompt's K/V
are not repeated). The score is the same quantity as exp(logit - logsumexp_K'), the logsumexp over exactly K'. On
CPU (no soft-cap) the fused kernel runs on segments of the keys ([prefix, chunk]; the other chunks; the repeat's own,
causal) and returns each segment's row logsumexp: the output is the segments' outputs weighted by them, the score's
logsumexp is that of [prefix, chunk] and the repeat's, and the score pass is one product per block of QUERY_BLOCK
queries, [q, -logsumexp] . [k / sqrt(D), 1] (the subtraction inside the product), then a max over the queries.
The last layer's output is read by nothing (its scores are all the repeat needs of it): there the output is not
computed and `RepeatDone` ends the repeat's forward before that layer's output projection, MLP and final norm. Elsewhere (another device, a soft-capped model) the output is the public
fused kernel's with a causal mask, or the explicit softmax under a soft-cap, and the scores come from blocked logits
over K' alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pyramidkv.components import AttentionForm

QUERY_BLOCK = 256   # repeat queries per block of the score pass (bounds its [Hq, block, prefix + chunk + m] logits)


class RepeatDone(Exception):
    """Raised by the last layer's repeat attention once its scores are recorded: nothing of the forward after it
    (that layer's output projection and MLP, the final norm) is read, so the repeat's forward stops there."""


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
    last_layer: Optional[int] = None   # the model's last layer: its repeat records scores only (RepeatDone)

    def attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               prompt_keys: torch.Tensor, prompt_values: torch.Tensor, pad: int, form: AttentionForm) -> torch.Tensor:
        """One layer of a repeat input. queries [1, Hq, m, D] (scaled: q . k / sqrt(D) is the logit), keys, values
        [1, Hkv, m, D] the repeat's; prompt_keys, prompt_values [H, n, D] the prompt's row (stored heads: Hkv, or
        Hq repeated), pad its padding; form: the model's attention form (its logits). Returns the attention output
        [1, Hq, m, D] and records the chunk's scores."""
        b, chunk = self.current
        plan = self.plans[b]
        _, num_q, m, dim = queries.shape
        heads = prompt_keys.shape[0]
        n = prompt_keys.shape[1] - pad
        read = n - plan.suffix              # the suffix is not in the cache the authors' repeat reads
        group = num_q // heads              # query heads per stored head: the queries are grouped, K/V not repeated
        own_k, own_v = keys[0], values[0]
        if own_k.shape[0] != heads:         # prompt stored per query head: the repeat's K/V to the same heads
            own_k = own_k.repeat_interleave(heads // own_k.shape[0], 0)
            own_v = own_v.repeat_interleave(heads // own_v.shape[0], 0)
        every_k = torch.cat([prompt_keys[:, pad:pad + read], own_k], 1).float()     # [H, read + m, D]
        every_v = torch.cat([prompt_values[:, pad:pad + read], own_v], 1).float()
        grouped = queries[0].float().reshape(heads, group * m, dim)               # [H, g * m, D], head-major
        width = chunk.stop - chunk.start
        device = queries.device
        last = layer == self.last_layer     # its output is read by nothing
        edges = (plan.prefix, chunk.start, chunk.stop, read, m, group)
        if not form.capped and _FLASH_CPU is not None and device.type == "cpu":
            best, out = _segmented(grouped, every_k, every_v, *edges, output=not last)
        else:
            best, out = _blocked(grouped, every_k, every_v, *edges, form, output=not last)
        if layer not in self.scores:
            self.scores[layer] = torch.zeros(len(self.plans), num_q, pad + n, dtype=torch.float32, device=keys.device)
        self.scores[layer][b, :, pad + chunk.start:pad + chunk.stop] = best.reshape(num_q, width)
        if last:
            raise RepeatDone
        return out.reshape(num_q, m, dim)[None].to(queries.dtype)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash(queries, keys, values, causal=False):
    """The CPU fused attention kernel's output and its row logsumexp (natural log) over the keys given."""
    out, lse = _FLASH_CPU(queries, keys, values, 0.0, causal)[:2]
    return out, lse


def _segmented(grouped, every_k, every_v, prefix, start, stop, read, m, group, output=True):
    """The repeat's attention on CPU by the fused kernel, run on segments of the keys so that its row logsumexps
    give the score's denominator: [prefix, chunk] and the rest of the prompt's read keys (no mask), the repeat's own
    (causal); the output is their logsumexp-weighted sum, the score's logsumexp is over [prefix, chunk, repeat]
    alone. grouped [H, g * m, D] (head-major), every_k, every_v [H, read + m, D] float32; output=False: the scores
    only (the rest of the prompt's keys is not read). Returns the scores [H, g, chunk] (maximised over the queries)
    and the output [H, g * m, D] (None without output)."""
    heads, _, dim = grouped.shape
    inside_k = torch.cat([every_k[:, :prefix], every_k[:, start:stop]], 1)
    inside_v = torch.cat([every_v[:, :prefix], every_v[:, start:stop]], 1)
    out_in, lse_in = _flash(grouped[None], inside_k[None], inside_v[None])
    own = lambda x: x[:, None, read:].expand(heads, group, m, dim)
    out_own, lse_own = _flash(grouped.view(heads, group, m, dim), own(every_k), own(every_v), causal=True)
    outs = [out_in[0], out_own.reshape(heads, group * m, dim)]
    lses = [lse_in[0], lse_own.reshape(heads, group * m)]
    denominator = torch.logaddexp(lses[0], lses[1])        # logsumexp over K' = [prefix, chunk, repeat]
    out = None
    if output:
        if start > prefix or stop < read:                 # the other chunks: in the output's softmax, not the score's
            rest_k = torch.cat([every_k[:, prefix:start], every_k[:, stop:read]], 1)
            rest_v = torch.cat([every_v[:, prefix:start], every_v[:, stop:read]], 1)
            out_rest, lse_rest = _flash(grouped[None], rest_k[None], rest_v[None])
            outs.append(out_rest[0])
            lses.append(lse_rest[0])
        lses = torch.stack(lses)
        weights = (lses - torch.logsumexp(lses, 0)).exp()
        out = sum(o * w[..., None] for o, w in zip(outs, weights))
    # the score: exp(logit - logsumexp_K'), the chunk's logits read once, maximised over the queries; the
    # subtraction rides in the product as one more coordinate, [q, -lse] . [k / sqrt(D), 1]
    chunk_k = every_k[:, start:stop] * dim ** -0.5
    chunk_kt = torch.cat([chunk_k, torch.ones_like(chunk_k[..., :1])], -1).transpose(1, 2)    # [H, D + 1, chunk]
    lifted = torch.cat([grouped, -denominator[..., None]], -1).view(heads, group, m, dim + 1)
    best = torch.full((heads, group, stop - start), float("-inf"), dtype=torch.float32, device=grouped.device)
    for first in range(0, m, QUERY_BLOCK):
        last = min(first + QUERY_BLOCK, m)
        block = lifted[:, :, first:last].reshape(heads, -1, dim + 1)
        logits = torch.matmul(block, chunk_kt).view(heads, group, last - first, -1)
        best = torch.maximum(best, logits.amax(2))
    return best.exp(), out


def _blocked(grouped, every_k, every_v, prefix, start, stop, read, m, group, form, output=True):
    """The repeat's attention by explicit products (a soft-capped model's; any device): the output by the fused
    kernel where the logits are not capped, by the explicit softmax where they are; the scores in blocks of queries
    over K' = [prefix, chunk, repeat] alone. Returns the scores [H, g, chunk] and the output (None: output=False,
    where the logits are not capped)."""
    heads, _, dim = grouped.shape
    # K' = [prefix, chunk, repeat]: the keys the score's softmax covers (its denominator, the authors' extent)
    width = stop - start
    scored_k = torch.cat([every_k[:, :prefix], every_k[:, start:stop], every_k[:, read:]], 1)
    scored_k = scored_k.transpose(1, 2)                                         # [H, D, prefix + chunk + m]
    inside = slice(prefix, prefix + width)
    device = grouped.device
    best = torch.full((heads, group, width), float("-inf"), dtype=torch.float32, device=device)
    if form.capped:      # soft-capped logits: no fused kernel takes them; explicit, the score from the same logits
        out = torch.empty(heads, group, m, dim, dtype=torch.float32, device=device)
        every_kt = every_k.transpose(1, 2)
        columns = torch.cat([torch.arange(prefix), torch.arange(start, stop),
                             torch.arange(read, read + m)]).to(device)
    for first in range(0, m, QUERY_BLOCK):
        last = min(first + QUERY_BLOCK, m)
        rows = torch.arange(first, last, device=device)
        block = grouped.view(heads, group, m, dim)[:, :, first:last].reshape(heads, -1, dim)   # [H, g * r, D]
        if form.capped:
            logits = form.cap(torch.matmul(block, every_kt) / dim ** 0.5)               # [H, g * r, read + m]
            later = torch.arange(read + m, device=device)[None, :] > read + rows[:, None]   # causal in the repeat
            logits = logits.view(heads, group, last - first, -1).masked_fill(later, float("-inf"))
            out[:, :, first:last] = torch.matmul(torch.softmax(logits, -1),
                                                 every_v[:, None]).view(heads, group, last - first, dim)
            logits = logits.index_select(-1, columns)                            # [H, g, r, prefix + chunk + m]
        else:
            logits = (torch.matmul(block, scored_k) / dim ** 0.5).view(heads, group, last - first, -1)
            later = torch.arange(scored_k.shape[-1], device=device)[None, :] > inside.stop + rows[:, None]
            logits = logits.masked_fill(later, float("-inf"))
        # softmax over K' read once per logit: score = exp(logit - logsumexp_K'), maximised over the queries
        lse = torch.logsumexp(logits, -1, keepdim=True)
        best = torch.maximum(best, (logits[..., inside] - lse).amax(2))
    best = best.exp()
    if not output and not form.capped:
        return best, None
    if not form.capped:  # the output the next layer reads: the fused kernel, grouped, causal in the repeat
        visible = torch.arange(read + m, device=device)[None, :] <= read + torch.arange(m, device=device)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped[None], every_k[None], every_v[None], attn_mask=visible.repeat(group, 1)[None, None])[0]
    return best, out
