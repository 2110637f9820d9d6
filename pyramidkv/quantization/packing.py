"""Bit packing of integer codes into bytes.

Code i of a row goes to byte i // per_byte at bit offset (i % per_byte) * nbits, per_byte = 8 // nbits
(little-endian within the byte): codes [1, 2, 3, 0] at 2 bits pack to 0b00_11_10_01 = 57. A row of m
codes takes ceil(m * nbits / 8) bytes; the unused high bits of its last byte are 0.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 4, 8)


def check_nbits(nbits: int) -> None:
    if nbits not in SUPPORTED_BITS:
        raise ValueError(f"nbits must be one of {', '.join(map(str, SUPPORTED_BITS))} (codes are packed whole into "
                         f"bytes), got {nbits!r}")


def packed_length(m: int, nbits: int) -> int:
    """Bytes one row of m codes takes."""
    return -(-m * nbits // 8)


def pack_codes(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """codes: uint8 [..., m], each < 2**nbits -> uint8 [..., ceil(m * nbits / 8)]."""
    check_nbits(nbits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_codes: codes must be uint8, got {codes.dtype}")
    if nbits == 8:
        return codes.clone()
    per_byte = 8 // nbits
    m = codes.shape[-1]
    nbytes = packed_length(m, nbits)
    padded = torch.zeros(*codes.shape[:-1], nbytes * per_byte, dtype=torch.int32, device=codes.device)
    padded[..., :m] = codes.to(torch.int32) & ((1 << nbits) - 1)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * nbits        # [per_byte]
    fields = padded.view(*codes.shape[:-1], nbytes, per_byte) << shifts                   # [..., nbytes, per_byte]
    return fields.sum(-1).to(torch.uint8)        # the fields do not overlap, so the sum is their bitwise or


def unpack_codes(packed: torch.Tensor, nbits: int, m: int) -> torch.Tensor:
    """packed: uint8 [..., ceil(m * nbits / 8)] -> codes uint8 [..., m]."""
    check_nbits(nbits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_codes: packed must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_length(m, nbits):
        raise ValueError(f"unpack_codes: {m} codes at {nbits} bits take {packed_length(m, nbits)} bytes, "
                         f"got {packed.shape[-1]}")
    if nbits == 8:
        return packed.clone()
    per_byte = 8 // nbits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * nbits
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << nbits) - 1)        # [..., bytes, per_byte]
    return fields.flatten(-2)[..., :m].to(torch.uint8)
