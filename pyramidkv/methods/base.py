"""What a compression method is: a scorer plus a budget split, with its defaults in one dataclass.

A method answers three questions:
  * `score(ctx)`: how important each prompt token is (higher = keep), the one function to write;
  * its `layer_allocation`: how many tokens each layer keeps (`layer_budgets`);
  * its `head_allocation`: how a layer's tokens are split across its heads (`head_budgets`).
The allocations are allocator objects from `pyramidkv.allocation` (uniform unless the method or
the user picks another). The shared core (`pyramidkv.core`) turns the answers into a smaller
cache: selection, GQA layout, eviction and storage are the same for every method.

Methods are frozen dataclasses: settings are checked once, by type and range, when the
method is built, and cannot change afterwards (`dataclasses.replace(method, kernel_size=5)`
derives a variant, checked the same way).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.allocation.base import HeadAllocation, LayerAllocation, ModelShape
from pyramidkv.allocation.uniform import UniformHeads, UniformLayers
from pyramidkv.merging.base import MergeRule
from pyramidkv.quantization.base import Quantizer

GQA_LAYOUTS = ("kv_head", "query_head")
GQA_REDUCTIONS = ("mean", "max", "sum")


@dataclass
class ScoreContext:
    """Everything a scorer may look at for one layer at prefill.

    queries: [B, Hq, n, D] and keys/values: [B, Hkv, n, D], after RoPE.
    real: [B, n] bool, False at left padding.
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    real: torch.Tensor


@dataclass
class DecodeScoreContext(ScoreContext):
    """What a method's `decode_score` sees when the cache re-selects during decoding (one layer).

    Each row is one stored head of one prompt (prompt-major): keys/values [R, 1, m, D] hold the
    tokens the head holds now (kept prompt tokens, then generated ones), in position order and
    left-padded to a common m (real [R, m] False there). queries [R, g, m, D]: only the last
    min(window, m) rows are real queries, those of the most recent tokens (g = the query heads
    of the stored head: the GQA group in the kv_head layout, 1 in query_head); earlier rows are 0.
    positions: [R, m] true positions (0 = first real prompt token; -1 at padding).
    accumulated: [R, g, m] attention each held token has received from every query since it
    was appended (prompt queries included), for methods with `accumulates_attention`; else None.
    """

    positions: Optional[torch.Tensor] = None
    accumulated: Optional[torch.Tensor] = None


# Settings named with their command-line flag in errors.
SETTING_LABELS = {"budget": "budget (max_capacity_prompts)", "budget_ratio": "budget_ratio (max_capacity_prompts_ratio)"}


class SettingTypeError(TypeError, ValueError):
    """A method setting of the wrong type (a ValueError too, so callers catching bad settings catch it)."""


def _type_error(owner: str, field: str, value, expected: str) -> SettingTypeError:
    return SettingTypeError(f"{owner}: {SETTING_LABELS.get(field, field)} must be {expected}, "
                            f"got {value!r} ({type(value).__name__})")


def check_setting_type(owner: str, field: str, value, annotation) -> None:
    """Check one setting against its annotation: int (not bool), float (finite, int allowed), str,
    bool, a class (an instance of it), or Optional[...] of those. Raises SettingTypeError naming
    the owner, the setting and the value."""
    if typing.get_origin(annotation) is typing.Union:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return
        annotation = options[0]
    if annotation is bool:
        if not isinstance(value, bool):
            raise _type_error(owner, field, value, "True or False")
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(owner, field, value, "an integer")
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _type_error(owner, field, value, "a finite number")
    elif annotation is str:
        if not isinstance(value, str):
            raise _type_error(owner, field, value, "a string")
    elif isinstance(annotation, type) and not isinstance(value, annotation):
        raise _type_error(owner, field, value, f"a {annotation.__name__}")


