"""KIVI (Liu et al., ICML 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Asymmetric uniform quantization (uniform.py): keys per channel (groups of G tokens of one channel),
values per token (groups of G channels of one token). The R most recent tokens stay in full
precision in the cache and leave that window in whole groups, never re-quantized (the cache's job).
Defaults, the paper's experimental setting (as shared/ADAPTIVE.md records it): 2 bits, G = 32,
R = 128.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyramidkv.quantization.base import Quantizer
from pyramidkv.quantization.block import QuantizedBlock


@dataclass(frozen=True)
class KIVIQuantizer(Quantizer):
    name = "kivi"

    nbits: int = 2
    group_size: int = 32
    residual_length: int = 128

    def _quantize(self, rows, layout, shape, decoding):
        packed, scale, zero, _ = self._encode(rows)
        return QuantizedBlock(shape=shape, layout=layout, nbits=self.nbits, group_size=self.group_size,
                              codes=packed, scale=scale, zero=zero)
