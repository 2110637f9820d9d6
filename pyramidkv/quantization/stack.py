"""Quantized storage over time: the blocks a cache quantizes at prefill (`PrefillGroup`), the stack of
G-token groups that attention reads as one block (`DecodeBlocks`: the groups quantized while decoding,
after those of the prefill blocks that split into groups), and the bytes each segment (one prompt's stored
head) stores, by part, after every appended token (`ByteLedger`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from pyramidkv.quantization.block import QuantizedBlock
from pyramidkv.quantization.cells import CellGrid, grid_of, plain
from pyramidkv.quantization.kernels import dequantize_span

# The parts of quantized storage, in the order bytes are reported ("residual": full-precision rows;
# "channels": ThinK's kept-channel index sets).
BYTE_PARTS = ("codes", "scales", "zeros", "codebook", "outliers", "factors", "positions", "channels", "residual")


@dataclass
class PrefillGroup:
    """The prefill-quantized tokens of some segments of one prompt that all quantized the same count T."""

    segments: torch.Tensor                 # long [n]
    keys: QuantizedBlock                   # [n, T, D]
    values: QuantizedBlock
    positions: Optional[torch.Tensor]      # int32 [n, T] RoPE positions (keys stored before RoPE), else None
    channels: Optional[torch.Tensor] = None  # long [n, D'] the key channels of thin keys (ThinK), else None

    def queries(self, grouped: torch.Tensor) -> torch.Tensor:
        """grouped [n, rows, D] -> the queries the group's keys meet (thin keys: the kept channels)."""
        if self.channels is None:
            return grouped
        return grouped.gather(-1, self.channels[:, None, :].expand(-1, grouped.shape[1], -1))

    @property
    def tokens(self) -> int:
        return self.keys.shape[1]


def per_row_bytes(block: QuantizedBlock) -> dict[str, int]:
    """Bytes one leading row (segment) of the block stores, by part (the shared codebook not included)."""
    def size(*tensors) -> int:
        return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)

    return {"codes": size(block.codes), "scales": size(block.scale), "zeros": size(block.zero),
            "outliers": size(block.outlier_index, block.outlier_value), "factors": size(block.left, block.right)}


def splits(block: QuantizedBlock) -> bool:
    """Whether the block splits into blocks of G tokens that store exactly its bytes: no outliers (chosen over
    whole rows or heads), no low-rank term and no codebook (one per block), and key groups of whole bytes."""
    whole_bytes = block.layout == "token" or block.group_size * block.nbits % 8 == 0
    return block.outlier_index is None and block.left is None and block.codebook is None and whole_bytes


def split_groups(block: QuantizedBlock) -> QuantizedBlock:
    """[N, J * G, D] -> [N * J, G, D]: row n * J + j is tokens [j * G, (j + 1) * G) of head n (`splits` must hold)."""
    n, tokens, dim = block.shape
    groups = tokens // block.group_size
    if groups == 1:
        return block
    if not splits(block):
        raise ValueError("a block with outliers, a low-rank term, a codebook or keys groups that split a byte "
                         "does not split into groups")
    if block.layout == "channel":    # codes [N, D, J * b] -> [N * J, D, b]; scale, zero [N, D, J] -> [N * J, D, 1]
        codes = block.codes.unflatten(-1, (groups, -1)).transpose(1, 2).reshape(n * groups, dim, -1)
        scale, zero = (t.transpose(1, 2).reshape(n * groups, dim, 1) for t in (block.scale, block.zero))
    else:                            # rows are tokens: views
        codes, scale, zero = (t.reshape(n * groups, block.group_size, -1)
                              for t in (block.codes, block.scale, block.zero))
    return replace(block, shape=(n * groups, block.group_size, dim), codes=codes, scale=scale, zero=zero)


