"""Decode attention over full-precision kept tokens plus a dense tail, every prompt and head of a layer at once.

Either every prompt and head keeps the same count L: one batched matmul over [B, H, L, D] views.
Or the counts are ragged (AdaKV, HeadKV, prompts kept whole next to compressed ones): the layer's
rows lie flat, prompt-major then head-major, and are attended in blocks of segments (a segment =
one prompt's stored head); each block's query rows meet all of the block's key rows in one matmul
and the rows of other segments are masked out. No Python loop over heads, no padded copy. One joint
softmax (float32) over (kept, tail) per query row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.core.kept import KeptKV

# At most this many segments per block bounds the FLOPs spent on masked rows.
SEGMENTS_PER_BLOCK = 4


def softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last axis in float32 (as transformers' eager attention), back in `dtype`."""
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


@dataclass
class SegmentBlock:
    """Consecutive segments attended in one matmul. segments, rows: [start, stop) into the layer's
    segments and flat K/V rows; own_rows: bool [segments, rows], True where a row is that segment's."""

    segments: tuple[int, int]
    rows: tuple[int, int]
    own_rows: torch.Tensor


@dataclass
class DecodeLayout:
    """How one layer's kept tokens are read: dense_keys/values [B, H, L, D], or flat_keys/values [R, D]
    in blocks. Built from the prompts' KeptKV, which then hold views of the layout's tensors."""

    dense_keys: Optional[torch.Tensor] = None
    dense_values: Optional[torch.Tensor] = None
    flat_keys: Optional[torch.Tensor] = None
    flat_values: Optional[torch.Tensor] = None
    blocks: Optional[list[SegmentBlock]] = None

    @classmethod
    def build(cls, kept: list[KeptKV]) -> "DecodeLayout":
        """One tensor per layer: the prompts' K/V are moved into it (a copy only when B > 1 or the rows
        are not contiguous) and each KeptKV keeps views of it; nothing is duplicated."""
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
        lengths = [n for k in kept for n in k.lengths]  # per segment
        heads, dim = len(kept[0].lengths), flat_keys.shape[-1]
        if len(set(lengths)) == 1:
            shape = (len(kept), heads, lengths[0], dim)
            return cls(dense_keys=flat_keys.view(shape), dense_values=flat_values.view(shape))
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        blocks = []
        for first in range(0, len(lengths), SEGMENTS_PER_BLOCK):
            last = min(first + SEGMENTS_PER_BLOCK, len(lengths))
            rows = torch.arange(offsets[first], offsets[last], device=flat_keys.device)
            starts = torch.tensor(offsets[first:last], device=flat_keys.device)
            stops = torch.tensor(offsets[first + 1:last + 1], device=flat_keys.device)
            own_rows = (rows[None, :] >= starts[:, None]) & (rows[None, :] < stops[:, None])
            blocks.append(SegmentBlock((first, last), (offsets[first], offsets[last]), own_rows))
        return cls(flat_keys=flat_keys, flat_values=flat_values, blocks=blocks)

    def attend(self, queries: torch.Tensor, tail_keys: torch.Tensor, tail_values: torch.Tensor) -> torch.Tensor:
        """queries [B, Hq, q, D] of the q tokens appended last; tail_keys/values [B, H, t, D] (the q new
        tokens last). Returns [B, Hq, q, D]."""
        bsz, num_q_heads, q_len, dim = queries.shape
        heads, t = tail_keys.shape[1], tail_keys.shape[2]
        rows = num_q_heads // heads * q_len
        # Query rows of one stored head (its query heads x q tokens), pre-scaled: [B, H, rows, D].
        grouped = queries.reshape(bsz, heads, rows, dim) * dim ** -0.5
        tail_scores = torch.matmul(grouped, tail_keys.transpose(-1, -2))  # [B, H, rows, t]
        if q_len > 1:  # new token i sees the tail up to its own position
            query_pos = torch.arange(t - q_len, t, device=queries.device).repeat(num_q_heads // heads)
            visible = torch.arange(t, device=queries.device)[None, :] <= query_pos[:, None]
            tail_scores = tail_scores.masked_fill(~visible, torch.finfo(tail_scores.dtype).min)
        if self.dense_keys is not None:
            kept_scores = torch.matmul(grouped, self.dense_keys.transpose(-1, -2))  # [B, H, rows, L]
            probs = softmax(torch.cat([kept_scores, tail_scores], dim=-1), queries.dtype)
            kept = kept_scores.shape[-1]
            out = torch.matmul(probs[..., :kept], self.dense_values)
            out = out + torch.matmul(probs[..., kept:], tail_values)  # [B, H, rows, D]
            return out.reshape(bsz, num_q_heads, q_len, dim)
        grouped = grouped.reshape(bsz * heads, rows, dim)
        tail_scores = tail_scores.reshape(bsz * heads, rows, t)
        tail_values = tail_values.reshape(bsz * heads, t, dim)
        outputs = []
        for block in self.blocks:
            (first, last), (row_start, row_stop) = block.segments, block.rows
            block_queries = grouped[first:last].reshape(-1, dim)  # [S * rows, D]
            scores = torch.matmul(block_queries, self.flat_keys[row_start:row_stop].T).view(last - first, rows, -1)
            scores = scores.masked_fill(~block.own_rows[:, None, :], torch.finfo(scores.dtype).min)
            probs = softmax(torch.cat([scores, tail_scores[first:last]], dim=-1), queries.dtype)
            kept = row_stop - row_start
            out = torch.matmul(probs[..., :kept].reshape(-1, kept), self.flat_values[row_start:row_stop])
            outputs.append(out.view(last - first, rows, dim) + torch.matmul(probs[..., kept:], tail_values[first:last]))
        return torch.cat(outputs).reshape(bsz, num_q_heads, q_len, dim)
