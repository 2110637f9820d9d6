"""Reading quantized blocks without materialising them: dequantize a span of tokens, or weight the
values by attention probabilities with scale and zero folded in.

Codes are unpacked through a byte lookup table (a byte value -> its 8 / nbits codes) into reused
scratch buffers, so a decode step allocates no multi-MB temporaries.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

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


def levels_of(codes: torch.Tensor, nbits: int, count: int, codebook: Optional[torch.Tensor],
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


def weighted_values(block: QuantizedBlock, probs: torch.Tensor, start: int, stop: int, dtype: torch.dtype,
                    row_codebook: Optional[torch.Tensor] = None, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """probs [N, rows, stop - start] @ the block's values (token layout) [start, stop) -> [N, rows, D].

    Without outliers and low-rank term, the per-token scale and zero are folded into the weights instead of
    dequantizing: out[:, :, group j] = (probs * scale[:, :, j]) @ levels[:, :, group j] + (probs @ zero[:, :, j])."""
    if block.left is not None or block.outlier_index is not None:
        return probs @ dequantize_span(block, start, stop, dtype, row_codebook, scratch)
    n, _, dim = block.shape
    g = block.group_size
    levels = levels_of(block.codes[:, start:stop], block.nbits, dim, block.codebook, row_codebook, scratch)
    weights = probs.float()
    scale = block.scale[:, start:stop].float()                                   # [N, span, D / G]
    zero = block.zero[:, start:stop].float()
    parts = [(weights * scale[:, :, j].unsqueeze(1)) @ levels[:, :, j * g:(j + 1) * g] for j in range(dim // g)]
    out = torch.cat(parts, dim=-1) + (weights @ zero).repeat_interleave(g, dim=-1)
    return out.to(dtype)
