"""Decode attention over full-precision kept tokens plus a dense tail, every prompt and head of a layer at once.

A layer's kept tokens form one or two *parts*: the full-width rows, and with ThinK the thin rows (keys
on each head's kept channels, the query gathered to those channels before the dot product; the scale
stays 1/sqrt(D)). Within a part, either every prompt and head keeps the same count L: one batched
matmul over [B, H, L, Dk] views; or the counts are ragged (AdaKV, HeadKV, prompts kept whole next to
compressed ones): the part's rows lie flat, prompt-major then head-major, and are attended in blocks
of segments (a segment = one prompt's stored head); each block's query rows meet all of the block's
key rows in one matmul and the rows of other segments are masked out (a threshold decoder's stores, whose
heads hold 128 next to 4,000 tokens: one segment at a time instead, `by_segment`; float32 CPU segments without
thin rows: every segment of the layer in one C call, pyramidkv/native/segment_attend.c). No padded copy. One
joint softmax (float32) over (thin, full, tail) per query row. Rows marked gone (a threshold
decision in place, core/in_place.py) get the lowest logit: probability 0, as if not held.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.scoring import PLAIN, probabilities
from pyramidkv.native import check, library

# At most this many segments per block bounds the FLOPs spent on masked rows.
SEGMENTS_PER_BLOCK = 4
# Ragged full-width rows are attended one segment at a time where a segment holds this many rows on average (and
# always under `by_segment`, a threshold decoder's, and wherever the segments run in C: pyramidkv/native's
# segment_attend.c, 0.76x-0.98x a dense read of the same size, docs/speed.md, Eighth pass), else in blocks. measure/ragged_attend.py, n = 4,096, one thread,
# x a dense read of the same size: AdaKV at 128 / 256 tokens a head, segments 1.53 / 1.50, blocks 1.42 / 1.45; at
# 1,024 / 2,048, segments 1.31-1.40 / 1.26, blocks 1.58-1.64 / 1.57 (docs/speed.md, Seventh pass).
SEGMENT_ROWS = 512


@dataclass
class Part:
    """One part of a layer's kept rows: keys [R, Dk] and values [R, D] flat (segment-major), lengths per
    segment; channels: long [S, Dk] the channels of each segment's keys (None: all D)."""

    keys: torch.Tensor
    values: torch.Tensor
    lengths: list[int]
    channels: Optional[torch.Tensor] = None

    @property
    def dense(self) -> bool:
        return len(set(self.lengths)) == 1

    def queries(self, grouped: torch.Tensor, first: int = 0) -> torch.Tensor:
        """grouped [S, rows, D] of segments first.. -> the queries this part's keys meet: [S, rows, Dk]."""
        if self.channels is None:
            return grouped
        channels = self.channels[first:first + grouped.shape[0]]
        return grouped.gather(-1, channels[:, None, :].expand(-1, grouped.shape[1], -1))

    def rows(self, first: int, last: int) -> tuple[int, int, torch.Tensor]:
        """(row start, row stop, own_rows bool [last - first, rows]) of segments [first, last)."""
        offsets = self.offsets
        rows = torch.arange(offsets[first], offsets[last], device=self.keys.device)
        starts = torch.tensor(offsets[first:last], device=self.keys.device)
        stops = torch.tensor(offsets[first + 1:last + 1], device=self.keys.device)
        return offsets[first], offsets[last], (rows[None, :] >= starts[:, None]) & (rows[None, :] < stops[:, None])

    def __post_init__(self) -> None:
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.offset_tensor = torch.tensor(self.offsets, dtype=torch.int64)   # for the C segment path


