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

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.allocation import make_head_allocation, make_layer_allocation
from pyramidkv.allocation.base import HeadAllocation, LayerAllocation, ModelShape
from pyramidkv.allocation.uniform import UniformHeads, UniformLayers
from pyramidkv.components import Component
from pyramidkv.core.context import DecodeScoreContext, ScoreContext
from pyramidkv.core.pages import PAGE_SELECTIONS
from pyramidkv.merging import make_merge_rule
from pyramidkv.merging.base import MergeRule
from pyramidkv.quantization import make_quantizer
from pyramidkv.quantization.base import Quantizer
from pyramidkv.sparse_prefill import make_sparse_prefill
from pyramidkv.sparse_prefill.base import SparsePrefill

GQA_LAYOUTS = ("kv_head", "query_head")
GQA_REDUCTIONS = ("mean", "max", "sum")


@dataclass(frozen=True)
class Method(Component):
    """Base of all methods. Exactly one of budget and budget_ratio is set, except for methods that keep
    everything.

    budget: tokens kept per layer per head of each prompt, observation window included.
    budget_ratio: the budget as a fraction of each prompt's length, in (0, 1]; it must give at least
        the window on every prompt.
    window_size: the most recent prompt tokens, always kept (the observation window of the scorers
        that read attention).
    gqa_layout: kv_head keeps one set per KV head (scores reduced over the query group with
        gqa_reduce); query_head repeats K/V to the query heads first, as the published baselines do
        (costs g x the memory).
    gqa_reduce: how a query group's scores become one KV head's: mean, max or sum.
    head_allocation: how a layer's budget is split across its heads (pyramidkv.allocation): uniform,
        adakv, headkv.
    layer_allocation: how the budget is split across layers: uniform, pyramid, zigzag.
    merge: what happens to evicted tokens: none drops them; a merge rule (pyramidkv.merging: pivot,
        weighted, mergingpress, cam) folds them into the kept ones without changing which are kept.
    quant_method: how the kept tokens are stored: none in the model dtype; a quantizer
        (pyramidkv.quantization: kivi, kvquant, gear) stores the kept prompt tokens and the generated
        ones in packed low-bit codes outside a full-precision recent window.
    decode_budget: tokens per stored head the cache may hold while generating (none: no compression
        during decoding). With it every layer re-selects (kept prompt + generated tokens) down to
        decode_budget with the method's scorer whenever a head would hold decode_budget +
        decode_interval tokens (docs/decoding.md).
    decode_interval: new tokens between two decode-time compressions, only with decode_budget (the
        memory overshoot is at most this many tokens per head, and each re-selection is amortised over
        them).
    num_sinks: the first prompt tokens (attention sinks) every head keeps, like the window, whatever their
        scores (StreamingLLM's sinks; 0: none). The budget includes them.
    random_fraction: the share of each head's selected tokens (budget minus window and sinks) drawn at
        prefill without replacement from softmax(score) over the tokens the top share left, instead of
        taken by score (NACL's random eviction; 0: all by score).
    random_seed: seeds the random share: one generator per (seed, layer, stored head), fresh for every
        prompt, so a prompt draws the same tokens in any batch.
    key_channel_ratio: ThinK's key-channel pruning (lambda, the share of key channels pruned; 0: off):
        after selection each stored head keeps its D - floor(lambda D) channels with the largest
        ||Q_w[:, c]||^2 ||K_kept[:, c]||^2 and stores its kept keys that thin, values and generated
        tokens never pruned (docs/methods.md).
    key_recent_size: ThinK: the most recent kept tokens of each head whose keys stay full width.
    key_query_window: ThinK: the prompt's last queries that score the key channels (Q_w).
    page_budget: Quest's decode-time page retrieval (none: off): per stored head and decode step, attention
        reads only the tokens of the pages with the highest criticality U_p = sum_c max(q_c m_c, q_c M_c)
        (m, M: the element-wise min and max key of a page of page_size held tokens), K = min(max(
        page_min_count, floor(page_budget / page_size)), pages) of them. Nothing is evicted.
    page_size: Quest: held tokens per page.
    page_min_count: Quest: the fewest pages attended per step.
    page_keep_last: Quest: the newest token's page is always attended.
    page_dense_layers: Quest: the first layers, which attend densely (the official code: 2).
    page_selection: Quest: query_head (each query head its own pages, as the official code), group_max or
        group_mean (U reduced over the GQA group: one page set per stored head).
    cross_layer_merge: MiniCache's cross-layer merging: from cross_layer_start upward, each pair of adjacent
        layers (l - 1, l) stores per token and stored head one shared direction for its keys and one for its
        values (SLERP of the two unit vectors at cross_layer_t) and the four magnitudes; with eviction the
        pair selects once, on the sum of its two layers' scores.
    cross_layer_start: MiniCache: the first layer merged (none: the middle layer).
    cross_layer_t: MiniCache: the SLERP interpolation t between the two layers' directions.
    cross_layer_retain: MiniCache: the share of token pairs with the largest angular distance (keys and
        values separately) that keep their original vectors in both layers.
    prefill_attention: how the prompt's attention is computed (none: the model's own dense attention); a
        sparse prefill (pyramidkv.sparse_prefill: minference) computes only its pattern's entries, and the
        scorers' attention statistics count those entries only.
    """

    kind_key = "method"
    label_separator = "_"
    unlabelled = ("budget", "budget_ratio")
    setting_labels = {"budget": "budget (max_capacity_prompts)",
                      "budget_ratio": "budget_ratio (max_capacity_prompts_ratio)"}
    only_with = {"decode_interval": "decode_budget"}
    needs_budget: ClassVar[bool] = True
    # During decoding the cache accumulates the attention every held token receives (H2O) and
    # passes it to decode_score as ctx.accumulated; costs one extra attention pass per step.
    accumulates_attention: ClassVar[bool] = False
    # The score reads the column sums of the prompt's causal attention: the engine computes them in the
    # prefill attention pass itself (pyramidkv.core.scoring.attention_with_column_sums) and passes them
    # as ctx.column_sums, instead of the model's own kernel plus a second pass over the scores.
    needs_column_sums: ClassVar[bool] = False
    # With a history window w, the cache keeps each held token's attention from the last w queries and
    # passes them to decode_score as ctx.history (Scissorhands); None: it keeps none.
    history_window: ClassVar[Optional[int]] = None

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
    num_sinks: int = 0
    random_fraction: float = 0.0
    random_seed: int = 0
    key_channel_ratio: float = 0.0
    key_recent_size: int = 32
    key_query_window: int = 32
    page_budget: Optional[int] = None
    page_size: int = 16
    page_min_count: int = 3
    page_keep_last: bool = False
    page_dense_layers: int = 2
    page_selection: str = "query_head"
    cross_layer_merge: bool = False
    cross_layer_start: Optional[int] = None
    cross_layer_t: float = 0.6
    cross_layer_retain: float = 0.05
    prefill_attention: Optional[SparsePrefill] = None

    def __post_init__(self) -> None:
        # A unit may be given by name ("adakv"): it gets that unit with its defaults.
        for setting, make in (("head_allocation", make_head_allocation), ("layer_allocation", make_layer_allocation),
                              ("merge", make_merge_rule), ("quant_method", make_quantizer),
                              ("prefill_attention", make_sparse_prefill)):
            if isinstance(getattr(self, setting), str):
                object.__setattr__(self, setting, make(getattr(self, setting)))
        super().__post_init__()

    # --- the two questions a method answers -------------------------------------------------
    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hq or Hkv, n] importance of each prompt position (higher = keep)."""
        raise NotImplementedError

    def decode_score(self, ctx: DecodeScoreContext) -> torch.Tensor:
        """[R, g or 1, m] importance of each held token when the cache re-selects during decoding
        (only with decode_budget). By default the method's own `score` over the held tokens (the
        buffered recent queries as the observation window); methods that need something else
        override it (H2O: the attention each token has accumulated)."""
        return self.score(ctx)

    @property
    def selects_pages(self) -> bool:
        return self.page_budget is not None

    def decode_page_budget(self, real_len: int) -> Optional[int]:
        """Quest: tokens of the pages attended per stored head and decode step (None: everything held)."""
        return self.page_budget

    @property
    def layer_budgets_need_scores(self) -> bool:
        return self.layer_allocation.needs_scores

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int,
                      layer_scores: Optional[list[torch.Tensor]] = None) -> list[int]:
        """Tokens kept by each layer (window included) for a prompt of `prompt_len` real tokens,
        called only when prompt_len > budget: the window plus the layer allocation's share.
        layer_scores (per layer [H, prompt_len - window]) only for allocations that need them.
        A layer given `prompt_len` keeps the whole prompt."""
        protected = self.protected_tokens
        selected = self.layer_allocation.selected_per_layer(budget - protected, num_layers, prompt_len,
                                                            prompt_len - protected, layer_scores)
        return [protected + count for count in selected]

    def head_budgets(self, scores: torch.Tensor, layer_budget: int, layer_idx: int, model: ModelShape) -> list[int]:
        """Tokens kept by each stored head of a layer (window and sinks included), summing to H x layer_budget.
        scores: [H, candidates] of one prompt (the window and sinks excluded)."""
        if isinstance(self.head_allocation, UniformHeads):
            return [layer_budget] * scores.shape[0]
        protected = self.protected_tokens
        selected = self.head_allocation.selected_per_head(scores, layer_budget - protected, layer_idx, model)
        return [protected + count for count in selected]

    @property
    def protected_tokens(self) -> int:
        """Tokens every compressed head keeps whatever their scores: the window and the sinks."""
        return self.window_size + self.num_sinks

    # --- budget handling ---------------------------------------------------------------------
    def prompt_budget(self, real_len: int) -> int:
        """The per-layer budget for a prompt of `real_len` tokens."""
        if self.budget is not None:
            return self.budget
        return max(self.protected_tokens, round(self.budget_ratio * real_len), 1)

    # --- checks before anything runs ------------------------------------------------------------
    def check_model(self, model: ModelShape) -> None:
        """ValueError if the method cannot do what its settings say on this model (the runners call it before
        the weights load, compress() when it patches): a head-score table that does not fit, quantizer
        settings the head dim or dtype defeat, ..."""
        self.head_allocation.check_model(model)
        self.layer_allocation.check_model(model)
        if self.quant_method is not None:
            self.quant_method.check_model(model.head_dim, model.dtype_bytes, model.context_window)
        layers = model.num_layers
        if self.cross_layer_merge and self.cross_layer_start is not None and self.cross_layer_start >= layers - 1:
            raise ValueError(f"cross_layer_start {self.cross_layer_start} leaves no layer pair to merge in this "
                             f"{layers}-layer model (layers 0..{layers - 1}); use at most {layers - 2}")
        if self.selects_pages and self.page_dense_layers >= layers:
            raise ValueError(f"page_dense_layers {self.page_dense_layers} leaves no layer of this {layers}-layer "
                             f"model to Quest; use at most {layers - 1}")
        if self.prefill_attention is not None:  # e.g. a pattern table of another model
            self.prefill_attention.check_model(model)

    def check_prompt(self, prompt_len: int) -> None:
        """ValueError if on a prompt of `prompt_len` tokens the method would not do what its settings say
        (a ratio budget that resolves below the window is not silently raised to it)."""
        if self.budget_ratio is not None:
            share = round(self.budget_ratio * prompt_len)
            if share < max(self.window_size, 1):
                needed = max(self.window_size, 1) / prompt_len
                raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) {self.budget_ratio:g} gives "
                                 f"round({self.budget_ratio:g} x {prompt_len}) = {share} tokens on a {prompt_len}-token "
                                 f"prompt, below the {max(self.window_size, 1)} the budget must hold (window_size "
                                 f"{self.window_size}); use a ratio >= {needed:.4g} or a smaller window_size")

    def validate(self) -> None:
        if self.gqa_layout not in GQA_LAYOUTS:
            raise ValueError(f"gqa_layout must be one of {'|'.join(GQA_LAYOUTS)}, got {self.gqa_layout!r}")
        if self.gqa_reduce not in GQA_REDUCTIONS:
            raise ValueError(f"gqa_reduce must be one of {'|'.join(GQA_REDUCTIONS)}, got {self.gqa_reduce!r}")
        if self.window_size < 0:
            raise ValueError(f"window_size must be an integer >= 0, got {self.window_size!r}")
        self._validate_selection_settings()
        self._validate_page_settings()
        self._validate_cross_layer_settings()
        self._validate_prefill_attention()
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
            if self.quant_method is not None:
                self.quant_method.check_budget(None)
            return
        self._validate_decode_settings()
        if self.quant_method is not None:
            self.quant_method.check_budget(self.budget)
        if self.merge is not None:
            self.merge.check_method(self)
        if (self.budget is None) == (self.budget_ratio is None):
            raise ValueError(f"{self.name} needs exactly one of budget (max_capacity_prompts) or budget_ratio "
                             f"(max_capacity_prompts_ratio); got budget={self.budget}, budget_ratio={self.budget_ratio}")
        if self.budget is not None:
            if self.budget < 1:
                raise ValueError(f"budget (max_capacity_prompts) must be an integer >= 1, got {self.budget!r}")
            if self.budget < self.protected_tokens:
                raise ValueError(f"budget (max_capacity_prompts) {self.budget} is smaller than window_size "
                                 f"{self.window_size} + num_sinks {self.num_sinks}; the budget includes the window "
                                 f"and the sinks, so it must be >= {self.protected_tokens}")
        else:
            if not (0.0 < self.budget_ratio <= 1.0):
                raise ValueError(f"budget_ratio (max_capacity_prompts_ratio) must be in (0, 1], got {self.budget_ratio!r}")

    def _validate_decode_settings(self) -> None:
        if self.decode_interval < 1:
            raise ValueError(f"decode_interval must be an integer >= 1 (new tokens between two decode-time "
                             f"compressions), got {self.decode_interval!r}")
        if self.decode_budget is None:
            return   # a decode_interval without decode_budget is refused by Component (only_with)
        if self.quant_method is not None:
            raise ValueError(f"decode_budget (compression during decoding) does not combine with quant_method="
                             f"{self.quant_method.name!r} yet (a quantized cache is never re-selected); use one of them")
        if self.decode_budget < 1:
            raise ValueError(f"decode_budget must be an integer >= 1 (tokens per head held while decoding), "
                             f"got {self.decode_budget!r}")
        if self.decode_budget < self.protected_tokens:
            raise ValueError(f"decode_budget {self.decode_budget} is smaller than window_size {self.window_size} + "
                             f"num_sinks {self.num_sinks}; the window and the sinks are always kept, so decode_budget "
                             f"must be >= {self.protected_tokens}")
        if self.key_channel_ratio > 0:
            raise ValueError(f"decode_budget (compression during decoding) does not combine with key_channel_ratio="
                             f"{self.key_channel_ratio:g} (thin keys are not re-selected); use one of them")

    def _validate_selection_settings(self) -> None:
        if self.num_sinks < 0:
            raise ValueError(f"num_sinks must be an integer >= 0 (first prompt tokens always kept), "
                             f"got {self.num_sinks!r}")
        if not 0.0 <= self.random_fraction < 1.0:
            raise ValueError(f"random_fraction must be in [0, 1) (share of the selected tokens drawn at random), "
                             f"got {self.random_fraction!r}")
        if self.random_seed < 0 or self.random_seed >= 2 ** 63:
            raise ValueError(f"random_seed must be an integer in [0, 2^63), got {self.random_seed!r}")
        if not 0.0 <= self.key_channel_ratio < 1.0:
            raise ValueError(f"key_channel_ratio must be in [0, 1) (share of key channels pruned), "
                             f"got {self.key_channel_ratio!r}")
        if self.key_recent_size < 0:
            raise ValueError(f"key_recent_size must be an integer >= 0 (most recent kept tokens left full width), "
                             f"got {self.key_recent_size!r}")
        if self.key_query_window < 1:
            raise ValueError(f"key_query_window must be an integer >= 1 (prompt queries that score the key "
                             f"channels), got {self.key_query_window!r}")
        quantizer = self.quant_method
        if self.key_channel_ratio > 0 and quantizer is not None and quantizer.residual_length < self.key_recent_size:
            raise ValueError(f"key_channel_ratio with quant_method={quantizer.name!r}: the quantizer's residual_length "
                             f"{quantizer.residual_length} must be >= key_recent_size {self.key_recent_size} (the "
                             f"recent keys stay full width, so they cannot be quantized thin)")
        if not self.needs_budget and (self.num_sinks or self.random_fraction):
            raise ValueError(f"{self.name} keeps every token; it takes no num_sinks or random_fraction "
                             f"(got num_sinks={self.num_sinks}, random_fraction={self.random_fraction:g})")

    def _unused(self, settings: tuple[str, ...], needs: str) -> None:
        """One line naming the first of `settings` changed from its default while the axis is off."""
        fields = type(self).__dataclass_fields__
        for setting in settings:
            if getattr(self, setting) != fields[setting].default:
                raise ValueError(f"{setting}={getattr(self, setting)!r} only applies with {needs}; set it too, or "
                                 f"leave {setting} out")

    def _validate_page_settings(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1 (tokens per Quest page), got {self.page_size!r}")
        if self.page_min_count < 1:
            raise ValueError(f"page_min_count must be an integer >= 1, got {self.page_min_count!r}")
        if self.page_dense_layers < 0:
            raise ValueError(f"page_dense_layers must be an integer >= 0, got {self.page_dense_layers!r}")
        if self.page_selection not in PAGE_SELECTIONS:
            raise ValueError(f"page_selection must be one of {'|'.join(PAGE_SELECTIONS)}, got {self.page_selection!r}")
        if not self.selects_pages:
            self._unused(("page_size", "page_min_count", "page_keep_last", "page_dense_layers", "page_selection"),
                         "page_budget (Quest)")
            return
        if self.page_budget is not None and self.page_budget < self.page_size:
            raise ValueError(f"page_budget {self.page_budget} is smaller than one page (page_size {self.page_size}); "
                             f"the budget counts the tokens of the attended pages")
        for setting, value, why in (
                ("quant_method", self.quant_method, "Quest pages a full-precision cache"),
                ("key_channel_ratio", self.key_channel_ratio or None, "Quest pages full-width keys"),
                ("cross_layer_merge", self.cross_layer_merge or None, "Quest pages one layer's own keys")):
            if value is not None:
                raise ValueError(f"Quest page selection does not combine with {setting}={value!r} ({why}); use one "
                                 f"of them")
        if self.decode_budget is not None and (self.accumulates_attention or self.history_window is not None):
            raise ValueError(f"Quest page selection does not combine with {self.name}'s decode-time attention "
                             f"statistics (decode_budget): they would count attention Quest never computed")

    def _validate_prefill_attention(self) -> None:
        if self.prefill_attention is not None and self.history_window is not None:
            raise ValueError(f"prefill_attention={self.prefill_attention.name!r} does not combine with {self.name}: its "
                             f"uniform level counts every key a prompt row attends, not a sparse head's")

    def _validate_cross_layer_settings(self) -> None:
        if not 0.0 <= self.cross_layer_t <= 1.0:
            raise ValueError(f"cross_layer_t must be in [0, 1] (SLERP weight of the upper layer), "
                             f"got {self.cross_layer_t!r}")
        if not 0.0 <= self.cross_layer_retain <= 1.0:
            raise ValueError(f"cross_layer_retain must be in [0, 1] (share of token pairs kept unmerged), "
                             f"got {self.cross_layer_retain!r}")
        if self.cross_layer_start is not None and self.cross_layer_start < 0:
            raise ValueError(f"cross_layer_start must be a layer index >= 0 (or None: the middle layer), "
                             f"got {self.cross_layer_start!r}")
        if not self.cross_layer_merge:
            self._unused(("cross_layer_start", "cross_layer_t", "cross_layer_retain"), "cross_layer_merge (MiniCache)")
            return
        refused = [("quant_method", self.quant_method is not None, "the merged directions are not quantized"),
                   ("decode_budget", self.decode_budget is not None, "decode-time re-selection is per layer"),
                   ("key_channel_ratio", self.key_channel_ratio > 0, "thin keys are per layer"),
                   ("layer_allocation", not isinstance(self.layer_allocation, UniformLayers),
                    "a merged pair keeps one token set, so its two layers need the same budget"),
                   ("head_allocation", self.head_allocation.global_over_layers,
                    "its per-layer head table would split a merged pair")]
        for setting, bad, why in refused:
            if bad:
                value = getattr(self, setting)
                raise ValueError(f"cross-layer merging (MiniCache) does not combine with {setting}="
                                 f"{getattr(value, 'name', value)!r}: {why}")
