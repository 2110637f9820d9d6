"""Generation under a compression method: one prompt per answer (`greedy`), and one compressed context answering
several questions (`shared`: multi_request, multi_turn), the `pipeline` API over it, and compressed caches
saved to disk (`cache_file`)."""

from pyramidkv.generation.greedy import (
    Generation, default_stop_token_ids, end_of_turn_token, end_token_ids, generate, split_prompt,
)

__all__ = ["Generation", "default_stop_token_ids", "end_of_turn_token", "end_token_ids", "generate", "split_prompt"]