def check_setting_types(obj, owner: str) -> None:
    """check_setting_type for every field of a settings dataclass."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        check_setting_type(owner or type(obj).__name__, f.name, getattr(obj, f.name), hints[f.name])


@dataclass(frozen=True)
class Method:
    """Base of all methods.

    budget: tokens kept per layer per head, window included (the CLI's
        `--max_capacity_prompts`). budget_ratio: the same as a fraction of each
        prompt's length (`--max_capacity_prompts_ratio`). Exactly one is set,
        except for methods that keep everything.
    gqa_layout: "kv_head" keeps one set per KV head (scores reduced over the
        query group with `gqa_reduce`); "query_head" repeats K/V to the query
        heads first, as the published baselines do (costs g x the memory).
    head_allocation, layer_allocation: how the budget is split (pyramidkv.allocation).
    merge: what happens to evicted tokens: None drops them; a merge rule (pyramidkv.merging,
        by name or object) folds them into the kept ones without changing which are kept.
    quant_method: how the kept tokens are stored: None in the model dtype; a quantizer
        (pyramidkv.quantization, by name or object: kivi, kvquant, gear) stores the kept prompt
        tokens and the generated ones in packed low-bit codes outside a full-precision recent window.
    decode_budget: tokens per stored head the cache may hold while generating (None: no
        compression during decoding; the prompt part is compressed once, generated tokens are
        all kept). With it, every layer re-selects (kept prompt + generated tokens) down to
        decode_budget with `decode_score` whenever a head would hold decode_budget +
        decode_interval tokens (see pyramidkv/core/decoding.py and docs/decoding.md).
    decode_interval: new tokens between two decode-time compressions (default 32: the memory
        overshoot is at most 32 tokens per head, and each re-selection, O(decode_budget) work
        per layer, is amortised over 32 steps).
    """

    name: ClassVar[str] = ""
    needs_budget: ClassVar[bool] = True
    # During decoding the cache accumulates the attention every held token receives (H2O) and
    # passes it to decode_score as ctx.accumulated; costs one extra attention pass per step.
    accumulates_attention: ClassVar[bool] = False

    budget: Optional[int] = None
    budget_ratio: Optional[float] = None
    window_size: int = 32
    gqa_layout: str = "kv_head"
    gqa_reduce: str = "mean"
    head_allocation: HeadAllocation = UniformHeads()
    layer_allocation: LayerAllocation = UniformLayers()
    merge: Optional[MergeRule] = None
    quant_method: Optional[Quantizer] = None
    decode_budget: Optional[int] = None
    decode_interval: int = 32

    def __post_init__(self) -> None:
        from pyramidkv.allocation import make_head_allocation, make_layer_allocation

        # An allocation may be given by name ("adakv"): it gets that allocator with its defaults.
        if isinstance(self.head_allocation, str):
            object.__setattr__(self, "head_allocation", make_head_allocation(self.head_allocation))
        if isinstance(self.layer_allocation, str):
            object.__setattr__(self, "layer_allocation", make_layer_allocation(self.layer_allocation))
        if isinstance(self.merge, str):
            from pyramidkv.merging import make_merge_rule

            object.__setattr__(self, "merge", make_merge_rule(self.merge))
        if isinstance(self.quant_method, str):
            from pyramidkv.quantization import make_quantizer

            object.__setattr__(self, "quant_method", make_quantizer(self.quant_method))
        check_setting_types(self, self.name)
        self.validate()

    # --- the two questions a method answers -------------------------------------------------
    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hq or Hkv, n] importance of each prompt position (higher = keep)."""
        raise NotImplementedError

    def decode_score(self, ctx: "DecodeScoreContext") -> torch.Tensor:
        """[R, g or 1, m] importance of each held token when the cache re-selects during decoding
        (only with decode_budget). Default, for methods that declare nothing else: the attention
        of the most recent max(window_size, 1) queries to each held token, summed over them
        (SnapKV's window score without pooling). Methods whose `score` reads only the last
        window_size queries (or none) use it as is; H2O returns the accumulated attention."""
        from pyramidkv.core.scoring import window_attention

        return window_attention(ctx.queries, ctx.keys, ctx.real, max(self.window_size, 1)).sum(dim=2)

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int,
                      layer_scores: Optional[list[torch.Tensor]] = None) -> list[int]:
        """Tokens kept by each layer (window included) for a prompt of `prompt_len` real tokens,
        called only when prompt_len > budget: the window plus the layer allocation's share.
        layer_scores (per layer [H, prompt_len - window]) only for allocations that need them.
        A layer given `prompt_len` keeps the whole prompt."""
        selected = self.layer_allocation.selected_per_layer(budget - self.window_size, num_layers, prompt_len,
                                                            prompt_len - self.window_size, layer_scores)
        return [self.window_size + count for count in selected]

    def head_budgets(self, scores: torch.Tensor, layer_budget: int, layer_idx: int, model: ModelShape) -> list[int]:
        """Tokens kept by each stored head of a layer (window included), summing to H x layer_budget.
        scores: [H, candidates] of one prompt (the window excluded)."""
        if isinstance(self.head_allocation, UniformHeads):
            return [layer_budget] * scores.shape[0]
        selected = self.head_allocation.selected_per_head(scores, layer_budget - self.window_size, layer_idx, model)
        return [self.window_size + count for count in selected]

    # --- budget handling ---------------------------------------------------------------------
    def prompt_budget(self, real_len: int) -> int:
        """The per-layer budget for a prompt of `real_len` tokens."""
        if self.budget is not None:
            return self.budget
        return max(self.window_size, round(self.budget_ratio * real_len), 1)

    def validate(self) -> None:
        if self.gqa_layout not in GQA_LAYOUTS:
            raise ValueError(f"gqa_layout must be one of {'|'.join(GQA_LAYOUTS)}, got {self.gqa_layout!r}")
        if self.gqa_reduce not in GQA_REDUCTIONS:
            raise ValueError(f"gqa_reduce must be one of {'|'.join(GQA_REDUCTIONS)}, got {self.gqa_reduce!r}")
        if self.window_size < 0:
            raise ValueError(f"window_size must be an integer >= 0, got {self.window_size!r}")
        if self.head_allocation.global_over_layers and not isinstance(self.layer_allocation, UniformLayers):
            raise ValueError(f"head_allocation={self.head_allocation.name!r} splits the budget over all layers and "
                             f"heads at once; it cannot be combined with layer_allocation="
                             f"{self.layer_allocation.name!r} (use layer_allocation='uniform')")
        if not self.needs_budget:
            if not isinstance(self.head_allocation, UniformHeads) or not isinstance(self.layer_allocation, UniformLayers):
                raise ValueError(f"{self.name} keeps every token; it takes no budget allocation (got head_allocation="
                                 f"{self.head_allocation.name!r}, layer_allocation={self.layer_allocation.name!r})")
            if self.budget is not None or self.budget_ratio is not None:
                raise ValueError(f"{self.name} keeps every token; it takes no budget (got budget={self.budget}, "
                                 f"budget_ratio={self.budget_ratio})")
            if self.merge is not None:
                raise ValueError(f"{self.name} keeps every token, so it evicts none to merge; it takes no merge "
                                 f"rule (got merge={self.merge.name!r})")
            if self.decode_budget is not None:
                raise ValueError(f"{self.name} keeps every token and has no scorer to choose which to keep while "
                                 f"decoding; it takes no decode_budget (got {self.decode_budget}); use e.g. "
                                 f"streamingllm, h2o or snapkv with decode_budget")
            self._validate_decode_settings()
            return
        self._validate_decode_settings()
        if self.merge is not None:
            self.merge.check_method(self)
        if (self.budget is None) == (self.budget_ratio is None):
            raise ValueError(f"{self.name} needs exactly one of budget (max_capacity_prompts) or budget_ratio "
                             f"(max_capacity_prompts_ratio); got budget={self.budget}, budget_ratio={self.budget_ratio}")
        if self.budget is not None:
            if self.budget < 1:
                raise ValueError(f"budget (max_capacity_prompts) must be an integer >= 1, got {self.budget!r}")
            if self.budget < self.window_size:
                raise ValueError(f"budget (max_capacity_prompts) {self.budget} is smaller than window_size "
                                 f"{self.window_size}; the budget includes the window, so it must be >= {self.window_size}")
        else:
            if not (0.0 < self.budget_ratio <= 1.0):
                raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) must be in (0, 1], got {self.budget_ratio!r}")

    def _validate_decode_settings(self) -> None:
        if self.decode_interval < 1:
            raise ValueError(f"decode_interval must be an integer >= 1 (new tokens between two decode-time "
                             f"compressions), got {self.decode_interval!r}")
        if self.decode_budget is None:
            default = type(self).__dataclass_fields__["decode_interval"].default
            if self.decode_interval != default:
                raise ValueError(f"decode_interval={self.decode_interval} only applies with decode_budget "
                                 f"(compression during decoding); set decode_budget too, or leave decode_interval out")
            return
        if self.quant_method is not None:
            raise ValueError(f"decode_budget (compression during decoding) does not combine with quant_method="
                             f"{self.quant_method.name!r} yet (a quantized cache is never re-selected); use one of them")
        if self.decode_budget < 1:
            raise ValueError(f"decode_budget must be an integer >= 1 (tokens per head held while decoding), "
                             f"got {self.decode_budget!r}")
        if self.decode_budget < self.window_size:
            raise ValueError(f"decode_budget {self.decode_budget} is smaller than window_size {self.window_size}; "
                             f"the most recent window is always kept, so decode_budget must be >= {self.window_size}")

    def describe(self) -> dict:
        """The full configuration, for run_meta.json (allocations as {"name", settings...})."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        settings["head_allocation"] = self.head_allocation.describe()
        settings["layer_allocation"] = self.layer_allocation.describe()
        settings["merge"] = None if self.merge is None else self.merge.describe()
        settings["quant_method"] = None if self.quant_method is None else self.quant_method.describe()
        return {"method": self.name, **settings}
