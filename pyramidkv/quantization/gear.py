"""GEAR (Kang et al., 2024, "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative
Inference of LLM"): X ~ D + L + S.

  * S: per head, the k = ceil(outlier_fraction * T * D) largest magnitudes of its [T, D] matrix, kept
    exactly (fp16 value + index t * D + d; ties: lower index first). They replace D + L there.
  * D: KIVI-style uniform groups (keys per channel, values per token) whose ranges leave S out.
  * L: rank-r approximation, per head, of the remaining error X - D (0 on S's entries), by subspace
    (power) iteration from a fixed random start (`seed`, drawn on the CPU, so results reproduce on
    any device): Q = orth(E P), P = E^T Q, `power_iterations` times; L = Q P^T, stored as fp16
    factors [T, r] and [D, r]. r = `rank` for a prefill block, `decode_rank` for one compressed while
    generating (`decoding=True`), both capped at min(T, D).

Defaults from the public GEAR code's GEAR-KIVI runs (GenerationBench/GenerationTest/
run_template_llama2-13b.sh: --quantize_bit 2 --group_size 64 --loop 3 --prefillrank 4 --rank 2
--left 0.02 --streaming_gap 64): 2 bits, G = 64, 3 iterations, rank 4 at prefill and 2 while
decoding, 2% outliers, a 64-token full-precision buffer. Differences: that code picks the outliers
per token (values) or per channel (keys), half the largest and half the most negative; here they are
the largest magnitudes per head, as the paper describes S. Its 4-bit "GEAR-KCVT" backbone (one range
per whole channel / token) is not a separate option: nbits=4 with groups is the nearest setting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pyramidkv.quantization.base import Quantizer
from pyramidkv.quantization.block import QuantizedBlock, index_dtype
from pyramidkv.quantization.sparse import outlier_count, top_magnitude


def low_rank_factors(error: torch.Tensor, rank: int, iterations: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """error: fp32 [N, T, D] -> (Q [N, T, rank] orthonormal, P [N, D, rank]) with error ~ Q @ P^T."""
    n, _, dim = error.shape
    generator = torch.Generator(device="cpu").manual_seed(seed)
    p = torch.randn(n, dim, rank, generator=generator).to(error.device)
    for _ in range(iterations):
        q = torch.linalg.qr(error @ p).Q                                  # [N, T, rank]
        p = error.transpose(1, 2) @ q                                      # [N, D, rank]
    return q, p


@dataclass(frozen=True)
class GEARQuantizer(Quantizer):
    """GEAR.

    outlier_fraction: share of each head's entries kept exactly as sparse outliers, in [0, 1).
    rank: rank of the low-rank error term of a block quantized at prefill, at most the head dim.
    decode_rank: the same for blocks compressed while decoding.
    power_iterations: subspace iterations of the low-rank fit (>= 1).
    seed: seed of the low-rank fit's random start; an integer in [0, 2**64).
    """

    name = "gear"

    nbits: int = 2
    group_size: int = 64
    residual_length: int = 64
    outlier_fraction: float = 0.02
    rank: int = 4
    decode_rank: int = 2
    power_iterations: int = 3
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.outlier_fraction < 1.0:
            raise ValueError(f"gear: outlier_fraction must be in [0, 1) (share of each head's entries kept "
                             f"exactly), got {self.outlier_fraction!r}")
        for setting in ("rank", "decode_rank"):
            if getattr(self, setting) < 0:
                raise ValueError(f"gear: {setting} must be >= 0 (0: no low-rank term), got {getattr(self, setting)!r}")
        if self.power_iterations < 1:
            raise ValueError(f"gear: power_iterations must be >= 1, got {self.power_iterations!r}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"gear: seed must be an integer in [0, 2**64) (a torch generator seed), got {self.seed!r}")

    def check_model(self, head_dim: int, dtype_bytes: int, context_window: int = 0) -> None:
        for setting in ("rank", "decode_rank"):
            if head_dim and getattr(self, setting) > head_dim:
                raise ValueError(f"gear: {setting} {getattr(self, setting)} is above the head dim {head_dim} (a rank is "
                                 f"at most min(tokens, head dim)); allowed: 0 <= {setting} <= {head_dim}")
        super().check_model(head_dim, dtype_bytes, context_window)

    def extra_bytes_per_entry(self, head_dim: int) -> float:
        # Outliers: fp16 value + int32 index each; low rank: a [T, r] fp16 factor per block (the [D, r] one is
        # shared by the block's tokens and left out).
        return 6 * self.outlier_fraction + 2 * max(self.rank, self.decode_rank) / head_dim

    def bytes_explained(self, head_dim: int) -> str:
        return (f"{super().bytes_explained(head_dim)}, + outliers ({self.outlier_fraction} of the entries at 6 bytes) "
                f"+ a rank-{max(self.rank, self.decode_rank)} fp16 factor")

    def bytes_advice(self) -> str:
        return "use a smaller outlier_fraction (0.02) or rank, a larger group_size or fewer bits"

    def _quantize(self, rows, layout, shape, decoding):
        n, tokens, dim = shape
        x = rows.transpose(1, 2) if layout == "channel" else rows          # [N, T, D] (a view)
        k = outlier_count(self.outlier_fraction, tokens * dim)
        keep_rows = index = value = outliers = None
        if k:
            flat = x.reshape(n, tokens * dim)
            order, picked = top_magnitude(flat, k)                         # [N, k], [N, T * D]
            value = flat.gather(1, order).to(torch.float16).unsqueeze(1)  # [N, 1, k]
            index = order.to(index_dtype(tokens * dim - 1)).unsqueeze(1)
            outliers = picked.view(n, tokens, dim)
            keep_rows = ~(outliers.transpose(1, 2) if layout == "channel" else outliers)
        packed, scale, zero, _ = self._encode(rows, keep_rows)
        block = QuantizedBlock(shape=shape, layout=layout, nbits=self.nbits, group_size=self.group_size,
                               codes=packed, scale=scale, zero=zero, outlier_index=index,
                               outlier_value=value, outlier_layout="head")
        rank = min(self.decode_rank if decoding else self.rank, tokens, dim)
        if rank == 0:
            return block
        dense = QuantizedBlock(shape=shape, layout=layout, nbits=self.nbits, group_size=self.group_size,
                               codes=packed, scale=scale, zero=zero).dequantize(torch.float32)
        error = x - dense
        if outliers is not None:
            error = error.masked_fill(outliers, 0.0)
        q, p = low_rank_factors(error, rank, self.power_iterations, self.seed)
        return replace(block, left=q.to(torch.float16), right=p.to(torch.float16))
