"""What is stored for one quantized tensor [N, T, D] (N heads or segments of equal length T, head dim D).

Rows. Keys are quantized per channel: a row is one channel of one head over the T tokens (V = D rows
of length L = T per head, `layout="channel"`). Values are quantized per token: a row is one token of
one head over its D channels (V = T rows of length L = D, `layout="token"`). A row holds L / G groups.

Tensors held (all with N first, so a range of heads is a plain slice):
  codes          uint8  [N, V, ceil(L * nbits / 8)]   packed per row (packing.pack_codes)
  scale, zero    fp16   [N, V, L / G]                  per group; x ~ level[code] * scale + zero
  codebook       fp16   [2^nbits] or None             levels in [0, 1] (non-uniform codes); None: level = code
  outlier_index  int16 / int32 [N, S, k] or None      int16 when every index fits, else int32
  outlier_value  fp16   [N, S, k] or None             kept exactly; they replace the dense value there
  left, right    fp16   [N, T, r], [N, D, r] or None  low-rank term left @ right^T added to the dense part
Outlier indices: `outlier_layout="row"`: S = V, index = position inside its row (token for a channel
row, channel for a token row); `"head"`: S = 1, index = t * D + d over the head's [T, D] matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch

from pyramidkv.quantization.packing import unpack_codes

Heads = Union[int, slice, Sequence[int], torch.Tensor]
LAYOUTS = ("channel", "token")
OUTLIER_LAYOUTS = ("row", "head")


def index_dtype(largest: int) -> torch.dtype:
    """The smallest signed integer type that holds 0..largest."""
    return torch.int16 if largest <= torch.iinfo(torch.int16).max else torch.int32


@dataclass(frozen=True)
class QuantizedBlock:
    shape: tuple[int, int, int]             # (N, T, D) of the tensor it stands for
    layout: str                             # "channel" (keys) or "token" (values)
    nbits: int
    group_size: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    codebook: Optional[torch.Tensor] = None
    outlier_index: Optional[torch.Tensor] = None
    outlier_value: Optional[torch.Tensor] = None
    outlier_layout: str = "row"
    left: Optional[torch.Tensor] = None
    right: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.outlier_layout not in OUTLIER_LAYOUTS:
            raise ValueError(f"outlier_layout must be one of {OUTLIER_LAYOUTS}, got {self.outlier_layout!r}")
        if (self.outlier_index is None) != (self.outlier_value is None):
            raise ValueError("outlier_index and outlier_value go together")
        if (self.left is None) != (self.right is None):
            raise ValueError("left and right low-rank factors go together")

    @property
    def rows(self) -> tuple[int, int]:
        """(V, L): rows per head and codes per row."""
        _, tokens, dim = self.shape
        return (dim, tokens) if self.layout == "channel" else (tokens, dim)

    @property
    def rank(self) -> int:
        return 0 if self.left is None else self.left.shape[-1]

    def tensors(self) -> dict[str, Optional[torch.Tensor]]:
        return {"codes": self.codes, "scale": self.scale, "zero": self.zero, "codebook": self.codebook,
                "outlier_index": self.outlier_index, "outlier_value": self.outlier_value,
                "left": self.left, "right": self.right}

    def bytes_breakdown(self) -> dict[str, int]:
        """Bytes of each stored part (exactly the tensors' bytes)."""
        def size(*tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        return {"codes": size(self.codes), "scales": size(self.scale), "zeros": size(self.zero),
                "codebook": size(self.codebook), "outliers": size(self.outlier_index, self.outlier_value),
                "factors": size(self.left, self.right)}

    def nbytes(self) -> int:
        return sum(self.bytes_breakdown().values())

    def select(self, heads: Heads) -> "QuantizedBlock":
        """The block of some heads only (an int, a slice, or indices into N); the codebook is shared."""
        if isinstance(heads, int):
            heads = slice(heads, heads + 1)
        elif not isinstance(heads, slice):
            heads = torch.as_tensor(heads, dtype=torch.long, device=self.codes.device)
        picked = {name: (t[heads] if t is not None and name != "codebook" else t)
                  for name, t in self.tensors().items()}
        _, tokens, dim = self.shape
        return replace(self, shape=(picked["codes"].shape[0], tokens, dim), **picked)

    def dequantize(self, dtype: torch.dtype = torch.float32, heads: Optional[Heads] = None) -> torch.Tensor:
        """[N, T, D] (or [len(heads), T, D]) in dtype; the sum is formed in fp32."""
        block = self if heads is None else self.select(heads)
        n, tokens, dim = block.shape
        num_rows, length = block.rows
        codes = unpack_codes(block.codes, block.nbits, length).long()                    # [n, V, L]
        levels = codes.float() if block.codebook is None else block.codebook.float()[codes]
        grouped = levels.view(n, num_rows, length // block.group_size, block.group_size)
        x = (grouped * block.scale.float().unsqueeze(-1) + block.zero.float().unsqueeze(-1)).view(n, num_rows, length)
        if block.layout == "channel":
            x = x.transpose(1, 2)
        x = x.contiguous()                                                                 # [n, T, D]
        if block.left is not None:
            x = x + block.left.float() @ block.right.float().transpose(1, 2)
        if block.outlier_index is not None:
            flat = block.flat_outlier_index()                                              # [n, S * k]
            x.view(n, tokens * dim).scatter_(1, flat, block.outlier_value.float().reshape(n, -1))
        return x.to(dtype)

    def flat_outlier_index(self) -> torch.Tensor:
        """Outlier positions as t * D + d, int64 [N, S * k]."""
        n, _, dim = self.shape
        index = self.outlier_index.long()
        if self.outlier_layout == "head":
            return index.reshape(n, -1)
        row = torch.arange(index.shape[1], device=index.device).view(1, -1, 1)           # the row each sits in
        flat = index * dim + row if self.layout == "channel" else row * dim + index
        return flat.reshape(n, -1)
