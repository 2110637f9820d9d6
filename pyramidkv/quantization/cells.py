"""Decode attention over a stack of plain G-token groups (KIVI's: no codebook, outliers, low-rank term or
positions) read as one grid [S, M] of cells, segment-major: cell (s, m) is segment s's m-th group in time
order, so a segment's groups are one run of M * G tokens and the value product is one matmul per segment
(S of them, over M * G tokens) instead of one per group. The stack's rows are that grid already when every
segment quantized the same number of groups and none was pushed since (a prefill whose heads keep the same
count); otherwise its codes, scales and zeros are gathered into grid order, into scratch, at each read (bytes
of codes, not floats: nothing derived is kept between steps). Empty cells (a segment with fewer than M
groups) read row 0 and are masked in the scores, so their probabilities are 0.

  scores [S, rows, M * G]   per cell one product of the query scaled by the group's per-channel scales with
                            the levels, plus the query . zeros bias (the keys' fold, kernels.py)
  values [S, rows, D]       per channel group j, (probs * scale[:, j]) @ levels[:, group j] + probs @ zero[:, j]

On the CPU the C kernels (native.py) read the grid instead, the same products, cell by cell through `order`.
Levels come through kernels.py's byte table; the values' are unpacked channel group first ([S, J, M * G, G'])
so that each group's product reads contiguous rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.quantization import native
from pyramidkv.quantization.block import QuantizedBlock
from pyramidkv.quantization.kernels import unpack_levels


@dataclass(frozen=True)
class CellGrid:
    """A stack's plain key and value blocks (rows [R]), where each cell of the [S, M] grid is among their rows
    (None: cell i is row i) and which cells are empty."""

    keys: QuantizedBlock             # [R, G, D], channel layout
    values: QuantizedBlock           # [R, G, D], token layout
    segments: int
    most: int
    order: Optional[torch.Tensor]    # long [S * M]: the stack row of each cell (empty cells: 0), or None
    empty: Optional[torch.Tensor]    # bool [S, M] or None (no empty cell)

    def scores(self, queries: torch.Tensor, scratch=None, cap=None) -> torch.Tensor:
        return grid_scores(self, self.keys, queries, scratch, cap)

    def values_of(self, probs: torch.Tensor, scratch=None) -> torch.Tensor:
        return grid_values(self, self.values, probs, scratch)


def plain(block: QuantizedBlock) -> bool:
    """Whether a stacked block reads through the grid: uniform levels in whole bytes per group, nothing else."""
    return (block.codebook is None and block.outlier_index is None and block.left is None
            and block.group_size % (8 // block.nbits) == 0)


def grid_of(keys: QuantizedBlock, values: QuantizedBlock, segment: torch.Tensor, slot: torch.Tensor,
            count: torch.Tensor, most: int) -> CellGrid:
    """The grid of a stack whose row i holds group slot[i] of segment segment[i]; count [S]: groups per segment."""
    segments = count.shape[0]
    cell = segment * most + slot
    if cell.shape[0] == segments * most and bool((cell == torch.arange(cell.shape[0], device=cell.device)).all()):
        return CellGrid(keys, values, segments, most, None, None)
    order = torch.zeros(segments * most, dtype=torch.long, device=cell.device)
    order[cell] = torch.arange(cell.shape[0], device=cell.device)
    empty = torch.arange(most, device=cell.device) >= count.unsqueeze(1)
    return CellGrid(keys, values, segments, most, order, empty if bool(empty.any()) else None)


def _take(scratch, name: str, device: torch.device):
    return None if scratch is None else (lambda key, shape, dtype: scratch.take(name + key, shape, dtype, device))


def _in_grid(grid: CellGrid, block: QuantizedBlock, scratch, name: str) -> tuple[torch.Tensor, ...]:
    """(codes, scale, zero) of the block's rows in grid order: views when the stack is the grid, else gathered."""
    parts = (block.codes, block.scale, block.zero)
    if grid.order is None:
        return parts
    take = _take(scratch, name, block.codes.device)
    out = []
    for key, t in zip(("codes", "scale", "zero"), parts):
        shape = (grid.order.shape[0], *t.shape[1:])
        buffer = torch.empty(shape, dtype=t.dtype, device=t.device) if take is None else take(key, shape, t.dtype)
        out.append(torch.index_select(t, 0, grid.order, out=buffer))
    return tuple(out)