def _flatten(kept: list[KeptKV]) -> Part:
    """The full-width rows of all prompts in one tensor pair (a copy only when B > 1 or the rows are not
    contiguous); each KeptKV then holds views of it, so nothing is duplicated."""
    if len(kept) == 1 and kept[0].keys.is_contiguous() and kept[0].values.is_contiguous():
        flat_keys, flat_values = kept[0].keys, kept[0].values
    else:
        flat_keys = torch.cat([k.keys for k in kept])
        flat_values = torch.cat([k.values for k in kept])
        start = 0
        for k in kept:
            stop = start + k.keys.shape[0]
            k.keys, k.values = flat_keys[start:stop], flat_values[start:stop]
            start = stop
    return Part(flat_keys, flat_values, [n for k in kept for n in k.lengths])


def _flatten_thin(kept: list[KeptKV]) -> Optional[Part]:
    if kept[0].thin is None or not any(n for k in kept for n in k.thin.lengths):
        return None
    return Part(torch.cat([k.thin.keys for k in kept]), torch.cat([k.thin.values for k in kept]),
                [n for k in kept for n in k.thin.lengths], torch.cat([k.thin.channels for k in kept]))


class DecodeLayout:
    """How one layer's kept tokens are read at decode time; built from the prompts' KeptKV."""

    def __init__(self, kept: list[KeptKV], form: AttentionForm = PLAIN):
        self.batch, self.heads = len(kept), len(kept[0].lengths)
        self.form = form  # the model's attention form: its logits
        self.gone: Optional[torch.Tensor] = None   # bool [R] per full-width row: its token left (in_place.py)
        self.keep_rows = False                     # keep the dense attend's probabilities in `rows`
        self.by_segment = False                    # ragged: each segment on its own (`_attend_segments`)
        self.gone_segments: set[int] = set()       # full-width segments holding a row marked gone
        self.rows: Optional[torch.Tensor] = None   # [B, H, g * q, L + t] float32, the last dense attend's
        thin = _flatten_thin(kept)
        self.parts = ([] if thin is None else [thin]) + [_flatten(kept)]
        self.dense = all(part.dense for part in self.parts)
        self._blocks: Optional[list] = None       # ragged, attended in blocks: built at the first such attend
        self._segments: Optional[list] = None     # ragged, one segment at a time: its views, built at the first

    @property
    def blocks(self) -> list:
        """Ragged: per block of segments, each part's (row start, row stop, own_rows), rows marked gone not own."""
        if self._blocks is None:
            segments = self.batch * self.heads
            self._blocks = [] if self.dense else [
                (first, min(first + SEGMENTS_PER_BLOCK, segments),
                 [part.rows(first, min(first + SEGMENTS_PER_BLOCK, segments)) for part in self.parts])
                for first in range(0, segments, SEGMENTS_PER_BLOCK)]
            if self.gone is not None and self._blocks:
                self.mark_blocks(self.gone.nonzero()[:, 0])
        return self._blocks

    def mark(self, rows: list[int]) -> None:
        """Full-width rows (flat indices) whose tokens left: out of every block's own rows (`gone` holds them for
        the dense path), their segments noted for the segment path."""
        if not self.dense:
            offsets = self.parts[-1].offsets
            self.gone_segments.update(bisect.bisect_right(offsets, r) - 1 for r in rows)
        if self._blocks is not None:
            self.mark_blocks(torch.tensor(rows, device=self.parts[-1].keys.device))

    def mark_blocks(self, rows: torch.Tensor) -> None:
        for _, _, part_rows in self._blocks:
            start, stop, own = part_rows[-1]
            inside = rows[(rows >= start) & (rows < stop)]
            if inside.numel():
                own[:, inside - start] = False

    def attend(self, queries: torch.Tensor, tail_keys: torch.Tensor, tail_values: torch.Tensor,
               tail_gone: Optional[torch.Tensor] = None) -> torch.Tensor:
        """queries [B, Hq, q, D] of the q tokens appended last; tail_keys/values [B, H, t, D] (the q new
        tokens last); tail_gone: bool [B, H, s <= t], the tail tokens that left. Returns [B, Hq, q, D]."""
        bsz, num_q_heads, q_len, dim = queries.shape
        heads, t = tail_keys.shape[1], tail_keys.shape[2]
        rows = num_q_heads // heads * q_len
        self.rows = None   # kept by the dense path only, for this step
        # Query rows of one stored head (its query heads x q tokens), pre-scaled: [B, H, rows, D].
        grouped = queries.reshape(bsz, heads, rows, dim) * dim ** -0.5
        tail_scores = self.form.logits(grouped, tail_keys.transpose(-1, -2))  # [B, H, rows, t]
        if q_len > 1:  # new token i sees the tail up to its own position
            query_pos = torch.arange(t - q_len, t, device=queries.device).repeat(num_q_heads // heads)
            visible = torch.arange(t, device=queries.device)[None, :] <= query_pos[:, None]
            tail_scores = tail_scores.masked_fill(~visible, torch.finfo(tail_scores.dtype).min)
        if tail_gone is not None and tail_gone.shape[2]:
            tail_scores[..., :tail_gone.shape[2]].masked_fill_(tail_gone[:, :, None, :], torch.finfo(tail_scores.dtype).min)
        if self.dense:
            return self._attend_dense(grouped, tail_scores, tail_values).reshape(bsz, num_q_heads, q_len, dim)
        part = self.parts[-1]
        if len(self.parts) == 1 and _in_c(part, grouped, self.form):
            gone = self.gone if self.gone_segments else None
            return _segments_in_c(part, gone, grouped, tail_scores, tail_values).reshape(bsz, num_q_heads, q_len, dim)
        if len(self.parts) == 1 and (self.by_segment or part.keys.shape[0] >= SEGMENT_ROWS * bsz * heads):
            return self._attend_segments(grouped, tail_scores, tail_values).reshape(bsz, num_q_heads, q_len, dim)
        return self._attend_blocks(grouped, tail_scores, tail_values).reshape(bsz, num_q_heads, q_len, dim)

    def _attend_dense(self, grouped, tail_scores, tail_values) -> torch.Tensor:
        bsz, heads, rows, dim = grouped.shape
        kept_scores, kept_values = [], []
        for part in self.parts:
            shape = (bsz, heads, part.lengths[0], part.keys.shape[-1])
            part_queries = part.queries(grouped.reshape(bsz * heads, rows, dim)).reshape(bsz, heads, rows, -1)
            scores = self.form.logits(part_queries, part.keys.view(shape).transpose(-1, -2))  # [B, H, rows, L]
            if part.channels is None and self.gone is not None:
                scores = scores.masked_fill(self.gone.view(bsz, heads, 1, -1), torch.finfo(scores.dtype).min)
            kept_scores.append(scores)
            kept_values.append(part.values.view(bsz, heads, part.lengths[0], dim))
        probs = probabilities(torch.cat([*kept_scores, tail_scores], dim=-1))
        if self.keep_rows:
            self.rows = probs
        probs = probs.to(grouped.dtype)
        out, start = None, 0
        for scores, values in zip(kept_scores, kept_values):
            stop = start + scores.shape[-1]
            term = torch.matmul(probs[..., start:stop], values)
            out = term if out is None else out + term
            start = stop
        return out + torch.matmul(probs[..., start:], tail_values)  # [B, H, rows, D]

    def _attend_segments(self, grouped, tail_scores, tail_values) -> torch.Tensor:
        """Ragged full-width rows (no thin part), one segment at a time: its queries meet its own rows only. At a
        threshold decoder's raggedness (heads of 128 next to heads of 4,000 tokens) the blocks' masked rows cost
        more than the extra calls (docs/speed.md, "Sixth pass")."""
        bsz, heads, rows, dim = grouped.shape
        part = self.parts[0]
        if self._segments is None:   # per segment (row start, keys^T [D, L_s], values [L_s, D])
            self._segments = [(start, keys.T, values) for start, keys, values in
                              zip(part.offsets, part.keys.split(part.lengths), part.values.split(part.lengths))]
        out = torch.empty_like(grouped)
        for s, (queries, tail, tail_v, (start, keys_t, values), into) in enumerate(zip(
                grouped.view(-1, rows, dim), tail_scores.view(bsz * heads, rows, -1),
                tail_values.view(bsz * heads, -1, dim), self._segments, out.view(-1, rows, dim))):
            scores = self.form.logits(queries, keys_t)   # [rows, L_s], a new tensor: masked in place
            length = scores.shape[1]
            if s in self.gone_segments:
                scores.masked_fill_(self.gone[start:start + length], torch.finfo(scores.dtype).min)
            probs = probabilities(torch.cat([scores, tail], dim=-1), dtype=grouped.dtype)
            torch.addmm(torch.matmul(probs[:, length:], tail_v), probs[:, :length], values, out=into)
        return out

    def _attend_blocks(self, grouped, tail_scores, tail_values) -> torch.Tensor:
        bsz, heads, rows, dim = grouped.shape
        segments = bsz * heads
        grouped = grouped.reshape(segments, rows, dim)
        tail_scores = tail_scores.reshape(segments, rows, -1)
        tail_values = tail_values.reshape(segments, -1, dim)
        outputs = []
        for first, last, part_rows in self.blocks:
            scores, spans = [], []
            for part, (row_start, row_stop, own_rows) in zip(self.parts, part_rows):
                block_queries = part.queries(grouped[first:last], first).reshape(-1, part.keys.shape[-1])  # [S * rows, Dk]
                block = self.form.logits(block_queries, part.keys[row_start:row_stop].T).view(last - first, rows, -1)
                scores.append(block.masked_fill(~own_rows[:, None, :], torch.finfo(block.dtype).min))
                spans.append((row_start, row_stop))
            probs = probabilities(torch.cat([*scores, tail_scores[first:last]], dim=-1), dtype=grouped.dtype)
            out, start = None, 0
            for part, (row_start, row_stop) in zip(self.parts, spans):
                kept = row_stop - row_start
                term = torch.matmul(probs[..., start:start + kept].flatten(0, 1), part.values[row_start:row_stop])
                out = term if out is None else out + term
                start += kept
            tail = torch.matmul(probs[..., start:], tail_values[first:last])
            outputs.append(out.view(last - first, rows, dim) + tail)
        return torch.cat(outputs)


def _in_c(part: Part, grouped: torch.Tensor, form: AttentionForm) -> bool:
    """Whether the segment path runs in C (pyramidkv/native/segment_attend.c): float32 on the CPU, logits not
    soft-capped, and the kernels built."""
    return (grouped.device.type == "cpu" and grouped.dtype == part.keys.dtype == torch.float32 and not form.capped
            and library() is not None)


def _segments_in_c(part: Part, gone: Optional[torch.Tensor], grouped: torch.Tensor, tail_scores: torch.Tensor,
                   tail_values: torch.Tensor) -> torch.Tensor:
    """The segment path in one call: grouped [B, H, rows, D], tail_scores [B, H, rows, t] (the tail's logits, masked),
    tail_values [B, H, t, D]; gone: bool [R] or None. Same logits, float32 softmax and products as the torch ops."""
    keys, values = part.keys.contiguous(), part.values.contiguous()
    gone = None if gone is None else gone.contiguous()
    queries, tail_scores = grouped.contiguous(), tail_scores.float().contiguous()
    tail_values = tail_values.contiguous()
    bsz, heads, rows, dim = queries.shape
    out = torch.empty_like(queries)
    check(library().pk_segment_attend(queries.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                      part.offset_tensor.data_ptr(), None if gone is None else gone.data_ptr(),
                                      tail_scores.data_ptr(), tail_values.data_ptr(), bsz * heads, rows, dim,
                                      tail_values.shape[2], out.data_ptr()))
    return out
