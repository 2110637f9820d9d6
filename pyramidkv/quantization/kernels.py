"""Reading quantized blocks without materialising them. Decode attention's two products over a block:

  key_scores(block, queries)       queries [N, rows, D] @ keys[start:stop]^T    -> [N, rows, span]
  weighted_values(block, probs)    probs [N, rows, span] @ values[start:stop]  -> [N, rows, D]

With x = level * scale + zero per group, both fold the group's scale and zero into the small operand, so
the large one is only the levels (the codes as floats), never the dequantized keys or values:

  keys (per channel, groups of G tokens): for the tokens t of group j,
      q . k_t = sum_d (q_d * scale[d, j]) * level[d, t] + sum_d q_d * zero[d, j]
    one batched matmul over (segment, group) with the query scaled per group, plus a bias per group;
  values (per token, groups of G channels): for the channels of group j,
      sum_t p_t * v_t = sum_t (p_t * scale[t, j]) * level[t, :] + sum_t p_t * zero[t, j]
    one batched matmul per channel group with the probabilities scaled per token.

Levels come from one table lookup per packed byte: a 256-entry table whose entry b holds the float32
levels of byte b's 8 / nbits codes as one wide element (complex128 at 2 bits, int64 at 4, float32 at 8),
so a byte becomes its levels in a single copy. They land in reused scratch buffers, so a decode step
allocates no multi-MB temporaries.

Outliers and a low-rank term fold too (GEAR: x ~ D + L + S, D the grouped part above, L = left @ right^T,
S outliers that REPLACE D + L at their entries). Products are linear, so each adds a small correction:

  low rank   keys: scores += (q @ right) @ left[start:stop]^T;  values: out += (p @ left[start:stop]) @ right^T
  outliers   for each outlier (t, d) in [start, stop), delta = value - (D + L)[t, d], gathered once per block
             from the k stored entries only (the code's byte and shift, its group's scale and zero,
             left[t] . right[d]) and kept on the block object (float32, derived: not in the stored bytes):
             keys: scores[:, t] += q[d] * delta;  values: out[d] += p[t] * delta  (two scatter-adds).

On the CPU, plain uniform blocks (KIVI's) are read by C kernels doing the same folded products without writing
the levels to memory (native.py, pyramidkv/native); these torch ops are their fallback and every other block's read.

KVQuant's per-vector outliers fold the same way. Apart from that delta, nothing derived is kept between
calls. Per-row codebooks (KVQuant `nuq` decode groups) and group sizes that split a byte are dequantized
span by span (`dequantize_span`) instead; KVQuant keys, stored before RoPE, are dequantized and rotated by
the cache (core/quantized.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pyramidkv.quantization import native
from pyramidkv.quantization.block import QuantizedBlock
from pyramidkv.quantization.packing import packed_length

_LUTS: dict[tuple[int, str], torch.Tensor] = {}


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
    """Work buffers that every read of one cache's quantized blocks reuses (as large as the largest span, so
    bounded): a decode step then allocates no multi-MB temporaries, which cost page faults on every step. A
    tensor taken from it is overwritten by the next read: use it at once. The views handed out are kept per
    shape (a step asks for the same shapes as the last one), up to VIEWS_PER_BUFFER per buffer. Buffers are
    per device (a model spread over devices: each device's layers share theirs)."""

    VIEWS_PER_BUFFER = 16

    def __init__(self):
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._views: dict[tuple[str, torch.device], dict[tuple, torch.Tensor]] = {}

    def take(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, torch.device(device))
        views = self._views.setdefault(key, {})
        view = views.get((shape, dtype))
        if view is not None:
            return view
        numel = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            views.clear()                                  # views of the buffer replaced
        if len(views) >= self.VIEWS_PER_BUFFER:
            views.clear()
        view = views[(shape, dtype)] = buffer[:numel].view(shape)
        return view

    def devices(self) -> set[torch.device]:
        """The devices holding buffers."""
        return {device for _, device in self._buffers}


def levels_of(codes: torch.Tensor, nbits: int, count: int, codebook: Optional[torch.Tensor],
            row_codebook: Optional[torch.Tensor], scratch: Optional[Scratch] = None) -> torch.Tensor:
    """Packed codes uint8 [n, V, bytes] -> fp32 levels [n, V, count] (the code itself, or its codebook level).
    codebook: [2^nbits] shared (or none: `unpack_levels`); row_codebook: [n, 2^nbits], one per leading row."""
    if row_codebook is None:
        return unpack_levels(codes, nbits, codebook, scratch, name="span_levels")[..., :count]
    n, rows, nbytes = codes.shape
    ints = _code_table(nbits, codes.device).index_select(0, codes.reshape(-1).int()).view(n, -1)
    return row_codebook.float().gather(1, ints).view(n, rows, nbytes * (8 // nbits))[..., :count]


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
        levels = levels_of(codes, nbits, span, block.codebook, row_codebook, scratch).reshape(n, dim, span // g, g)
        scale = block.scale[:, :, start // g: stop // g].float().unsqueeze(-1)
        zero = block.zero[:, :, start // g: stop // g].float().unsqueeze(-1)
        x = combine(zero, levels, scale).view(n, dim, span).transpose(1, 2)
    else:                                               # values: rows are tokens, codes packed along D
        levels = levels_of(block.codes[:, start:stop], nbits, dim, block.codebook, row_codebook, scratch)
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


def folds(block: QuantizedBlock, row_codebook: Optional[torch.Tensor] = None) -> bool:
    """Whether the block's products can fold scale and zero into the small operand: no per-row codebooks and
    groups of whole bytes (a code's group is its byte's). A low-rank term and outliers fold as corrections (the
    low-rank products in key_scores / weighted_values, `outlier_corrections`): GEAR's per-head outliers and
    KVQuant's per-vector ones alike."""
    return row_codebook is None and block.group_size % (8 // block.nbits) == 0


def outlier_delta(block: QuantizedBlock) -> torch.Tensor:
    """float32 [N, K]: outlier value - (D + L)[t, d] for each of the block's outliers (t * D + d as in
    flat_outlier_index), the amount an outlier adds over the dense and low-rank parts it replaces. (D + L)[t, d]
    is read from the K stored entries only: the code's byte and shift, its group's scale and zero, and
    left[t] . right[d]. Computed once per block object and kept on it (4 bytes per outlier, derived, not part of
    the stored bytes: `nbytes()` and the cache's byte counts leave it out)."""
    delta = block.__dict__.get("_outlier_delta")
    if delta is not None:
        return delta
    n, tokens, dim = block.shape
    nbits, per = block.nbits, 8 // block.nbits
    flat = block.flat_outlier_index()                                           # [N, K]: t * D + d
    t, d = flat.div(dim, rounding_mode="floor"), flat.remainder(dim)
    row, pos = (d, t) if block.layout == "channel" else (t, d)                  # code row, position in it
    byte = block.codes.reshape(n, -1).gather(1, row * block.codes.shape[-1] + pos.div(per, rounding_mode="floor"))
    code = byte.long().bitwise_right_shift(pos.remainder(per) * nbits).bitwise_and((1 << nbits) - 1)
    level = code.float() if block.codebook is None else block.codebook.float()[code]
    group = row * block.scale.shape[-1] + pos.div(block.group_size, rounding_mode="floor")
    dense = torch.addcmul(block.zero.reshape(n, -1).gather(1, group).float(), level,
                          block.scale.reshape(n, -1).gather(1, group).float())
    if block.left is not None:
        rank = block.rank
        left = block.left.gather(1, t.unsqueeze(-1).expand(-1, -1, rank)).float()
        right = block.right.gather(1, d.unsqueeze(-1).expand(-1, -1, rank)).float()
        dense = dense + (left * right).sum(-1)
    delta = block.outlier_value.reshape(n, -1).float() - dense
    object.__setattr__(block, "_outlier_delta", delta)                          # frozen dataclass: a derived cache
    return delta


def outlier_corrections(block: QuantizedBlock, start: int, stop: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the block's outliers: (t - start, d, delta), each [N, K] (K outliers per leading row), delta from
    `outlier_delta`. Outliers outside [start, stop) get delta 0 and t - start clamped into the span, so a
    scatter-add of them adds nothing."""
    n, tokens, dim = block.shape
    flat = block.flat_outlier_index()
    t, d, delta = flat.div(dim, rounding_mode="floor"), flat.remainder(dim), outlier_delta(block)
    local = t - start if start else t
    if start > 0 or stop < tokens:
        inside = (local >= 0) & (local < stop - start)
        delta = delta.masked_fill(~inside, 0.0)
        local = local.clamp(0, stop - start - 1)
    return local, d, delta


# The dtype of one table entry that holds the 8 / nbits float32 levels of a byte.
_WIDE = {2: torch.complex128, 4: torch.int64, 8: torch.float32}
_BYTE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def byte_table(nbits: int, device: torch.device, codebook: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[256] wide entries: entry b holds the float32 levels of the codes packed in byte b, in packing order
    (the codes themselves, or their codebook levels), as one element of dtype _WIDE[nbits]."""
    key = (nbits, device)
    if codebook is None and key in _BYTE_TABLES:
        return _BYTE_TABLES[key]
    codes = _code_table(nbits, device)                                          # [256, 8 // nbits]
    levels = codes.float() if codebook is None else codebook.float()[codes]
    table = levels.contiguous().view(_WIDE[nbits]).view(256)
    if codebook is None:
        _BYTE_TABLES[key] = table
    return table


def _buffer(scratch: Optional[Scratch], name: str, shape: tuple, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return scratch.take(name, shape, dtype, device)


def unpack_levels(codes: torch.Tensor, nbits: int, codebook: Optional[torch.Tensor] = None,
                  scratch: Optional[Scratch] = None, name: str = "byte_levels") -> torch.Tensor:
    """Packed codes uint8 [..., B] (any strides) -> their float32 levels [..., B * 8 // nbits], contiguous:
    one lookup per byte in `byte_table`. With scratch, a view of its buffer `name` (keys and values share one:
    the keys' levels are used up before the values' are unpacked, and a smaller footprint stays in cache)."""
    table = byte_table(nbits, codes.device, codebook)
    shape = (*codes.shape[:-1], codes.shape[-1] * (8 // nbits))
    index = _buffer(scratch, name + ".index", tuple(codes.shape), torch.int32, codes.device).copy_(codes)
    wide = _buffer(scratch, name, (index.numel(),), table.dtype, codes.device)
    torch.index_select(table, 0, index.view(-1), out=wide)
    return wide.view(torch.float32).view(shape)


def _groups_first(codes: torch.Tensor, scratch: Optional[Scratch]) -> torch.Tensor:
    """Key codes uint8 [N, D, J, b] (b bytes per channel and group) -> [N, J, D, b] in that memory order. The b
    bytes move as one integer where their size and alignment allow: a copy of N * J * D elements, not of bytes."""
    n, dim, groups, width = codes.shape
    out = _buffer(scratch, "keys.codes", (n, groups, dim, width), torch.uint8, codes.device)
    for wide in (torch.int64, torch.int32, torch.int16):
        size = wide.itemsize
        aligned = codes.storage_offset() % size == 0 and all(s % size == 0 for s in codes.stride()[:-1])
        if width % size == 0 and aligned:
            out.view(wide).copy_(codes.view(wide).transpose(1, 2))
            return out
    return out.copy_(codes.transpose(1, 2))


def key_scores(block: QuantizedBlock, queries: torch.Tensor, start: int, stop: int,
               row_codebook: Optional[torch.Tensor] = None, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """queries [N, rows, D] against the block's keys (channel layout) [start, stop): float32 [N, rows, stop - start],
    scores[n, r, t] = queries[n, r] . keys[n, t]. start and stop: multiples of the group size.

    Folded: one batched matmul over (segment, group j) of the query scaled by scale[:, j] with the levels of
    group j [D, G], plus the bias queries . zero[:, j]; then the low-rank term (queries @ right) @ left^T and,
    at each outlier (t, d) of the span, queries[d] * delta; otherwise the dequantized span."""
    if not folds(block, row_codebook):
        keys = dequantize_span(block, start, stop, torch.float32, row_codebook, scratch)
        return queries.float() @ keys.transpose(1, 2)
    n, tokens, dim = block.shape
    g, per_byte = block.group_size, 8 // block.nbits
    groups, rows = (stop - start) // g, queries.shape[1]
    codes, scale, zero = block.codes, block.scale, block.zero                  # [N, D, T / 4], [N, D, T / G] (2 bits)
    if stop - start != tokens:
        codes = codes[:, :, start // per_byte: stop // per_byte]
        scale, zero = scale[:, :, start // g: stop // g], zero[:, :, start // g: stop // g]
    if native.reads(block):
        return native.key_scores(codes, scale, zero, queries, groups, g, block.nbits)
    if groups > 1:
        codes = _groups_first(codes.unflatten(-1, (groups, -1)), scratch)     # [N, J, D, G / 4]
    levels = unpack_levels(codes, block.nbits, block.codebook, scratch).view(n * groups, dim, g)
    q = queries.float()
    scaled = torch.mul(q.unsqueeze(1), scale.transpose(1, 2).unsqueeze(2),      # [N, J, rows, D] (fp16 scale promoted)
                       out=_buffer(scratch, "scaled_queries", (n, groups, rows, dim), torch.float32, q.device))
    bias = torch.bmm(zero.transpose(1, 2).float(), q.transpose(1, 2))           # [N, J, rows]
    scores = torch.baddbmm(bias.view(n * groups, rows, 1), scaled.view(n * groups, rows, dim), levels)
    if groups > 1:
        scores = scores.view(n, groups, rows, g).transpose(1, 2).reshape(n, rows, groups * g)
    if block.left is not None:                                                 # + (q @ right) @ left^T
        scores.baddbmm_(torch.bmm(q, block.right.float()), block.left[:, start:stop].float().transpose(1, 2))
    if block.outlier_index is not None:                                        # + q[d] * delta at (t, d)
        local, channel, delta = outlier_corrections(block, start, stop)
        shape = (n, rows, local.shape[1])
        scores.scatter_add_(2, local.unsqueeze(1).expand(shape),
                            q.gather(2, channel.unsqueeze(1).expand(shape)) * delta.unsqueeze(1))
    return scores


def weighted_values(block: QuantizedBlock, probs: torch.Tensor, start: int, stop: int, dtype: torch.dtype,
                    row_codebook: Optional[torch.Tensor] = None, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """probs [N, rows, stop - start] @ the block's values (token layout) [start, stop) -> [N, rows, D] in dtype.

    Folded: for each channel group j, (probs * scale[:, j]) @ levels[:, group j] + probs @ zero[:, j]; then
    the low-rank term (probs @ left) @ right^T and, at each outlier (t, d) of the span, probs[t] * delta added
    to channel d; otherwise the dequantized span."""
    if not folds(block, row_codebook):
        return probs @ dequantize_span(block, start, stop, dtype, row_codebook, scratch)
    n, tokens, dim = block.shape
    g, span, rows = block.group_size, stop - start, probs.shape[1]
    codes, scale, zero = block.codes, block.scale, block.zero                  # [N, T, D / 4], [N, T, D / G] (2 bits)
    if span != tokens:
        codes, scale, zero = codes[:, start:stop], scale[:, start:stop], zero[:, start:stop]
    if native.reads(block):
        return native.weighted_values(codes, scale, zero, probs, 1, span, g, block.nbits).to(dtype)
    levels = unpack_levels(codes, block.nbits, block.codebook, scratch)                           # [N, span, D]
    p = probs.float()
    scaled = torch.mul(p.unsqueeze(1), scale.transpose(1, 2).unsqueeze(2),      # [N, D / G, rows, span]
                       out=_buffer(scratch, "scaled_probs", (n, dim // g, rows, span), torch.float32, p.device))
    # zero [N, span, D / G] read as a column-major matrix: a matmul over the span with unit stride.
    offset = torch.bmm(p, zero.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format).transpose(1, 2))
    parts = [torch.baddbmm(offset[:, :, j:j + 1], scaled[:, j], levels[:, :, j * g:(j + 1) * g])
             for j in range(dim // g)]
    out = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    if block.left is not None:                                                 # + (p @ left) @ right^T
        out.baddbmm_(torch.bmm(p, block.left[:, start:stop].float()), block.right.float().transpose(1, 2))
    if block.outlier_index is not None:                                        # + p[t] * delta at channel d
        local, channel, delta = outlier_corrections(block, start, stop)
        shape = (n, rows, local.shape[1])
        out.scatter_add_(2, channel.unsqueeze(1).expand(shape),
                         p.gather(2, local.unsqueeze(1).expand(shape)) * delta.unsqueeze(1))
    return out.to(dtype)
