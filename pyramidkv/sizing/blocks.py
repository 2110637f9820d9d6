"""What a paged engine could free: the share of a full cache's blocks that hold no kept token.

A paged engine (vLLM's PagedAttention, TensorRT-LLM's paged KV cache) stores each layer's K/V in fixed-size blocks
of `block_size` consecutive positions, one block table per sequence shared by every head of a layer. A full cache of
`length` tokens holds ceil(length / block_size) blocks per layer, the last one possibly partial. After eviction a
block can go back to the pool only when no head of its layer holds a token in it: with ragged heads (each head
keeping its own positions) one token of one head pins the whole block for every head. The bytes a method saves are
therefore an upper bound on what block-granular freeing returns; this is the lower side, without compacting tokens
across blocks (docs/serving.md).
"""

from __future__ import annotations

from typing import Sequence

# The block sizes the runners record (vLLM's default block is 16 tokens; 32 is the other common size).
BLOCK_SIZES = (16, 32)


def freeable_blocks(held: Sequence[Sequence[Sequence[int]]], length: int, block_size: int) -> tuple[int, int]:
    """(blocks free, blocks of the full cache), summed over layers.

    held: per layer, per head, the positions (0 = first token; ints, or 1-d integer tensors) it holds, each in
    [0, length). length: the tokens a full cache would hold (prompt + fed). A layer's block k covers positions
    [k * block_size, (k + 1) * block_size) (the last block may be partial) and is free when no head holds one of
    them.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size {block_size!r} is not a positive integer; allowed: an int >= 1 (e.g. 16)")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length {length!r} is not a positive integer: the full cache's tokens, >= 1")
    per_layer = -(-length // block_size)
    free = 0
    for layer, heads in enumerate(held):
        used: set[int] = set()
        for head, positions in enumerate(heads):
            values = positions.tolist() if hasattr(positions, "tolist") else list(positions)
            for p in values:
                if not 0 <= p < length:
                    raise ValueError(f"layer {layer} head {head} holds position {p}, outside [0, {length}) (the full "
                                     f"cache's positions)")
                used.add(p // block_size)
        free += per_layer - len(used)
    return free, per_layer * len(held)


def freeable_share(held: Sequence[Sequence[Sequence[int]]], length: int, block_size: int) -> float:
    """The share of the full cache's blocks free (freeable_blocks: free / all); 0.0 with no layers."""
    free, total = freeable_blocks(held, length, block_size)
    return free / total if total else 0.0
