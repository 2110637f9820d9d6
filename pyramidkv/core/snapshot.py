"""A compressed cache's state set aside and put back exactly: the shared-context protocol's `multi_request` rolls
every question back to the compressed context, byte for byte (pyramidkv/generation/shared.py).

The state is everything the cache object holds (its stores, the prefill's record, decode-time statistics, the
stop records), deep-copied with tensors that share storage still sharing it. What the model and the method give
a cache (`SHARED`: the method, the model's key rotation, the quantized attention's scratch buffers) is never
copied: the snapshot refers to the cache's own objects, as a saved cache file refers to them by name
(generation/cache_file.py)."""

from __future__ import annotations

import copy

from pyramidkv.core.cache import CompressedCache

# The attributes of a cache that the model and the method provide (a new cache for the same model and method
# has equal ones): a snapshot and a cache file hold references to them, never copies.
SHARED = ("method", "rotary", "scratch")


def shared_objects(cache: CompressedCache) -> dict[str, object]:
    """name -> object of the cache's SHARED attributes that are set."""
    return {name: getattr(cache, name) for name in SHARED if getattr(cache, name, None) is not None}


def _memo(cache: CompressedCache) -> dict:
    return {id(obj): obj for obj in shared_objects(cache).values()}


def snapshot(cache: CompressedCache) -> dict:
    """A copy of the cache's state now (its attributes but the SHARED ones, which it refers to)."""
    return copy.deepcopy(dict(cache.__dict__), _memo(cache))


def restore(cache: CompressedCache, state: dict) -> None:
    """Put the cache back to `state` (a `snapshot` of it); the snapshot itself stays as it was, to restore again."""
    fresh = copy.deepcopy(state, _memo(cache))
    cache.__dict__.clear()
    cache.__dict__.update(fresh)
