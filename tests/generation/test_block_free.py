"""A generation records the share of the full cache's blocks a paged engine could free (Generation.block_free),
checked against block layouts worked by hand from the method's documented selection."""

from __future__ import annotations

import torch

from pyramidkv import make_method
from pyramidkv.generation import generate
from tests.conftest import tiny_llama


class _Ids:
    """The tokenizer generate() needs for token-id prompts: a pad id and a decode."""

    pad_token_id, eos_token_id = 0, 2

    @staticmethod
    def decode(ids, **_):
        return " ".join(map(str, ids))


def _prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fullkv_frees_no_block():
    out = generate(tiny_llama(layers=2, vocab=96, std=0.2), _Ids, [_prompt(100)], make_method("fullkv"), 5,
                   stop_token_ids=[])[0]
    assert out.block_free == {16: 0.0, 32: 0.0}


def test_streamingllm_frees_the_blocks_between_its_sinks_and_its_window():
    # 100 prompt tokens kept as 4 sinks (0..3) + the last 16 (84..99); 4 answer tokens fed (the 5th is sampled, not
    # fed): the full cache holds 104 positions. Block 16: 7 blocks, 0, 5 (80..95) and 6 (96..103) held -> 4/7 free.
    # Block 32: 4 blocks, 0, 2 (64..95) and 3 held -> 1/4 free. Every layer and head alike.
    method = make_method("streamingllm", budget=20, window_size=12, num_sinks=4)
    out = generate(tiny_llama(layers=2, vocab=96, std=0.2), _Ids, [_prompt(100)], method, 5, stop_token_ids=[])[0]
    assert out.block_free == {16: round(4 / 7, 6), 32: 0.25}


def test_a_padded_prompt_in_a_batch_counts_its_own_positions():
    # Left padding must not shift a prompt's blocks. The 70-token prompt: sinks 0..3 + 54..69, 3 answer tokens fed
    # (73 positions). Block 16: 5 blocks, 0, 3 (48..63) and 4 (64..72) held -> 2/5. Block 32: 3 blocks, all held.
    # The 100-token one: 103 positions; block 16: 0, 5, 6 of 7 held -> 4/7; block 32: 0, 2, 3 of 4 held -> 1/4.
    method = make_method("streamingllm", budget=20, window_size=12, num_sinks=4)
    batch = generate(tiny_llama(layers=2, vocab=96, std=0.2), _Ids, [_prompt(100, 1), _prompt(70, 2)], method, 4,
                     stop_token_ids=[])
    assert [g.block_free for g in batch] == [{16: round(4 / 7, 6), 32: 0.25}, {16: 0.4, 32: 0.0}]
