"""The full-precision layer store: kept tokens in the model dtype (dense or ragged), then a dense tail.

Per prompt a `KeptKV` (flat [T, D] rows, a length per stored head: heads and prompts may keep
different counts without padding); tokens appended later go to a tail buffer [B, H, capacity, D]
that grows geometrically (no copy per step), of which the first t are held. Attention: layout.py.

Per-step eviction writes in place (core/in_place.py): TOVA's step puts the new token in the row of the token it
evicts (the kept rows are then in slot order, not position order: `in_order` False), a threshold decision marks
rows gone (masked out of the attention until `compact`). Every report (counts, positions, K/V, bytes) is of the
tokens held, in position order, whatever the slot order.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core import in_place
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.layout import DecodeLayout
from pyramidkv.core.scoring import PLAIN, probabilities
from pyramidkv.core.store import AttentionStatistics, Heads, LayerStore, Reselectable, StoreSetup

# The tail buffer grows by this many tokens, or by an eighth of its length when that is more:
# amortised O(1) appends, at most max(128 tokens, 12.5 %) of the tail allocated but unused.
TAIL_GROWTH_TOKENS = 128


class FullPrecisionStore(LayerStore, Reselectable, AttentionStatistics):
    abilities = ("reselect", "attention_statistics")

    @classmethod
    def open(cls, kept: list[KeptKV], setup: StoreSetup, layer_idx: int) -> "FullPrecisionStore":
        return cls(kept, setup.real_lens, setup.form)

    def __init__(self, kept: list[KeptKV], real_lens: list[int], form: AttentionForm = PLAIN):
        """kept: per prompt what the prefill kept; real_lens: per prompt its real (unpadded) length; form: the
        model's attention form (its logits)."""
        self.kept = kept
        self.form = form
        self.heads = len(kept[0].lengths)
        self.appended = 0
        self.tail_start = list(real_lens)  # position of each prompt's first tail token
        self.tail_len = 0
        self._buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # [B, H, capacity, D] keys, values
        self._layout: Optional[DecodeLayout] = None                       # built at the first attend
        self.keep_rows = False   # the attend keeps its attention rows (`rows`: the per-step rule reads them)
        self.by_segment = False  # ragged rows attended segment by segment (a threshold decoder's: layout.py)
        in_place.reset(self)

    # ---- growing -------------------------------------------------------------------------------
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held tail keys and values, views [B, H, t, D]."""
        if self._buffers is None:
            first = self.kept[0].keys
            empty = first.new_zeros(len(self.kept), self.heads, 0, first.shape[-1])
            return empty, empty
        keys, values = self._buffers
        return keys[:, :, :self.tail_len], values[:, :, :self.tail_len]

    def tail_capacity(self) -> int:
        """Tokens the tail buffer has room for, the held ones included."""
        return 0 if self._buffers is None else self._buffers[0].shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, rope_positions: torch.Tensor) -> None:
        bsz, heads, q_len, dim = keys.shape
        t = self.tail_len
        if self._buffers is None or t + q_len > self._buffers[0].shape[2]:
            capacity = t + q_len + max(TAIL_GROWTH_TOKENS, t // 8)
            grown = [keys.new_empty(bsz, heads, capacity, dim) for _ in range(2)]
            if t:
                grown[0][:, :, :t] = self._buffers[0][:, :, :t]
                grown[1][:, :, :t] = self._buffers[1][:, :, :t]
            self._buffers = (grown[0], grown[1])
        self._buffers[0][:, :, t:t + q_len] = keys
        self._buffers[1][:, :, t:t + q_len] = values
        self.tail_len += q_len
        self.appended += q_len

    def layout(self) -> DecodeLayout:
        """How the kept rows are read (built at the first attend, after each re-selection)."""
        if self._layout is None:
            self._layout = DecodeLayout(self.kept, self.form)
            self._layout.gone = self.gone_rows
        self._layout.keep_rows, self._layout.by_segment = self.keep_rows, self.by_segment
        return self._layout

    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        tail_gone = None if self.tail_gone is None else self.tail_gone[:, :, :self.settled]
        return self.layout().attend(queries, *self.tail(), tail_gone)

    def rows(self) -> Optional[torch.Tensor]:
        """The last attend's probabilities [B, H, g * q, L + t] float32 (slot order), if `keep_rows` asked."""
        return None if self._layout is None else self._layout.rows

    def _attention(self, queries: torch.Tensor):
        """For every prompt b and group of its heads (all of them when they keep the same count, else one
        at a time): (b, heads index, probs [h, g, q, L + t] float32, L) of the new queries [B, Hq, q, D]
        over the held tokens (causal among the new ones), g = Hq / H query heads per stored head."""
        in_place.compact(self)   # statistics align with the kept rows in position order
        tail_keys = self.tail()[0].float()  # [B, H, t, D]
        bsz, heads, t, dim = tail_keys.shape
        q_len, g = queries.shape[2], queries.shape[1] // heads
        grouped = queries.float().reshape(bsz, heads, g, q_len, dim) * dim ** -0.5
        tail_scores = self.form.cap(torch.einsum("bhgqd,bhtd->bhgqt", grouped, tail_keys))
        if q_len > 1:
            visible = torch.arange(t, device=queries.device)[None, :] <= \
                torch.arange(t - q_len, t, device=queries.device)[:, None]
            tail_scores = tail_scores.masked_fill(~visible, float("-inf"))
        for b, kept in enumerate(self.kept):
            if kept.uniform:  # all heads at once
                segments = [(slice(None), kept.keys.reshape(heads, -1, dim).float())]
            else:
                segments = [(h, k.float()[None]) for h, (k, _) in enumerate(kept.per_head())]
            for head, keys in segments:
                kept_scores = self.form.cap(torch.einsum("hgqd,hld->hgql", grouped[b, head].reshape(-1, g, q_len, dim),
                                                         keys))
                probs = probabilities(torch.cat([kept_scores, tail_scores[b, head].reshape(-1, g, q_len, t)], -1))
                yield b, head, probs, keys.shape[1]

    def received_attention(self, queries: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The attention each held token receives from the new queries [B, Hq, q, D], summed over them,
        per query head of its stored head, in float32: (per prompt [T, g] aligned with its kept rows,
        [B, H, t, g] for the tail)."""
        bsz, heads = len(self.kept), self.heads
        g, t = queries.shape[1] // heads, self.tail_len
        kept_mass, tail_mass = [[] for _ in range(bsz)], queries.new_zeros(bsz, heads, t, g, dtype=torch.float32)
        for b, head, probs, length in self._attention(queries):
            probs = probs.sum(dim=2)  # [h, g, L + t]
            kept_mass[b].append(probs[..., :length].permute(0, 2, 1).reshape(-1, g))
            tail_mass[b, head] = probs[..., length:].permute(0, 2, 1).reshape(tail_mass[b, head].shape)
        return [torch.cat(rows) for rows in kept_mass], tail_mass

    def attention_rows(self, queries: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Each new query's attention row over the held tokens, float32: (per prompt [T, g, q] for its kept
        rows, [B, H, t, g, q] for the tail, NaN where a new token is not visible yet), and [B, H, q] the
        number of tokens each query attended."""
        bsz, heads = len(self.kept), self.heads
        q_len, g, t = queries.shape[2], queries.shape[1] // heads, self.tail_len
        kept_rows = [[] for _ in range(bsz)]
        tail_rows = queries.new_zeros(bsz, heads, t, g, q_len, dtype=torch.float32)
        for b, head, probs, length in self._attention(queries):
            kept_rows[b].append(probs[..., :length].permute(0, 3, 1, 2).reshape(-1, g, q_len))
            tail_rows[b, head] = probs[..., length:].permute(0, 3, 1, 2).reshape(tail_rows[b, head].shape)
        # Query i (of q) sees the tail up to position t - q + i.
        hidden = torch.arange(t, device=queries.device)[:, None] > torch.arange(t - q_len, t, device=queries.device)
        tail_rows = tail_rows.masked_fill(hidden[:, None, :], float("nan"))
        kept = torch.tensor([k.counts() for k in self.kept], device=queries.device)              # [B, H]
        counts = kept[..., None] + torch.arange(t - q_len + 1, t + 1, device=queries.device)    # [B, H, q]
        return [torch.cat(rows) for rows in kept_rows], tail_rows, counts

    # ---- decode-time re-selection --------------------------------------------------------------
    def held(self, b: int) -> Heads:
        tail_keys, tail_values = self.tail()
        s = self.settled
        return [(torch.cat([k, tail_keys[b, h, s:]]), torch.cat([v, tail_values[b, h, s:]]), p)
                for h, ((_, k, v), p) in enumerate(zip(in_place.clean(self, b).full_width(), self.held_positions(b)))]

    def replace(self, kept: list[KeptKV], max_tail: Optional[int] = None) -> None:
        """The tail is folded into the new kept sets; a tail buffer grown beyond max_tail + TAIL_GROWTH_TOKENS
        tokens (before the first re-selection) is released."""
        self.fold(kept, self.tail_len)
        grown = self._buffers is not None and max_tail is not None
        if grown and self._buffers[0].shape[2] > max_tail + TAIL_GROWTH_TOKENS:
            self._buffers = None

    def fold(self, kept: list[KeptKV], folded: int) -> None:
        """Per prompt its new kept tokens, which took in the first `folded` tail tokens; the rest of the tail stays
        (moved to the buffer's start)."""
        t = self.tail_len
        if folded and t > folded:
            for buffer in self._buffers:
                buffer[:, :, :t - folded] = buffer[:, :, folded:t].clone()
        self.tail_start = [start + folded for start in self.tail_start]
        self.tail_len = t - folded
        self.kept = kept
        self._layout = None
        in_place.reset(self)

    def drop_before(self, first: list[int]) -> None:
        """A sliding window: every held token of prompt b at a position below first[b] leaves; the tail is folded
        into the kept rows (ThinK's thin rows stay thin)."""
        in_place.compact(self)
        tail_keys, tail_values = self.tail()
        kept = []
        for b, (k, start) in enumerate(zip(self.kept, self.tail_start)):
            positions = torch.arange(start, start + self.tail_len, device=k.positions.device, dtype=k.positions.dtype)
            kept.append(k.since(first[b], (tail_keys[b], tail_values[b], positions)))
        self.replace(kept)

    # ---- inspection ----------------------------------------------------------------------------
    def kept_counts(self) -> list[list[int]]:
        return [[n + self.settled - g for n, g in zip(k.counts(), gone)] for k, gone in zip(self.kept, self.gone)]

    def kept_positions(self, b: int) -> list[torch.Tensor]:
        return in_place.clean(self, b).all_positions()

    def kept_kv(self, b: int) -> Heads:
        """Views of the store where its rows are in position order (clone before modifying), else copies; thin keys
        (ThinK) full width with 0 in the pruned channels."""
        return in_place.clean(self, b).full_width()

    def held_counts(self) -> list[list[int]]:
        return [[n + self.tail_len - g for n, g in zip(k.counts(), gone)] for k, gone in zip(self.kept, self.gone)]

    def held_positions(self, b: int) -> list[torch.Tensor]:
        kept = in_place.clean(self, b)
        start = self.tail_start[b] + self.settled
        tail = torch.arange(start, self.tail_start[b] + self.tail_len, device=kept.positions.device,
                            dtype=kept.positions.dtype)
        return [torch.cat([p, tail]) for p in kept.all_positions()]

    def stored_kv(self, b: int) -> Heads:
        return [(p, k, v) for k, v, p in self.held(b)]

    def bytes_by_part(self, b: Optional[int] = None) -> dict[str, int]:
        first = self.kept[0].keys
        token = first.shape[-1] * first.element_size() * 2   # one token of one head, K and V
        prompts = range(len(self.kept)) if b is None else [b]
        return {"residual": sum(self.kept[i].nbytes() + (self.tail_len * self.heads - sum(self.gone[i])) * token
                                for i in prompts)}

    def capacity_bytes(self) -> int:
        return 0 if self._buffers is None else sum(t.numel() * t.element_size() for t in self._buffers)
