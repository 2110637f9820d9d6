"""The contract between the engine and a method: what a scorer sees, and what the engine reads of a method.

`pyramidkv.methods.Method` fulfils `CompressionMethod`; the engine (this package) never imports
`pyramidkv.methods`, so any object with these attributes drives it.

Shapes: B prompts, Hq query heads, Hkv KV heads, H stored heads (Hkv in the kv_head layout, Hq in
query_head), n prompt tokens, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional, Protocol

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.rotary import layer_rotation

if TYPE_CHECKING:
    from pyramidkv.allocation.base import ModelShape
    from pyramidkv.capabilities import DecodeBudget, MiniCacheSharing, QuestPages, Selection, ThinKChannels
    from pyramidkv.core.rotary import KeyRotation
    from pyramidkv.merging.base import MergeRule
    from pyramidkv.quantization.base import Quantizer
    from pyramidkv.sparse_prefill.base import PrefillPattern, SparsePrefill
    from pyramidkv.sizing import Sizing


@dataclass
class ScoreContext:
    """Everything a scorer may look at for one layer: the prompt at prefill, one prompt's held tokens at a
    decode-time re-selection (`DecodeScoreContext`, the same layout). A scorer written for prefill is right
    at decode when it reads the tokens through these shapes and `pyramidkv.core.scoring`'s helpers.

    queries: [B, Hq, q, D], those of the last q tokens (q = n at prefill: every prompt query), after RoPE.
    keys/values: [B, H, n, D] after RoPE: at prefill the KV heads (H = Hkv); at decode the stored heads.
    real: False at left padding: [B, n] when every head pads alike (always at prefill), [B, H, n] per head
    when the heads hold different token counts (ragged heads at decode). Helpers take either.
    pattern: the layer's sparse prefill pattern (MInference; its `mask(start, stop, n)` gives the entries the
    model computed), None for dense prefill and at decode: attention statistics pass it to the scoring helpers.
    column_sums: [B, Hq, n] float32, each key's attention summed over the real prompt queries, computed by
    the prefill attention pass itself for methods with `needs_column_sums` (None otherwise and at decode).
    Queries come scaled so that q . k / sqrt(D) is the model's logit (Gemma2's query_pre_attn_scalar folded in);
    `form` (the model's attention form, from `model`) gives the scoring helpers its soft-cap (`form=ctx.form`), so
    that a scorer's attention is the model's.
    positions: long RoPE positions: at prefill [B, n] the prompt rows' (padding included); at decode [1, H, m]
    (DecodeScoreContext).
    rotation: the model's RoPE (core/rotary.py) where the cache was given it (the model patch does for methods
    with `needs_rotation`: queries before RoPE, RoPE at other positions), else None; this layer's where the
    model's RoPE differs by layer (`layer_rotation`).
    reconstruction: [B, Hq, n] float32, for methods that `reconstruct` (KVzip): the most attention each key got
    from the repeat passes (core/reconstruction.py), given once they have run (queries and real are None then).
    hidden: [B, n, E] the layer's attention input (the hidden states after its norm) of the scored tokens, for
    methods with `needs_hidden` (KVzap), else None; at a threshold decision while decoding, the new tokens'.
    model: the model's shape (its name finds per-model artifacts: the calibrated methods' predictors, filters,
    patterns; its `form` the attention form), given by the engine; None in a context built by hand.
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    real: torch.Tensor
    pattern: Optional["PrefillPattern"] = None
    column_sums: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    rotation: Optional["KeyRotation"] = None
    reconstruction: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    model: Optional["ModelShape"] = None

    def __post_init__(self):
        self.rotation = layer_rotation(self.rotation, self.layer_idx)   # this layer's (RoPE by layer: Gemma3)

    @property
    def form(self) -> AttentionForm:
        """The model's attention form (its soft-cap): the model shape's, none without one."""
        return AttentionForm() if self.model is None else self.model.form


@dataclass
class DecodeScoreContext(ScoreContext):
    """What `decode_score` sees when the cache re-selects one prompt at one layer while decoding: the
    prefill layout with B = 1 and the prompt's stored heads as H (Hkv in the kv_head layout, Hq in
    query_head), scored the same way and brought to stored heads by the same `scores_per_stored_head`.

    keys/values [1, H, m, D]: every token each head holds now (kept prompt tokens, then generated ones), in
    position order, left-padded to the longest head's count m; real [1, m] when every head holds m tokens,
    else [1, H, m] False at each head's padding.
    queries [1, Hq, w, D]: the buffered queries of the w most recent tokens (w = min(query buffer, m)),
    the i-th at token m - w + i of every head, oldest first; none is padding.
    positions: [1, H, m] true positions (0 = first real prompt token; -1 at padding). Each head keeps its
    own tokens, so one slot of two heads is in general two positions.
    accumulated: [1, Hq, m] attention each held token has received from every query since it was appended
    (prompt queries included), per query head of its stored head, for methods with `accumulates_attention`;
    else None.
    history: [1, Hq, w_h, m] each held token's attention from the last w_h queries (the last prompt rows,
    then the decode queries; NaN where it was not there), history_levels: [1, Hq, w_h] the uniform level
    1 / (tokens its stored head attended) of each of those queries, for methods with a `history_window`;
    else None.
    """

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
    sizing: "Sizing"                        # tokens a head keeps: per_prompt(n, method), decode_threshold()
    selection: "Selection"                  # sinks and the random share of the one selection rule
    merge: Optional["MergeRule"]
    quant_method: Optional["Quantizer"]
    decode: Optional["DecodeBudget"]        # compression during decoding (None: none)
    channels: Optional["ThinKChannels"]     # ThinK's thin keys (None: full width)
    pages: Optional["QuestPages"]           # Quest's decode-time pages (None: dense decode attention)
    layer_sharing: Optional["MiniCacheSharing"]  # MiniCache's merged layer pairs (None: none)
    units: list                             # every unit on the method's axes that is on (store kinds, abilities)

    @property
    def layer_budgets_need_scores(self) -> bool:
        """True: layer budgets depend on every layer's scores (the engine holds each layer until the last)."""

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hq or Hkv, n] importance of each prompt position (higher = keep)."""

    def decode_score(self, ctx: DecodeScoreContext) -> torch.Tensor:
        """Importance of each held token at a decode-time re-selection (score()'s layout)."""

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int,
                      layer_scores: Optional[list[torch.Tensor]] = None) -> list:
        """Tokens kept by each layer for a prompt longer than its budget (per layer an int, or where one budget
        spans every layer the list of its stored heads' counts)."""

    def head_budgets(self, scores: torch.Tensor, layer_budget: int, layer_idx: int, model: "ModelShape") -> list[int]:
        """Tokens kept by each stored head of a layer; scores [H, candidates]."""
