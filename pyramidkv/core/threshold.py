"""Threshold eviction while decoding (a threshold sizing with threshold_decoding: pyramidkv/sizing/threshold.py).

The prefill decided every prompt token before the recent window (W = the method's window_size): kept in a stored
head iff its score there >= threshold. The window's tokens, and every token appended later, are PENDING: each was
given its score per stored head when it entered (the window's at prefill, a new token by the method's `score` on
that token alone, `token_scores`), and is decided when it leaves the window, i.e. once the newest held position
is p + W: it stays in head h iff its score there >= threshold. Tokens at positions below num_sinks are never
pending. Decisions run after the step's attention (a token leaving the window was attended by the step that
pushed it out); a token that leaves is marked gone in its slot (masked out of the attention, counted out of every
report and byte figure: core/in_place.py), and the store compacts every COMPACT_EVERY decisions: the held tokens
rebuilt without the gone ones, the tail up to the last decision folded into the kept rows, as a decode-time
re-selection does (decoding.py). A report between two compactions reads what the rebuild at each decision held.

Per prompt, per layer: `pending` holds (first, scores): the pending tokens are the true positions first .. first +
P - 1 (0 = first real prompt token), oldest first, and scores their P scores as Python lists of H floats (one
`tolist` as a token enters, each decision then a comparison in Python: no tensor op per step). They are consecutive:
every token from the first pending one to the newest is pending (a token >= num_sinks becomes pending as it enters
and leaves only once every older one has), so the P' tokens leaving at a step are the first P' and, as every pending
token is held in every head, the token at position p is row m - 1 - (newest - p) of a head whose slots hold m
tokens, gone ones included (they are all older than every pending token): `_evict` marks that row.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.core import in_place
from pyramidkv.core.context import CompressionMethod, ScoreContext
from pyramidkv.core.decoding import DecodeCompressor, RunningBytes
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.scoring import scores_per_stored_head

# Threshold decisions marked in place between two compactions of a layer's store (core/in_place.py): the gone rows
# stay in the attention (masked) until then, the decisions between cost no copy. A compaction copies the layer's
# whole store (1.45 ms a layer at kvzap's n = 4,096 on the CPU): at 16 it cost 0.1 ms a layer-step, at 64 a quarter
# of that; the gone rows kept meanwhile are a few per decision (about 3 % of kvzap's rows at 4,096), counted out of
# every byte figure (held tokens), not yet returned to the allocator.
COMPACT_EVERY = 64


class ThresholdDecoder(RunningBytes):
    """The decode-time state of a cache whose method evicts by a threshold while decoding (same hooks as a
    DecodeCompressor)."""

    def __init__(self, method: CompressionMethod, stores: list, model: ModelShape, threshold: float, rotation=None):
        self.method = method
        self.stores = stores
        self.model = model
        self.num_layers = len(stores)
        self.num_query_heads, self.num_kv_heads = model.num_query_heads, model.num_kv_heads
        self.rotation = rotation
        self.threshold = threshold
        # the threshold as the float32 comparison of a score tensor reads it: a float32 score s (a Python float)
        # is below it iff s < self.limit, exactly as (score tensor < threshold) in float32
        self.limit = float(torch.tensor(threshold, dtype=torch.float32))
        self.all_real: dict = {}   # (B, q, device) -> the new tokens' `real` [B, q] (never padding)
        self.window = method.window_size
        self.sinks = method.selection.num_sinks
        self.pending: list[Optional[list[tuple[int, list[list[float]]]]]] = [None] * self.num_layers
        self.next_position: list[list[int]] = [[] for _ in range(self.num_layers)]  # per layer, per prompt
        self.compressions = [0] * self.num_layers   # decode steps at which a layer evicted something
        self.evicted = [0] * self.num_layers        # (prompt, head, token) entries evicted while decoding, per layer
        self.start_byte_counts()

    # ---- hooks called by the cache ----------------------------------------------------------
    def observe_prefill(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor,
                        raw_scores: Optional[torch.Tensor], pad_lens: list[int], pattern=None,
                        column_sums: Optional[torch.Tensor] = None) -> None:
        """The prompt's window tokens become pending with their prefill scores (raw_scores [B, Hq|Hkv, n], None
        when no prompt is longer than the sinks: nothing is pending then)."""
        n = keys.shape[2]
        real_lens = [n - pad for pad in pad_lens]
        self.next_position[layer_idx] = real_lens
        scores = None if raw_scores is None else \
            scores_per_stored_head(raw_scores, self.method, self.num_kv_heads, self.num_query_heads).float()
        pending = []
        for b, real in enumerate(real_lens):
            first = max(real - self.window, self.sinks)   # true positions [first, real) are pending
            if scores is None or first >= real:
                pending.append((first, []))
            else:
                pending.append((first, scores[b, :, n - real + first:].T.tolist()))
        self.pending[layer_idx] = pending

    def after_prefill(self, layer_idx: int) -> None:
        store = self.stores[layer_idx]
        if type(store) is FullPrecisionStore:   # its heads grow apart as they decide: segment by segment
            store.by_segment = True
        self._recount(layer_idx)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.stored_bytes())

    def piece(self, layer_idx: int) -> int:
        """New tokens the layer takes in one piece: up to the step at which the first pending token that fails the
        threshold in some head leaves the window (the eviction comes after that step's attention), and at most W, so
        that no token of the piece leaves inside it. Each token's score reads it alone (`token_scores`), so scoring a
        piece at once gives every token its own score."""
        if self.window < 1:
            return 1
        steps = self.window
        for (first, scores), start in zip(self.pending[layer_idx], self.next_position[layer_idx]):
            fails = next((j for j, heads in enumerate(scores) if min(heads) < self.limit), None)
            if fails is not None:   # position p leaves after the step that appends p + W, step p + W - start + 1
                steps = min(steps, first + fails + self.window - start + 1)
        return steps

    def after_attend(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor = None,
                     values: torch.Tensor = None, hidden: Optional[torch.Tensor] = None,
                     rope: Optional[torch.Tensor] = None) -> None:
        """After a decode step's attention at one layer: queries [B, Hq, q, D], keys, values [B, Hkv, q, D] of the
        new tokens (before any repeat to query heads), hidden [B, q, E] their attention input (methods with
        `needs_hidden`), rope [B] the last new token's RoPE position. Score them, then decide what leaves the
        window."""
        bsz, _, q_len, _ = keys.shape
        positions = rope[:, None] if q_len == 1 else \
            rope[:, None] - q_len + 1 + torch.arange(q_len, device=keys.device)   # [B, q] RoPE positions
        real = self.all_real.get((bsz, q_len, keys.device))
        if real is None:
            real = self.all_real[bsz, q_len, keys.device] = torch.ones(bsz, q_len, dtype=torch.bool, device=keys.device)
        ctx = ScoreContext(layer_idx, self.num_layers, queries, keys, values, real, positions=positions.long(),
                           rotation=self.rotation, hidden=hidden, model=self.model)
        scores = scores_per_stored_head(self.method.score(ctx), self.method, self.num_kv_heads,
                                        self.num_query_heads).float()   # [B, H, q]
        new_scores = scores.transpose(1, 2).tolist()   # [B][q][H]
        drops, pending = [], self.pending[layer_idx]
        for b in range(bsz):
            start = self.next_position[layer_idx][b]
            self.next_position[layer_idx][b] = start + q_len
            first, held = pending[b]
            entering = max(start, self.sinks)             # the new tokens from here on become pending
            if entering < start + q_len:
                if not held:
                    first = entering
                held = held + new_scores[b][entering - start:]
            # the oldest pending tokens up to position newest - W leave: (their first position, (head, j) of each
            # that fails)
            leaving = min(max(start + q_len - self.window - first, 0), len(held))
            drops.append((first, [(h, j) for j in range(leaving) for h, score in enumerate(held[j])
                                  if score < self.limit]))
            pending[b] = (first + leaving, held[leaving:] if leaving else held)
        if any(hits for _, hits in drops):
            self._evict(layer_idx, drops)
        self._recount(layer_idx)   # the step's append, and any eviction
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.stored_bytes())

    def drop_before(self, layer_idx: int, first: list[int]) -> None:
        """A sliding layer's window: every held token of prompt b below position first[b] leaves, pending or not."""
        store = self.stores[layer_idx]
        pending = self.pending[layer_idx]
        for b, f in enumerate(first):
            start, scores = pending[b]
            gone = min(max(f - start, 0), len(scores))
            pending[b] = (start + gone, scores[gone:])
        store.replace([KeptKV.from_heads([(k[p >= f], v[p >= f], p[p >= f]) for k, v, p in store.held(b)])
                       for b, f in enumerate(first)])
        self._recount(layer_idx)

    # ---- eviction ---------------------------------------------------------------------------
    def _evict(self, layer_idx: int, drops: list[tuple[int, list[tuple[int, int]]]]) -> None:
        """Per prompt (first, the (h, j) of each pending token that fails): head h drops position first + j.
        In a plain full-precision store without thin rows the leaving rows are marked gone in place (their row known
        from the newest position, module docstring; core/in_place.py) and the store compacts every COMPACT_EVERY
        decisions; elsewhere every prompt's held tokens are rebuilt without them, head by head."""
        store = self.stores[layer_idx]
        self.compressions[layer_idx] += 1
        if type(store) is FullPrecisionStore and all(k.thin is None for k in store.kept):
            t = store.tail_len
            cuts = []
            for b, (first, hits) in enumerate(drops):
                # row of position first + j in head h: m_h - 1 - (newest - first - j), m_h = L_h + t, newest the tail's last
                lengths, base = store.kept[b].lengths, first - store.tail_start[b]
                heads = [[] for _ in lengths]
                for h, j in hits:
                    heads[h].append(lengths[h] + base + j)
                cuts.append(heads)
            self.evicted[layer_idx] += in_place.mark_gone(store, cuts)
            if store.marks >= COMPACT_EVERY:
                in_place.compact(store)
            return
        kept = []
        for b, (first, hits) in enumerate(drops):
            if not hits:
                kept.append(KeptKV.from_heads(store.held(b)))
                continue
            rows = []
            for h, (k, v, p) in enumerate(store.held(b)):
                stay = ~torch.isin(p, torch.tensor([first + j for head, j in hits if head == h], dtype=p.dtype,
                                                   device=p.device))
                self.evicted[layer_idx] += int((~stay).sum())
                rows.append((k[stay], v[stay], p[stay]))
            kept.append(KeptKV.from_heads(rows))
        store.replace(kept)


def decoder_for(method: CompressionMethod, stores: list, model: ModelShape, stored_heads: int, rotation=None):
    """The cache's decode-time compressor: a threshold decoder (the method's sizing applies a threshold while
    decoding), a DecodeCompressor (decode_budget), or None."""
    threshold = method.sizing.decode_threshold()
    if threshold is not None:
        return ThresholdDecoder(method, stores, model, threshold, rotation)
    if method.decode is None:
        return None
    return DecodeCompressor(method, stores, model.num_query_heads, stored_heads, method.decode.decode_query_window,
                            rotation, model)
