"""Quantized storage for the compressed cache: the kept prompt tokens and the generated ones, per layer,
per stored head (a "segment" = one prompt's stored head), ragged counts included.

A method with a `quant_method` (pyramidkv.quantization: kivi, kvquant, gear) gets a
`QuantizedCompressedCache`: selection, allocation and merging are the core's as usual (cache.py); what
the method keeps is handed to `_store_prefix`, which encodes it here, one `QuantizedLayer` per layer.

Per segment, in time order, a layer stores
  * sink   : KVQuant's attention sink (its first `sink_tokens` prompt tokens, if kept), full precision;
  * prefill: the oldest kept prompt tokens, quantized at prefill in whole groups of G tokens (one
             QuantizedBlock per set of segments that quantize the same count; `PrefillGroup`);
  * decode : groups of G tokens that left the full-precision window while generating, one block of
             exactly G tokens per segment and event, stacked along the block axis (`BlockStack`);
  * window : the most recent tokens, full precision, in the model dtype: R to R + G - 1 of them
             (R = residual_length) once a segment holds R tokens or more, fewer before.
KIVI windowing: a segment keeps its sink plus at most R + G - 1 window tokens; the append that brings
the window to R + G quantizes its oldest G tokens (once: a quantized block is never touched again) and
the window drops to R. At prefill, of k kept tokens (sink excluded) G * floor((k - R) / G) are quantized.

Keys are stored after RoPE, except for quantizers with `keys_before_rope` (KVQuant): their quantized
keys are un-rotated first (exactly, in float32: a rotation by -theta with the model's own cos/sin for
the token's RoPE position, which the cache keeps as int32 with the block) and rotated again when
attention reads them; sink and window keys stay as the model produced them.

Attention (`QuantizedLayer.attend`) reads every part of a layer at once for all segments: scores of the
queries against the keys of each part, one joint softmax (float32), then the values of each part. The
quantized parts are dequantized on the fly, a span of at most `CHUNK_ELEMENTS` values at a time
(codes -> float levels through a byte lookup table, then level * scale + zero per group, low-rank term and
outliers added); nothing dequantized outlives the step.

Bytes (`kv_bytes_breakdown`): exactly the stored tensors: codes (uint8, packed), scales and zeros (fp16),
codebook, outliers (index + fp16 value), low-rank factors (fp16), positions (int32 RoPE positions of
quantized keys stored before RoPE) and residual (full-precision sink + window rows, K and V, model dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.core.cache import CompressedCache, KeptKV, _softmax
from pyramidkv.quantization.base import Quantizer
from pyramidkv.quantization.block import QuantizedBlock
from pyramidkv.quantization.packing import packed_length

# Largest span (segments x tokens x head dim values) dequantized at once by attention.
CHUNK_ELEMENTS = 1 << 19
BYTE_PARTS = ("codes", "scales", "zeros", "codebook", "outliers", "factors", "positions", "residual")
_LUTS: dict[tuple[int, str], torch.Tensor] = {}


# ---- dequantization of a span of tokens -----------------------------------------------------------
def _code_table(nbits: int, device: torch.device) -> torch.Tensor:
    """long [256, 8 // nbits]: the codes packed in each byte value (packing.py's order)."""
    key = (nbits, str(device))
    if key not in _LUTS:
        per_byte = 8 // nbits
        byte = torch.arange(256, device=device).unsqueeze(1)
        shifts = torch.arange(per_byte, device=device) * nbits
        _LUTS[key] = (byte >> shifts) & ((1 << nbits) - 1)
    return _LUTS[key]


class Scratch:
    """Work buffers that every dequantization of one cache reuses (as large as the largest span, so bounded):
    a decode step then allocates no multi-MB temporaries, which cost page faults on every step. A tensor
    taken from it is overwritten by the next dequantization: use it at once."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)


def _levels(codes: torch.Tensor, nbits: int, count: int, codebook: Optional[torch.Tensor],
            row_codebook: Optional[torch.Tensor], scratch: Optional[Scratch] = None) -> torch.Tensor:
    """Packed codes uint8 [n, V, bytes] -> fp32 levels [n, V, count] (the code itself, or its codebook level).
    codebook: [2^nbits] shared; row_codebook: [n, 2^nbits], one per leading row."""
    table = _code_table(nbits, codes.device)                                   # [256, per_byte]
    n, rows, nbytes = codes.shape
    per_byte = 8 // nbits
    if row_codebook is not None:
        ints = table.index_select(0, codes.reshape(-1).int()).view(n, -1)
        levels = row_codebook.float().gather(1, ints)
    else:
        lut = table.float() if codebook is None else codebook.float()[table]
        if scratch is None:
            levels = lut.index_select(0, codes.reshape(-1).int())
        else:
            index = scratch.take("index", codes.shape, torch.int32, codes.device).copy_(codes).view(-1)
            out = scratch.take("levels", (index.numel(), per_byte), torch.float32, codes.device)
            levels = torch.index_select(lut, 0, index, out=out)
    return levels.view(n, rows, nbytes * per_byte)[..., :count]


def dequantize_span(block: QuantizedBlock, start: int, stop: int, dtype: torch.dtype,
                    row_codebook: Optional[torch.Tensor] = None, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """Tokens [start, stop) of a block, dequantized: [N, stop - start, D] (maybe a transposed view; with
    `scratch`, maybe a view of its buffers).

    start is a multiple of the group size and of 8 // nbits (the codes of a channel row are then cut at a
    byte boundary); stop a multiple of the group size or T. Same values as block.dequantize()[:, start:stop]."""
    n, tokens, dim = block.shape
    g, nbits, span = block.group_size, block.nbits, stop - start

    def combine(zero, levels, scale):
        out = None if scratch is None else scratch.take("dequantized", levels.shape, torch.float32, levels.device)
        return torch.addcmul(zero, levels, scale, out=out)

    if block.layout == "channel":                       # keys: rows are channels, codes packed along T
        codes = block.codes[:, :, start * nbits // 8: packed_length(stop, nbits)]
        levels = _levels(codes, nbits, span, block.codebook, row_codebook, scratch).reshape(n, dim, span // g, g)
        scale = block.scale[:, :, start // g: stop // g].float().unsqueeze(-1)
        zero = block.zero[:, :, start // g: stop // g].float().unsqueeze(-1)
        x = combine(zero, levels, scale).view(n, dim, span).transpose(1, 2)
    else:                                               # values: rows are tokens, codes packed along D
        levels = _levels(block.codes[:, start:stop], nbits, dim, block.codebook, row_codebook, scratch)
        levels = levels.reshape(n, span, dim // g, g)
        scale = block.scale[:, start:stop].float().unsqueeze(-1)
        zero = block.zero[:, start:stop].float().unsqueeze(-1)
        x = combine(zero, levels, scale).view(n, span, dim)
    if block.left is not None:
        x = x + block.left[:, start:stop].float() @ block.right.float().transpose(1, 2)
    if block.outlier_index is not None:
        x = x.contiguous()
        local = block.flat_outlier_index() - start * dim                       # [n, k] in this span's t * D + d
        inside = (local >= 0) & (local < span * dim)
        where = (torch.arange(n, device=local.device).unsqueeze(1) * (span * dim) + local)[inside]
        x.view(-1)[where] = block.outlier_value.reshape(n, -1)[inside].float()
    return x.to(dtype)


def weighted_values(block: QuantizedBlock, probs: torch.Tensor, start: int, stop: int, dtype: torch.dtype,
                    row_codebook: Optional[torch.Tensor] = None, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """probs [N, rows, stop - start] @ the block's values (token layout) [start, stop) -> [N, rows, D].

    Without outliers and low-rank term, the per-token scale and zero are folded into the weights instead of
    dequantizing: out[:, :, group j] = (probs * scale[:, :, j]) @ levels[:, :, group j] + (probs @ zero[:, :, j])."""
    if block.left is not None or block.outlier_index is not None:
        return probs @ dequantize_span(block, start, stop, dtype, row_codebook, scratch)
    n, _, dim = block.shape
    g = block.group_size
    levels = _levels(block.codes[:, start:stop], block.nbits, dim, block.codebook, row_codebook, scratch)
    weights = probs.float()
    scale = block.scale[:, start:stop].float()                                   # [N, span, D / G]
    zero = block.zero[:, start:stop].float()
    parts = [(weights * scale[:, :, j].unsqueeze(1)) @ levels[:, :, j * g:(j + 1) * g] for j in range(dim // g)]
    out = torch.cat(parts, dim=-1) + (weights @ zero).repeat_interleave(g, dim=-1)
    return out.to(dtype)


def _per_row_bytes(block: QuantizedBlock) -> dict[str, int]:
    """Bytes one leading row (segment) of the block stores, by part (the shared codebook not included)."""
    def size(*tensors) -> int:
        return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)

    return {"codes": size(block.codes), "scales": size(block.scale), "zeros": size(block.zero),
            "outliers": size(block.outlier_index, block.outlier_value), "factors": size(block.left, block.right)}


# ---- RoPE for keys stored before it ----------------------------------------------------------------
class RotaryTable:
    """cos / sin [P, D] (fp32) of RoPE positions 0..P-1, from the model's own rotary module; grows on demand."""

    def __init__(self, rotary_emb):
        self.rotary_emb = rotary_emb
        self.cos = self.sin = None

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self.cos is None or self.cos.shape[0] < needed or self.cos.device != positions.device:
            size = max(needed, 2 * (0 if self.cos is None else self.cos.shape[0]), 1024)
            ids = torch.arange(size, device=positions.device).unsqueeze(0)
            probe = torch.zeros(1, device=positions.device, dtype=torch.float32)
            cos, sin = self.rotary_emb(probe, ids)
            self.cos, self.sin = cos[0].float(), sin[0].float()
        index = positions.long()
        return self.cos[index], self.sin[index]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., T, D] rotated (or un-rotated) to positions [..., T], in fp32 (Llama / Mistral rotate_half)."""
        cos, sin = self.lookup(positions)
        x = x.float()
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos - turned * sin if inverse else x * cos + turned * sin


# ---- storage ---------------------------------------------------------------------------------------
@dataclass
class PrefillGroup:
    """The prefill-quantized tokens of some segments that all quantized the same count T (a multiple of G)."""

    segments: torch.Tensor                 # long [n]
    keys: QuantizedBlock                   # [n, T, D]
    values: QuantizedBlock
    positions: Optional[torch.Tensor]      # int32 [n, T] RoPE positions (keys stored before RoPE), else None

    @property
    def tokens(self) -> int:
        return self.keys.shape[1]


class BlockStack:
    """Blocks of exactly G tokens, stacked along the leading axis in buffers that grow geometrically (a
    pushed row is copied when the buffer grows, never changed). `block()` is the QuantizedBlock of all rows."""

    def __init__(self):
        self.rows = 0
        self._template: Optional[QuantizedBlock] = None
        self._buffers: dict[str, torch.Tensor] = {}

    def push(self, block: QuantizedBlock) -> None:
        parts = {name: t for name, t in block.tensors().items() if t is not None and name != "codebook"}
        if block.codebook is not None:                 # one codebook per pushed block: kept per row
            parts["codebook"] = block.codebook.unsqueeze(0).expand(block.shape[0], -1)
        count = block.shape[0]
        for name, t in parts.items():
            buffer = self._buffers.get(name)
            if buffer is None or self.rows + count > buffer.shape[0]:
                grown = t.new_empty((max(self.rows + count, 2 * (0 if buffer is None else buffer.shape[0]), 8),
                                     *t.shape[1:]))
                if self.rows:
                    grown[:self.rows] = buffer[:self.rows]
                self._buffers[name] = buffer = grown
            buffer[self.rows:self.rows + count] = t
        self._template = block
        self.rows += count

    def block(self, start: int = 0, stop: Optional[int] = None) -> tuple[QuantizedBlock, Optional[torch.Tensor]]:
        """(rows [start, stop) as one block, their per-row codebooks or None)."""
        stop = self.rows if stop is None else stop
        t = {name: buffer[start:stop] for name, buffer in self._buffers.items()}
        _, tokens, dim = self._template.shape
        block = QuantizedBlock(shape=(stop - start, tokens, dim), layout=self._template.layout,
                               nbits=self._template.nbits, group_size=self._template.group_size,
                               codes=t["codes"], scale=t["scale"], zero=t["zero"],
                               outlier_index=t.get("outlier_index"), outlier_value=t.get("outlier_value"),
                               outlier_layout=self._template.outlier_layout, left=t.get("left"), right=t.get("right"))
        return block, t.get("codebook")


class QuantizedLayer:
    """One layer's quantized storage for all segments (prompt-major, then stored head), and its attention."""

    def __init__(self, quantizer: Quantizer, kept: list[KeptKV], rope_positions: list[torch.Tensor],
                 rotary: Optional[RotaryTable], scratch: Optional[Scratch] = None):
        """kept: per prompt, the KeptKV the method selected; rope_positions: per prompt, long [T] RoPE
        position of each of its kept rows; scratch: work buffers shared with the cache's other layers."""
        q = self.quantizer = quantizer
        self.scratch = scratch
        self.heads = len(kept[0].lengths)
        self.rotary = rotary if q.keys_before_rope else None
        first = kept[0].keys
        self.dtype, self.device, dim = first.dtype, first.device, first.shape[-1]
        g, r = q.group_size, q.residual_length
        sink_tokens = getattr(q, "sink_tokens", 0)
        keys, values, positions, rope = [], [], [], []
        for kv, pos in zip(kept, rope_positions):
            keys += kv.keys.split(kv.lengths)
            values += kv.values.split(kv.lengths)
            positions += kv.positions.split(kv.lengths)
            rope += pos.split(kv.lengths)
        for p in positions:
            if p.numel() > 1 and bool((p[1:] < p[:-1]).any()):
                raise ValueError("a stored head's kept positions are not in time order")
        self.segments = len(keys)
        self.prompt_counts = [k.shape[0] for k in keys]
        # RoPE positions of the kept prompt rows per segment, and of each appended token per prompt (metadata
        # for the inspection API, like KeptKV.positions; not counted as stored bytes).
        self.prompt_positions = [p.clone() for p in rope]
        self.tail_positions: list[torch.Tensor] = []
        sink = [int((p < sink_tokens).sum()) for p in positions]
        quantized = [g * (max(0, n - s - r) // g) for n, s in zip(self.prompt_counts, sink)]

        self.prefill: list[PrefillGroup] = []
        for count in sorted(set(quantized) - {0}):
            segs = [s for s, c in enumerate(quantized) if c == count]
            k = torch.stack([keys[s][sink[s]:sink[s] + count] for s in segs])
            v = torch.stack([values[s][sink[s]:sink[s] + count] for s in segs])
            pos = torch.stack([rope[s][sink[s]:sink[s] + count] for s in segs])
            self.prefill.append(self._encode(torch.tensor(segs, device=self.device), k, v, pos, decoding=False))

        # Full-precision rows: the sink, then the window; room for the most a window ever holds (R + G).
        fp = [n - c for n, c in zip(self.prompt_counts, quantized)]
        capacity = max(max(fp) + 1, max(sink) + r + g)
        self.fp_keys = first.new_zeros(self.segments, capacity, dim)
        self.fp_values = first.new_zeros(self.segments, capacity, dim)
        self.fp_positions = torch.zeros(self.segments, capacity, dtype=torch.long, device=self.device)
        for s in range(self.segments):
            rows = torch.cat([torch.arange(sink[s]), torch.arange(sink[s] + quantized[s], self.prompt_counts[s])])
            rows = rows.to(self.device)
            self.fp_keys[s, :fp[s]] = keys[s][rows]
            self.fp_values[s, :fp[s]] = values[s][rows]
            self.fp_positions[s, :fp[s]] = rope[s][rows]
        self.fp_len = torch.tensor(fp, device=self.device)
        self.sink = torch.tensor(sink, device=self.device)

        # Tokens quantized while decoding: one block of G tokens per (segment, event).
        self.decode_keys, self.decode_values = BlockStack(), BlockStack()
        self.decode_segment = torch.zeros(0, dtype=torch.long, device=self.device)   # per stacked row
        self.decode_slot = torch.zeros(0, dtype=torch.long, device=self.device)      # the segment's n-th block
        self.decode_positions: Optional[torch.Tensor] = None                          # int32 [rows, G]
        self.decode_count = torch.zeros(self.segments, dtype=torch.long, device=self.device)

        # Bytes of the quantized parts per segment [S, parts], for kv_bytes; a snapshot after every append.
        self.quantized_bytes = torch.zeros(self.segments, len(BYTE_PARTS), dtype=torch.long)
        for group in self.prefill:
            self._count(group.segments, group.keys, group.values, group.positions)
        self.history = [(self.quantized_bytes, self.fp_len.cpu().clone())]

    # ---- encoding ----------------------------------------------------------------------------------
    def _encode(self, segments, keys, values, positions, decoding: bool) -> PrefillGroup:
        if self.rotary is not None:
            keys = self.rotary.rotate(keys, positions, inverse=True)
        stored = positions.to(torch.int32) if self.rotary is not None else None
        return PrefillGroup(segments, self.quantizer.quantize_keys(keys, decoding=decoding),
                            self.quantizer.quantize_values(values, decoding=decoding), stored)

    def _count(self, segments, keys: QuantizedBlock, values: QuantizedBlock, positions) -> None:
        counted = self.quantized_bytes.clone()
        add = {part: 0 for part in BYTE_PARTS}
        for block in (keys, values):
            for part, size in _per_row_bytes(block).items():
                add[part] += size
        if positions is not None:
            add["positions"] = positions[0].numel() * positions.element_size()
        row = torch.tensor([add[part] for part in BYTE_PARTS])
        segs = segments.cpu()
        counted[segs] += row
        shared = sum(b.codebook.numel() * b.codebook.element_size() for b in (keys, values) if b.codebook is not None)
        if shared:               # a codebook shared by the block's segments: counted once, with its first
            counted[segs[0], BYTE_PARTS.index("codebook")] += shared
        self.quantized_bytes = counted

    # ---- decoding ----------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """keys, values: [B, H, 1, D] one new token per segment (after RoPE); positions: long [B] RoPE positions."""
        bsz, heads, q_len, dim = keys.shape
        if q_len != 1:
            raise NotImplementedError("a quantized cache decodes one token per step (got q_len > 1)")
        rows = torch.arange(self.segments, device=self.device)
        self.fp_keys[rows, self.fp_len] = keys.reshape(self.segments, dim)
        self.fp_values[rows, self.fp_len] = values.reshape(self.segments, dim)
        self.fp_positions[rows, self.fp_len] = positions.repeat_interleave(heads)
        self.fp_len += 1
        self.tail_positions.append(positions.clone())
        g, r = self.quantizer.group_size, self.quantizer.residual_length
        full = (self.fp_len - self.sink) >= r + g
        if bool(full.any()):
            self._quantize_oldest(full.nonzero().squeeze(1))
        self.history.append((self.quantized_bytes, self.fp_len.cpu().clone()))

    def _quantize_oldest(self, segs: torch.Tensor) -> None:
        """The oldest G window tokens of these segments (each holding R + G) -> one stacked block each."""
        g, r = self.quantizer.group_size, self.quantizer.residual_length
        start = self.sink[segs].unsqueeze(1)
        oldest = start + torch.arange(g, device=self.device)                       # [n, G]
        index = segs.unsqueeze(1)
        group = self._encode(segs, self.fp_keys[index, oldest], self.fp_values[index, oldest],
                             self.fp_positions[index, oldest], decoding=True)
        self.decode_keys.push(group.keys)
        self.decode_values.push(group.values)
        self.decode_segment = torch.cat([self.decode_segment, segs])
        self.decode_slot = torch.cat([self.decode_slot, self.decode_count[segs]])
        if group.positions is not None:
            self.decode_positions = group.positions if self.decode_positions is None else \
                torch.cat([self.decode_positions, group.positions])
        self.decode_count[segs] += 1
        self._count(segs, group.keys, group.values, group.positions)
        rest = start + g + torch.arange(r, device=self.device)                     # the R tokens that stay
        moved = start + torch.arange(r, device=self.device)
        self.fp_keys[index, moved] = self.fp_keys[index, rest]
        self.fp_values[index, moved] = self.fp_values[index, rest]
        self.fp_positions[index, moved] = self.fp_positions[index, rest]
        self.fp_len[segs] -= g

    # ---- reading -----------------------------------------------------------------------------------
    def _chunk(self, rows: int, dim: int) -> int:
        """Tokens per dequantized span for `rows` segments: a multiple of G and of 4 (whole bytes)."""
        step = self.quantizer.group_size * 4
        return max(step, CHUNK_ELEMENTS // max(1, rows * dim) // step * step)

    def _prefill_keys(self, group: PrefillGroup, start: int, stop: int, dtype, scratch=None) -> torch.Tensor:
        k = dequantize_span(group.keys, start, stop, torch.float32, scratch=scratch)
        if self.rotary is not None:
            k = self.rotary.rotate(k, group.positions[:, start:stop])
        return k.to(dtype)

    def _decode_spans(self, dim: int):
        """(row start, row stop) spans of the decode stack, each a bounded amount to dequantize."""
        per = max(1, CHUNK_ELEMENTS // (self.quantizer.group_size * dim))
        return [(a, min(a + per, self.decode_keys.rows)) for a in range(0, self.decode_keys.rows, per)]

    def _decode_keys(self, start: int, stop: int, dtype, scratch=None) -> torch.Tensor:
        block, codebook = self.decode_keys.block(start, stop)
        k = dequantize_span(block, 0, block.shape[1], torch.float32, codebook, scratch)
        if self.rotary is not None:
            k = self.rotary.rotate(k, self.decode_positions[start:stop])
        return k.to(dtype)

    def _decode_values(self, start: int, stop: int, dtype, scratch=None) -> torch.Tensor:
        block, codebook = self.decode_values.block(start, stop)
        return dequantize_span(block, 0, block.shape[1], dtype, codebook, scratch)

    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        """queries [B, Hq, 1, D] of the token just appended -> attention output [B, Hq, 1, D]."""
        bsz, num_q_heads, q_len, dim = queries.shape
        segs, rows, dtype = self.segments, num_q_heads // self.heads * q_len, queries.dtype
        grouped = queries.reshape(segs, rows, dim) * dim ** -0.5
        lowest = torch.finfo(dtype).min
        parts = []
        # Prefill part: [S, rows, P] with P the most any segment quantized (fewer: masked).
        longest = max((group.tokens for group in self.prefill), default=0)
        whole = len(self.prefill) == 1 and self.prefill[0].segments.numel() == segs
        if longest:
            pre = None if whole else grouped.new_full((segs, rows, longest), lowest)
            for group in self.prefill:
                step = self._chunk(group.segments.numel(), dim)
                q = grouped if whole else grouped[group.segments]
                scores = torch.cat([q @ self._prefill_keys(group, a, min(a + step, group.tokens), dtype,
                                                           self.scratch).transpose(1, 2)
                                    for a in range(0, group.tokens, step)], dim=-1)
                if whole:
                    pre = scores
                else:
                    pre[group.segments, :, :group.tokens] = scores
            parts.append(pre)
        # Decode part: [S, rows, J * G], block j of segment s at [j * G, (j + 1) * G).
        g = self.quantizer.group_size
        blocks = int(self.decode_count.max()) if self.decode_keys.rows else 0
        if blocks:
            dec = grouped.new_full((segs, rows, blocks, g), lowest)
            for a, b in self._decode_spans(dim):
                seg, slot = self.decode_segment[a:b], self.decode_slot[a:b]
                dec[seg, :, slot] = grouped[seg] @ self._decode_keys(a, b, dtype, self.scratch).transpose(1, 2)
            parts.append(dec.view(segs, rows, blocks * g))
        # Full-precision part: [S, rows, F].
        width = int(self.fp_len.max())
        fp = grouped @ self.fp_keys[:, :width].transpose(1, 2)
        unused = torch.arange(width, device=self.device).unsqueeze(0) >= self.fp_len.unsqueeze(1)
        parts.append(fp.masked_fill(unused.unsqueeze(1), lowest))

        probs = _softmax(torch.cat(parts, dim=-1), dtype)
        out = probs[..., probs.shape[-1] - width:] @ self.fp_values[:, :width]
        if longest:
            for group in self.prefill:
                step = self._chunk(group.segments.numel(), dim)
                p = probs if whole else probs[group.segments]
                part = sum(weighted_values(group.values, p[..., a:min(a + step, group.tokens)], a,
                                           min(a + step, group.tokens), dtype, scratch=self.scratch)
                           for a in range(0, group.tokens, step))
                if whole:
                    out = out + part
                else:
                    out = out.index_add(0, group.segments, part)
        if blocks:
            dec_probs = probs[..., longest:longest + blocks * g].view(segs, rows, blocks, g)
            for a, b in self._decode_spans(dim):
                seg, slot = self.decode_segment[a:b], self.decode_slot[a:b]
                block, codebook = self.decode_values.block(a, b)
                out = out.index_add(0, seg, weighted_values(block, dec_probs[seg, :, slot], 0, g, dtype, codebook,
                                                            self.scratch))
        return out.reshape(bsz, num_q_heads, q_len, dim)

    # ---- inspection --------------------------------------------------------------------------------
    def breakdown(self, segments: slice, tail_tokens: Optional[int] = None) -> dict[str, int]:
        """Stored bytes by part of some segments (a slice), after `tail_tokens` appends (default: now)."""
        quantized, fp_len = self.history[-1 if tail_tokens is None else tail_tokens]
        totals = dict(zip(BYTE_PARTS, quantized[segments].sum(0).tolist()))
        row = self.fp_keys.shape[-1] * self.fp_keys.element_size()
        totals["residual"] = int(fp_len[segments].sum()) * row * 2
        return totals

    def segment_kv(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(RoPE positions [n], keys [n, D], values [n, D]) of everything segment s stores, dequantized
        (keys after RoPE), in time order: sink, prefill-quantized, decode-quantized, window."""
        sink, fp = int(self.sink[s]), int(self.fp_len[s])
        keys, values = [self.fp_keys[s, :sink]], [self.fp_values[s, :sink]]
        for group in self.prefill:
            hit = (group.segments == s).nonzero()
            if hit.numel():
                i = int(hit[0, 0])
                keys.append(self._prefill_keys(group, 0, group.tokens, torch.float32)[i].to(self.dtype))
                values.append(group.values.dequantize(self.dtype, heads=i)[0])
        rows = (self.decode_segment == s).nonzero().squeeze(1)
        for i in rows[self.decode_slot[rows].argsort()].tolist():
            keys.append(self._decode_keys(i, i + 1, self.dtype)[0])
            values.append(self._decode_values(i, i + 1, self.dtype)[0])
        keys.append(self.fp_keys[s, sink:fp])
        values.append(self.fp_values[s, sink:fp])
        positions = [self.prompt_positions[s]] + [p[s // self.heads: s // self.heads + 1] for p in self.tail_positions]
        return torch.cat(positions), torch.cat(keys), torch.cat(values)


class QuantizedCompressedCache(CompressedCache):
    """A CompressedCache whose kept prompt tokens and generated tokens are stored quantized
    (`method.quant_method`); see the module docstring for the layout."""

    def __init__(self, method, num_layers: int, num_kv_heads: int, num_query_heads: int, model_name: str = "",
                 rotary_emb=None):
        super().__init__(method, num_layers, num_kv_heads, num_query_heads, model_name)
        if method.quant_method is None:
            raise ValueError("QuantizedCompressedCache needs a method with a quant_method")
        self.quantizer: Quantizer = method.quant_method
        if self.quantizer.keys_before_rope and rotary_emb is None:
            raise ValueError(f"{self.quantizer.name} stores keys before RoPE: the cache needs the model's rotary module")
        self.rotary = None if rotary_emb is None else RotaryTable(rotary_emb)
        self.layers: list[Optional[QuantizedLayer]] = [None] * num_layers
        self.scratch = Scratch()
        self.appended = [0] * num_layers

    def _store_prefix(self, layer_idx: int, kept: list[KeptKV]) -> None:
        dim = kept[0].keys.shape[-1]
        self.quantizer.check_head_dim(dim)
        ids = self.rope_position_ids
        rope = []
        for b, (kv, pad) in enumerate(zip(kept, self.pad_lens)):
            padded = kv.positions + pad
            rope.append(padded if ids is None else ids[min(b, ids.shape[0] - 1)][padded].long())
        self.layers[layer_idx] = QuantizedLayer(self.quantizer, kept, rope, self.rotary, self.scratch)
        # The prefix keeps what the inspection API reads (counts, positions); the K/V live in the layer store.
        empty = kept[0].keys.new_zeros(0, dim)
        self.prefix[layer_idx] = [KeptKV(empty, empty, list(kv.lengths), kv.positions) for kv in kept]

    def _note_prefill_bytes(self) -> None:
        held = sum(self._layer_bytes(layer) for layer in range(self.num_layers) if self.layers[layer] is not None)
        held += sum(t.numel() * t.element_size() for k, v, *_ in self._deferred.values() for t in (k, v))
        self.peak_prefill_kv_bytes = max(self.peak_prefill_kv_bytes, held)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        layer_idx = layer_idx or 0
        return 0 if self.prefix[layer_idx] is None else self.prompt_len + self.appended[layer_idx]

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.method.gqa_layout == "query_head" and self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=1)
            values = values.repeat_interleave(self.group, dim=1)
        bsz = keys.shape[0]
        ids = self.rope_position_ids
        if ids is None:
            positions = torch.full((bsz,), self.get_seq_length(layer_idx), device=keys.device)
        else:
            positions = ids[:, -1].expand(bsz).long()
        self.layers[layer_idx].append(keys, values, positions)
        self.appended[layer_idx] += keys.shape[2]

    def attend(self, layer_idx: int, queries: torch.Tensor) -> torch.Tensor:
        return self.layers[layer_idx].attend(queries)

    def tail_capacity_bytes(self) -> int:
        """Bytes allocated for full-precision rows and decode-time blocks, all layers, unused capacity included."""
        total = 0
        for layer in self.layers:
            if layer is not None:
                total += sum(t.numel() * t.element_size() for t in (layer.fp_keys, layer.fp_values))
                for stack in (layer.decode_keys, layer.decode_values):
                    total += sum(b.numel() * b.element_size() for b in stack._buffers.values())
        return total

    # ---- inspection ----------------------------------------------------------------------------------
    def kv_bytes_breakdown(self, batch_idx: Optional[int] = None, tail_tokens: Optional[int] = None) -> dict[str, int]:
        """Stored bytes by part (codes, scales, zeros, codebook, outliers, factors, positions, residual), all
        layers; of one prompt when batch_idx is given; after the first `tail_tokens` appended tokens."""
        totals = {part: 0 for part in BYTE_PARTS}
        for layer in self.layers:
            if layer is None:
                continue
            heads = layer.heads
            segments = slice(None) if batch_idx is None else slice(batch_idx * heads, (batch_idx + 1) * heads)
            for part, size in layer.breakdown(segments, tail_tokens).items():
                totals[part] += size
        return totals

    def _layer_bytes(self, layer_idx: int) -> int:
        return sum(self.layers[layer_idx].breakdown(slice(None)).values())

    def kv_bytes(self, batch_idx: Optional[int] = None, tail_tokens: Optional[int] = None) -> int:
        return sum(self.kv_bytes_breakdown(batch_idx, tail_tokens).values())

    def held_counts(self, layer_idx: int) -> list[list[int]]:
        """Tokens stored per prompt and stored head at one layer (kept prompt tokens + appended ones)."""
        return [[n + self.appended[layer_idx] for n in kept.lengths] for kept in self.prefix[layer_idx]]

    def held_positions(self, layer_idx: int, batch_idx: int = 0) -> list[torch.Tensor]:
        """Positions (0 = first real prompt token) of every token stored per stored head, ascending."""
        kept = self.prefix[layer_idx][batch_idx]
        start = self.prompt_len - self.pad_lens[batch_idx]
        tail = torch.arange(start, start + self.appended[layer_idx], dtype=kept.positions.dtype,
                            device=kept.positions.device)
        return [torch.cat([p, tail]) for p in kept.positions_per_head()]

    def stored_kv(self, layer_idx: int, batch_idx: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per stored head, (RoPE positions [n], keys [n, D], values [n, D]) of every token it stores (kept
        prompt tokens, then generated ones), dequantized, keys after RoPE, in time order."""
        layer = self.layers[layer_idx]
        return [layer.segment_kv(batch_idx * layer.heads + h) for h in range(layer.heads)]

    def kept_kv(self, layer_idx: int, batch_idx: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per stored head, (positions [k] in the prompt, keys [k, D], values [k, D]) of the kept prompt tokens,
        dequantized (keys after RoPE): copies, not views of the cache."""
        layer = self.layers[layer_idx]
        out = []
        for h, positions in enumerate(self.kept_positions(layer_idx, batch_idx)):
            _, keys, values = layer.segment_kv(batch_idx * layer.heads + h)
            out.append((positions, keys[:len(positions)], values[:len(positions)]))
        return out
