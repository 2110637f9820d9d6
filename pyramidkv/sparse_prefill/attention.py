"""The sparse prefill attention itself: exactly the entries a `PrefillPattern` marks, nothing else.

On CPU (and wherever the optional `minference` package or CUDA is missing, or the attention weights are
asked for) it is a masked reference: per prompt (its padding cut off), in chunks of query rows, softmax over
the marked entries (scaled dot products, float32 softmax as transformers' eager attention), then the
values: MInference's accuracy at dense cost. With CUDA and `minference` importable its kernels compute each
head (vertical_slash_sparse_attention with the same index, streaming_forward, block_sparse_attention); that
path needs a GPU and is not exercised by the CPU test suite.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from pyramidkv.sparse_prefill.base import HeadMasks, PrefillPattern

# Most mask / score entries built at once (query heads x rows x keys).
CHUNK_ENTRIES = 1 << 24


def minference_kernels():
    """The `minference` package's kernel functions, or None where it (or Triton) cannot be imported."""
    try:
        from minference.ops.block_sparse_flash_attention import block_sparse_attention
        from minference.ops.pit_sparse_flash_attention_v2 import vertical_slash_sparse_attention
        from minference.ops.streaming_kernel import streaming_forward
    except Exception:  # ImportError, or a Triton / CUDA error at import
        return None
    return vertical_slash_sparse_attention, streaming_forward, block_sparse_attention


def sparse_prefill_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             pattern: PrefillPattern, need_weights: bool = False
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor], list[float]]:
    """queries [B, Hq, n, D], keys and values [B, Hkv, n, D] (after RoPE), left-padded.

    Returns (output [B, n, Hq, D] (padding rows 0), weights [B, Hq, n, n] when asked (0 outside the pattern),
    per prompt the fraction of its causal query-key entries computed)."""
    bsz, heads, n, dim = queries.shape
    group = heads // keys.shape[1]
    out = queries.new_zeros(bsz, heads, n, dim)
    weights = queries.new_zeros(bsz, heads, n, n) if need_weights else None
    kernels = minference_kernels() if queries.is_cuda and not need_weights else None
    density = []
    for b, (masks, pad) in enumerate(zip(pattern.heads, pattern.pad_lens)):
        q, k, v = queries[b, :, pad:], keys[b, :, pad:], values[b, :, pad:]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        m = n - pad
        if kernels is not None and masks is not None and masks.sources is not None:
            out[b, :, pad:] = _kernel_heads(kernels, masks, q, k, v)
            density.append(float("nan"))
            continue
        computed = 0
        step = max(1, CHUNK_ENTRIES // max(1, heads * m))
        for start in range(0, m, step):
            stop = min(m, start + step)
            allowed = _allowed(masks, heads, start, stop, m, q.device)                  # [Hq, c, m]
            computed += int(allowed.sum())
            if need_weights:
                logits = q[:, start:stop] @ k.transpose(1, 2) / math.sqrt(dim)
                probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32)
                probs = probs.to(q.dtype)
                weights[b, :, pad + start:pad + stop, pad:] = probs
                out[b, :, pad + start:pad + stop] = probs @ v
            else:
                out[b, :, pad + start:pad + stop] = F.scaled_dot_product_attention(
                    q[None, :, start:stop], k[None], v[None], attn_mask=allowed[None])[0]
        density.append(computed / (heads * m * (m + 1) / 2))
    return out.transpose(1, 2), weights, density


def _allowed(masks: Optional[HeadMasks], heads: int, start: int, stop: int, m: int, device) -> torch.Tensor:
    if masks is not None:
        return masks.allowed(start, stop)
    rows = torch.arange(start, stop, device=device)[:, None]
    return (torch.arange(m, device=device)[None, :] <= rows).expand(heads, -1, -1)


def _kernel_heads(kernels, masks: HeadMasks, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One prompt's heads through MInference's CUDA kernels, head by head as the official forward does."""
    vertical_slash, streaming, block_sparse = kernels
    out = torch.empty_like(q)
    for h, source in enumerate(masks.sources):
        qh, kh, vh = q[None, h:h + 1], k[None, h:h + 1], v[None, h:h + 1]
        kind = source[0]
        if kind == "vertical_and_slash":
            out[h] = vertical_slash(qh, kh, vh, source[1][None, None, :], source[2][None, None, :])[0, 0]
        elif kind == "stream_llm":
            out[h] = streaming(qh, kh, vh, source[1], source[2])[0, 0]
        else:
            out[h] = block_sparse(qh, kh, vh, source[1])[0, 0]
    return out
