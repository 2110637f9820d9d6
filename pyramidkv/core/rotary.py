"""RoPE applied and undone outside the model, for stores that keep keys before RoPE (KVQuant).

Llama / Mistral rotate_half convention, with the model's own rotary module for cos and sin.
"""

from __future__ import annotations

import torch


class RotaryTable:
    """cos / sin [P, D] (fp32) of RoPE positions 0..P-1, from the model's own rotary module; grows on demand."""

    def __init__(self, rotary_emb):
        self.rotary_emb = rotary_emb
        self.cos = self.sin = None

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if self.cos is None or self.cos.shape[0] < needed or self.cos.device != positions.device:
            size = max(needed, 2 * (0 if self.cos is None else self.cos.shape[0]), 1024)
            ids = torch.arange(size, device=positions.device).unsqueeze(0)
            probe = torch.zeros(1, device=positions.device, dtype=torch.float32)
            cos, sin = self.rotary_emb(probe, ids)
            self.cos, self.sin = cos[0].float(), sin[0].float()
        index = positions.long()
        return self.cos[index], self.sin[index]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., T, D] rotated (or un-rotated) to positions [..., T], in fp32 (Llama / Mistral rotate_half)."""
        cos, sin = self.lookup(positions)
        x = x.float()
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos - turned * sin if inverse else x * cos + turned * sin

