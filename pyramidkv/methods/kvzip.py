"""KVzip (Kim et al., NeurIPS 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416): each context key is scored by the most attention it receives while the model repeats the
context (core/reconstruction.py), and one threshold over every layer, head and position keeps the best
(`head_allocation="global"`; "uniform" is the authors' `pair-uniform`). The chat template's prefix and what follows
the context (end of turn, assistant header) are never evicted and not counted in the budget: `budget_ratio` is the
kept fraction of the context (the authors' `ratio`), `budget` the context tokens a head keeps on average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pyramidkv.allocation.base import HeadAllocation
from pyramidkv.allocation.global_ import GlobalHeads
from pyramidkv.core.context import ScoreContext
from pyramidkv.core.reconstruction import ReconstructionPlan, Reconstruction, RepeatChunk
from pyramidkv.methods.base import Method

FIRST_REPEAT = "\n\nRepeat the previous context exactly."
NEXT_REPEAT = "\n\nRepeat the part of the previous context exactly, starting with "
MARK = "\x00pyramidkv-context\x00"


def template_edges(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids of the chat template before and after one user message (generation prompt included); ([], [])
    for a tokenizer without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return [], []
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=True)
    before, _, after = text.partition(MARK)
    return (tokenizer(before, add_special_tokens=False).input_ids, tokenizer(after, add_special_tokens=False).input_ids)


def edge_lengths(tokens: Sequence[int], prefix_ids: list[int], suffix_ids: list[int]) -> tuple[int, int]:
    """(prefix, suffix) tokens of a prompt: the template's prefix where the prompt starts with it exactly, else 0;
    the suffix from the last place the template's suffix starts after the prefix to the end (an answer prefix after
    the assistant header, as RULER's, comes after compression in the authors' protocol too), else 0."""
    prefix = len(prefix_ids) if list(tokens[:len(prefix_ids)]) == prefix_ids else 0
    width = len(suffix_ids)
    for start in range(len(tokens) - width, prefix - 1, -1) if width else ():
        if list(tokens[start:start + width]) == suffix_ids:
            return prefix, len(tokens) - start
    return prefix, 0


@dataclass(frozen=True)
class KVzip(Method):
    """KVzip's scorer (the repeat passes).

    chunk_size: context tokens repeated by one pass (the authors' 2,000; kvpress 2,048).
    chunk_overlap: tokens of the previous chunk quoted in a later chunk's instruction (the authors' 8).
    """

    name = "kvzip"
    reconstructs = True
    refuses = {setting: "its scores come from repeat passes after the prefill, which run once per prompt"
               for setting in ("decode_budget", "merge", "page_budget", "cross_layer_merge", "prefill_attention")}
    global_scale = "raw"
    window_size: int = 0
    gqa_reduce: str = "max"
    head_allocation: HeadAllocation = GlobalHeads()
    chunk_size: int = 2000
    chunk_overlap: int = 8

    def validate(self) -> None:
        super().validate()
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1 (context tokens per repeat pass), got {self.chunk_size!r}")
        if self.chunk_overlap < 0:
            raise ValueError(f"chunk_overlap must be an integer >= 0, got {self.chunk_overlap!r}")
        protected = {"window_size": self.window_size, "num_sinks": self.selection.num_sinks}
        for setting, value in protected.items():
            if value:
                raise ValueError(f"kvzip protects the prompt's template prefix and suffix itself; {setting} must be 0, "
                                 f"got {value}")

    def check_model(self, model) -> None:
        super().check_model(model)
        if model.form.sliding:
            raise ValueError(f"kvzip does not support sliding-window layers (model {model.name or '?'}: layer windows "
                             f"{sorted({w for w in model.form.windows if w})}); its repeat passes attend the whole "
                             f"prompt")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.reconstruction is None:
            raise ValueError("kvzip scores by making the model repeat each prompt's context: the cache needs the repeat "
                             "inputs, which pyramidkv.generate builds with the tokenizer (or pass "
                             "patch.new_cache(prompt_token_lists, tokenizer) to model.generate)")
        return ctx.reconstruction   # [B, Hq, n]

    def reconstruction(self, token_lists: Sequence[Sequence[int]], tokenizer) -> Reconstruction:
        """The repeat passes of a batch of prompts (token ids, chat template applied as the runners do), in the
        authors' wording: chunk 0 "\\n\\nRepeat the previous context exactly." + the assistant header + the chunk;
        chunk c > 0 "\\n\\nRepeat the part of the previous context exactly, starting with " + the last
        `chunk_overlap` tokens of chunk c - 1 + the header + the chunk. The header is the end of the model's chat
        template after a user turn (none without a template); prefix and suffix: `edge_lengths`."""
        prefix_ids, suffix_ids = template_edges(tokenizer)
        first = tokenizer(FIRST_REPEAT, add_special_tokens=False).input_ids
        later = tokenizer(NEXT_REPEAT, add_special_tokens=False).input_ids
        plans = []
        for index, tokens in enumerate(token_lists):
            prefix, suffix = edge_lengths(tokens, prefix_ids, suffix_ids)
            stop = len(tokens) - suffix
            if stop <= prefix:
                raise ValueError(f"kvzip: prompt {index} ({len(tokens)} tokens) has no context to reconstruct between its "
                                 f"template prefix ({prefix} tokens) and suffix ({suffix} tokens)")
            chunks = []
            for start in range(prefix, stop, self.chunk_size):
                end = min(start + self.chunk_size, stop)
                quoted = [] if start == prefix else later + list(tokens[max(prefix, start - self.chunk_overlap):start])
                chunks.append(RepeatChunk((quoted or first) + suffix_ids + list(tokens[start:end]), start, end))
            plans.append(ReconstructionPlan(prefix, suffix, chunks))
        return Reconstruction(plans)
