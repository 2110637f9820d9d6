"""Quantized KV storage units: KIVI, KVQuant and GEAR quantizers (pure tensor code; the cache decides
which tokens are quantized and when).

Each quantizer is a frozen dataclass with its defaults; `make_quantizer("kivi", nbits=4)` builds one by
name. `quantize_keys` / `quantize_values` turn a block [N, T, D] into a `QuantizedBlock`, whose
`dequantize()` gives the block back and `nbytes()` counts exactly what it stores.
"""

from __future__ import annotations

from pyramidkv.quantization.base import Quantizer
from pyramidkv.quantization.block import QuantizedBlock
from pyramidkv.quantization.gear import GEARQuantizer
from pyramidkv.quantization.kivi import KIVIQuantizer
from pyramidkv.quantization.kvquant import KVQuantQuantizer
from pyramidkv.quantization.packing import pack_codes, packed_length, unpack_codes
from pyramidkv.quantization.uniform import dequantize_groups, quantize_groups

QUANTIZERS: dict[str, type[Quantizer]] = {cls.name: cls for cls in (KIVIQuantizer, KVQuantQuantizer, GEARQuantizer)}


def make_quantizer(name: str, **settings) -> Quantizer:
    key = name.lower() if isinstance(name, str) else name
    if key not in QUANTIZERS:
        raise ValueError(f"unknown quantizer {name!r}; choose one of: {', '.join(QUANTIZERS)}")
    return QUANTIZERS[key](**settings)


__all__ = [
    "Quantizer", "QuantizedBlock", "QUANTIZERS", "make_quantizer", "KIVIQuantizer", "KVQuantQuantizer",
    "GEARQuantizer", "pack_codes", "unpack_codes", "packed_length", "quantize_groups", "dequantize_groups",
]
