"""What a sparse prefill attention is: a unit that decides, per layer, prompt and query head, which
query-key entries of the causal prefill attention are computed (a `PrefillPattern`); everything else is
the engine's (sparse_prefill/attention.py computes exactly those entries, scorers read them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.components import Component, ModelShape


@dataclass
class HeadMasks:
    """Which keys the query heads of one prompt read, in the prompt's own coordinates (n real tokens); causal
    masking always applies on top. A row i reads key j <= i when columns[h, j], or diagonals[h, i - j], or
    blocks[h, i // block_size, j].

    columns, diagonals: bool [Hq, n]; blocks: bool [Hq, ceil(n / block_size), n] or None. sources: per head
    what a kernel needs to compute the same pattern (pattern name and its index or sizes)."""

    columns: torch.Tensor
    diagonals: torch.Tensor
    blocks: Optional[torch.Tensor] = None
    block_size: int = 64
    sources: Optional[list[tuple]] = None

    def allowed(self, start: int, stop: int) -> torch.Tensor:
        """bool [Hq, stop - start, n]: the keys rows start..stop-1 read."""
        n = self.columns.shape[1]
        rows = torch.arange(start, stop, device=self.columns.device)[:, None]
        cols = torch.arange(n, device=self.columns.device)[None, :]
        offset = (rows - cols).clamp(min=0)                                           # [c, n]
        mask = self.columns[:, None, :] | self.diagonals[:, offset]
        if self.blocks is not None:
            mask = mask | self.blocks[:, rows[:, 0] // self.block_size]
        return mask & (cols <= rows)


@dataclass
class PrefillPattern:
    """One layer's sparse prefill pattern for a left-padded batch: per prompt its HeadMasks (None: dense)."""

    heads: list[Optional[HeadMasks]]
    pad_lens: list[int]

    def mask(self, start: int, stop: int, n: int, device=None) -> torch.Tensor:
        """bool [B, Hq, stop - start, n] in padded coordinates: the entries computed (padding never)."""
        out = []
        for masks, pad in zip(self.heads, self.pad_lens):
            if masks is None:
                rows = torch.arange(start, stop, device=device)[:, None]
                cols = torch.arange(n, device=device)[None, :]
                out.append(((cols <= rows) & (cols >= pad) & (rows >= pad))[None])
                continue
            heads = masks.columns.shape[0]
            block = torch.zeros(heads, stop - start, n, dtype=torch.bool, device=masks.columns.device)
            first = max(start, pad)
            if first < stop:
                block[:, first - start:, pad:] = masks.allowed(first - pad, stop - pad)
            out.append(block)
        heads = max(m.shape[0] for m in out)
        return torch.stack([m.expand(heads, -1, -1) for m in out])


@dataclass(frozen=True)
class SparsePrefill(Component):
    """Base of the sparse prefill attentions (a frozen dataclass of settings, like the other units)."""

    def pattern(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor,
                pad_lens: list[int]) -> Optional[PrefillPattern]:
        """queries [B, Hq, n, D], keys [B, Hkv, n, D] after RoPE -> the layer's pattern (None: dense)."""
        raise NotImplementedError

    def check_prompt(self, prompt_len: int) -> None:
        """Fail with one line when on a prompt of prompt_len tokens a setting would not be what it says."""

    def check_model(self, model: ModelShape) -> None:
        """Fail with one line, before any prompt runs, when the unit cannot serve this model."""
