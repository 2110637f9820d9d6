"""What a compression method is: a scorer plus units on composable axes, with its defaults in one dataclass.

A method answers three questions, for the tokens its `sizing` keeps (pyramidkv/sizing: a budget in tokens, a
ratio, everything, or what passes a threshold):
  * `score(ctx)`: how important each prompt token is (higher = keep), the one function to write;
  * its `layer_allocation`: how many tokens each layer keeps (`layer_budgets`);
  * its `head_allocation`: how a layer's tokens are split across its heads (`head_budgets`).
Every other choice is a unit on its own axis (one field each, None: off): the merge rule, the quantizer,
the sparse prefill, and the capabilities (pyramidkv.capabilities): the selection rule's knobs, a decode
budget, Quest's page selection, ThinK's key channels, MiniCache's layer sharing. A capability's settings
read as the method's own (`page_size=8`, `decode_budget=64`). The shared core (`pyramidkv.core`) turns the
answers into a smaller cache.

Methods are frozen dataclasses: settings are checked once, by type and range, when the method is built,
and what the units cannot compose with is refused then, in one line (composition.py), never mid-generation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.allocation import make_head_allocation, make_layer_allocation
from pyramidkv.allocation.base import HeadAllocation, LayerAllocation, ModelShape
from pyramidkv.allocation.uniform import UniformHeads, UniformLayers
from pyramidkv.capabilities import (Capability, DecodeBudget, MiniCacheSharing, QuestPages, Selection, ThinKChannels,
                                    capability_class, make_capability)
from pyramidkv.components import Component
from pyramidkv.core.context import DecodeScoreContext, ScoreContext
from pyramidkv.merging import make_merge_rule
from pyramidkv.merging.base import MergeRule
from pyramidkv.methods.composition import check_allocation, check_nothing_evicted, check_units
from pyramidkv.quantization import make_quantizer
from pyramidkv.quantization.base import Quantizer
from pyramidkv.sparse_prefill import make_sparse_prefill
from pyramidkv.sparse_prefill.base import SparsePrefill
from pyramidkv.sizing import FlatSizing, Sizing, Tokens, make_sizing

GQA_LAYOUTS = ("kv_head", "query_head")
GQA_REDUCTIONS = ("mean", "max", "sum")
CAPABILITY_AXES = ("decode", "selection", "channels", "pages", "layer_sharing")
# Every unit axis, in the order a method's refusals name two units that need different stores (capabilities first).
UNIT_MAKERS = {"sizing": make_sizing, "head_allocation": make_head_allocation, "layer_allocation": make_layer_allocation,
               "merge": make_merge_rule, "prefill_attention": make_sparse_prefill,
               **{axis: (lambda name, axis=axis: make_capability(axis, name)) for axis in CAPABILITY_AXES},
               "quant_method": make_quantizer}


@dataclass(frozen=True)
class Method(Component, metaclass=FlatSizing):
    """Base of all methods.

    sizing: how many tokens each head keeps (pyramidkv/sizing), chosen by the setting given: budget (tokens),
        budget_ratio (a fraction of each prompt), threshold (what passes it); a method that keeps every token
        has keep_all.
    window_size: the most recent prompt tokens, always kept (the observation window of the scorers
        that read attention).
    gqa_layout: kv_head keeps one set per KV head (scores reduced over the query group with
        gqa_reduce); query_head repeats K/V to the query heads first, as the published baselines do
        (costs g x the memory).
    gqa_reduce: how a query group's scores become one KV head's: mean, max or sum.
    head_allocation: how a layer's budget is split across its heads (pyramidkv.allocation).
    layer_allocation: how the budget is split across layers (pyramidkv.allocation).
    merge: what happens to evicted tokens: none drops them; a merge rule (pyramidkv.merging) folds them
        into the kept ones without changing which are kept.
    quant_method: how the kept tokens are stored: none in the model dtype; a quantizer
        (pyramidkv.quantization) stores the kept prompt tokens and the generated ones in packed low-bit
        codes outside a full-precision recent window.
    decode: compression during decoding (pyramidkv.capabilities; on with decode_budget; none: off).
    selection: the knobs of the one selection rule (num_sinks, random_fraction, random_seed).
    channels: ThinK's key-channel pruning (on with key_channel_ratio; none: off).
    pages: Quest's decode-time page selection (on with page_budget; none: off).
    layer_sharing: MiniCache's cross-layer merging (on with cross_layer_merge=true; none: off).
    prefill_attention: how the prompt's attention is computed (none: the model's own dense attention); a
        sparse prefill (pyramidkv.sparse_prefill) computes only its pattern's entries, and the
        scorers' attention statistics count those entries only.
    """

    kind_key = "method"
    label_separator = "_"
    unlabelled = ("budget", "budget_ratio")
    setting_labels = {"budget": "budget (max_capacity_prompts)", "budget_ratio": "budget_ratio (max_capacity_prompts_ratio)"}
    # What the scorer reads besides q/k/v (core/context.py): the attention each held token accumulates while
    # decoding (H2O), the column sums of the prompt's attention from the prefill pass itself (H2O), each held
    # token's attention from the last w queries (Scissorhands), the model's RoPE (Expected Attention).
    accumulates_attention: ClassVar[bool] = False
    needs_column_sums: ClassVar[bool] = False
    history_window: ClassVar[Optional[int]] = None
    reconstructs: ClassVar[bool] = False   # scored by the model repeating the prompt's context (KVzip)
    global_scale: ClassVar[str] = "zscore"  # how head_allocation global compares layers' scores (global_.py)
    needs_rotation: ClassVar[bool] = False  # the scorer reads queries before RoPE or RoPE elsewhere (patch.py)
    needs_hidden: ClassVar[bool] = False    # the scorer reads the attention input (ScoreContext.hidden: KVzap)
    token_scores: ClassVar[bool] = False    # a token's score reads that token alone (threshold decoding needs it)
    newest_row_score = None   # decode score from the newest query's attention rows alone, [B, Hq, m] -> [B, 1, m] (TOVA)
    score_bounds: ClassVar[Optional[tuple[float, float]]] = None   # [low, high] every score lies in, if known
    decodes_at_budget: ClassVar[bool] = False   # evicts while decoding by its own rule (a ratio sets decode_budget)
    refuses: ClassVar[dict[str, str]] = {}  # setting -> why it is refused (composition.check_refused; not in --help)
    flat_units = {"sizing": Sizing, **{axis: capability_class(axis) for axis in CAPABILITY_AXES}}

    sizing: Sizing = Tokens()
    window_size: int = 32
    gqa_layout: str = "kv_head"
    gqa_reduce: str = "mean"
    head_allocation: HeadAllocation = UniformHeads()
    layer_allocation: LayerAllocation = UniformLayers()
    merge: Optional[MergeRule] = None
    quant_method: Optional[Quantizer] = None
    decode: Optional[DecodeBudget] = None
    selection: Selection = Selection()
    channels: Optional[ThinKChannels] = None
    pages: Optional[QuestPages] = None
    layer_sharing: Optional[MiniCacheSharing] = None
    prefill_attention: Optional[SparsePrefill] = None

    def __post_init__(self) -> None:
        # A unit may be given by name ("adakv"): it gets that unit with its defaults.
        for setting, make in UNIT_MAKERS.items():
            if isinstance(getattr(self, setting), str):
                object.__setattr__(self, setting, make(getattr(self, setting)))
        super().__post_init__()

    # --- the two questions a method answers -------------------------------------------------
    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hq or Hkv, n] importance of each prompt position (higher = keep)."""
        raise NotImplementedError

    def decode_score(self, ctx: DecodeScoreContext) -> torch.Tensor:
        """Importance of each held token when the cache re-selects during decoding (with a decode budget), in score()'s
        layout (core/context.py). By default the method's own `score` over the held tokens (the buffered recent
        queries as the observation window); others override it (H2O: the attention each token accumulated)."""
        return self.score(ctx)

    @property
    def layer_budgets_need_scores(self) -> bool:
        return self.layer_allocation.needs_scores or self.head_allocation.needs_scores

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int,
                      layer_scores: Optional[list[torch.Tensor]] = None) -> list:
        """Tokens kept by each layer (window included) for a prompt of `prompt_len` real tokens, called only when
        prompt_len > budget: the window plus the layer allocation's share; a layer given `prompt_len` (l2norm's
        `whole_layers`) keeps the whole prompt. Where one budget spans every layer (head_allocation global) each
        other layer's entry is its stored heads' counts. layer_scores (per layer [H, candidates]) only for
        allocations that need them."""
        protected, whole = self.protected_tokens, self.whole_layers(num_layers)
        if self.sizing.outcome:   # threshold: the window and sinks, then each head what passes
            return [prompt_len if layer in whole else protected for layer in range(num_layers)]
        selected = self.layer_allocation.selected_per_layer(budget - protected, num_layers, prompt_len,
                                                            prompt_len - protected, layer_scores)
        budgets = [prompt_len if layer in whole else protected + count for layer, count in enumerate(selected)]
        if not self.head_allocation.needs_scores or layer_scores is None:
            return budgets
        split = iter(self.head_allocation.selected_over_layers(
            [s for layer, s in enumerate(layer_scores) if layer not in whole], budget - protected, self.global_scale))
        return [b if layer in whole else [protected + c for c in next(split)] for layer, b in enumerate(budgets)]

    def whole_layers(self, num_layers: int) -> range:
        """The layers that keep the whole prompt (none; l2norm: its skipped layers)."""
        return range(0)

    def head_budgets(self, scores: torch.Tensor, layer_budget: int, layer_idx: int, model: ModelShape) -> list[int]:
        """Tokens kept by each stored head of a layer (window, sinks included; sum H x layer_budget); scores [H, cands]."""
        protected = self.protected_tokens
        if self.sizing.outcome:   # threshold: each head what passes
            return [protected + count for count in self.sizing.selected_per_head(scores)]
        if isinstance(self.head_allocation, UniformHeads):
            return [layer_budget] * scores.shape[0]
        selected = self.head_allocation.selected_per_head(scores, layer_budget - protected, layer_idx, model, protected)
        return [protected + count for count in selected]

    @property
    def protected_tokens(self) -> int:
        """Tokens every compressed head keeps whatever their scores: the window and the sinks."""
        return self.window_size + self.selection.num_sinks

    def prompt_budget(self, real_len: int) -> int:
        """The per-layer budget for a prompt of `real_len` tokens (its sizing's count; all of it for keep_all)."""
        return self.sizing.per_prompt(real_len, self)

    def __getattr__(self, name: str):   # only for names that are no attribute: a capability's settings
        if name.startswith("_"):
            raise AttributeError(name)
        return self.setting(name)

    def held_units(self) -> list[tuple[str, Component]]:
        """(the setting that turns it on, unit) for every unit on the method's axes that is on, in field order: a
        capability by its switch (page_budget), another unit by its axis (quant_method)."""
        return [(getattr(unit, "switch", "") or axis, unit) for axis in UNIT_MAKERS
                if (unit := getattr(self, axis)) is not None]

    @property
    def units(self) -> list[Component]:
        """Every unit the method holds (what core/store_kinds.py asks for store kinds and abilities)."""
        return [unit for _, unit in self.held_units()]

    @property
    def capabilities(self) -> list[Capability]:
        return [unit for unit in (getattr(self, axis) for axis in CAPABILITY_AXES) if unit is not None]

    # --- checks before anything runs ------------------------------------------------------------
    def check_model(self, model: ModelShape) -> None:
        """ValueError if the method cannot do what its settings say on this model (the runners call it before
        the weights load, compress() when it patches): a head-score table that does not fit, quantizer
        settings the head dim or dtype defeat, ..."""
        self.head_allocation.check_model(model)
        self.layer_allocation.check_model(model)
        self.sizing.check_model(model, self)
        if self.quant_method is not None:
            self.quant_method.check_model(model.head_dim, model.dtype_bytes, model.context_window)
            self.quant_method.check_layers(model.form.windows)
        for unit in self.capabilities:
            unit.check_model(model, self)
        if self.prefill_attention is not None:  # e.g. a pattern table of another model
            self.prefill_attention.check_model(model)

    def normalized(self, model: ModelShape) -> "Method":
        """The same method with each unit's setting at its model default written as that default, and a path to its
        packaged file left out (Component.with_packaged_defaults): a run is named by its effective configuration."""
        method = self.with_packaged_defaults(model)
        changes = {}
        for axis in CAPABILITY_AXES:
            unit = getattr(method, axis)
            if unit is not None and unit.normalized(model) != unit:
                changes[axis] = unit.normalized(model)
        return dataclasses.replace(method, **changes) if changes else method

    def check_prompt(self, prompt_len: int) -> None:
        """ValueError if on a prompt of `prompt_len` tokens the method would not do what its settings say
        (a ratio budget that resolves below the window is not silently raised to it)."""
        for unit in self.capabilities:
            unit.check_prompt(prompt_len, self)
        if self.prefill_attention is not None:
            self.prefill_attention.check_prompt(prompt_len)
        self.sizing.check_prompt(prompt_len, self)

    def validate(self) -> None:
        if self.gqa_layout not in GQA_LAYOUTS:
            raise ValueError(f"gqa_layout must be one of {'|'.join(GQA_LAYOUTS)}, got {self.gqa_layout!r}")
        if self.gqa_reduce not in GQA_REDUCTIONS:
            raise ValueError(f"gqa_reduce must be one of {'|'.join(GQA_REDUCTIONS)}, got {self.gqa_reduce!r}")
        if self.window_size < 0:
            raise ValueError(f"window_size must be an integer >= 0, got {self.window_size!r}")
        check_units(self)
        check_allocation(self)
        if self.prefill_attention is not None and self.history_window is not None:
            raise ValueError(f"prefill_attention={self.prefill_attention.name!r} does not combine with {self.name}: its "
                             f"uniform level counts every key a prompt row attends, not a sparse head's")
        if self.quant_method is not None:
            self.quant_method.check_budget(self.sizing.fixed_count())
        if not self.sizing.evicts:   # the checks of a method that keeps every token: its own validate (fullkv.py)
            check_nothing_evicted(self)
            return
        self.sizing.check_with(self)
        if self.merge is not None:
            self.merge.check_method(self)
