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
    """Base of the quantizers; subclasses set their defaults and implement `_quantize`.

    nbits: bits per code: 2, 4 or 8.
    group_size: values per quantization group (keys: tokens of one channel; values: channels of one
        token); must divide the model's head dim.
    residual_length: the most recent tokens kept in full precision, a multiple of group_size.
    """

    keys_before_rope: ClassVar[bool] = False   # True: the cache must hand over keys before RoPE
    store_kind: ClassVar[str] = "quantized"    # the layer store a quantized cache needs (pyramidkv/core/cache.py)
    title: ClassVar[str] = "quantized storage (quant_method)"

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

    def check_model(self, head_dim: int, dtype_bytes: int, context_window: int = 0) -> None:
        """What the settings need from the model: the group size divides the head dim, and a quantized entry is
        smaller than an unquantized one in the model's dtype (settings that store more than they save are
        refused). 0 for an unknown figure skips the checks that need it."""
        if head_dim:
            self.check_head_dim(head_dim)
        if head_dim and dtype_bytes:
            stored = self.bytes_per_entry(head_dim)
            if stored > dtype_bytes:
                raise ValueError(f"{self.name}: these settings store {stored:.4g} bytes per quantized key/value entry "
                                 f"({self.bytes_explained(head_dim)}), more than the {dtype_bytes} bytes of the "
                                 f"unquantized cache in the model's dtype: nothing would be saved; "
                                 f"{self.bytes_advice()}")

    def check_layers(self, layer_windows: tuple) -> None:
        """A sliding-window layer is stored in full precision (its store drops what leaves the window, which a
        quantized store cannot): refused when every layer slides, so that nothing would be quantized."""
        if layer_windows and all(w is not None for w in layer_windows):
            raise ValueError(f"{self.name}: every layer of this model has a sliding window ({layer_windows[0]} "
                             f"tokens) and is stored in full precision, so nothing would be quantized; quantizers "
                             f"apply to global layers (docs/models.md, \"Sliding windows\")")

    def bytes_per_entry(self, head_dim: int) -> float:
        """Average bytes one quantized key or value entry costs in a long block: its code plus its share of
        the group's fp16 scale and zero, plus what the unit adds (`extra_bytes_per_entry`)."""
        return self.nbits / 8 + 4 / self.group_size + self.extra_bytes_per_entry(head_dim)

    def extra_bytes_per_entry(self, head_dim: int) -> float:
        return 0.0

    def bytes_explained(self, head_dim: int) -> str:
        return f"{self.nbits}-bit code + an fp16 scale and zero per group of {self.group_size}"

    def bytes_advice(self) -> str:
        return "use a larger group_size (32 or 64) or fewer bits"

    def check_budget(self, budget) -> None:
        """ValueError if a method keeping `budget` prompt tokens per head would quantize none of them for
        reasons of these settings (budget None: the method keeps every token)."""

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
