"""KVQuant (Hooper et al., NeurIPS 2024, "KVQuant: Towards 10 Million Context Length LLM Inference with
KV Cache Quantization").

  * Keys per channel, quantized BEFORE RoPE (`keys_before_rope`: the cache hands over pre-RoPE keys
    and applies RoPE after dequantization); values per token.
  * Per-vector dense-and-sparse: in every vector (a key channel over the block's T tokens, a value
    token over its D channels) the k = ceil(outlier_fraction * length) largest magnitudes are kept
    exactly (fp16 value + position, sparse.py; ties: lower position first) and the group ranges
    (min/max) are taken over the remaining entries only.
  * The first `sink_tokens` tokens (the attention sink) stay in fp16: the cache's job, not this unit's.

Left out / changed from the paper: its ranges are per whole channel (calibrated offline for keys) and
per whole token; here they are per group of `group_size`, computed online, like KIVI. Its
non-uniform datatype comes from sensitivity-weighted k-means on calibration data (Fisher
information); `datatype="nuq"` here is NOT that: a plain 1-D k-means (deterministic quantile start,
`kmeans_iterations` Lloyd steps) on the block's own normalized values (x - min) / (max - min),
fitted at each call (one codebook per block, so per layer when the cache quantizes a layer's prefill
at once), stored as 2^nbits fp16 levels in [0, 1]; a value's code is its nearest level (ties: the
lower one). The paper's headline setting is 3 bits (abstract: < 0.1 perplexity degradation at 3
bits) with 1% outliers; 3-bit codes do not pack whole into bytes here, so the default is 4 bits.
sink_tokens 1 is the attention-sink token of shared/ADAPTIVE.md; the public KVQuant README suggests
"a small number of initial keys and values (eg. 5)".
With no calibrated key ranges the keys need whole groups of tokens, so the cache keeps at most an
incomplete group in full precision: residual_length 0 (the paper has no recent-token window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyramidkv.quantization.base import Quantizer
from pyramidkv.quantization.block import QuantizedBlock, index_dtype
from pyramidkv.quantization.packing import pack_codes
from pyramidkv.quantization.sparse import outlier_count, top_magnitude
from pyramidkv.quantization.uniform import group_min_max

DATATYPES = ("uniform", "nuq")
MAX_FIT_VALUES = 1 << 20


def nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted levels [K] for every entry of u (ties: the lower level)."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.searchsorted(midpoints.contiguous(), u.contiguous(), right=False)


def fit_levels(sample: torch.Tensor, count: int, iterations: int) -> torch.Tensor:
    """1-D k-means: `count` sorted fp32 levels for the values `sample` [M] (at most MAX_FIT_VALUES of
    them, evenly spaced in sorted order, when M is larger); start at the quantiles (i + 0.5) / count;
    an empty cluster keeps its level. No sample: evenly spaced levels in [0, 1]."""
    if sample.numel() == 0:
        return torch.linspace(0, 1, count, device=sample.device)
    ordered = sample.float().flatten().sort().values
    if ordered.numel() > MAX_FIT_VALUES:                   # evenly spaced order statistics keep it quick
        ordered = ordered[:: -(-ordered.numel() // MAX_FIT_VALUES)]
    start = ((torch.arange(count, device=sample.device) + 0.5) / count * ordered.numel()).long()
    levels = ordered[start.clamp(max=ordered.numel() - 1)]
    for _ in range(iterations):
        levels = levels.sort().values
        assign = nearest_level(ordered, levels)
        sums = torch.zeros(count, device=sample.device).scatter_add_(0, assign, ordered)
        counts = torch.bincount(assign, minlength=count)
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels)
    return levels.sort().values


@dataclass(frozen=True)
class KVQuantQuantizer(Quantizer):
    """KVQuant.

    outlier_fraction: share of each vector kept exactly as sparse outliers, in [0, 1).
    sink_tokens: the first prompt tokens kept in full precision (the attention sink).
    datatype: uniform levels, or nuq (1-D k-means levels fitted per block, not calibrated).
    kmeans_iterations: Lloyd steps of the nuq fit (>= 1).
    """

    name = "kvquant"
    keys_before_rope = True

    nbits: int = 4
    group_size: int = 32
    residual_length: int = 0
    outlier_fraction: float = 0.01
    sink_tokens: int = 1
    datatype: str = "uniform"
    kmeans_iterations: int = 16

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.outlier_fraction < 1.0:
            raise ValueError(f"kvquant: outlier_fraction must be in [0, 1) (share of each vector kept exactly), "
                             f"got {self.outlier_fraction!r}")
        if self.sink_tokens < 0:
            raise ValueError(f"kvquant: sink_tokens must be >= 0 (first tokens kept in fp16), got {self.sink_tokens!r}")
        if self.datatype not in DATATYPES:
            raise ValueError(f"kvquant: datatype must be one of {', '.join(DATATYPES)}, got {self.datatype!r}")
        if self.kmeans_iterations < 1:
            raise ValueError(f"kvquant: kmeans_iterations must be >= 1, got {self.kmeans_iterations!r}")

    def extra_bytes_per_entry(self, head_dim: int) -> float:
        # Per value vector ceil(f * D) exact entries of fp16 value + int16 index (keys' channel rows: about f).
        return 4 * outlier_count(self.outlier_fraction, head_dim) / head_dim

    def bytes_explained(self, head_dim: int) -> str:
        return (f"{super().bytes_explained(head_dim)}, + {outlier_count(self.outlier_fraction, head_dim)} of every "
                f"{head_dim} entries kept exactly at 4 bytes (outlier_fraction {self.outlier_fraction})")

    def bytes_advice(self) -> str:
        return "use a smaller outlier_fraction (0.01), a larger group_size or fewer bits"

    def check_model(self, head_dim: int, dtype_bytes: int, context_window: int = 0) -> None:
        super().check_model(head_dim, dtype_bytes, context_window)
        if context_window and self.sink_tokens >= context_window:
            raise ValueError(f"kvquant: sink_tokens {self.sink_tokens} covers the model's whole context window "
                             f"({context_window} tokens): every prompt token would stay in full precision and "
                             f"nothing be quantized; allowed: 0 <= sink_tokens < {context_window}")

    def check_budget(self, budget) -> None:
        if budget is not None and self.sink_tokens >= budget:
            raise ValueError(f"kvquant: sink_tokens {self.sink_tokens} covers every one of the {budget} prompt tokens a "
                             f"head keeps (the budget): they would all stay in full precision and none be "
                             f"quantized; allowed: 0 <= sink_tokens < {budget}")

    def _quantize(self, rows, layout, shape, decoding):
        n, num_rows, length = rows.shape
        k = outlier_count(self.outlier_fraction, length)
        keep = index = value = None
        if k:
            order, outliers = top_magnitude(rows, k)                          # [N, V, k], [N, V, L]
            value = rows.gather(-1, order).to(torch.float16)
            index = order.to(index_dtype(length - 1))
            keep = ~outliers
        codebook = None
        if self.datatype == "uniform":
            packed, scale, zero, _ = self._encode(rows, keep)
        else:
            packed, scale, zero, codebook = self._encode_nuq(rows, keep)
        return QuantizedBlock(shape=shape, layout=layout, nbits=self.nbits, group_size=self.group_size,
                              codes=packed, scale=scale, zero=zero, codebook=codebook,
                              outlier_index=index, outlier_value=value, outlier_layout="row")

    def _encode_nuq(self, rows, keep):
        """Non-uniform codes: scale = max - min of the group (fp16), zero = min; x ~ level[code] * scale + zero."""
        n, num_rows, length = rows.shape
        shape = (n, num_rows, length // self.group_size, self.group_size)
        x = rows.reshape(shape)
        mask = None if keep is None else keep.reshape(shape)
        lo, hi = group_min_max(x, mask)
        scale, zero = (hi - lo).to(torch.float16), lo.to(torch.float16)
        s, z = scale.float(), zero.float()
        varying = (s > 0).expand(shape)
        u = (x - z) / torch.where(s > 0, s, torch.ones_like(s))
        fitted = varying if mask is None else varying & mask
        codebook = fit_levels(u[fitted], 1 << self.nbits, self.kmeans_iterations).to(torch.float16)
        codes = torch.where(fitted, nearest_level(u, codebook.float()), torch.zeros_like(u, dtype=torch.long))
        codes = codes.to(torch.uint8).view(n, num_rows, length)
        return pack_codes(codes, self.nbits), scale.squeeze(-1), zero.squeeze(-1), codebook
