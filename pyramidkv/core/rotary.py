"""What the engine needs of RoPE: a rotation of keys a store keeps before RoPE (KVQuant), at given positions.

The engine knows no RoPE convention. The model's glue (pyramidkv/models/, `ModelGlue.key_rotation`) builds
the object; the cache hands it to the stores that quantize keys before RoPE.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KeyRotation(Protocol):
    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., T, D] rotated to RoPE positions [..., T] (long), as the model rotates its keys; inverse:
        that rotation undone. float32."""
        ...
