"""The knobs of the one selection rule every method uses (pyramidkv/core/selection.py): sinks and the random
share (NACL's random eviction, Chen et al., ACL 2024)."""

from __future__ import annotations

from dataclasses import dataclass

from pyramidkv.capabilities.base import Capability, fixed_budget, prompt_kept
from pyramidkv.components import ModelShape


@dataclass(frozen=True)
class Selection(Capability):
    """Which prompt tokens a head keeps besides the window and the best by score.

    num_sinks: the first prompt tokens (attention sinks) every head keeps, like the window, whatever their
        scores (StreamingLLM's sinks; 0: none). The budget includes them.
    random_fraction: the share of each head's selected tokens (budget minus window and sinks) drawn at
        prefill without replacement from softmax(score) over the tokens the top share left, instead of
        taken by score (NACL's random eviction; 0: all by score).
    random_seed: seeds the random share: one generator per (seed, layer, stored head), fresh for every
        prompt, so a prompt draws the same tokens in any batch.
    """

    name = "topk"
    axis = "selection"
    title = "the selection rule"
    num_sinks: int = 0
    random_fraction: float = 0.0
    random_seed: int = 0

    def validate(self) -> None:
        if self.num_sinks < 0:
            raise ValueError(f"num_sinks must be an integer >= 0 (first prompt tokens always kept), "
                             f"got {self.num_sinks!r}")
        if not 0.0 <= self.random_fraction < 1.0:
            raise ValueError(f"random_fraction must be in [0, 1) (share of the selected tokens drawn at random), "
                             f"got {self.random_fraction!r}")
        if self.random_seed < 0 or self.random_seed >= 2 ** 63:
            raise ValueError(f"random_seed must be an integer in [0, 2^63), got {self.random_seed!r}")
        if self.random_seed != 0 and self.random_fraction == 0.0:
            raise ValueError(f"random_seed={self.random_seed} has no effect without random_fraction (it seeds the "
                             f"random share, and random_fraction is 0: every token is taken by score); set "
                             f"random_fraction too, or leave random_seed out")

    def _check_draws(self, selected: int, where: str) -> None:
        drawn = int(self.random_fraction * selected + 1e-9)    # core/selection.py's count
        if self.random_fraction > 0.0 and selected > 0 and drawn == 0:
            raise ValueError(f"random_fraction {self.random_fraction:g} of the {selected} tokens each head selects "
                             f"({where}) draws floor({self.random_fraction * selected:.3g}) = 0 at random: nothing "
                             f"would be random; use random_fraction >= {1 / selected:.4g} or a larger budget")

    def check_with(self, method) -> None:
        if not method.sizing.evicts and (self.num_sinks or self.random_fraction):
            raise ValueError(f"{method.name} keeps every token; it takes no num_sinks or random_fraction "
                             f"(got num_sinks={self.num_sinks}, random_fraction={self.random_fraction:g})")
        budget = fixed_budget(method)
        if budget is not None:
            self._check_draws(budget - method.protected_tokens, f"budget {budget} - window {method.window_size} - "
                                                               f"sinks {self.num_sinks}")

    def check_model(self, model: ModelShape, method=None) -> None:
        context = model.context_window
        if method is None or not method.sizing.evicts or not context:
            return
        if method.protected_tokens >= context:
            raise ValueError(f"window_size {method.window_size} + num_sinks {self.num_sinks} = {method.protected_tokens} "
                             f"tokens every head keeps whatever their scores is at least the model's context window "
                             f"({context} tokens): every token of any prompt would be kept (that is fullkv); use "
                             f"window_size + num_sinks < {context}")

    def check_prompt(self, prompt_len: int, method=None) -> None:
        if method is None or not method.sizing.evicts or fixed_budget(method) is not None:
            return
        kept = prompt_kept(method, prompt_len)
        if kept < prompt_len:
            self._check_draws(kept - method.protected_tokens, f"of a {prompt_len}-token prompt: {kept} kept - window "
                                                              f"{method.window_size} - sinks {self.num_sinks}")
