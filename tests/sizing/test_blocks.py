"""The block-freeable share (sizing/blocks.py), on cases worked by hand."""

from __future__ import annotations

import pytest
import torch

from pyramidkv.sizing.blocks import freeable_blocks, freeable_share


def test_a_full_cache_frees_nothing_and_an_empty_one_frees_every_block():
    # 40 tokens at block 16: blocks [0,16) [16,32) [32,40) -> 3 per layer, the last partial
    assert freeable_blocks([[range(40)]], 40, 16) == (0, 3)
    assert freeable_blocks([[[]], [[], []]], 40, 16) == (6, 6)


def test_one_token_pins_its_block_for_every_head_of_the_layer():
    # layer 0: head 0 keeps 0..3 (block 0), head 1 keeps 20 (block 1): only block 2 is free
    # layer 1: both heads keep positions of block 0 only: blocks 1 and 2 are free
    held = [[[0, 1, 2, 3], [20]], [[5], [15]]]
    assert freeable_blocks(held, 40, 16) == (1 + 2, 6)
    assert freeable_share(held, 40, 16) == pytest.approx(3 / 6)


def test_ragged_heads_free_less_than_their_bytes_say():
    # 64 tokens, block 16 (4 blocks); each of 4 heads keeps 16 tokens (a quarter of the bytes), one block each,
    # but a different block per head: no block is free, though 3/4 of the bytes are gone
    held = [[list(range(16 * h, 16 * h + 16)) for h in range(4)]]
    assert freeable_blocks(held, 64, 16) == (0, 4)
    # the same quarter kept by every head in the same block: 3 of 4 blocks free
    assert freeable_blocks([[list(range(16))] * 4], 64, 16) == (3, 4)


def test_the_last_partial_block_counts_as_one_block():
    # 33 tokens at block 16: blocks [0,16) [16,32) [32,33); keeping only position 32 frees 2 of 3
    assert freeable_blocks([[[32]]], 33, 16) == (2, 3)
    # at block 32: [0,32) [32,33): 1 of 2
    assert freeable_blocks([[[32]]], 33, 32) == (1, 2)


def test_sinks_and_window_pin_the_first_and_last_blocks():
    # StreamingLLM at 100 tokens: 4 sinks + the last 12 positions; block 16 -> 7 blocks, blocks 0 and 5, 6 held
    held = [[[0, 1, 2, 3, *range(88, 100)]]]
    assert freeable_blocks(held, 100, 16) == (4, 7)
    # block 32: 4 blocks [0,32) [32,64) [64,96) [96,100): blocks 0, 2, 3 held
    assert freeable_blocks(held, 100, 32) == (1, 4)


def test_tensors_are_read_as_positions():
    held = [[torch.tensor([0, 17]), torch.tensor([], dtype=torch.long)]]
    assert freeable_blocks(held, 48, 16) == (1, 3)


@pytest.mark.parametrize("block_size", [0, -16, 16.0, True])
def test_a_bad_block_size_is_named(block_size):
    with pytest.raises(ValueError, match=f"block_size {block_size!r} is not a positive integer"):
        freeable_blocks([[[0]]], 10, block_size)


def test_a_position_outside_the_cache_is_named():
    with pytest.raises(ValueError, match=r"layer 0 head 1 holds position 10, outside \[0, 10\)"):
        freeable_blocks([[[0], [10]]], 10, 4)
    with pytest.raises(ValueError, match="length 0 is not a positive integer"):
        freeable_blocks([[[0]]], 0, 4)
