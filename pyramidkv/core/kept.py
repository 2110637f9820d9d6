"""What one layer keeps of one prompt: flat per-head rows of K/V with their positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class KeptKV:
    """The tokens one layer keeps for one prompt, every stored head's rows one after the other.

    keys, values: [T, D]; head h owns rows offsets[h]:offsets[h+1], offsets = cumsum(lengths).
    positions: [T] position of each kept token in its prompt (0 = first real token), ascending per head.
    Heads may keep different counts (AdaKV, HeadKV): nothing is padded.
    """

    keys: torch.Tensor
    values: torch.Tensor
    lengths: list[int]
    positions: torch.Tensor

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, positions: list[torch.Tensor], pad: int,
               merged: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None) -> "KeptKV":
        """keys, values: [H, n, D] of one prompt; positions: per head, ascending padded positions (pad =
        the prompt's left padding). merged: per head the kept (keys, values) a merge rule rewrote, stored
        instead of the gathered rows."""
        if merged is None:
            merged = ([keys[h, idx] for h, idx in enumerate(positions)],
                      [values[h, idx] for h, idx in enumerate(positions)])
        kept_keys, kept_values = torch.cat(merged[0]), torch.cat(merged[1])
        return cls(kept_keys.contiguous(), kept_values.contiguous(), [len(p) for p in positions],
                   torch.cat(positions) - pad)

    @classmethod
    def from_heads(cls, heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> "KeptKV":
        """From per head (keys [k, D], values [k, D], positions [k])."""
        return cls(torch.cat([k for k, _, _ in heads]).contiguous(), torch.cat([v for _, v, _ in heads]).contiguous(),
                   [len(p) for _, _, p in heads], torch.cat([p for _, _, p in heads]))

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) <= 1

    def per_head(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys.split(self.lengths), self.values.split(self.lengths)))

    def positions_per_head(self) -> list[torch.Tensor]:
        return list(self.positions.split(self.lengths))

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
