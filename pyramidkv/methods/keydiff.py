"""KeyDiff (Park et al., 2025, arXiv 2504.15364), "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments": keep the keys least similar to the others.

Per stored head the anchor is a = mean over the prompt's real keys of k / ||k|| (post-RoPE keys, every real
key of the prompt: window and sinks, when set, included, as kvpress's KeyDiffPress takes all keys of the
context); score = -cos(k, a), highest kept. No attention is read. Defaults as the authors': no window, no
sinks. Padding never enters the anchor, so a prompt scores in a batch as alone. While decoding (with
decode_budget) the same rule over the held tokens: the anchor is then the mean over what the head holds.
"""

from dataclasses import dataclass

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method


def keydiff_scores(keys: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """keys [B, H, n, D], real [B, n] or [B, H, n] -> [B, H, n] float32: minus each key's cosine to the mean
    of the real normalised keys of its head (0 at padding)."""
    mask = (real[:, None, :] if real.dim() == 2 else real).expand(keys.shape[:3]).float()   # [B, H, n]
    unit = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)          # [B, H, n, D]
    anchor = (unit * mask[..., None]).sum(dim=2) / mask.sum(dim=2).clamp_min(1)[..., None]  # [B, H, D]
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return -(unit * anchor[:, :, None, :]).sum(dim=-1) * mask


@dataclass(frozen=True)
class KeyDiff(Method):
    """KeyDiff's scorer: the keys least similar to the mean normalised key of their head are kept."""

    name = "keydiff"
    window_size: int = 0

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return keydiff_scores(ctx.keys, ctx.real)  # [B, Hkv, n] (stored heads at decode)
