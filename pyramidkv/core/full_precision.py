"""The full-precision layer store: kept tokens in the model dtype (dense or ragged), then a dense tail.

Per prompt a `KeptKV` (flat [T, D] rows, a length per stored head: heads and prompts may keep
different counts without padding); tokens appended later go to a tail buffer [B, H, capacity, D]
that grows geometrically (no copy per step), of which the first t are held. Attention: layout.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.core.kept import KeptKV
from pyramidkv.core.layout import DecodeLayout
from pyramidkv.core.store import Heads, LayerStore

# The tail buffer grows by this many tokens, or by an eighth of its length when that is more:
# amortised O(1) appends, at most max(128 tokens, 12.5 %) of the tail allocated but unused.
TAIL_GROWTH_TOKENS = 128


class FullPrecisionStore(LayerStore):
    def __init__(self, kept: list[KeptKV], real_lens: list[int]):
        """kept: per prompt what the prefill kept; real_lens: per prompt its real (unpadded) length."""
        self.kept = kept
        self.heads = len(kept[0].lengths)
        self.appended = 0
        self.tail_start = list(real_lens)  # position of each prompt's first tail token
        self.tail_len = 0
        self._buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # [B, H, capacity, D] keys, values
        self._layout: Optional[DecodeLayout] = None                       # built at the first attend
        self._history = [[k.nbytes() for k in kept]]                      # per appended count, per prompt

    # ---- growing -------------------------------------------------------------------------------
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held tail keys and values, views [B, H, t, D]."""
        if self._buffers is None:
            first = self.kept[0].keys
            empty = first.new_zeros(len(self.kept), self.heads, 0, first.shape[-1])
            return empty, empty
        keys, values = self._buffers
        return keys[:, :, :self.tail_len], values[:, :, :self.tail_len]

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
        row = heads * dim * keys.element_size() * 2
        for i in range(1, q_len + 1):
            self._history.append([k.nbytes() + (t + i) * row for k in self.kept])

    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        if self._layout is None:
            self._layout = DecodeLayout.build(self.kept)
        return self._layout.attend(queries, *self.tail())

    def received_attention(self, queries: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The attention each held token receives from the new queries [B, Hq, q, D] (causal among them),
        summed over the q queries, per query head of its stored head (g = Hq / H), in float32:
        (per prompt [T, g] aligned with its kept rows, [B, H, t, g] for the tail)."""
        tail_keys = self.tail()[0].float()  # [B, H, t, D]
        bsz, heads, t, dim = tail_keys.shape
        q_len, g = queries.shape[2], queries.shape[1] // heads
        grouped = queries.float().reshape(bsz, heads, g, q_len, dim) * dim ** -0.5
        tail_scores = torch.einsum("bhgqd,bhtd->bhgqt", grouped, tail_keys)
        if q_len > 1:
            visible = torch.arange(t, device=queries.device)[None, :] <= \
                torch.arange(t - q_len, t, device=queries.device)[:, None]
            tail_scores = tail_scores.masked_fill(~visible, float("-inf"))
        kept_mass, tail_mass = [], tail_keys.new_zeros(bsz, heads, t, g)
        for b, kept in enumerate(self.kept):
            if kept.uniform:  # all heads at once
                segments = [(slice(None), kept.keys.reshape(heads, -1, dim).float())]
            else:
                segments = [(h, k.float()[None]) for h, (k, _) in enumerate(kept.per_head())]
            rows = []
            for head, keys in segments:
                kept_scores = torch.einsum("hgqd,hld->hgql", grouped[b, head].reshape(-1, g, q_len, dim), keys)
                probs = torch.softmax(torch.cat([kept_scores, tail_scores[b, head].reshape(-1, g, q_len, t)], -1),
                                      dim=-1).sum(dim=2)  # [h, g, L + t]
                length = keys.shape[1]
                rows.append(probs[..., :length].permute(0, 2, 1).reshape(-1, g))
                tail_mass[b, head] = probs[..., length:].permute(0, 2, 1).reshape(tail_mass[b, head].shape)
            kept_mass.append(torch.cat(rows))
        return kept_mass, tail_mass

    # ---- decode-time re-selection --------------------------------------------------------------
    def held(self, b: int) -> Heads:
        tail_keys, tail_values = self.tail()
        kept = self.kept[b]
        start = self.tail_start[b]
        tail_positions = torch.arange(start, start + self.tail_len, device=kept.positions.device,
                                      dtype=kept.positions.dtype)
        return [(torch.cat([k, tail_keys[b, h]]), torch.cat([v, tail_values[b, h]]), torch.cat([p, tail_positions]))
                for h, ((k, v), p) in enumerate(zip(kept.per_head(), kept.positions_per_head()))]

    def replace(self, kept: list[KeptKV], max_tail: Optional[int] = None) -> None:
        """The tail is folded into the new kept sets; a tail buffer grown beyond max_tail + TAIL_GROWTH_TOKENS
        tokens (before the first re-selection) is released."""
        self.tail_start = [start + self.tail_len for start in self.tail_start]
        self.tail_len = 0
        self.kept = kept
        self._layout = None
        grown = self._buffers is not None and max_tail is not None
        if grown and self._buffers[0].shape[2] > max_tail + TAIL_GROWTH_TOKENS:
            self._buffers = None
        self._history[-1] = [k.nbytes() for k in kept]

    # ---- inspection ----------------------------------------------------------------------------
    def kept_counts(self) -> list[list[int]]:
        return [list(k.lengths) for k in self.kept]

    def kept_positions(self, b: int) -> list[torch.Tensor]:
        return self.kept[b].positions_per_head()

    def kept_kv(self, b: int) -> Heads:
        """Views of the store: clone before modifying."""
        kept = self.kept[b]
        return [(p, k, v) for p, (k, v) in zip(kept.positions_per_head(), kept.per_head())]

    def held_counts(self) -> list[list[int]]:
        return [[n + self.tail_len for n in k.lengths] for k in self.kept]

    def held_positions(self, b: int) -> list[torch.Tensor]:
        return [p for _, _, p in self.held(b)]

    def stored_kv(self, b: int) -> Heads:
        return [(p, k, v) for k, v, p in self.held(b)]

    def bytes_by_part(self, b: Optional[int] = None, appended: Optional[int] = None) -> dict[str, int]:
        per_prompt = self._history[self.appended if appended is None else appended]
        return {"residual": sum(per_prompt) if b is None else per_prompt[b]}

    def capacity_bytes(self) -> int:
        return 0 if self._buffers is None else sum(t.numel() * t.element_size() for t in self._buffers)
