"""One layer's storage for every prompt of the batch: the interface the cache and decoding talk to.

The cache is a list of these, one per layer (as transformers' `cache_utils` holds layer objects).
`LayerStore` is the contract every store fulfils (append, attend, counts and positions, kept / stored
K/V, bytes by part); the optional abilities are small declared interfaces: `Reselectable` (decode-time
re-selection: `held`, `replace`) and `AttentionStatistics` (what decode-time scorers read: `received_attention`,
`attention_rows`). A store class lists the abilities it has in `abilities`; the cache's `STORES` table
(core/cache.py) maps a kind to its class, and a method asking a store kind for an ability it lacks is
refused when the method is made. A store is built from what the prefill pipeline kept (per prompt a
`KeptKV`) by `build`, and then grows by `append`.

Words: a *segment* is one prompt's stored head (B x H of them per layer); *kept* tokens are those
the store holds in its compressed part (the prompt tokens after prefill, plus generated tokens folded
in by a decode-time re-selection); *held* tokens are all it holds (kept + appended since).
Positions count from the prompt's first real token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.kept import KeptKV

# Per stored head: (keys [m, D], values [m, D], positions [m]).
Heads = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class StoreSetup:
    """What building a layer's store may need besides its kept tokens (one object per cache and prompt batch).

    real_lens, pad_lens: per prompt its real length and its left padding; position_ids: [B or 1, n] the
    prompt's RoPE positions (None: 0..n-1); method: the compression method (its units configure the store);
    rotary: RoPE applied and undone outside the model (stores keeping keys before RoPE); scratch: buffers
    the layers' quantized attention shares; num_layers: layers of the model; form: the model's attention form
    (components.AttentionForm: the stores' logits are `form.logits` / `form.cap`)."""

    real_lens: list[int]
    pad_lens: list[int]
    position_ids: Optional[torch.Tensor]
    method: Any
    num_layers: int
    rotary: Any = None
    scratch: Any = None
    form: AttentionForm = AttentionForm()

    def rope_positions(self, kept: list[KeptKV]) -> list[torch.Tensor]:
        """Per prompt, long [T] the RoPE position of each kept row: its position id (its padded position without)."""
        padded = [torch.cat(kv.all_positions()) + pad for kv, pad in zip(kept, self.pad_lens)]
        ids = self.position_ids   # the first layer's: on its device, which may not be this layer's
        return padded if ids is None else [ids[min(b, ids.shape[0] - 1)].to(p.device)[p].long()
                                           for b, p in enumerate(padded)]


class LayerStore(ABC):
    heads: int          # stored heads per prompt
    appended: int       # tokens appended since the prompt (each prompt of the batch appends one per step)
    abilities: ClassVar[tuple[str, ...]] = ()   # the optional interfaces below it implements, by name
    multi_token: ClassVar[bool] = True          # append / attend take several new tokens at once (False: the
    # cache hands it one per call: core/cache.py `_piece`)
    max_piece: ClassVar[Optional[int]] = None   # the most new tokens per call (None: any)

    @classmethod
    def build(cls, kept: dict[int, list["KeptKV"]], setup: StoreSetup) -> dict[int, "LayerStore"]:
        """The stores of the layers in `kept` (layer -> per prompt what the prefill kept): one per layer, except
        for kinds that share storage across layers (the paired store gets both layers of each pair)."""
        return {layer: cls.open(kv, setup, layer) for layer, kv in kept.items()}

    @classmethod
    def open(cls, kept: list["KeptKV"], setup: StoreSetup, layer_idx: int) -> "LayerStore":
        """One layer's store from what the prefill kept of each prompt."""
        raise NotImplementedError

    # ---- growing -------------------------------------------------------------------------------
    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor, rope_positions: torch.Tensor) -> None:
        """keys, values: [B, H, q, D] new tokens after RoPE; rope_positions: long [B] the RoPE position of
        the last of them (stores that keep keys before RoPE need it)."""

    @abstractmethod
    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        """queries [B, Hq, q, D] of the q tokens appended last -> attention output [B, Hq, q, D] over
        everything held (causal among the new tokens)."""

    # ---- inspection ----------------------------------------------------------------------------
    @abstractmethod
    def kept_counts(self) -> list[list[int]]:
        """Per prompt, per stored head: kept tokens."""

    @abstractmethod
    def kept_positions(self, b: int) -> list[torch.Tensor]:
        """Per stored head of prompt b: positions of its kept tokens, ascending."""

    @abstractmethod
    def kept_kv(self, b: int) -> Heads:
        """Per stored head of prompt b: (positions, keys, values) of its kept tokens (dequantized)."""

    @abstractmethod
    def held_counts(self) -> list[list[int]]:
        """Per prompt, per stored head: held tokens (kept + appended since)."""

    @abstractmethod
    def held_positions(self, b: int) -> list[torch.Tensor]:
        """Per stored head of prompt b: positions of every held token, ascending."""

    @abstractmethod
    def stored_kv(self, b: int) -> Heads:
        """Per stored head of prompt b: (RoPE positions, keys, values) of every held token, time order
        (dequantized, keys after RoPE)."""

    @abstractmethod
    def bytes_by_part(self, b: Optional[int] = None) -> dict[str, int]:
        """Stored bytes by part now (full-precision rows are "residual"), of all prompts or prompt b."""

    def nbytes(self, b: Optional[int] = None) -> int:
        return sum(self.bytes_by_part(b).values())

    def read_bytes(self, b: Optional[int] = None) -> int:
        """Bytes the last attend read, of all prompts or prompt b: everything held, for a store that attends
        over all it holds (a paged store reads less)."""
        return self.nbytes(b)

    @abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes allocated for appended tokens, unused capacity included."""


class Reselectable(ABC):
    """Ability "reselect": the store can hand over what it holds and take a new kept set (decode budget)."""

    @abstractmethod
    def held(self, b: int) -> Heads:
        """Per stored head of prompt b, everything it holds in position order."""

    @abstractmethod
    def replace(self, kept: list[KeptKV], max_tail: Optional[int] = None) -> None:
        """Per prompt its new kept tokens; nothing appended remains apart. max_tail: the most tokens that will
        be appended before the next re-selection (a larger tail buffer may be released)."""

    @abstractmethod
    def drop_before(self, first: list[int]) -> None:
        """A sliding window: every held token of prompt b at a position below first[b] leaves."""


class AttentionStatistics(ABC):
    """Ability "attention_statistics": the decode step's attention per held token (H2O, Scissorhands)."""

    @abstractmethod
    def received_attention(self, queries: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The attention each held token receives from the new queries [B, Hq, q, D], summed over them, per
        query head of its stored head, float32: (per prompt [T, g] aligned with its kept rows, [B, H, t, g]
        for the tail)."""

    @abstractmethod
    def attention_rows(self, queries: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Each new query's attention row over the held tokens, float32: (per prompt [T, g, q], [B, H, t, g, q]
        for the tail, NaN where a new token is not visible yet), and [B, H, q] the tokens each query attended."""


ABILITIES: dict[str, type] = {"reselect": Reselectable, "attention_statistics": AttentionStatistics}
