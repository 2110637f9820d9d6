"""Compression during decoding: the cache re-selects (kept prompt + generated tokens) as it grows.

Without `decode_budget` the prompt part of the cache is compressed once, at prefill, and every
generated token is kept: a long generation grows the cache without bound. With it, each layer of
a `CompressedCache` owns a `DecodeCompressor` state and, after every decode step:

  1. the new queries go into a per-layer buffer of the last max(window_size, 1) queries (seeded
     with the prompt's last queries at prefill), the observation window of the re-selection;
  2. methods with `accumulates_attention` (H2O) add the attention the new queries give every held
     token to its running total (prompt tokens start from their prefill column sums);
  3. FIRING RULE: a prompt of the batch is compressed at this layer when one of its stored heads
     holds decode_budget + decode_interval tokens or more (kept prompt + generated). Each
     of its heads then keeps decode_budget tokens: the most recent window_size (by position) plus
     the best of the rest by the method's `decode_score` (same tie-break as at prefill: the more
     recent wins), evicted tokens folded in by the method's merge rule if it has one.
     This happens after the step's attention, so a head holds at most decode_budget +
     decode_interval tokens at any moment, for any number of new tokens, and exactly
     decode_budget right after a compression (every decode_interval tokens in steady state).
     The same rule is applied once right after prefill: a prompt whose kept part already
     reaches the bound (kept whole, or a larger prefill budget) is re-selected then, with the
     prompt's last queries as the window; one holding fewer grows until it reaches the bound.
     Heads holding no more than decode_budget keep everything.

The decision is per prompt and per layer (a prompt's result does not depend on its batch). When
any prompt of the batch is compressed, every prompt's generated tokens move from the dense tail
into its kept set (the others unchanged, just stored there), so the tail restarts empty.
Positions stay true: kept tokens carry their positions, `get_seq_length()` still counts every
token ever appended (new tokens keep their RoPE positions), and the inspection helpers report
true positions (0 = first real prompt token).

Ragged heads (AdaKV, HeadKV) keep their prefill split; at decode time every head is bounded by the
same decode_budget (the adaptive split is not re-run over generated tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from pyramidkv.core.scoring import attention_column_sums, scores_per_stored_head, window_attention
from pyramidkv.core.selection import select_kept_positions
from pyramidkv.merging.base import merge_prompt
from pyramidkv.methods.base import DecodeScoreContext

if TYPE_CHECKING:
    from pyramidkv.core.cache import CompressedCache

# One held head: (keys [m, D], values [m, D], positions [m], accumulated attention [m, g] or None).
HeldHead = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class DecodeCompressor:
    """The decode-time state of one CompressedCache whose method has a decode_budget."""

    def __init__(self, cache: "CompressedCache"):
        method = cache.method
        self.cache = cache
        self.method = method
        self.budget: int = method.decode_budget
        self.interval: int = method.decode_interval
        self.limit = self.budget + self.interval  # a head holding this many tokens triggers a compression
        self.buffer_size = max(method.window_size, 1)
        stored = cache.num_query_heads if method.gqa_layout == "query_head" else cache.num_kv_heads
        self.group = cache.num_query_heads // stored  # query heads per stored head
        layers = cache.num_layers
        self.folded = [0] * layers         # generated tokens moved from the tail into the kept set
        self.compressions = [0] * layers   # how often each layer was compressed
        self.queries: list[Optional[torch.Tensor]] = [None] * layers  # [B, Hq, <= buffer_size, D]
        self._prefill_scores: list[Optional[torch.Tensor]] = [None] * layers  # [B, Hq, n] (accumulating)
        self._acc_prefix: list[Optional[list[torch.Tensor]]] = [None] * layers  # per prompt [T, g]
        self._acc_tail: list[Optional[torch.Tensor]] = [None] * layers  # [B, H, t, g]
        # Tokens a prompt has fed back -> its stored bytes then (kv_bytes(b, tail_tokens=k) once the
        # tail has been folded away), and the most bytes stored at any moment while decoding.
        self.bytes_history: dict[int, list[int]] = {}
        self.peak_kv_bytes = 0

    # ---- hooks called by the cache ----------------------------------------------------------
    def observe_prefill(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor,
                        raw_scores: Optional[torch.Tensor]) -> None:
        """queries [B, Hq, n, D], keys [B, Hkv, n, D] of the prompt; raw_scores: the method's prefill
        score [B, Hq|Hkv, n] before the GQA reduction (None when no prompt was compressed)."""
        self.queries[layer_idx] = queries[:, :, -self.buffer_size:].clone()
        if not self.method.accumulates_attention:
            return
        if raw_scores is None:  # every prompt kept whole: the column sums are still the starting totals
            n = keys.shape[2]
            pads = torch.tensor(self.cache.pad_lens, device=keys.device)
            real = torch.arange(n, device=keys.device)[None, :] >= pads[:, None]
            raw_scores = attention_column_sums(queries, keys, real)
        heads = raw_scores.shape[1]
        if heads != self.cache.num_query_heads:
            raw_scores = raw_scores.repeat_interleave(self.cache.num_query_heads // heads, dim=1)
        self._prefill_scores[layer_idx] = raw_scores.float()

    def after_prefill(self, layers) -> None:
        """The prompt part of these layers is stored: a layer whose kept prompt already reaches
        decode_budget + decode_interval in some head is re-selected now, with the prompt's last
        queries as the window, so the bound holds from the first decode step on."""
        for layer_idx in layers:
            if self.method.accumulates_attention:
                self._start_accumulation(layer_idx)
            fire = [max(kept.lengths) >= self.limit for kept in self.cache.prefix[layer_idx]]
            if any(fire):
                self._compress(layer_idx, fire)

    def after_attend(self, layer_idx: int, queries: torch.Tensor) -> None:
        """After a decode step's attention at one layer (queries [B, Hq, q, D] of the new tokens)."""
        cache = self.cache
        if layer_idx == 0 and 0 not in self.bytes_history:  # nothing folded yet: the after-prefill bytes
            self.bytes_history[0] = [cache.kv_bytes(b, tail_tokens=0) for b in range(len(cache.pad_lens))]
        self.queries[layer_idx] = torch.cat([self.queries[layer_idx], queries], dim=2)[:, :, -self.buffer_size:]
        if self.method.accumulates_attention:
            self._accumulate(layer_idx, queries)
        t = cache.tail_keys[layer_idx].shape[2]
        fire = [max(kept.lengths) + t >= self.limit for kept in cache.prefix[layer_idx]]
        if any(fire):
            self.peak_kv_bytes = max(self.peak_kv_bytes, cache.kv_bytes())
            self._compress(layer_idx, fire)
        if layer_idx == cache.num_layers - 1:
            self.peak_kv_bytes = max(self.peak_kv_bytes, cache.kv_bytes())
            self.bytes_history[self.appended(layer_idx)] = [cache.kv_bytes(b) for b in range(len(cache.pad_lens))]

    # ---- inspection -------------------------------------------------------------------------
    def appended(self, layer_idx: int) -> int:
        """Tokens appended to this layer since the prompt (generated tokens fed back)."""
        tail = self.cache.tail_keys[layer_idx]
        return self.folded[layer_idx] + (0 if tail is None else tail.shape[2])

    # ---- H2O's accumulated attention --------------------------------------------------------
    def _start_accumulation(self, layer_idx: int) -> None:
        """Per prompt, the prefill column sums of the kept tokens, as rows aligned with its KeptKV."""
        cache, g = self.cache, self.group
        raw = self._prefill_scores[layer_idx]
        per_prompt = []
        for b, kept in enumerate(cache.prefix[layer_idx]):
            pad = cache.pad_lens[b]
            rows = [raw[b, h * g:(h + 1) * g][:, positions + pad].T
                    for h, positions in enumerate(kept.positions_per_head())]
            per_prompt.append(torch.cat(rows) if rows else raw.new_zeros(0, g))
        self._acc_prefix[layer_idx] = per_prompt
        heads = len(cache.prefix[layer_idx][0].lengths)
        self._acc_tail[layer_idx] = raw.new_zeros(len(per_prompt), heads, 0, g)
        self._prefill_scores[layer_idx] = None

    def _accumulate(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Add the attention of the new queries (over everything held, causal among themselves) to the
        running totals. Recomputed here in float32 rather than taken from `attend`."""
        cache, g = self.cache, self.group
        if self._acc_prefix[layer_idx] is None:
            self._start_accumulation(layer_idx)
        tail_keys = cache.tail_keys[layer_idx].float()  # [B, H, t, D]
        bsz, heads, t, dim = tail_keys.shape
        q_len = queries.shape[2]
        grouped = queries.float().reshape(bsz, heads, g, q_len, dim) * dim ** -0.5
        tail_scores = torch.einsum("bhgqd,bhtd->bhgqt", grouped, tail_keys)
        if q_len > 1:
            allowed = torch.arange(t, device=queries.device)[None, :] <= torch.arange(t - q_len, t, device=queries.device)[:, None]
            tail_scores = tail_scores.masked_fill(~allowed, float("-inf"))
        acc_tail = torch.cat([self._acc_tail[layer_idx], tail_keys.new_zeros(bsz, heads, q_len, g)], dim=2)
        for b, kept in enumerate(cache.prefix[layer_idx]):
            acc = self._acc_prefix[layer_idx][b]
            if kept.uniform:
                prefix_keys = kept.keys.reshape(heads, -1, dim).float()
                segments = [(slice(None), prefix_keys)]
            else:
                segments = [(h, k.float()[None]) for h, (k, _) in enumerate(kept.per_head())]
            start = 0
            for head, keys in segments:
                prefix_scores = torch.einsum("hgqd,hld->hgql", grouped[b, head].reshape(-1, g, q_len, dim), keys)
                probs = torch.softmax(torch.cat([prefix_scores, tail_scores[b, head].reshape(-1, g, q_len, t)], -1),
                                      dim=-1).sum(dim=2)  # [h, g, L + t]
                length = keys.shape[1]
                rows = probs[..., :length].permute(0, 2, 1).reshape(-1, g)
                acc[start:start + rows.shape[0]] += rows
                start += rows.shape[0]
                acc_tail[b, head] += probs[..., length:].permute(0, 2, 1).reshape(acc_tail[b, head].shape)
        self._acc_tail[layer_idx] = acc_tail

    # ---- re-selection -----------------------------------------------------------------------
    def _held(self, layer_idx: int, b: int) -> list[HeldHead]:
        """Per stored head of prompt b: everything it holds (kept tokens, then the tail), in position order."""
        cache = self.cache
        kept = cache.prefix[layer_idx][b]
        tail_keys, tail_values = cache.tail_keys[layer_idx], cache.tail_values[layer_idx]
        if tail_keys is None:  # nothing appended since the last compression (or the prefill)
            tail_keys = tail_values = kept.keys.new_zeros(len(cache.prefix[layer_idx]), len(kept.lengths), 0,
                                                          kept.keys.shape[-1])
        t = tail_keys.shape[2]
        start = cache.prompt_len - cache.pad_lens[b] + self.folded[layer_idx]
        tail_positions = torch.arange(start, start + t, device=kept.positions.device, dtype=kept.positions.dtype)
        accumulated = [None] * len(kept.lengths)
        if self.method.accumulates_attention:
            acc_tail = self._acc_tail[layer_idx]
            accumulated = [torch.cat([a, acc_tail[b, h]]) for h, a in
                           enumerate(self._acc_prefix[layer_idx][b].split(kept.lengths))]
        return [(torch.cat([k, tail_keys[b, h]]), torch.cat([v, tail_values[b, h]]), torch.cat([p, tail_positions]),
                 accumulated[h])
                for h, ((k, v), p) in enumerate(zip(kept.per_head(), kept.positions_per_head()))]

    def _compress(self, layer_idx: int, fire: list[bool]) -> None:
        """Re-select the prompts in `fire`; fold every prompt's tail into its kept set; empty the tail."""
        from pyramidkv.core.cache import TAIL_GROWTH_TOKENS, KeptKV

        cache = self.cache
        new_prefix, new_acc = [], []
        for b in range(len(cache.prefix[layer_idx])):
            heads = self._held(layer_idx, b)
            if fire[b]:
                heads = self._reselect(layer_idx, b, heads)
            new_prefix.append(KeptKV(torch.cat([h[0] for h in heads]).contiguous(),
                                     torch.cat([h[1] for h in heads]).contiguous(),
                                     [len(h[2]) for h in heads], torch.cat([h[2] for h in heads])))
            if self.method.accumulates_attention:
                new_acc.append(torch.cat([h[3] for h in heads]))
        tail = cache.tail_keys[layer_idx]
        t = 0 if tail is None else tail.shape[2]
        cache.prefix[layer_idx] = new_prefix  # a new list: attend rebuilds the layer's DecodeLayout
        cache.tail_keys[layer_idx] = cache.tail_values[layer_idx] = None
        cache._decode_layouts[layer_idx] = None
        buffers = cache._tail_buffers[layer_idx]
        if buffers is not None and buffers[0].shape[2] > self.interval + TAIL_GROWTH_TOKENS:
            cache._tail_buffers[layer_idx] = None  # a tail grown before the first compression: release it
        self.folded[layer_idx] += t
        self.compressions[layer_idx] += 1
        if self.method.accumulates_attention:
            self._acc_prefix[layer_idx] = new_acc
            self._acc_tail[layer_idx] = self._acc_tail[layer_idx][:, :, :0]

    def _reselect(self, layer_idx: int, b: int, heads: list[HeldHead]) -> list[HeldHead]:
        """Each head of prompt b keeps decode_budget tokens: the window + the best by decode_score."""
        cache, method, g = self.cache, self.method, self.group
        rows = len(heads)
        m = max(len(h[2]) for h in heads)
        first = heads[0][0]
        dim = first.shape[-1]
        keys = first.new_zeros(rows, 1, m, dim)
        values = first.new_zeros(rows, 1, m, dim)
        real = torch.zeros(rows, m, dtype=torch.bool, device=first.device)
        positions = torch.full((rows, m), -1, dtype=torch.long, device=first.device)
        accumulated = first.new_zeros(rows, g, m, dtype=torch.float32) if method.accumulates_attention else None
        pads = []
        for r, (k, v, p, a) in enumerate(heads):
            pad = m - len(p)
            pads.append(pad)
            keys[r, 0, pad:], values[r, 0, pad:], real[r, pad:], positions[r, pad:] = k, v, True, p
            if accumulated is not None:
                accumulated[r, :, pad:] = a.T
        # The buffered queries of this prompt, g per stored head, as the last rows of the window.
        buffered = self.queries[layer_idx][b]  # [Hq, w, D]
        w = min(buffered.shape[1], m)
        queries = first.new_zeros(rows, g, m, dim)
        queries[:, :, m - w:] = buffered[:, -w:].reshape(rows, g, w, dim).to(first.dtype)
        ctx = DecodeScoreContext(layer_idx, cache.num_layers, queries, keys, values, real,
                                 positions=positions, accumulated=accumulated)
        scores = scores_per_stored_head(method.decode_score(ctx), method, 1, g)[:, 0]  # [rows, m]
        attention = generator = None
        if method.merge is not None:
            if method.merge.needs_attention:
                attention = window_attention(queries, keys, real, self.buffer_size).mean(dim=2)
                attention = scores_per_stored_head(attention, method, 1, g)  # [rows, 1, m]
            seed = method.merge.seed_for(layer_idx)
            generator = None if seed is None else torch.Generator(device=first.device).manual_seed(seed)
        kept = []
        for r, (k, v, p, a) in enumerate(heads):
            chosen = select_kept_positions(scores[r:r + 1], pads[r], [min(self.budget, len(p))], method.window_size)[0]
            index = chosen - pads[r]
            new_keys, new_values = k[index], v[index]
            if method.merge is not None and len(index) < len(p):
                merged_keys, merged_values = merge_prompt(method.merge, keys[r], values[r], [chosen], pads[r],
                                                          None if attention is None else attention[r],
                                                          method.window_size, generator)
                new_keys, new_values = merged_keys[0], merged_values[0]
            kept.append((new_keys, new_values, p[index], None if a is None else a[index]))
        return kept