class BlockStack:
    """Blocks of exactly G tokens, stacked along the leading axis in buffers that grow by a quarter (a pushed
    row is copied when the buffer grows, never changed). `block()` is the QuantizedBlock of all rows."""

    def __init__(self):
        self.rows = 0
        self._template: Optional[QuantizedBlock] = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._whole: Optional[tuple[QuantizedBlock, Optional[torch.Tensor]]] = None

    def push(self, block: QuantizedBlock) -> None:
        parts = {name: t for name, t in block.tensors().items() if t is not None and name != "codebook"}
        if block.codebook is not None:                 # one codebook per pushed block: kept per row
            parts["codebook"] = block.codebook.unsqueeze(0).expand(block.shape[0], -1)
        count = block.shape[0]
        for name, t in parts.items():
            buffer = self._buffers.get(name)
            if buffer is None or self.rows + count > buffer.shape[0]:
                held = 0 if buffer is None else buffer.shape[0]
                grown = t.new_empty((max(self.rows + count, held + held // 4, 8), *t.shape[1:]))
                if self.rows:
                    grown[:self.rows] = buffer[:self.rows]
                self._buffers[name] = buffer = grown
            buffer[self.rows:self.rows + count] = t
        self._template = block
        self.rows += count
        self._whole = None

    def block(self, start: int = 0, stop: Optional[int] = None) -> tuple[QuantizedBlock, Optional[torch.Tensor]]:
        """(rows [start, stop) as one block, their per-row codebooks or None)."""
        stop = self.rows if stop is None else stop
        whole = start == 0 and stop == self.rows
        if whole and self._whole is not None:
            return self._whole
        t = {name: buffer[start:stop] for name, buffer in self._buffers.items()}
        _, tokens, dim = self._template.shape
        block = QuantizedBlock(shape=(stop - start, tokens, dim), layout=self._template.layout,
                               nbits=self._template.nbits, group_size=self._template.group_size,
                               codes=t["codes"], scale=t["scale"], zero=t["zero"],
                               outlier_index=t.get("outlier_index"), outlier_value=t.get("outlier_value"),
                               outlier_layout=self._template.outlier_layout, left=t.get("left"), right=t.get("right"))
        if whole:
            self._whole = (block, t.get("codebook"))
        return block, t.get("codebook")

    def capacity_bytes(self) -> int:
        """Bytes allocated, unused rows included."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


@dataclass(frozen=True)
class StackSpan:
    """Some consecutive rows of a `DecodeBlocks` stack, as attention reads them."""

    keys: QuantizedBlock                   # [n, G, D]
    values: QuantizedBlock
    key_codebooks: Optional[torch.Tensor]  # [n, 2^nbits] per-row codebooks, else None
    value_codebooks: Optional[torch.Tensor]
    segment: torch.Tensor                  # long [n]
    cell: torch.Tensor                     # long [n] segment * most + slot
    positions: Optional[torch.Tensor]      # int32 [n, G] (keys before RoPE), else None


class DecodeBlocks:
    """Quantized groups of exactly G tokens, one row per (segment, group): keys and values stacked, with each
    row's segment, its slot (the segment's n-th group in time order) and RoPE positions, so that attention
    reads every group of a layer as one block. First the `prefill_rows` groups of the prefill blocks that split
    (KIVI's; pushed at prefill), then the `rows` groups quantized while decoding; `stacked` = both."""

    def __init__(self, segments: int, device: torch.device):
        self.keys, self.values = BlockStack(), BlockStack()
        self.segment = torch.zeros(0, dtype=torch.long, device=device)
        self.slot = torch.zeros(0, dtype=torch.long, device=device)
        self.positions: Optional[torch.Tensor] = None                   # int32 [stacked, G] (keys before RoPE)
        self.count = torch.zeros(segments, dtype=torch.long, device=device)
        self.most = 0                                                   # the most groups any segment holds
        self.cell = self.slot
        self.prefill_rows = 0
        self._spans: dict[int, list[StackSpan]] = {}
        self._grid: Optional[CellGrid] = None

    @property
    def stacked(self) -> int:
        return self.keys.rows

    @property
    def rows(self) -> int:
        """Groups quantized while decoding."""
        return self.keys.rows - self.prefill_rows

    def push(self, segments: torch.Tensor, keys: QuantizedBlock, values: QuantizedBlock,
             positions: Optional[torch.Tensor], prefill: bool = False) -> None:
        """Blocks [n, J * G, D] of segments [n] -> n * J rows (J > 1: a prefill block; `splits` must hold)."""
        groups = keys.shape[1] // keys.group_size
        self.keys.push(split_groups(keys))
        self.values.push(split_groups(values))
        self.segment = torch.cat([self.segment, segments.repeat_interleave(groups)])
        slots = self.count[segments].unsqueeze(1) + torch.arange(groups, device=segments.device)
        self.slot = torch.cat([self.slot, slots.flatten()])
        if positions is not None:
            positions = positions.reshape(-1, keys.group_size)
            self.positions = positions if self.positions is None else torch.cat([self.positions, positions])
        self.count[segments] += groups
        self.most = int(self.count.max())
        self.cell = self.segment * self.most + self.slot               # a row's place in a [S * most] grid
        self._spans, self._grid = {}, None
        if prefill:
            self.prefill_rows = self.keys.rows

    def spans(self, rows: int) -> list[StackSpan]:
        """All rows, in spans of at most `rows` (kept until the next push)."""
        if rows not in self._spans:
            out = []
            for a in range(0, self.stacked, rows):
                b = min(a + rows, self.stacked)
                (keys, key_books), (values, value_books) = self.keys.block(a, b), self.values.block(a, b)
                out.append(StackSpan(keys, values, key_books, value_books, self.segment[a:b], self.cell[a:b],
                                     None if self.positions is None else self.positions[a:b]))
            self._spans[rows] = out
        return self._spans[rows]

    def grid(self) -> Optional[CellGrid]:
        """All rows as a segment-major grid of cells (cells.py), when every stacked block is plain and no RoPE
        positions are stored; else None (read in spans). Kept until the next push."""
        if self._grid is None:
            self._grid = False                                          # nothing stacked: nothing to read
            if self.stacked and self.positions is None:
                keys, values = self.keys.block()[0], self.values.block()[0]
                if plain(keys) and plain(values):
                    self._grid = grid_of(keys, values, self.segment, self.slot, self.count, self.most)
        return self._grid or None

    def dequantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of some rows, float32 [len(rows), G, D] each (keys as stored: before RoPE for KVQuant)."""
        out = []
        for stack in (self.keys, self.values):
            block, codebooks = stack.block()
            picked = block.select(rows)
            out.append(picked.dequantize(torch.float32) if codebooks is None else
                       dequantize_span(picked, 0, block.shape[1], torch.float32, codebooks[rows]))
        return out[0], out[1]

    def capacity_bytes(self) -> int:
        return self.keys.capacity_bytes() + self.values.capacity_bytes()


class ByteLedger:
    """Bytes of the quantized parts per segment [S, parts]; the full-precision rows are counted from the
    store's window lengths when read."""

    def __init__(self, segments: int, row_bytes: int):
        self.quantized = torch.zeros(segments, len(BYTE_PARTS), dtype=torch.long)
        self.row_bytes = row_bytes              # one full-precision row of K and V

    def count(self, segments: torch.Tensor, keys: QuantizedBlock, values: QuantizedBlock,
              positions: Optional[torch.Tensor], channels: Optional[torch.Tensor] = None) -> None:
        counted = self.quantized.clone()
        add = {part: 0 for part in BYTE_PARTS}
        for block in (keys, values):
            for part, size in per_row_bytes(block).items():
                add[part] += size
        if positions is not None:
            add["positions"] = positions[0].numel() * positions.element_size()
        if channels is not None:
            add["channels"] = channels[0].numel() * channels.element_size()
        segs = segments.cpu()
        counted[segs] += torch.tensor([add[part] for part in BYTE_PARTS])
        shared = sum(b.codebook.numel() * b.codebook.element_size() for b in (keys, values) if b.codebook is not None)
        if shared:               # a codebook shared by the block's segments: counted once, with its first
            counted[segs[0], BYTE_PARTS.index("codebook")] += shared
        self.quantized = counted

    def parts(self, segments: slice, fp_len: torch.Tensor) -> dict[str, int]:
        """Bytes by part of some segments now; fp_len [S]: the full-precision rows each segment holds."""
        totals = dict(zip(BYTE_PARTS, self.quantized[segments].sum(0).tolist()))
        totals["residual"] = int(fp_len[segments].sum()) * self.row_bytes
        return totals
