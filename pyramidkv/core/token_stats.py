"""Per-token attention statistics that decode-time scores read, kept aligned with each layer's held tokens.

Two statistics, chosen by the method:
  * `AccumulatedAttention` (`accumulates_attention`, H2O): per held token and query head of its stored
    head, the attention it has received from every query since it was appended (prompt tokens start
    from their prefill column sums). Row [g].
  * `AttentionHistory` (`history_window` w, Scissorhands): per held token and query head, its attention
    from each of the last w queries (the last w prompt rows at first, then one row per decode query),
    NaN where the token was not there or not visible; with `levels`, per head and row, 1 / (tokens the
    query attended), the uniform level. Row [g, w].

Rows follow the store's order: per prompt the kept rows (head-major), then the tail [B, H, t, ...].
After a re-selection the cache hands back each prompt's kept rows (`replace`).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.scoring import PLAIN, attention_column_sums, real_positions, window_attention


class TokenRows:
    """Per layer: per prompt the rows of its kept tokens (`kept`), and the tail's rows [B, H, t, ...]."""

    kept: list[Optional[list[torch.Tensor]]]
    tail: list[Optional[torch.Tensor]]
    form: AttentionForm = PLAIN   # the model's attention form, for the prefill rows

    def held(self, layer_idx: int, b: int, counts: list[int]) -> list[torch.Tensor]:
        tail = self.tail[layer_idx]
        return [torch.cat([a, tail[b, h]]) for h, a in enumerate(self.kept[layer_idx][b].split(counts))]

    def replace(self, layer_idx: int, kept: list[torch.Tensor]) -> None:
        self.kept[layer_idx] = kept
        self.tail[layer_idx] = self.tail[layer_idx][:, :, :0]