def grid_scores(grid: CellGrid, keys: QuantizedBlock, queries: torch.Tensor, scratch=None, cap=None) -> torch.Tensor:
    """queries [S, rows, D] (scaled) . the stacked keys (channel layout, rows [S * M] in grid order) -> float32
    [S, rows, M * G], tokens in time order, through `cap` (the model's logit soft-cap) where given, then empty
    cells at the lowest float."""
    segs, most = grid.segments, grid.most
    _, g, dim = keys.shape
    rows = queries.shape[1]
    if native.reads(keys):
        out = native.key_scores(keys.codes, keys.scale, keys.zero, queries, most, g, keys.nbits, _order(grid))
        return _capped_and_masked(grid, out, cap)
    codes, scale, zero = _in_grid(grid, keys, scratch, "grid.keys.")            # [S*M, D, G/per], [S*M, D, 1] x 2
    levels = unpack_levels(codes, keys.nbits, scratch=scratch)                 # [S*M, D, G]
    q = queries.float()
    shape = (segs, most, rows, dim)
    scaled = torch.empty(shape, device=q.device) if scratch is None else scratch.take("grid.queries", shape,
                                                                                       torch.float32, q.device)
    torch.mul(q.unsqueeze(1), scale.view(segs, most, 1, dim), out=scaled)      # fp16 scales promoted
    bias = torch.bmm(zero.view(segs, most, dim).float(), q.transpose(1, 2))    # [S, M, rows]
    raw = torch.bmm(scaled.view(segs * most, rows, dim), levels)               # [S*M, rows, G]
    out = torch.empty(segs, rows, most, g, device=q.device)
    torch.add(raw.view(segs, most, rows, g).transpose(1, 2), bias.transpose(1, 2).unsqueeze(-1), out=out)
    return _capped_and_masked(grid, out.view(segs, rows, most * g), cap)


def _capped_and_masked(grid: CellGrid, scores: torch.Tensor, cap) -> torch.Tensor:
    """scores [S, rows, M * G] through the soft-cap where given, then empty cells at the lowest float."""
    out = scores if cap is None else cap(scores)
    if grid.empty is not None:
        out.view(grid.segments, out.shape[1], grid.most, -1).masked_fill_(grid.empty[:, None, :, None],
                                                                            torch.finfo(torch.float32).min)
    return out


_IDENTITY: dict[torch.device, torch.Tensor] = {}


def _order(grid: CellGrid) -> torch.Tensor:
    """The stack row of each cell (long [S * M]): grid.order, or the identity where the stack is the grid."""
    if grid.order is not None:
        return grid.order
    device, cells = grid.keys.codes.device, grid.segments * grid.most
    if device not in _IDENTITY or _IDENTITY[device].numel() < cells:
        _IDENTITY[device] = torch.arange(max(cells, 2 * _IDENTITY.get(device, torch.empty(0)).numel()),
                                         device=device)
    return _IDENTITY[device][:cells]


def grid_values(grid: CellGrid, values: QuantizedBlock, probs: torch.Tensor, scratch=None) -> torch.Tensor:
    """probs [S, rows, M * G] (cells in grid order) @ the stacked values (token layout) -> float32 [S, rows, D].
    The levels are unpacked channel group first, [S, J, M * G, G'] (G' channels a group): each group's product
    is then a matmul over contiguous rows."""
    segs, most = grid.segments, grid.most
    _, row_tokens, dim = values.shape
    g = values.group_size                                                      # channels per group
    groups, tokens, rows = dim // g, most * row_tokens, probs.shape[1]
    if native.reads(values):
        return native.weighted_values(values.codes, values.scale, values.zero, probs, most, row_tokens, g,
                                      values.nbits, _order(grid))
    codes, scale, zero = _in_grid(grid, values, scratch, "grid.values.")       # [S*M, G, D/per], [S*M, G, J] x 2
    codes = codes.reshape(segs, tokens, groups, -1).transpose(1, 2)            # [S, J, T, g/per] (a view)
    levels = unpack_levels(codes, values.nbits, scratch=scratch)               # [S, J, T, g]
    p = probs.float()
    shape = (segs, groups, rows, tokens)
    scaled = torch.empty(shape, device=p.device) if scratch is None else scratch.take("grid.probs", shape,
                                                                                       torch.float32, p.device)
    torch.mul(p.unsqueeze(1), scale.view(segs, tokens, groups).transpose(1, 2).float().unsqueeze(2), out=scaled)
    offset = torch.bmm(p, zero.view(segs, tokens, groups).float())             # [S, rows, J]
    out = torch.baddbmm(offset.transpose(1, 2).reshape(segs * groups, rows, 1),          # [S*J, rows, g]
                        scaled.view(segs * groups, rows, tokens), levels.view(segs * groups, tokens, g))
    return out.view(segs, groups, rows, g).transpose(1, 2).reshape(segs, rows, dim)
