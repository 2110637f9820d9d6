"""Asymmetric uniform quantization of groups along the last axis (KIVI, Liu et al., ICML 2024, Sec. 3).

For a group g of G values and b bits: scale = (max(g) - min(g)) / (2^b - 1), zero = min(g),
code = round((x - zero) / scale) clamped to [0, 2^b - 1], x ~ code * scale + zero.
Scale and zero are stored in fp16; the codes are computed with those fp16-rounded values (cast back
to fp32), so that dequantization reproduces what the codes were fitted to. Math in fp32; rounding is
torch.round (half to even). A constant group (max == min, or a range whose scale rounds to 0 in fp16)
gets scale 0 and codes 0, and dequantizes to its value as fp16 represents it. Inputs must lie in the
fp16 range (KV activations do).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.quantization.packing import check_nbits


def group_min_max(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) fp32 [..., 1] of x [..., G] over the entries where mask [..., G] is True (all if None).
    A group with no entry included gets (0, 0)."""
    x = x.float()
    if mask is None:
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    lo = torch.where(mask, x, torch.full_like(x, float("inf"))).amin(-1, keepdim=True)
    hi = torch.where(mask, x, torch.full_like(x, float("-inf"))).amax(-1, keepdim=True)
    empty = ~mask.any(-1, keepdim=True)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def quantize_groups(x: torch.Tensor, nbits: int, mask: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., G] -> (codes uint8 [..., G], scale fp16 [..., 1], zero fp16 [..., 1]).

    mask: bool [..., G], True where an entry counts (min/max are taken over those only); entries
    left out (outliers stored elsewhere) get code 0."""
    check_nbits(nbits)
    if x.dim() == 0 or x.shape[-1] < 1:
        raise ValueError("quantize_groups: x needs a last (group) axis of at least one value")
    levels = (1 << nbits) - 1
    x = x.float()
    lo, hi = group_min_max(x, mask)
    scale = ((hi - lo) / levels).to(torch.float16)
    zero = lo.to(torch.float16)
    s, z = scale.float(), zero.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x - z) / safe).clamp_(0, levels)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    if mask is not None:
        codes = torch.where(mask, codes, torch.zeros_like(codes))
    return codes.to(torch.uint8), scale, zero


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., G] * scale [..., 1] + zero [..., 1], in fp32, then cast to dtype."""
    return (codes.float() * scale.float() + zero.float()).to(dtype)
