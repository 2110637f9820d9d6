"""What one layer keeps of one prompt: flat per-head rows of K/V with their positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ThinRows:
    """ThinK's pruned part of a prompt's kept tokens: each head's oldest kept rows, their keys stored on
    the head's kept channels only. keys: [T, D'] (head-major, lengths per head); values: [T, D];
    positions: [T]; channels: long [H, D'], ascending channel indices of each head."""

    keys: torch.Tensor
    values: torch.Tensor
    lengths: list[int]
    positions: torch.Tensor
    channels: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.channels))


@dataclass
class KeptKV:
    """The tokens one layer keeps for one prompt, every stored head's rows one after the other.

    keys, values: [T, D]; head h owns rows offsets[h]:offsets[h+1], offsets = cumsum(lengths).
    positions: [T] position of each kept token in its prompt (0 = first real token), ascending per head.
    Heads may keep different counts (AdaKV, HeadKV): nothing is padded.
    thin: with ThinK's key-channel pruning, each head's older kept tokens, stored with thin keys; the
    rows above are then only its most recent (full-width) kept tokens. A head's kept tokens are its
    thin rows followed by its rows here.
    """

    keys: torch.Tensor
    values: torch.Tensor
    lengths: list[int]
    positions: torch.Tensor
    thin: Optional[ThinRows] = None

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, positions: list[torch.Tensor], pad: int,
               merged: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None) -> "KeptKV":
        """keys, values: [H, n, D] of one prompt; positions: per head, ascending padded positions (pad =
        the prompt's left padding). merged: per head the kept (keys, values) a merge rule rewrote, stored
        instead of the gathered rows."""
        lengths = [len(p) for p in positions]
        if (merged is None and lengths and lengths[0] and len(set(lengths)) == 1 and len(lengths) == keys.shape[0]
                and keys.is_contiguous()
                and values.is_contiguous()):
            # every head the same count: one index_select of the [H * n, D] rows for all heads
            heads, n, _ = keys.shape
            flat = torch.cat(positions)
            rows = (flat.view(heads, -1) + torch.arange(0, heads * n, n, device=flat.device)[:, None]).view(-1)
            return cls(keys.flatten(0, 1).index_select(0, rows), values.flatten(0, 1).index_select(0, rows), lengths,
                       flat - pad)
        if merged is None:  # index_select: advanced indexing (keys[h, idx]) took ms per head on a busy CPU
            merged = ([keys[h].index_select(0, idx) for h, idx in enumerate(positions)],
                      [values[h].index_select(0, idx) for h, idx in enumerate(positions)])
        kept_keys, kept_values = torch.cat(merged[0]), torch.cat(merged[1])
        return cls(kept_keys.contiguous(), kept_values.contiguous(), lengths, torch.cat(positions) - pad)

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

    def counts(self) -> list[int]:
        """Kept tokens per head (thin rows included)."""
        thin = [0] * len(self.lengths) if self.thin is None else self.thin.lengths
        return [a + b for a, b in zip(thin, self.lengths)]

    def all_positions(self) -> list[torch.Tensor]:
        """Per head, the positions of all its kept tokens (thin rows first), ascending."""
        if self.thin is None:
            return self.positions_per_head()
        thin = self.thin.positions.split(self.thin.lengths)
        return [torch.cat([t, f]) for t, f in zip(thin, self.positions_per_head())]

    def full_width(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per head (positions, keys [k, D], values [k, D]) of all its kept tokens; thin keys are given full
        width with 0 in the pruned channels (which gives the same attention logits)."""
        out = [(p, k, v) for p, (k, v) in zip(self.positions_per_head(), self.per_head())]
        if self.thin is None:
            return out
        thin = self.thin
        dim = self.keys.shape[-1]
        for h, (pos, keys, values) in enumerate(zip(thin.positions.split(thin.lengths), thin.keys.split(thin.lengths),
                                                    thin.values.split(thin.lengths))):
            wide = keys.new_zeros(keys.shape[0], dim)
            wide[:, thin.channels[h]] = keys
            p, k, v = out[h]
            out[h] = (torch.cat([pos, p]), torch.cat([wide, k]), torch.cat([values, v]))
        return out

    def since(self, first: int, tail: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> "KeptKV":
        """The kept tokens at positions >= first (thin rows stay thin), each head's full-width rows followed by
        `tail`: (keys [H, t, D], values [H, t, D], positions [t]), the tokens appended since (a sliding window)."""
        heads = []
        for h, (p, (k, v)) in enumerate(zip(self.positions_per_head(), self.per_head())):
            keep = p >= first
            k, v, p = k[keep], v[keep], p[keep]
            if tail is not None:
                k, v, p = torch.cat([k, tail[0][h]]), torch.cat([v, tail[1][h]]), torch.cat([p, tail[2]])
            heads.append((k, v, p))
        out = KeptKV.from_heads(heads)
        if self.thin is not None:
            thin = self.thin
            keep = thin.positions >= first
            lengths = [int(m.sum()) for m in keep.split(thin.lengths)]
            out.thin = ThinRows(thin.keys[keep], thin.values[keep], lengths, thin.positions[keep], thin.channels)
        return out

    def nbytes(self) -> int:
        full = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        return full + (0 if self.thin is None else self.thin.nbytes())
