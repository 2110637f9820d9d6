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
    from pyramidkv.capabilities import DecodeBudget, MiniCacheSharing, QuestPages, Selection, ThinKChannels
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
    """Exactly what the engine reads of a method (see pyramidkv/methods/base.py for their meaning). The units
    are read through their own settings (pyramidkv/capabilities): `decode` (decode_budget, decode_interval),
    `selection` (num_sinks, random_fraction, random_seed), `channels` (ThinK), `pages` (Quest), `layer_sharing`
    (MiniCache); the units that need a layer store kind name it (`store_kind`)."""

    name: ClassVar[str]
    accumulates_attention: ClassVar[bool]   # the cache accumulates received attention while decoding (H2O)
    needs_column_sums: ClassVar[bool]       # the prefill attention pass returns its column sums (H2O's score)
    history_window: Optional[int]           # the cache keeps each token's last attention rows (Scissorhands)
    window_size: int
    gqa_layout: str                         # "kv_head" | "query_head"
    gqa_reduce: str                         # "mean" | "max" | "sum"
    selection: "Selection"                  # sinks and the random share of the one selection rule
    merge: Optional["MergeRule"]
    quant_method: Optional["Quantizer"]
    decode: Optional["DecodeBudget"]        # compression during decoding (None: none)
    channels: Optional["ThinKChannels"]     # ThinK's thin keys (None: full width)
    pages: Optional["QuestPages"]           # Quest's decode-time pages (None: dense decode attention)
    layer_sharing: Optional["MiniCacheSharing"]  # MiniCache's merged layer pairs (None: none)

    @property
    def layer_budgets_need_scores(self) -> bool:
        """True: layer budgets depend on every layer's scores (the engine holds each layer until the last)."""

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hq or Hkv, n] importance of each prompt position (higher = keep)."""

    def decode_score(self, ctx: DecodeScoreContext) -> torch.Tensor:
        """Importance of each held token at a decode-time re-selection (score()'s layout)."""

    def prompt_budget(self, real_len: int) -> int:
        """The per-layer budget (window included) for a prompt of real_len tokens (real_len: kept whole)."""

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int,
                      layer_scores: Optional[list[torch.Tensor]] = None) -> list[int]:
        """Tokens kept by each layer for a prompt longer than its budget."""

    def head_budgets(self, scores: torch.Tensor, layer_budget: int, layer_idx: int, model: "ModelShape") -> list[int]:
        """Tokens kept by each stored head of a layer; scores [H, candidates]."""
