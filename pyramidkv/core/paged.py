"""The paged layer store: Quest's decode attention over the top pages of a full-precision store.

It holds exactly what a `FullPrecisionStore` holds (kept rows + tail; nothing is evicted) plus a
`PageTable` (pages.py) over each segment's held tokens, updated on every append and rebuilt after a
decode-time re-selection. Each decode step, per segment and query head (or per stored head with a
group-reduced selection), the K best pages by U_p are chosen and the new query attends exactly over
their tokens, gathered from the kept rows and the tail ([S, rows, K * S, D]); when every segment would
take all its pages the step is the full-precision store's own dense attention (the same bits). Several new
tokens (a question in one forward) are attended at once (`_attend_piece`): query i scores the pages held at its
step by their bounds as they were then (`PageTable.extend`), takes its K best, and its softmax runs over those
pages' tokens in the one-token order (logits over every held token once, gathered per query): what it would get fed
alone, to float rounding.

Bytes: held = K/V rows + page metadata (`bytes_by_part` adds "page_metadata"); read per step
(`read_bytes`) = the K/V of the union of the chosen pages' tokens + all page metadata (read to score
the pages), or the K/V held when the step attended densely; for a piece of several tokens, the union over its
queries (what the one-token steps would read in all; the piece computes logits over every held token).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.scoring import PLAIN, probabilities
from pyramidkv.core.store import StoreSetup
from pyramidkv.core.pages import (PageSettings, PageTable, PieceBounds, bound_scores, choose_pages, page_tokens,
                                  pages_to_attend, tokens_read)


class PagedStore(FullPrecisionStore):
    # Attention reads only the chosen pages: statistics over every held token would count attention never computed.
    abilities = ("reselect",)
    # A piece of new tokens is attended at once, each query choosing its pages among those held at its step; its
    # per-query page bounds [S, q, J, D] and logits over every held token [S, g, q, n] grow with q: 128 at a time.
    max_piece = 128

    @classmethod
    def open(cls, kept: list[KeptKV], setup: StoreSetup, layer_idx: int) -> FullPrecisionStore:
        """Layers below the unit's dense layers attend densely: they get a full-precision store."""
        pages = setup.method.pages
        if layer_idx < pages.page_dense_layers:
            return FullPrecisionStore(kept, setup.real_lens, setup.form)
        settings = PageSettings(pages.page_size, pages.page_min_count, pages.page_keep_last, pages.page_selection)
        return cls(kept, setup.real_lens, settings, [pages.budget_for(n) for n in setup.real_lens], setup.form)

    def __init__(self, kept: list[KeptKV], real_lens: list[int], settings: PageSettings, budgets: list[int],
                 form: AttentionForm = PLAIN):
        """budgets: per prompt, the tokens of the pages each of its segments attends per step; form: the model's
        attention form (its logits)."""
        super().__init__(kept, real_lens, form)
        self.settings = settings
        self.budgets = torch.tensor(budgets, device=kept[0].keys.device).repeat_interleave(self.heads)  # [S]
        self.table = self._table()
        self.last_read: Optional[list[int]] = None                # per prompt, bytes the last attend read
        self.chosen_pages: Optional[torch.Tensor] = None          # [S, r, K] pages of the last query (-1: none)
        self._piece: Optional[PieceBounds] = None                 # the last append's, when it took several tokens

    def _table(self) -> PageTable:
        tail_keys = self.tail()[0]
        keys = [torch.cat([k, tail_keys[b, h]]) for b, kept in enumerate(self.kept)
                for h, (k, _) in enumerate(kept.per_head())]
        return PageTable(self.settings.size, keys)

    def _metadata_per_prompt(self) -> list[int]:
        return self.table.segment_bytes().view(len(self.kept), self.heads).sum(dim=1).tolist()

    # ---- growing -------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, rope_positions: torch.Tensor) -> None:
        bsz, heads, q_len, dim = keys.shape
        super().append(keys, values, rope_positions)
        if q_len == 1:
            self._piece = None
            self.table.append(keys.reshape(bsz * heads, dim))
        else:
            self._piece = self.table.extend(keys.reshape(bsz * heads, q_len, dim))

    def replace(self, kept: list[KeptKV], max_tail: Optional[int] = None) -> None:
        super().replace(kept, max_tail)
        self.table = self._table()

    # ---- attention -----------------------------------------------------------------------------
    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        if queries.shape[2] > 1:
            return self._attend_piece(queries)
        bsz, num_q_heads, _, dim = queries.shape
        segments = bsz * self.heads
        g = num_q_heads // self.heads
        pages = self.table.pages()
        count = pages_to_attend(pages, self.budgets, self.settings)
        held_bytes = self.table.counts * 2 * dim * queries.element_size()
        if bool((count >= pages).all()):  # every page of every segment: plain dense attention
            self.chosen_pages = None
            self.last_read = held_bytes.view(bsz, self.heads).sum(dim=1).tolist()
            return super().attend(queries)
        grouped = queries.reshape(segments, g, dim)
        scores = self.table.criticality(grouped)                               # [S, g, P]
        if self.settings.selection == "group_max":
            scores = scores.amax(dim=1, keepdim=True)
        elif self.settings.selection == "group_mean":
            scores = scores.mean(dim=1, keepdim=True)
        chosen, valid = choose_pages(scores, pages, count, self.settings.keep_last)
        self.chosen_pages = chosen.masked_fill(~valid, -1)
        tokens, visible = page_tokens(chosen, valid, self.table.counts, self.settings.size)
        keys, values = self._gather(tokens)                                    # [S, r, T, D]
        logits = torch.einsum("sgd,srtd->sgt" if keys.shape[1] == 1 else "sgd,sgtd->sgt", grouped * dim ** -0.5, keys)
        logits = self.form.cap(logits)
        logits = logits.masked_fill(~visible.expand_as(logits), float("-inf"))
        probs = probabilities(logits, dtype=queries.dtype)
        out = torch.einsum("sgt,srtd->sgd" if values.shape[1] == 1 else "sgt,sgtd->sgd", probs, values)
        read = tokens_read(chosen, valid, self.table.counts, self.settings.size) * 2 * dim * queries.element_size()
        read = read + self.table.segment_bytes()
        self.last_read = read.view(bsz, self.heads).sum(dim=1).tolist()
        return out.reshape(bsz, num_q_heads, 1, dim)

    def _attend_piece(self, queries: torch.Tensor) -> torch.Tensor:
        """Queries [B, Hq, q, D] of the piece the last append took: query i chooses its pages as it would alone, over
        the pages and bounds of the n_i = n_0 + i + 1 tokens held at its step (causal among the new tokens), and its
        softmax runs over its pages' tokens in the order the one-token step uses (the same float32 rounding)."""
        bsz, num_q_heads, q_len, dim = queries.shape
        segments, g, piece, size = bsz * self.heads, num_q_heads // self.heads, self._piece, self.settings.size
        held = self.table.counts[:, None] - q_len + torch.arange(1, q_len + 1, device=queries.device)  # n_i [S, q]
        pages = (held + size - 1) // size
        count = pages_to_attend(pages, self.budgets[:, None], self.settings)
        dense = (count >= pages).all(dim=0)                                    # [q]: the one-token step is dense
        if bool(dense.all()):
            self.chosen_pages, self._piece = None, None
            self.last_read = (self.table.counts * 2 * dim * queries.element_size()).view(bsz, -1).sum(1).tolist()
            return super().attend(queries)
        grouped = queries.reshape(segments, g, q_len, dim)
        scores = self.table.criticality(grouped.reshape(segments, g * q_len, dim)).view(segments, g, q_len, -1)
        width = scores.shape[-1]
        touched = bound_scores(grouped, piece.mins, piece.maxs).masked_fill(~piece.exists[:, None], float("-inf"))
        at = (piece.first[:, None] + torch.arange(touched.shape[-1], device=queries.device)).clamp(max=width)
        scores = torch.cat([scores, scores.new_full((segments, g, q_len, 1), float("-inf"))], -1)
        scores = scores.scatter(-1, at[:, None, None].expand_as(touched), touched)[..., :width]
        if self.settings.selection == "group_max":
            scores = scores.amax(dim=1, keepdim=True)
        elif self.settings.selection == "group_mean":
            scores = scores.mean(dim=1, keepdim=True)
        rows = scores.shape[1]
        chosen, valid = choose_pages(scores.transpose(1, 2).reshape(segments * q_len, rows, width), pages.flatten(),
                                     count.flatten(), self.settings.keep_last)
        self.chosen_pages = chosen.masked_fill(~valid, -1).view(segments, q_len, rows, -1)[:, -1]
        tokens, visible = page_tokens(chosen, valid, held.flatten(), size)        # [S q, r, T]
        in_order = torch.arange(tokens.shape[-1], device=queries.device)       # a dense step reads in held order
        tokens = torch.where(dense.repeat(segments)[:, None, None], in_order, tokens)
        visible = torch.where(dense.repeat(segments)[:, None, None], in_order < held.view(-1, 1, 1), visible)
        tokens = tokens.view(segments, q_len, rows, -1).transpose(1, 2).expand(-1, g, -1, -1)  # [S, g, q, T]
        visible = visible.view(segments, q_len, rows, -1).transpose(1, 2).expand(-1, g, -1, -1)
        n = int(self.table.counts.max())
        keys, values = (kv[:, 0] for kv in self._gather(torch.arange(n, device=queries.device).expand(segments, 1, n)))
        logits = self.form.cap(torch.einsum("sgqd,snd->sgqn", grouped * dim ** -0.5, keys))
        index = tokens.clamp(max=n - 1)
        logits = logits.gather(-1, index).masked_fill(~visible, float("-inf"))
        probs = probabilities(logits, dtype=queries.dtype)
        spread = probs.new_zeros(segments, g, q_len, n).scatter_add_(-1, index, probs)
        out = torch.einsum("sgqn,snd->sgqd", spread, values)
        valid = valid.expand_as(chosen).reshape(segments, -1, chosen.shape[-1])
        read = tokens_read(chosen.view(segments, -1, chosen.shape[-1]), valid, self.table.counts, size)
        read = read * 2 * dim * queries.element_size() + self.table.segment_bytes()
        self.last_read = read.view(bsz, -1).sum(1).tolist()
        self._piece = None
        return out.reshape(bsz, num_q_heads, q_len, dim)

    def _gather(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [S, r, T, D] of held indices tokens [S, r, T] (kept rows first, then the tail)."""
        part = self.layout().parts[-1]
        kept_len = torch.tensor(part.lengths, device=tokens.device)[:, None, None]
        starts = torch.tensor(part.offsets[:-1], device=tokens.device)[:, None, None]
        tail_keys, tail_values = self.tail()
        segments, t = tokens.shape[0], tail_keys.shape[2]
        tail_keys = tail_keys.reshape(segments, t, -1)
        tail_values = tail_values.reshape(segments, t, -1)
        in_kept = (tokens < kept_len)[..., None]
        rows = (starts + tokens).clamp(max=part.keys.shape[0] - 1)
        seg = torch.arange(segments, device=tokens.device)[:, None, None]
        tail_rows = (tokens - kept_len).clamp(0, max(t - 1, 0))
        keys = torch.where(in_kept, part.keys[rows], tail_keys[seg, tail_rows])
        values = torch.where(in_kept, part.values[rows], tail_values[seg, tail_rows])
        return keys, values

    # ---- inspection ----------------------------------------------------------------------------
    def bytes_by_part(self, b: Optional[int] = None) -> dict[str, int]:
        parts = super().bytes_by_part(b)
        metadata = self._metadata_per_prompt()
        parts["page_metadata"] = sum(metadata) if b is None else metadata[b]
        return parts

    def read_bytes(self, b: Optional[int] = None) -> int:
        if self.last_read is None:
            return super().bytes_by_part(b)["residual"]
        return sum(self.last_read) if b is None else self.last_read[b]
