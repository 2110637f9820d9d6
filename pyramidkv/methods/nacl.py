"""NACL (Chen et al., ACL 2024, "NACL: A General and Effective KV Cache Eviction Framework for LLMs at
Inference Time"): one eviction at the end of prefill. Score = attention of the last `proxy_size`
prompt queries (the proxy tokens, normally the question) summed over them, no pooling. Each head keeps
its `num_sinks` first tokens and its recent `window_size`, the top (1 - random_fraction) of the rest of
its budget by score, and draws the remaining random_fraction without replacement from softmax(score)
over the tokens left (random eviction), seeded per (random_seed, layer, stored head) for every prompt.

Defaults: the official split of the kept middle, 12 % by score and 7 % at random (random_fraction
7/19); sinks, window and proxies in tokens (the official ratios of the prompt length, with 256 sinks,
only work near 128K tokens). `--max_capacity_prompts_ratio 0.2` keeps the official 20 %.
"""

from dataclasses import dataclass

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.core.scoring import window_attention
from pyramidkv.capabilities import Selection
from pyramidkv.methods.base import Method


@dataclass(frozen=True)
class NACL(Method):
    """Proxy-token scores plus seeded random eviction, at the end of prefill: 4 sinks, and 7/19 of the
    selected tokens drawn from softmax(score) (the official 7 % at random next to 12 % by score).

    proxy_size: the prompt's last queries (the proxy tokens) whose attention, summed, scores the tokens.
    proxy_causal: True (default): each proxy row's softmax covers the tokens up to its own, the attention the
        model ran (with a sparse prefill, the entries it computed); False: the official code's second pass
        (flash_attn with causal=False), each row's softmax also covering the later proxy tokens, dense. The
        default stays causal: every result so far was made with it, and a row then reads what the model read."""

    name = "nacl"
    global_scale = "raw"   # attention received: comparable across layers as it is
    selection: Selection = Selection(num_sinks=4, random_fraction=7 / 19)
    proxy_size: int = 32
    proxy_causal: bool = True

    def validate(self) -> None:
        super().validate()
        if self.proxy_size < 1:
            raise ValueError(f"proxy_size must be an integer >= 1 (prompt queries that score the tokens), "
                             f"got {self.proxy_size!r}")

    def check_prompt(self, prompt_len: int) -> None:
        super().check_prompt(prompt_len)
        if self.proxy_size != self.__dataclass_fields__["proxy_size"].default and self.proxy_size > prompt_len:
            raise ValueError(f"proxy_size {self.proxy_size} is longer than the {prompt_len}-token prompt: the run would "
                             f"score with all {prompt_len} queries under a label that says {self.proxy_size}; use "
                             f"proxy_size <= {prompt_len}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        n = ctx.keys.shape[2]
        proxies = window_attention(ctx.queries, ctx.keys, ctx.real, min(self.proxy_size, n),
                                   ctx.pattern if self.proxy_causal else None, self.proxy_causal, ctx.form)
        return proxies.sum(dim=2)  # [B, Hq, n]
