"""The quantized reads in C (pyramidkv/native/quantized_read.c): decode attention's key scores and weighted values
over plain uniform blocks (KIVI's: no codebook, outliers or low-rank term; groups of whole bytes), reading the packed
codes where torch ops (kernels.py, cells.py) first write every level as a float32 to memory. Same products, same
float32 operands; the sums run in another order, so results agree to float32 rounding, not bit for bit. CPU tensors
only; where the kernels are off or unavailable (pyramidkv/native) the torch ops read.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.native import check, library
from pyramidkv.quantization.block import QuantizedBlock


def reads(block: QuantizedBlock) -> bool:
    """Whether the C kernels read this block: a CPU block of plain uniform groups of whole bytes."""
    return (block.codes.device.type == "cpu" and block.codebook is None and block.outlier_index is None
            and block.left is None and block.group_size % (8 // block.nbits) == 0
            and block.scale.dtype == block.zero.dtype == torch.float16 and library() is not None)


def _pointer(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def key_scores(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, queries: torch.Tensor, groups: int,
               group_size: int, nbits: int, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keys in channel layout read as N x `groups` groups of G = group_size tokens -> float32 [N, rows, J * G].

    codes uint8 [N, D, J * G / per] and scale, zero fp16 [N, D, J] (a block, or a token span of one: J groups
    from its start), or with `order` (long [N * J]: the row of each group) codes [R, D, G / per] and scale, zero
    [R, D, 1] (one group a row: a stack read as a grid). queries [N, rows, D], any float dtype."""
    q = queries.float().contiguous()
    n, rows, dim = q.shape
    codes, scale, zero = _inner(codes), _inner(scale), _inner(zero)
    per = 8 // nbits
    if order is None:
        sn, sj, ssn, ssj = codes.stride(0), group_size // per, scale.stride(0), 1
    else:
        order = order.contiguous()
        sn, sj, ssn, ssj = codes.stride(0), 0, scale.stride(0), 0
    out = torch.empty(n, rows, groups * group_size)
    check(library().pk_key_scores(codes.data_ptr(), sn, sj, codes.stride(1), scale.data_ptr(), zero.data_ptr(), ssn,
                                  ssj, scale.stride(1), _pointer(order), q.data_ptr(), n, groups, rows, dim, group_size,
                                  nbits, out.data_ptr()))
    return out


def weighted_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, probs: torch.Tensor, groups: int,
                    tokens: int, channels: int, nbits: int, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """probs [N, rows, J * T] @ values in token layout read as N x `groups` runs of T = `tokens` tokens ->
    float32 [N, rows, D]; `channels`: the channels of a scale group.

    codes uint8 [N, J * T, D / per] and scale, zero fp16 [N, J * T, D / channels], or with `order` (long [N * J]:
    the row of each run) codes [R, T, D / per] and scale, zero [R, T, D / channels]."""
    p = _inner(probs.float())
    n, rows, _ = p.shape
    codes, scale, zero = _inner(codes), _inner(scale), _inner(zero)
    dim = codes.shape[-1] * (8 // nbits)
    if order is None:
        sn, sj, ssn, ssj = codes.stride(0), tokens * codes.stride(1), scale.stride(0), tokens * scale.stride(1)
    else:
        order = order.contiguous()
        sn, sj, ssn, ssj = codes.stride(0), 0, scale.stride(0), 0
    out = torch.empty(n, rows, dim)
    check(library().pk_weighted_values(codes.data_ptr(), sn, sj, codes.stride(1), scale.data_ptr(), zero.data_ptr(),
                                       ssn, ssj, scale.stride(1), _pointer(order), p.data_ptr(), p.stride(0),
                                       p.stride(1), n, groups, rows, dim, tokens, channels, nbits, out.data_ptr()))
    return out
