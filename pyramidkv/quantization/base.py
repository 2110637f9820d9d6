"""What a KV quantizer is: settings in a frozen dataclass, and two calls that turn a block of keys or
values [N, T, D] into a `QuantizedBlock`.

The unit quantizes whole groups it is given; the cache decides which tokens (the full-precision
residual window of `residual_length` recent tokens, attention sinks, pre- or post-RoPE keys) and
hands them over in blocks whose length T is a multiple of `group_size`.

Keys: per channel, a group = `group_size` consecutive tokens of one channel (T % group_size == 0).
Values: per token, a group = `group_size` consecutive channels of one token (D % group_size == 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.components import Component
from pyramidkv.quantization.block import QuantizedBlock
from pyramidkv.quantization.packing import SUPPORTED_BITS, pack_codes
from pyramidkv.quantization.uniform import quantize_groups


@dataclass(frozen=True)
class Quantizer(Component):
    """Base of the quantizers; subclasses set their defaults and implement `_quantize`."""

    keys_before_rope: ClassVar[bool] = False   # True: the cache must hand over keys before RoPE

    nbits: int = 2
    group_size: int = 32
    residual_length: int = 128

    def validate(self) -> None:
        if self.nbits not in SUPPORTED_BITS:
            raise ValueError(f"{self.name}: nbits must be one of {', '.join(map(str, SUPPORTED_BITS))} (codes are "
                             f"packed whole into bytes), got {self.nbits!r}")
        if self.group_size < 1:
            raise ValueError(f"{self.name}: group_size must be >= 1 (values per quantization group), "
                             f"got {self.group_size!r}")
        if self.residual_length < 0 or self.residual_length % self.group_size:
            raise ValueError(f"{self.name}: residual_length must be a multiple of group_size {self.group_size} "
                             f"and >= 0 (tokens leave the full-precision window in whole groups), "
                             f"got {self.residual_length!r}")

    def check_head_dim(self, head_dim: int) -> None:
        """Values are grouped over channels: group_size must divide the head dim."""
        if head_dim % self.group_size:
            raise ValueError(f"{self.name}: group_size {self.group_size} does not divide head_dim {head_dim} "
                             f"(values are quantized per token in groups of group_size channels)")

    def quantize_keys(self, keys: torch.Tensor, *, decoding: bool = False) -> QuantizedBlock:
        """keys: [N, T, D], T a multiple of group_size -> per-channel groups of group_size tokens.
        decoding: the block is one compressed while generating (GEAR uses its decode rank then)."""
        n, tokens, dim = _check_block(keys, "keys")
        if tokens % self.group_size:
            raise ValueError(f"{self.name}: keys have T={tokens} tokens, not a multiple of group_size "
                             f"{self.group_size} (keys are quantized per channel in whole groups of tokens)")
        rows = keys.float().transpose(1, 2)                          # [N, D, T]: a row is a channel
        return self._quantize(rows, "channel", (n, tokens, dim), decoding)

    def quantize_values(self, values: torch.Tensor, *, decoding: bool = False) -> QuantizedBlock:
        """values: [N, T, D], group_size dividing D -> per-token groups of group_size channels."""
        n, tokens, dim = _check_block(values, "values")
        self.check_head_dim(dim)
        return self._quantize(values.float(), "token", (n, tokens, dim), decoding)

    def _quantize(self, rows: torch.Tensor, layout: str, shape: tuple[int, int, int],
                  decoding: bool) -> QuantizedBlock:
        """rows: fp32 [N, V, L] in the block's row layout (see block.py)."""
        raise NotImplementedError

    def _encode(self, rows: torch.Tensor, mask: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Uniform group codes of rows [N, V, L] -> (packed codes, scale, zero [N, V, L/G], codes [N, V, L])."""
        n, num_rows, length = rows.shape
        shape = (n, num_rows, length // self.group_size, self.group_size)
        codes, scale, zero = quantize_groups(rows.reshape(shape), self.nbits,
                                             None if mask is None else mask.reshape(shape))
        codes = codes.view(n, num_rows, length)
        return pack_codes(codes, self.nbits), scale.squeeze(-1), zero.squeeze(-1), codes


def _check_block(x: torch.Tensor, what: str) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"{what} must be a floating tensor [N, T, D], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return tuple(x.shape)
