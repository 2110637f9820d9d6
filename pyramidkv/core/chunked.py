"""Chunked prefill: the prompt enters the cache a chunk at a time, compressed to the budget between chunks.

For one prompt of n tokens and chunk size C (batch of one; B = 1 in every shape below):

    chunk 1      tokens [0, C)         the ordinary prefill (core/prefill.py), with the budgets of the whole
                                       prompt: each layer keeps its budget of the chunk
    chunk k > 1  the next C tokens     each layer: the chunk's K/V appended to what the layer keeps, its queries
                                       attend to both (causal among themselves: the store's multi-token attend),
                                       then the union [1, H, kept + C, D] is scored by the method with the
                                       chunk's queries as the observation window (SnapKV-style: the last
                                       window_size of them, the chunk being at least that long) and cut back to
                                       the layer's budget by the same selection as the prefill's
    last token   n - 1                 fed by generate()'s first step, as a decode step (held beside the budget)

So at any moment a layer holds at most its budget + C tokens, and at most one layer (the one computing)
holds more than its budget: the peak K/V bytes of the prefill is at most the sum of the layer budgets plus
one chunk of one layer (`ChunkedPrefill.peak_bytes`, the byte accounting of the stores).
A method that scores by accumulated column sums (H2O) adds each chunk's column sums over the union to the sums
its kept tokens gathered from the chunks before (a dropped token's are lost with it; each softmax runs over
what the layer held, not the whole prompt).

Defined for the per-layer methods whose kept sets can be re-scored from what a layer holds; `refusal` names
the others and why (a budget over every layer, KVzip's repeat pass, ragged heads, units that rewrite or
requantize what is stored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.core.context import CompressionMethod
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.prefill import PromptCompressor
from pyramidkv.core.scoring import scores_per_stored_head


@dataclass(frozen=True)
class PrefillChunks:
    """How a prompt enters the cache (a setting of the run, for every method).

    prefill_chunk_size: tokens per prefill chunk: the prompt is prefilled a chunk at a time and each layer is
        compressed to its budget between chunks, so a layer holds at most budget + one chunk (None: the whole
        prompt in one forward, as without the option; at least the method's window_size; docs/speed.md,
        "Chunked prefill")
    """

    prefill_chunk_size: Optional[int] = None

    def check(self, method: CompressionMethod, model: Optional[ModelShape] = None) -> None:
        """Raises ValueError (one line) for a chunk size out of range or a configuration it is not defined for."""
        size = self.prefill_chunk_size
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"prefill_chunk_size must be an integer >= 1, got {size!r}")
        why = refusal(method, model)
        if why:
            raise ValueError(f"prefill_chunk_size is not defined for {method.name}: {why}")
        if size < method.window_size:
            raise ValueError(f"prefill_chunk_size {size} is shorter than {method.name}'s window_size "
                             f"{method.window_size}: each chunk's last window_size queries score it; use >= "
                             f"{method.window_size}")


def refusal(method: CompressionMethod, model: Optional[ModelShape] = None) -> Optional[str]:
    """Why chunked prefill is not defined for this configuration (None: it is)."""
    checks = [
        (getattr(method, "reconstructs", False), "KVzip's scores come from repeating the whole prompt after its "
                                                 "prefill (every layer waits for it)"),
        (method.layer_budgets_need_scores, "its budgets are fixed over every layer's scores of the whole prompt "
                                           "(head or layer allocation over all layers)"),
        (method.sizing.outcome, "threshold eviction keeps what passes, a count no chunk can be cut back to"),
        (getattr(method.head_allocation, "name", "uniform") != "uniform",
         "its heads keep different counts, and a chunk's union of kept and new tokens is scored per layer with "
         "the same count per head (use head_allocation uniform)"),
        (method.gqa_layout != "kv_head", "the query_head layout stores repeated K/V (use gqa_layout kv_head)"),
        (method.merge is not None, "a merge rule rewrites kept K/V, which a later chunk would score as tokens"),
        (method.quant_method is not None, "quantized K/V would be dequantized and requantized at every chunk"),
        (method.channels is not None, "ThinK's thin keys cannot be re-scored as full tokens"),
        (method.pages is not None or method.decode is not None, "decode-time units start from a whole prefill"),
        (method.layer_sharing is not None, "MiniCache's merged layer pairs select once over both layers"),
        (getattr(method, "prefill_attention", None) is not None, "a sparse prefill pattern covers the whole prompt"),
        (getattr(method, "needs_hidden", False), "its scorer reads each token's attention input, not kept"),
        (getattr(method, "needs_rotation", False), "its scorer needs one RoPE position per slot; held heads differ"),
        (model is not None and model.form.sliding, "a sliding-window layer keeps its own window"),
    ]
    return next((why for refused, why in checks if refused), None)


class ChunkCompressor(PromptCompressor):
    """The prefill pipeline of one chunk (or of one layer's union of kept and new tokens), with the budgets of
    the whole prompt: prompt_len is what this pass sees, full_len the prompt's real length."""

    def __init__(self, method: CompressionMethod, model: ModelShape, prompt_len: int, full_len: int,
                 budgets: Optional[tuple[list, list]] = None):
        super().__init__(method, model, [0], prompt_len)
        self.full_len = full_len
        # H2O's score is attention accumulated over every query: each chunk's column sums are added to what the
        # kept tokens gathered from the chunks before (every pass is scored, to have them)
        self.carry = method.accumulates_attention and method.needs_column_sums
        self.raw: dict[int, torch.Tensor] = {}   # per layer this pass's raw scores [1, Hq or Hkv, n], when carried
        if budgets is None:   # fixed once, from the whole prompt
            self.real_lens = [full_len]
            self.fix_layer_budgets()
            self.real_lens = [prompt_len]
        else:
            self.layer_budgets, self.head_plans = budgets

    def nominal_budget(self, b: int) -> int:
        return self.method.sizing.per_prompt(self.full_len, self.method)

    def score(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        scored = super().score(layer_idx, queries, keys, values, *args, **kwargs)
        if self.carry and scored.raw_scores is not None:
            self.raw[layer_idx] = scored.raw_scores
        return scored

    def kept_union(self, layer_idx: int, scored) -> KeptKV:
        """The one prompt's kept tokens of a scored pass (positions: indices into what the pass saw)."""
        return self._keep_layer(layer_idx, scored)[0]

    def compressed(self, b: int) -> bool:
        """The whole prompt is over its budget and this pass sees more than its smallest layer budget."""
        return self.full_len > self.nominal_budget(b) and (self.carry or self.real_lens[b] > min(self.layer_budgets[b]))


def kept_rows(raw: torch.Tensor, index: list[torch.Tensor]) -> torch.Tensor:
    """raw [R, m] scores per raw head (query or KV heads), index per stored head the kept indices -> [R, k]: each raw
    head's scores of the tokens its stored head keeps (a group of R / H raw heads per stored head)."""
    group = raw.shape[0] // len(index)
    return torch.stack([raw[r, index[r // group]] for r in range(raw.shape[0])])


class ChunkedPrefill:
    """The state of one prompt's chunked prefill, held by the cache (`CompressedCache.chunked`) while it runs."""

    def __init__(self, method: CompressionMethod, model: ModelShape, first_chunk: int, full_len: int):
        self.method, self.model, self.full_len = method, model, full_len
        self.first = ChunkCompressor(method, model, first_chunk, full_len)
        self.budgets = (self.first.layer_budgets, self.first.head_plans)
        self.peak_bytes = 0   # most K/V bytes held at once: every layer's store + the layer computing
        self.sums: dict[int, torch.Tensor] = {}   # carried scores: per layer [Hq or Hkv, kept] in held order

    def note(self, held: int) -> None:
        self.peak_bytes = max(self.peak_bytes, held)

    @torch.no_grad()
    def reselect(self, cache, layer_idx: int, queries: torch.Tensor) -> None:
        """After a chunk's queries [1, Hq, c, D] attended to layer layer_idx (its K/V appended): score what the layer
        holds with those queries and keep its budget."""
        store = cache.layers[layer_idx]
        self.note(cache.kv_bytes())
        heads = store.held(0)   # per stored head (keys [m, D], values [m, D]); positions below
        positions = store.held_positions(0)
        keys = torch.stack([k for k, _, _ in heads])[None]      # [1, H, m, D]
        values = torch.stack([v for _, v, _ in heads])[None]
        compressor = ChunkCompressor(self.method, self.model, keys.shape[2], self.full_len, self.budgets)
        scored = compressor.score(layer_idx, queries, keys, values)
        carry = compressor.carry and layer_idx in compressor.raw   # scored: the whole prompt is over its budget
        if carry:
            raw = self.carried(store, layer_idx, compressor.raw[layer_idx])
            scored.raw_scores = raw
            scored.scores = scores_per_stored_head(raw, self.method, self.model.num_kv_heads, self.model.num_query_heads)
        kept = compressor.kept_union(layer_idx, scored)         # positions: indices into the union
        if carry:
            self.sums[layer_idx] = kept_rows(scored.raw_scores[0], list(kept.positions.split(kept.lengths)))
        union = [positions[h][p] for h, p in enumerate(kept.positions.split(kept.lengths))]
        store.replace([KeptKV(kept.keys, kept.values, kept.lengths, torch.cat(union))], max_tail=0)

    def carried(self, store, layer_idx: int, raw: torch.Tensor) -> torch.Tensor:
        """raw [1, R, m] this chunk's scores of the union (kept, then the chunk) plus what the kept tokens gathered
        before: after the first chunk its own scores of the tokens each layer kept."""
        if layer_idx not in self.sums:
            first = [p.to(raw.device) for p in store.kept_positions(0)]   # chunk 1's positions are its indices
            self.sums[layer_idx] = kept_rows(self.first.raw[layer_idx][0], first)
        prior = self.sums[layer_idx]
        total = raw.clone()
        total[0, :, :prior.shape[1]] += prior
        return total