class AccumulatedAttention(TokenRows):
    def __init__(self, num_layers: int, group: int, num_query_heads: int):
        self.group, self.num_query_heads = group, num_query_heads
        self.prefill: list[Optional[torch.Tensor]] = [None] * num_layers  # [B, Hq, n]
        self.kept: list[Optional[list[torch.Tensor]]] = [None] * num_layers  # per prompt [T, g]
        self.tail: list[Optional[torch.Tensor]] = [None] * num_layers  # [B, H, t, g]

    def observe_prefill(self, layer_idx, queries, keys, raw_scores, pad_lens, pattern=None, column_sums=None) -> None:
        if column_sums is not None:  # the attention pass computed them
            raw_scores = column_sums
        elif raw_scores is None:  # every prompt kept whole: the column sums are still the starting totals
            raw_scores = attention_column_sums(queries, keys, real_positions(pad_lens, keys.shape[2], keys.device),
                                               pattern=pattern, form=self.form)
        heads = raw_scores.shape[1]
        if heads != self.num_query_heads:
            raw_scores = raw_scores.repeat_interleave(self.num_query_heads // heads, dim=1)
        self.prefill[layer_idx] = raw_scores.float()

    def start(self, layer_idx: int, store, pad_lens: list[int]) -> None:
        """Per prompt, the prefill column sums of the kept tokens, as rows aligned with its kept rows."""
        g, raw = self.group, self.prefill[layer_idx]
        per_prompt = []
        for b, pad in enumerate(pad_lens):
            rows = [raw[b, h * g:(h + 1) * g][:, positions + pad].T
                    for h, positions in enumerate(store.kept_positions(b))]
            per_prompt.append(torch.cat(rows) if rows else raw.new_zeros(0, g))
        self.kept[layer_idx] = per_prompt
        self.tail[layer_idx] = raw.new_zeros(len(per_prompt), store.heads, 0, g)
        self.prefill[layer_idx] = None

    def step(self, layer_idx: int, store, queries: torch.Tensor) -> None:
        """Add the attention of the new queries (over everything held, causal among themselves): the step's own
        float32 rows where its attention kept them (a dense store in position order: `keep_rows`), else recomputed
        in float32 by the store."""
        kept_mass, tail_mass = self.step_rows(store, queries.shape[2]) or store.received_attention(queries)
        for acc, mass in zip(self.kept[layer_idx], kept_mass):
            acc += mass
        old = self.tail[layer_idx]
        bsz, heads, _, g = old.shape
        self.tail[layer_idx] = torch.cat([old, old.new_zeros(bsz, heads, queries.shape[2], g)], dim=2) + tail_mass

    def step_rows(self, store, q_len: int):
        """(per prompt [T, g], [B, H, t, g]) the attention the new tokens gave every held token, summed over them,
        read from the rows the step's attention kept ([B, H, g * q, L + t], position order); None where it kept
        none, or not in that layout."""
        rows = store.rows() if getattr(store, "in_order", False) and not getattr(store, "marks", 0) else None
        t, g = store.tail_len, self.group
        if rows is None or rows.shape[2] != g * q_len or \
                any(not k.uniform or k.lengths[0] != rows.shape[3] - t for k in store.kept):
            return None
        bsz, heads, _, width = rows.shape
        mass = rows.view(bsz, heads, g, q_len, width).sum(dim=3)   # [B, H, g, L + t]
        length = width - t
        kept = [mass[b, :, :, :length].permute(0, 2, 1).reshape(-1, g) for b in range(bsz)]
        return kept, mass[:, :, :, length:].permute(0, 1, 3, 2)


class AttentionHistory(TokenRows):
    def __init__(self, num_layers: int, group: int, window: int):
        self.group, self.window = group, window
        self.prefill: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * num_layers
        self.kept: list[Optional[list[torch.Tensor]]] = [None] * num_layers   # per prompt [T, g, w]
        self.tail: list[Optional[torch.Tensor]] = [None] * num_layers         # [B, H, t, g, w]
        self.levels: list[Optional[torch.Tensor]] = [None] * num_layers       # [B, H, w]

    def observe_prefill(self, layer_idx, queries, keys, raw_scores, pad_lens, pattern=None, column_sums=None) -> None:
        """The last w prompt rows: attention [B, Hq, w', n] (NaN where not visible) and levels [B, w']."""
        n = keys.shape[2]
        real = real_positions(pad_lens, n, keys.device)
        rows = window_attention(queries, keys, real, self.window, pattern, form=self.form)  # [B, Hq, w', n]
        w = rows.shape[2]
        query_pos = torch.arange(n - w, n, device=keys.device)
        causal = torch.arange(n, device=keys.device)[None, :] <= query_pos[:, None]      # [w', n]
        visible = causal[None] & real[:, None, :] & real[:, n - w:, None]           # [B, w', n]; padding rows: none
        rows = rows.masked_fill(~visible[:, None], float("nan"))
        counts = visible.sum(dim=-1).float()                                       # keys each row attended
        self.prefill[layer_idx] = (rows, torch.where(counts > 0, 1.0 / counts, torch.full_like(counts, float("nan"))))

    def start(self, layer_idx: int, store, pad_lens: list[int]) -> None:
        g, w = self.group, self.window
        rows, levels = self.prefill[layer_idx]
        missing = w - rows.shape[2]  # a prompt shorter than the window: the oldest rows never were
        per_prompt = []
        for b, pad in enumerate(pad_lens):
            heads = [rows[b, h * g:(h + 1) * g][:, :, positions + pad].permute(2, 0, 1)
                     for h, positions in enumerate(store.kept_positions(b))]      # [k, g, w']
            per_prompt.append(torch.nn.functional.pad(torch.cat(heads), (missing, 0), value=float("nan")))
        self.kept[layer_idx] = per_prompt
        bsz = len(pad_lens)
        self.tail[layer_idx] = rows.new_zeros(bsz, store.heads, 0, g, w)
        self.levels[layer_idx] = torch.nn.functional.pad(levels, (missing, 0), value=float("nan"))[:, None].expand(
            bsz, store.heads, w).clone()
        self.prefill[layer_idx] = None

    def step(self, layer_idx: int, store, queries: torch.Tensor) -> None:
        """Each new query's attention row over the held tokens enters the window (the oldest row leaves)."""
        q = queries.shape[2]
        kept_rows, tail_rows, counts = store.attention_rows(queries)  # per prompt [T, g, q]; [B, H, t, g, q]; [B, H, q]
        self.kept[layer_idx] = [torch.cat([h[..., q:], r], dim=-1) for h, r in zip(self.kept[layer_idx], kept_rows)]
        old = self.tail[layer_idx]
        bsz, heads, _, g, w = old.shape
        grown = torch.cat([old, old.new_full((bsz, heads, q, g, w), float("nan"))], dim=2)
        self.tail[layer_idx] = torch.cat([grown[..., q:], tail_rows], dim=-1)
        self.levels[layer_idx] = torch.cat([self.levels[layer_idx][..., q:], 1.0 / counts.float()], dim=-1)

