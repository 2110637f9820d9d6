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


def layer_rotation(rotation, layer: int):
    """The rotation of one layer: a model whose RoPE differs by layer (Gemma3's local and global bases) gives its
    rotation as an object with `for_layer(layer) -> KeyRotation`; any other rotation (or None) serves every layer."""
    return rotation.for_layer(layer) if hasattr(rotation, "for_layer") else rotation
