"""A decode budget: the cache re-selects (kept prompt + generated tokens) while generating (docs/decoding.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pyramidkv.capabilities.base import Capability, Conflict
from pyramidkv.components import ModelShape


@dataclass(frozen=True)
class DecodeBudget(Capability):
    """Compression during decoding.

    decode_budget: tokens per stored head the cache may hold while generating (none: no compression
        during decoding). With it every layer re-selects (kept prompt + generated tokens) down to
        decode_budget with the method's scorer whenever a head would hold decode_budget +
        decode_interval tokens (docs/decoding.md). A method's own default may leave it None inside the unit
        for "the method's budget", filled in when the method is built (tova).
    decode_interval: new tokens between two decode-time compressions, only with decode_budget (the
        memory overshoot is at most this many tokens per head, and each re-selection is amortised over
        them).
    decode_query_window: the most recent queries buffered as the observation window of a decode-time
        re-selection (none: max(window_size, 1), the prefill window).
    """

    name = "decode"
    axis = "decode"
    title = "decode_budget (compression during decoding)"
    switch = "decode_budget"
    store_abilities = ("reselect",)
    conflicts = (Conflict("key_channel_ratio", lambda m: m.channels is not None, "thin keys are not re-selected"),)
    decode_budget: Optional[int] = None
    decode_interval: int = 32
    decode_query_window: Optional[int] = None

    def validate(self) -> None:
        if self.decode_interval < 1:
            raise ValueError(f"decode_interval must be an integer >= 1 (new tokens between two decode-time "
                             f"compressions), got {self.decode_interval!r}")
        if self.decode_query_window is not None and self.decode_query_window < 1:
            raise ValueError(f"decode_query_window must be an integer >= 1 (queries buffered for a decode-time "
                             f"re-selection) or none, got {self.decode_query_window!r}")
        if self.decode_budget is not None and self.decode_budget < 1:
            raise ValueError(f"decode_budget must be an integer >= 1 (tokens per head held while decoding), "
                             f"got {self.decode_budget!r}")
        if self.decode_budget is None:   # a method's default, filled in from its budget (check_with)
            return
        most = self.decode_budget + self.decode_interval
        if self.decode_query_window is not None and self.decode_query_window > most:
            raise ValueError(f"decode_query_window {self.decode_query_window} is more than a head ever holds at a "
                             f"re-selection (decode_budget + decode_interval = {most}): it would act as {most}; use "
                             f"at most {most}")

    def check_with(self, method) -> None:
        if self.decode_budget is None:
            raise ValueError(f"decode_budget must be an integer >= 1 (tokens per head held while decoding), "
                             f"got None")
        if not method.sizing.evicts:
            raise ValueError(f"{method.name} keeps every token and has no scorer to choose which to keep while "
                             f"decoding; it takes no decode_budget (got {self.decode_budget}); use e.g. "
                             f"streamingllm, h2o or snapkv with decode_budget")
        if self.decode_budget < method.protected_tokens:
            raise ValueError(f"decode_budget {self.decode_budget} is smaller than window_size {method.window_size} + "
                             f"num_sinks {method.selection.num_sinks}; the window and the sinks are always kept, so "
                             f"decode_budget must be >= {method.protected_tokens}")

    def check_model(self, model: ModelShape, method=None) -> None:
        most = self.decode_budget + self.decode_interval
        if model.context_window and most > model.context_window:
            raise ValueError(f"decode_budget {self.decode_budget} + decode_interval {self.decode_interval} = {most} is "
                             f"more than a head can hold in the model's context window ({model.context_window} tokens): "
                             f"the cache would never re-select while decoding; use decode_budget + decode_interval <= "
                             f"{model.context_window}")
