"""Compression during decoding: the cache re-selects (kept prompt + generated tokens) as it grows.

Without `decode_budget` the prompt part of the cache is compressed once, at prefill, and every
generated token is kept: a long generation grows the cache without bound. With it, the cache owns a
`DecodeCompressor` that, at every layer and after every decode step:

  1. the new queries go into a per-layer buffer of the last `query_window` queries (default
     max(window_size, 1); seeded with the prompt's last queries at prefill), the queries the
     re-selection's scores read;
  2. methods with `accumulates_attention` (H2O) add the attention the new queries give every held
     token to its running total (prompt tokens start from their prefill column sums); methods with a
     `history_window` (Scissorhands) keep each held token's attention from the last w queries
     (token_stats.py);
  3. FIRING RULE: a prompt of the batch is compressed at this layer when one of its stored heads
     holds decode_budget + decode_interval tokens or more (kept prompt + generated). Each
     of its heads then keeps decode_budget tokens: the most recent window_size (by position) plus
     the best of the rest by the method's `decode_score` (same tie-break as at prefill: the more
     recent wins), evicted tokens folded in by the method's merge rule if it has one. The score sees
     the prompt in the prefill layout (`DecodeScoreContext`: batch 1, its stored heads, the buffered
     queries) and is brought to one row per stored head by the same `scores_per_stored_head`.
     This happens after the step's attention; a forward of several new tokens is cut where the
     rule may fire (`piece`: the cache attends each piece at once), so a head holds at most
     decode_budget + decode_interval tokens at any moment, and exactly decode_budget right after
     a compression, the decisions those of one token per step. Right after prefill the same
     rule runs once (a prompt kept whole, or a larger prefill budget, is re-selected then, its
     last queries as the window). Heads holding no more than decode_budget keep everything.

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

from typing import Optional

import torch

from pyramidkv.core.context import CompressionMethod, DecodeScoreContext
from pyramidkv.core.drop_one import drop_one, in_place_step
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.scoring import PLAIN, scores_per_stored_head, window_attention
from pyramidkv.core.selection import select_kept_positions
from pyramidkv.core.token_stats import AccumulatedAttention, AttentionHistory
from pyramidkv.merging.base import merge_prompt

# One held head: (keys [m, D], values [m, D], positions [m], its token statistic [m, ...] or None).
HeldHead = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


class RunningBytes:
    """The byte figures of a decode-time unit over `self.stores` (DecodeCompressor, ThresholdDecoder): each layer's
    stored bytes, recounted when the layer changes (`_recount`), their sum kept running (`stored_bytes`), never
    re-summed over every layer; `peak_kv_bytes`: the most bytes stored at any moment while decoding."""

    def start_byte_counts(self) -> None:
        self.peak_kv_bytes = 0
        self.layer_bytes = [0] * self.num_layers
        self.total_bytes = 0

    def stored_bytes(self) -> int:
        """Every layer's bytes now: the running total of the per-layer counts (a layer is recounted after each
        change to it)."""
        return self.total_bytes

    def _recount(self, layer_idx: int) -> None:
        now = self.stores[layer_idx].nbytes()
        self.total_bytes += now - self.layer_bytes[layer_idx]
        self.layer_bytes[layer_idx] = now


class DecodeCompressor(RunningBytes):
    """The decode-time state of one cache whose method has a decode_budget.

    stores: the cache's list of layer stores (filled in as prefill stores each layer); query_window: how many
    recent queries each layer buffers for the re-selection's scores (None: max(window_size, 1))."""

    def __init__(self, method: CompressionMethod, stores: list[Optional[FullPrecisionStore]], num_query_heads: int,
                 stored_heads: int, query_window: Optional[int] = None, rotation=None, model=None):
        if query_window is not None and query_window < 1:
            raise ValueError(f"query_window must be >= 1 (recent queries buffered for decode-time scoring), "
                             f"got {query_window}")
        self.method = method
        self.rotation = rotation  # the model's RoPE (core/rotary.py), for methods with `needs_rotation`
        self.model = model        # the model's shape (ScoreContext.model), None: unknown
        self.form = PLAIN if model is None else model.form   # its attention form (the scores' attention)
        self.stores = stores
        self.num_layers = len(stores)
        self.budget: int = method.decode.decode_budget
        self.interval: int = method.decode.decode_interval
        self.limit = self.budget + self.interval  # a head holding this many tokens triggers a compression
        self.buffer_size = max(method.window_size, 1) if query_window is None else query_window
        self.group = num_query_heads // stored_heads  # query heads per stored head
        self.compressions = [0] * self.num_layers   # how often each layer was compressed
        self.start_byte_counts()
        self.pad_lens: list[int] = []
        self.drop_grid = None                       # drop_one.py's constant tensors for the step's shape
        self.step_bytes = [0] * self.num_layers     # bytes a layer's last re-selection freed (its steady step's)
        self.queries: list[Optional[torch.Tensor]] = [None] * self.num_layers        # [B, Hq, <= buffer_size, D]
        self.stats = None                           # what decode_score reads besides the tokens
        if method.accumulates_attention:
            self.stats = AccumulatedAttention(self.num_layers, self.group, num_query_heads)
        elif method.history_window is not None:
            self.stats = AttentionHistory(self.num_layers, self.group, method.history_window)
        if self.stats is not None:
            self.stats.form = self.form

    # ---- hooks called by the cache ----------------------------------------------------------
    def observe_prefill(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor,
                        raw_scores: Optional[torch.Tensor], pad_lens: list[int], pattern=None,
                        column_sums: Optional[torch.Tensor] = None) -> None:
        """queries [B, Hq, n, D], keys [B, Hkv, n, D] of the prompt; raw_scores: the method's prefill
        score [B, Hq|Hkv, n] before the GQA reduction (None when no prompt was compressed); pattern: the
        sparse prefill pattern (None: dense); column_sums: [B, Hq, n] from the attention pass, or None."""
        self.pad_lens = pad_lens
        self.queries[layer_idx] = queries[:, :, -self.buffer_size:].clone()
        if self.stats is not None:
            self.stats.observe_prefill(layer_idx, queries, keys, raw_scores, pad_lens, pattern, column_sums)

    def after_prefill(self, layer_idx: int) -> None:
        """The layer's prompt part is stored: if a head's kept prompt already reaches decode_budget +
        decode_interval, re-select now (the prompt's last queries as the window), so the bound holds
        from the first decode step on."""
        if self.stats is not None:
            self.stats.start(layer_idx, self.stores[layer_idx], self.pad_lens)
        # the per-step rule in place reads the step's own attention rows (core/drop_one.py)
        # (and H2O's accumulation, core/token_stats.py)
        self.stores[layer_idx].keep_rows = self.method.accumulates_attention or \
            self.interval == 1 and getattr(self.method, "newest_row_score", None) is not None
        fire = [max(lengths) >= self.limit for lengths in self.stores[layer_idx].kept_counts()]
        if any(fire):
            self._compress(layer_idx, fire)
        self._recount(layer_idx)

    def piece(self, layer_idx: int) -> int:
        """New tokens the layer can take in one piece: until one of its heads would reach the firing bound."""
        return self.limit - max(max(held, default=0) for held in self.stores[layer_idx].held_counts())

    def after_attend(self, layer_idx: int, queries: torch.Tensor, *new) -> None:
        """After a decode step's attention at one layer (queries [B, Hq, q, D] of the new tokens; `new`: their keys,
        values, hidden states and position, which a threshold decoder reads, core/threshold.py)."""
        if queries.shape[2] == self.buffer_size:   # the new queries are the buffer (TOVA's one query a step)
            self.queries[layer_idx] = queries
        elif queries.shape[2] > self.buffer_size:
            self.queries[layer_idx] = queries[:, :, queries.shape[2] - self.buffer_size:]
        else:
            self.queries[layer_idx] = torch.cat([self.queries[layer_idx], queries], dim=2)[:, :, -self.buffer_size:]
        if self.stats is not None:
            self.stats.step(layer_idx, self.stores[layer_idx], queries)
        store = self.stores[layer_idx]
        if getattr(store, "steady", False) and in_place_step(self, layer_idx, store):
            # the step before was TOVA's in place, nothing else since: every head held decode_budget + 1 tokens
            # after the append, as then, and is back to decode_budget: the layer's bytes are its count before it
            self.compressions[layer_idx] += 1
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.total_bytes + self.step_bytes[layer_idx])
        else:
            self._recount(layer_idx)   # the step's append
            fire = [max(held) >= self.limit for held in store.held_counts()]
            if any(fire):
                self.peak_kv_bytes = max(self.peak_kv_bytes, self.stored_bytes())
                appended = self.layer_bytes[layer_idx]
                self._compress(layer_idx, fire)
                self._recount(layer_idx)
                self.step_bytes[layer_idx] = appended - self.layer_bytes[layer_idx]
        if layer_idx == self.num_layers - 1:
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.stored_bytes())

    # ---- re-selection -----------------------------------------------------------------------
    def _held(self, layer_idx: int, b: int) -> list[HeldHead]:
        """Per stored head of prompt b: everything it holds (kept tokens, then the tail), in position order."""
        store = self.stores[layer_idx]
        heads = store.held(b)
        stats = [None] * len(heads)
        if self.stats is not None:
            stats = self.stats.held(layer_idx, b, store.kept_counts()[b])
        return [(k, v, p, a) for (k, v, p), a in zip(heads, stats)]

    def _compress(self, layer_idx: int, fire: list[bool]) -> None:
        """Re-select the prompts in `fire`; every prompt's tail is folded into its kept set."""
        self.compressions[layer_idx] += 1
        if self._drop_one(layer_idx, fire):
            return
        held = [self._held(layer_idx, b) for b in range(len(fire))]
        self._replace(layer_idx, [self._reselect(layer_idx, b, heads) if fire[b] else heads
                                  for b, heads in enumerate(held)])

    def drop_before(self, layer_idx: int, first: list[int]) -> None:
        """A sliding layer's window: every held token of prompt b before position first[b] leaves (with its
        statistics); what stays is folded into the kept sets, as a re-selection does."""
        self._replace(layer_idx, [[(k[p >= f], v[p >= f], p[p >= f], None if a is None else a[p >= f])
                                   for k, v, p, a in self._held(layer_idx, b)] for b, f in enumerate(first)])
        self._recount(layer_idx)

    def _replace(self, layer_idx: int, held: list[list[HeldHead]]) -> None:
        """Per prompt its held heads become the store's kept sets (and their statistics the kept rows')."""
        self.stores[layer_idx].replace([KeptKV.from_heads([(k, v, p) for k, v, p, _ in heads]) for heads in held],
                                       max_tail=self.interval)
        if self.stats is not None:
            self.stats.replace(layer_idx, [torch.cat([a for *_, a in heads]) for heads in held])

    def _drop_one(self, layer_idx: int, fire: list[bool]) -> bool:
        """The per-step rule's steady state in place (core/drop_one.py); False, changing nothing, where it does not
        apply (the general path runs)."""
        return drop_one(self, layer_idx, fire)

    def _context(self, layer_idx: int, b: int, heads: list[HeldHead]) -> tuple[DecodeScoreContext, list[int]]:
        """Prompt b's held tokens in the prefill layout (DecodeScoreContext), and each head's left padding."""
        method, g = self.method, self.group
        rows = len(heads)
        m = max(len(h[2]) for h in heads)
        first = heads[0][0]
        dim = first.shape[-1]
        keys = first.new_zeros(1, rows, m, dim)
        values = first.new_zeros(1, rows, m, dim)
        real = torch.zeros(1, rows, m, dtype=torch.bool, device=first.device)
        positions = torch.full((1, rows, m), -1, dtype=torch.long, device=first.device)
        # Statistics per stored head and query head of its group ([H, g, ...]), then [1, H * g = Hq, ...].
        accumulated = first.new_zeros(rows, g, m, dtype=torch.float32) if method.accumulates_attention else None
        history = levels = None
        if isinstance(self.stats, AttentionHistory):
            history = first.new_full((rows, g, self.stats.window, m), float("nan"), dtype=torch.float32)
            levels = self.stats.levels[layer_idx][b].repeat_interleave(g, dim=0)[None]  # [1, Hq, w_h]
        pads = []
        for r, (k, v, p, a) in enumerate(heads):
            pad = m - len(p)
            pads.append(pad)
            keys[0, r, pad:], values[0, r, pad:], real[0, r, pad:], positions[0, r, pad:] = k, v, True, p
            if accumulated is not None:
                accumulated[r, :, pad:] = a.T
            if history is not None:
                history[r, :, :, pad:] = a.permute(1, 2, 0)
        if not any(pads):  # every head holds m tokens: one mask for all, as at prefill
            real = real[:, 0]
        buffered = self.queries[layer_idx][b:b + 1]  # [1, Hq, <= buffer_size, D], oldest first
        w = min(buffered.shape[2], m)
        queries = buffered[:, :, buffered.shape[2] - w:].to(first.dtype)
        ctx = DecodeScoreContext(
            layer_idx, self.num_layers, queries, keys, values, real, positions=positions,
            rotation=self.rotation, model=self.model,
            accumulated=None if accumulated is None else accumulated.reshape(1, rows * g, m),
            history=None if history is None else history.reshape(1, rows * g, self.stats.window, m),
            history_levels=levels)
        return ctx, pads

    def _reselect(self, layer_idx: int, b: int, heads: list[HeldHead]) -> list[HeldHead]:
        """Each head of prompt b keeps decode_budget tokens: the window + the best by decode_score."""
        method = self.method
        ctx, pads = self._context(layer_idx, b, heads)
        stored, query_heads = ctx.keys.shape[1], ctx.queries.shape[1]
        scores = scores_per_stored_head(method.decode_score(ctx), method, stored, query_heads)[0]  # [H, m]
        attention = generator = None
        if method.merge is not None:
            if method.merge.needs_attention:
                attention = window_attention(ctx.queries, ctx.keys, ctx.real, self.buffer_size,
                                             form=self.form).mean(dim=2)
                attention = scores_per_stored_head(attention, method, stored, query_heads)[0]  # [H, m]
            seed = method.merge.seed_for(layer_idx)
            generator = None if seed is None else torch.Generator(device=ctx.keys.device).manual_seed(seed)
        kept = []
        for r, (k, v, p, a) in enumerate(heads):
            chosen = select_kept_positions(scores[r:r + 1], pads[r], [min(self.budget, len(p))], method.window_size,
                                           method.selection.num_sinks)[0]
            index = chosen - pads[r]
            new_keys, new_values = k[index], v[index]
            if method.merge is not None and len(index) < len(p):
                merged_keys, merged_values = merge_prompt(method.merge, ctx.keys[0, r:r + 1], ctx.values[0, r:r + 1],
                                                          [chosen], pads[r],
                                                          None if attention is None else attention[r:r + 1],
                                                          method.window_size, generator)
                new_keys, new_values = merged_keys[0], merged_values[0]
            kept.append((new_keys, new_values, p[index], None if a is None else a[index]))
        return kept
