"""One layer's storage for every prompt of the batch: the interface the cache and decoding talk to.

The cache is a list of these, one per layer (as transformers' `cache_utils` holds layer objects).
Two siblings implement it: `FullPrecisionStore` (core/full_precision.py: the kept tokens in the model
dtype, dense or ragged) and `QuantizedStore` (core/quantized.py: packed low-bit codes outside a
full-precision recent window). A store is built from what the prefill pipeline kept (per prompt a
`KeptKV`) and then grows by `append`.

Words: a *segment* is one prompt's stored head (B x H of them per layer); *kept* tokens are those
the store holds in its compressed part (the prompt tokens after prefill, plus generated tokens folded
in by a decode-time re-selection); *held* tokens are all it holds (kept + appended since).
Positions count from the prompt's first real token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from pyramidkv.core.kept import KeptKV

# Per stored head: (keys [m, D], values [m, D], positions [m]).
Heads = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class LayerStore(ABC):
    heads: int          # stored heads per prompt
    appended: int       # tokens appended since the prompt (each prompt of the batch appends one per step)

    # ---- growing -------------------------------------------------------------------------------
    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor, rope_positions: torch.Tensor) -> None:
        """keys, values: [B, H, q, D] new tokens after RoPE; rope_positions: long [B] the RoPE position of
        the last of them (stores that keep keys before RoPE need it)."""

    @abstractmethod
    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        """queries [B, Hq, q, D] of the q tokens appended last -> attention output [B, Hq, q, D] over
        everything held (causal among the new tokens)."""

    def held(self, b: int) -> Heads:
        """Per stored head of prompt b, everything it holds in position order (decode-time re-selection)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be re-selected while decoding")

    def replace(self, kept: list[KeptKV]) -> None:
        """After a decode-time re-selection: per prompt its new kept tokens; nothing appended remains apart."""
        raise NotImplementedError(f"{type(self).__name__} cannot be re-selected while decoding")

    # ---- inspection ----------------------------------------------------------------------------
    @abstractmethod
    def kept_counts(self) -> list[list[int]]:
        """Per prompt, per stored head: kept tokens."""

    @abstractmethod
    def kept_positions(self, b: int) -> list[torch.Tensor]:
        """Per stored head of prompt b: positions of its kept tokens, ascending."""

    @abstractmethod
    def kept_kv(self, b: int) -> Heads:
        """Per stored head of prompt b: (positions, keys, values) of its kept tokens (dequantized)."""

    @abstractmethod
    def held_counts(self) -> list[list[int]]:
        """Per prompt, per stored head: held tokens (kept + appended since)."""

    @abstractmethod
    def held_positions(self, b: int) -> list[torch.Tensor]:
        """Per stored head of prompt b: positions of every held token, ascending."""

    @abstractmethod
    def stored_kv(self, b: int) -> Heads:
        """Per stored head of prompt b: (RoPE positions, keys, values) of every held token, time order
        (dequantized, keys after RoPE)."""

    @abstractmethod
    def bytes_by_part(self, b: Optional[int] = None, appended: Optional[int] = None) -> dict[str, int]:
        """Stored bytes by part (full-precision rows are "residual"), of all prompts or prompt b, now or
        when `appended` tokens had been appended."""

    def nbytes(self, b: Optional[int] = None, appended: Optional[int] = None) -> int:
        return sum(self.bytes_by_part(b, appended).values())

    def read_bytes(self, b: Optional[int] = None) -> int:
        """Bytes the last attend read, of all prompts or prompt b: everything held, for a store that attends
        over all it holds (a paged store reads less)."""
        return self.nbytes(b)

    @abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes allocated for appended tokens, unused capacity included."""
