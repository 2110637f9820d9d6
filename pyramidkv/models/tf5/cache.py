"""The engine's CompressedCache as a transformers 5.x `Cache`.

In 5.x an attention module computes its q, k, v (RoPE applied), calls `cache.update(k, v, layer_idx, ...)`, and
hands what update returns to the attention function its config names. Here update hands the new tokens' k, v
back untouched: the registered attention function (models/tf5/attention.py) then runs the prompt's attention and
gives the layer to the engine (`prefill`), or appends the new tokens and attends over what the layer holds
(`decode_step`). So `layers` stays the engine's list of per-layer stores, not 5.x's `CacheLayerMixin`s, and the
methods of `Cache` that read those are answered here from the engine.

The mask transformers builds for a decode step has the uncompressed length (`get_mask_sizes`); decode steps do
not read it (the stores know each prompt's padding and what they hold).
"""

from __future__ import annotations

from typing import Optional

from transformers.cache_utils import Cache

from pyramidkv.core.cache import CompressedCache


class _EngineLayers(Cache):
    """5.x's `Cache.__init__` asks for layer objects; the engine builds its own stores (CompressedCache)."""

    def __init__(self):
        self.layer_class_to_replicate = None
        self.offloading = False


class InterfaceCache(CompressedCache, _EngineLayers):
    """A CompressedCache that a 5.x model drives through `update` and the registered attention function."""

    pending: Optional[int] = None   # the layer whose update ran and whose attention has not yet

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.pending is not None:
            raise RuntimeError(f"layer {self.pending}'s attention did not reach pyramidkv's attention function: the "
                               f"model's attn_implementation is not pyramidkv's (patch it with pyramidkv.compress)")
        self.pending = layer_idx
        return key_states, value_states

    def attended(self, layer_idx: int) -> None:
        """The registered attention function took the layer that `update` announced."""
        self.pending = None

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [self.form.window(layer) is not None for layer in range(self.num_layers)]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        return -1 if self.pad_lens is None else len(self.pad_lens)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed cache cannot be cropped (assisted decoding is not supported)")

    def reset(self) -> None:
        raise NotImplementedError("a compressed cache serves one generate(): make a new one (patch.new_cache())")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("a compressed cache cannot be repeated over the batch (num_return_sequences 1)")

    def batch_select_indices(self, indices):
        raise NotImplementedError("a compressed cache cannot select batch rows")
