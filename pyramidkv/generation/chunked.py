"""Chunked prefill's driver (core/chunked.py holds what each layer does): one prompt's tokens but the last through
the decoder a chunk at a time, so that generate() starts from a cache compressed between chunks."""

from __future__ import annotations

import torch

from pyramidkv.core.chunked import ChunkedPrefill
from pyramidkv.models.glue import decoder
from pyramidkv.models.line import CACHE_ARGUMENT, INTERFACE_LINE


def chunk_bounds(body: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of `body` tokens: every chunk `size` long but the first (1 to size tokens), so
    that each later chunk's queries are a whole observation window."""
    first = (body - 1) % size + 1
    return [(0, first)] + [(start, start + size) for start in range(first, body, size)]


@torch.no_grad()
def prefill_in_chunks(model, cache, input_ids: torch.Tensor, size: int) -> ChunkedPrefill:
    """input_ids [1, n]: tokens [0, n - 1) into `cache` (empty; the model patched) in chunks of `size`; the last
    token is left for generate()'s first step. Records the prefill's peak K/V bytes in the cache."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"chunked prefill takes one prompt at a time, got a batch of {input_ids.shape[0]}")
    n = input_ids.shape[1]
    bounds = chunk_bounds(n - 1, size) if n > 1 else []
    state = ChunkedPrefill(cache.method, cache.model_shape, bounds[0][1] if bounds else 1, n)
    state.chunks = len(bounds)
    cache.pad_lens, cache.prompt, cache.chunked = [0], state.first, state
    try:
        for start, stop in bounds:
            positions = torch.arange(start, stop, device=input_ids.device)
            # 5.x's decoders take no cache_position (they read positions from position_ids)
            where = {} if INTERFACE_LINE else {"cache_position": positions}
            decoder(model)(input_ids=input_ids[:, start:stop], **{CACHE_ARGUMENT: cache}, use_cache=True,
                           position_ids=positions[None], **where)
    finally:
        cache.chunked = None
    cache.peak_prefill_kv_bytes = max(cache.peak_prefill_kv_bytes, state.peak_bytes)
    return state
