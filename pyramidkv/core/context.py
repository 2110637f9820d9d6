"""The contract between the engine and a method: what a scorer sees, and what the engine reads of a method.

`pyramidkv.methods.Method` fulfils `CompressionMethod`; the engine (this package) never imports
`pyramidkv.methods`, so any object with these attributes drives it.

Shapes: B prompts, Hq query heads, Hkv KV heads, n prompt tokens, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional, Protocol

import torch

if TYPE_CHECKING:
    from pyramidkv.allocation.base import ModelShape
    from pyramidkv.merging.base import MergeRule
    from pyramidkv.quantization.base import Quantizer
    from pyramidkv.sparse_prefill.base import PrefillPattern, SparsePrefill


@dataclass
class ScoreContext:
    """Everything a scorer may look at for one layer at prefill.

    queries: [B, Hq, n, D] and keys/values: [B, Hkv, n, D], after RoPE.
    real: [B, n] bool, False at left padding.
    pattern: the layer's sparse prefill pattern (MInference; its `mask(start, stop, n)` gives the entries the
    model computed), None for dense prefill: attention statistics pass it to the scoring helpers.
    column_sums: [B, Hq, n] float32, each key's attention summed over the real prompt queries, computed by
    the prefill attention pass itself for methods with `needs_column_sums` (None otherwise).
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    real: torch.Tensor
    pattern: Optional["PrefillPattern"] = None
    column_sums: Optional[torch.Tensor] = None


@dataclass
class DecodeScoreContext(ScoreContext):
    """What `decode_score` sees when the cache re-selects during decoding (one layer, one prompt).

    Each row is one stored head: keys/values [R, 1, m, D] hold the tokens the head holds now (kept
    prompt tokens, then generated ones), in position order and left-padded to a common m (real [R, m]
    False there). queries [R, g, m, D]: only the last min(window, m) rows are real queries, those of
    the most recent tokens (g = the query heads of the stored head: the GQA group in the kv_head
    layout, 1 in query_head); earlier rows are 0.
    positions: [R, m] true positions (0 = first real prompt token; -1 at padding).
    accumulated: [R, g, m] attention each held token has received from every query since it was
    appended (prompt queries included), for methods with `accumulates_attention`; else None.
    history: [R, g, w, m] each held token's attention from the last w queries (the last prompt rows,
    then the decode queries; NaN where it was not there), history_levels: [R, w] the uniform level
    1 / (tokens attended) of each of those queries, for methods with a `history_window`; else None.
    """

    positions: Optional[torch.Tensor] = None
    accumulated: Optional[torch.Tensor] = None
    history: Optional[torch.Tensor] = None
    history_levels: Optional[torch.Tensor] = None


class CompressionMethod(Protocol):
    """Exactly what the engine reads of a method (see pyramidkv/methods/base.py for their meaning)."""

    name: ClassVar[str]
    needs_budget: ClassVar[bool]            # False: every token is kept (fullkv)
    accumulates_attention: ClassVar[bool]   # the cache accumulates received attention while decoding (H2O)
    needs_column_sums: ClassVar[bool]       # the prefill attention pass returns its column sums (H2O's score)
    history_window: Optional[int]           # the cache keeps each token's last attention rows (Scissorhands)
    window_size: int
    gqa_layout: str                         # "kv_head" | "query_head"
    gqa_reduce: str                         # "mean" | "max" | "sum"
    merge: Optional["MergeRule"]
    quant_method: Optional["Quantizer"]
    decode_budget: Optional[int]
    decode_interval: int
    num_sinks: int                          # first prompt tokens always kept
    random_fraction: float                  # share of the selected tokens drawn from softmax(score) at prefill
    random_seed: int
    key_channel_ratio: float                # ThinK: share of key channels pruned (0: none)
    key_recent_size: int                    # most recent kept tokens whose keys stay full width
    key_query_window: int                   # prompt queries that score the key channels
    page_size: int                          # Quest: tokens per page
    page_min_count: int                     # Quest: pages attended at least
    page_keep_last: bool                    # Quest: the newest token's page is always attended
    page_dense_layers: int                  # Quest: the first layers attend densely
    page_selection: str                     # Quest: "query_head" | "group_max" | "group_mean"
    cross_layer_merge: bool                 # MiniCache: adjacent layer pairs share their K/V directions
    cross_layer_start: Optional[int]        # MiniCache: first layer of the first pair (None: the middle)
    cross_layer_t: float                    # MiniCache: SLERP weight of the upper layer
    cross_layer_retain: float               # MiniCache: share of token pairs kept unmerged
    prefill_attention: Optional["SparsePrefill"]  # sparse prefill attention (MInference); None: the model's own

    @property
    def selects_pages(self) -> bool:
        """True: decode attention reads only the top pages of each segment (Quest)."""

    def decode_page_budget(self, real_len: int) -> Optional[int]:
        """Quest: the tokens of the pages attended per stored head and decode step, for a prompt of
        real_len tokens (None: attention reads everything held)."""

    @property
    def layer_budgets_need_scores(self) -> bool:
        """True: layer budgets depend on every layer's scores (the engine holds each layer until the last)."""

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hq or Hkv, n] importance of each prompt position (higher = keep)."""

    def decode_score(self, ctx: DecodeScoreContext) -> torch.Tensor:
        """[R, g or 1, m] importance of each held token at a decode-time re-selection."""

    def prompt_budget(self, real_len: int) -> int:
        """The per-layer budget (window included) for a prompt of real_len tokens."""

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int,
                      layer_scores: Optional[list[torch.Tensor]] = None) -> list[int]:
        """Tokens kept by each layer for a prompt longer than its budget."""

    def head_budgets(self, scores: torch.Tensor, layer_budget: int, layer_idx: int, model: "ModelShape") -> list[int]:
        """Tokens kept by each stored head of a layer; scores [H, candidates]."""
