"""The prefill pipeline: what each layer keeps of the prompt, and what is stored in the kept slots.

For one layer of a left-padded batch (B prompts padded to n tokens, Hq query heads, Hkv KV heads,
H stored heads: Hkv in the `kv_head` layout, Hq in `query_head`; D head dim), top to bottom:

    score        method.score(ctx)                     [B, Hq or Hkv, n]   higher = keep
    per head     scores_per_stored_head                [B, H, n]           reduced over / repeated to the GQA group
    layer        method.layer_budgets                  per prompt: tokens each layer keeps (window included)
    heads        method.head_budgets                   per prompt: tokens each stored head keeps
    select       select_kept_positions                 per prompt and head: sinks + window + the top-scored rest
    merge        merge_prompt(method.merge, ...)       per prompt and head: what the kept slots store
    gather       KeptKV.gather                         per prompt: flat [T, D] rows, a length per head
    channels     prune_key_channels                    (ThinK) per prompt and head: older keys on D' channels

A prompt no longer than its budget is kept whole (SnapKV's rule) and not scored (its key channels
are still pruned, as ThinK's code does). Every step after
`score` runs prompt by prompt on the prompt's own rows, so a prompt keeps what it keeps alone.
Layer budgets are fixed when the first layer is scored, or, for allocations that need every layer's scores
(ZigZagKV's layers, one budget over the whole model: head_allocation global), when the last layer is: until then
each layer waits with its full K/V, or under one budget over all layers holds only what the B best scores so far
keep (core/running_top.py). A method scored by repeat passes (KVzip) gets its scores after the prompt has passed a
layer: core/reconstructing.py.
With cross-layer merging (MiniCache) the lower layer of each merged pair waits for the upper one; the
pair then selects once, on the sum of its two layers' scores (same budget, same seeds), so both keep the
same tokens.
A sliding-window layer (window W: the next token attends to the last W - 1 prompt tokens) sees only those: the
tokens before them count as its padding (scores, candidates, sinks, merging), so it keeps at most W - 1
(docs/models.md, "Sliding windows").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.core.channels import prune_key_channels
from pyramidkv.core.context import CompressionMethod, ScoreContext
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.running_top import RunningTop, runs_top
from pyramidkv.core.scoring import real_positions, scores_per_stored_head, window_attention
from pyramidkv.core.selection import select_kept_positions
from pyramidkv.merging.base import merge_prompt


@dataclass
class ScoredLayer:
    """One layer after scoring. keys, values: [B, H, n, D] stored heads; scores: [B, H, n] (None when no
    prompt is compressed); raw_scores: the method's own [B, Hq or Hkv, n]; merge_attention: [B, H, n],
    the observation window's mean attention, for merge rules that need it."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: Optional[torch.Tensor]
    raw_scores: Optional[torch.Tensor]
    merge_attention: Optional[torch.Tensor]
    last_queries: Optional[torch.Tensor] = None   # [B, Hq, w, D] the last queries, for key-channel scores

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


SEED_MODULUS = 2 ** 64   # torch seeds are 64-bit


def sampling_generator(method: CompressionMethod, layer_idx: int, head: int) -> torch.Generator:
    """The generator of one stored head's random share (CPU, so draws are the same on every device): seeded
    by (random_seed, layer, head) and fresh for each prompt, so a prompt draws the same in any batch. The mix
    is taken modulo 2^64, the range torch seeds take: every random_seed in [0, 2^63) works, each gives a
    head its own seed (the multipliers are odd), and a seed below about 1.8e10 keeps the seed it had."""
    return torch.Generator().manual_seed(
        ((method.selection.random_seed * 1_000_003 + layer_idx) * 1_009 + head) % SEED_MODULUS)


class PromptCompressor:
    """The prefill pipeline of one batch of prompts, layer by layer."""

    scores_at_prefill = True   # False: the method is scored by repeat passes (core/reconstructing.py), not here

    def __init__(self, method: CompressionMethod, model: ModelShape, pad_lens: list[int], prompt_len: int,
                 rotation=None):
        """rotation: the model's RoPE (core/rotary.py), for methods with `needs_rotation`."""
        self.method = method
        self.rotation = rotation
        self.model = model
        self.pad_lens = pad_lens
        self.real_lens = [prompt_len - pad for pad in pad_lens]
        self.stored_heads = model.num_query_heads if method.gqa_layout == "query_head" else model.num_kv_heads
        self.layer_budgets: Optional[list[list[int]]] = None      # per prompt, per layer
        self.head_plans: list[Optional[list[list[int]]]] = []     # per prompt: per layer and head (one budget over all)
        self.waiting: dict[int, ScoredLayer] = {}                  # layers scored, not yet kept
        self.peak_waiting_bytes = 0
        self.pairs = {} if method.layer_sharing is None else method.layer_sharing.pairs(model.num_layers)
        # per prompt (prefix, suffix) tokens it protects itself, in place of the sinks and the window (KVzip's
        # template): the budget is then the method's on the rest, plus them
        self.edges: Optional[list[tuple[int, int]]] = None
        # one budget over every layer, cut as the layers are scored (core/running_top.py); None: layers wait whole
        self.running = RunningTop(self) if runs_top(method) and self.any_compressed() and self.scores_at_prefill \
            else None

    def extra(self, b: int) -> int:
        """Tokens prompt b protects beyond the method's own budget (its prefix and suffix, where it has them)."""
        return 0 if self.edges is None else sum(self.edges[b])

    def nominal_budget(self, b: int) -> int:
        return self.extra(b) + self.method.sizing.per_prompt(self.real_lens[b] - self.extra(b), self.method)

    def compressed(self, b: int) -> bool:
        return self.real_lens[b] > self.nominal_budget(b)

    def any_compressed(self) -> bool:
        return any(self.compressed(b) for b in range(len(self.pad_lens)))

    def needs_column_sums(self) -> bool:
        """True: the method scores by the attention's column sums and some prompt is compressed."""
        return self.method.needs_column_sums and self.any_compressed()

    def score(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              pattern=None, column_sums: Optional[torch.Tensor] = None,
              position_ids: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None) -> ScoredLayer:
        """queries: [B, Hq, n, D]; keys, values: [B, Hkv, n, D] after RoPE; pattern: the layer's sparse prefill
        pattern (None: dense), what the attention statistics count; column_sums: [B, Hq, n] from the
        attention pass, for methods with `needs_column_sums`; position_ids: [B or 1, n] the rows' RoPE positions
        (None: 0..n-1); hidden: [B, n, E] the layer's attention input (ScoreContext.hidden) or None."""
        method, model = self.method, self.model
        if self.stored_heads != keys.shape[1]:  # query_head: K/V repeated to the query heads before compression
            group = self.stored_heads // keys.shape[1]
            stored_keys, stored_values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        else:
            stored_keys, stored_values = keys, values
        scores = raw = merge_attention = None
        if self.any_compressed() and self.scores_at_prefill:
            n = keys.shape[2]
            real = real_positions(self.layer_pads(layer_idx, n), n, keys.device)
            positions = torch.arange(n, device=keys.device)[None] if position_ids is None else position_ids
            raw = method.score(ScoreContext(layer_idx, model.num_layers, queries, keys, values, real, pattern,
                                            column_sums, positions.to(keys.device).expand(len(real), n),
                                            self.rotation, hidden=hidden, model=model))
            scores = scores_per_stored_head(raw, method, model.num_kv_heads, model.num_query_heads)
            if method.merge is not None and method.merge.needs_attention:
                attention = window_attention(queries, keys, real, method.window_size, pattern,
                                             form=model.form).mean(dim=2)  # [B, Hq, n]
                merge_attention = scores_per_stored_head(attention, method, model.num_kv_heads, model.num_query_heads)
        channels = method.channels
        last_queries = None if channels is None else queries[:, :, -channels.key_query_window:]
        return ScoredLayer(stored_keys, stored_values, scores, raw, merge_attention, last_queries)

    def keep(self, layer_idx: int, scored: ScoredLayer) -> dict[int, list[KeptKV]]:
        """The layers whose kept tokens are known now -> per prompt its KeptKV: this layer, or none until
        the last layer when the budgets need every layer's scores (then all of them)."""
        if not self.method.layer_budgets_need_scores:
            self.fix_layer_budgets()
            if layer_idx in self.pairs:  # the lower layer of a merged pair waits for the upper one
                self._wait(layer_idx, scored)
                return {}
            if layer_idx - 1 in self.pairs:
                lower = self.waiting.pop(layer_idx - 1)
                both = None if scored.scores is None else lower.scores + scored.scores
                return {layer_idx - 1: self._keep_layer(layer_idx - 1, lower, both, layer_idx - 1),
                        layer_idx: self._keep_layer(layer_idx, scored, both, layer_idx - 1)}
            return {layer_idx: self._keep_layer(layer_idx, scored)}
        if self.running is not None:
            return self.running.add(layer_idx, scored)
        self._wait(layer_idx, scored)
        if layer_idx < self.model.num_layers - 1:
            return {}
        self.fix_layer_budgets(self._candidate_scores())
        return {layer: self._keep_layer(layer, self.waiting.pop(layer)) for layer in range(self.model.num_layers)}

    def _wait(self, layer_idx: int, scored: ScoredLayer) -> None:
        self.waiting[layer_idx] = scored
        self.peak_waiting_bytes = max(self.peak_waiting_bytes, sum(s.nbytes() for s in self.waiting.values()))

    def layer_pads(self, layer_idx: int, n: int) -> list[int]:
        """Per prompt, the positions before its first token the layer can attend to (padded coordinates): its left
        padding, or on a sliding layer of window W everything before the last W - 1 tokens."""
        window = self.model.form.window(layer_idx)
        return self.pad_lens if window is None else [max(pad, n - window + 1) for pad in self.pad_lens]

    def candidates(self, b: int, n: int, pad: Optional[int] = None) -> tuple[int, int]:
        """[first, stop) of prompt b's selectable positions (padded coordinates): not the sinks, not the window;
        pad: where the layer's tokens start (default: the prompt's padding)."""
        sinks, window = self.protected(b, n, pad)
        return (self.pad_lens[b] if pad is None else pad) + sinks, n - window

    def protected(self, b: int, n: int, pad: Optional[int] = None) -> tuple[int, int]:
        """(sinks, window) of prompt b on a layer whose tokens start at pad: the method's, or the prompt's own
        prefix and suffix, at most what the layer sees."""
        pad = self.pad_lens[b] if pad is None else pad
        sinks, window = (self.method.selection.num_sinks, self.method.window_size) if self.edges is None else self.edges[b]
        window = min(window, n - pad)
        return min(sinks, n - pad - window), window

    def waiting_bytes(self) -> int:
        return sum(s.nbytes() for s in self.waiting.values()) + (0 if self.running is None else self.running.nbytes())

    def _candidate_scores(self) -> list[Optional[list[torch.Tensor]]]:
        """Per compressed prompt, per layer its [H, candidates] scores (the window excluded; on a sliding layer the
        tokens it sees)."""
        n = self.waiting[0].keys.shape[2]
        out = []
        for b, pad in enumerate(self.pad_lens):
            if self.waiting[0].scores is None or not self.compressed(b):
                out.append(None)
                continue
            bounds = [self.candidates(b, n, self.layer_pads(layer, n)[b])
                      for layer in range(self.model.num_layers)]
            out.append([self.waiting[layer].scores[b, :, first:stop] for layer, (first, stop) in enumerate(bounds)])
        return out

    def planned_budgets(self) -> tuple[list[list[int]], list]:
        """(layer_budgets, head_plans) as the method fixes them before any score is known, for a method whose budgets
        do not depend on the scores (`layer_budgets_need_scores` False): what a loaded cache's are checked against."""
        self.fix_layer_budgets()
        return self.layer_budgets, self.head_plans

    def fix_layer_budgets(self, layer_scores: Optional[list] = None) -> None:
        """Per prompt, the tokens each layer keeps. A prompt no longer than the method's budget is kept
        whole in every layer (even where a layer's own share would be smaller)."""
        if self.layer_budgets is None:
            plans = [self.prompt_plan(b, None if layer_scores is None else layer_scores[b])
                     for b in range(len(self.real_lens))]
            self.layer_budgets, self.head_plans = [p[0] for p in plans], [p[1] for p in plans]

    def prompt_plan(self, b: int, scores: Optional[list]) -> tuple[list[int], Optional[list[list[int]]]]:
        """Prompt b's (tokens per layer, per layer and stored head where the method splits them itself or None), from
        its candidate scores per layer [H, candidates] (None where the budgets need none)."""
        n, extra = self.real_lens[b], self.extra(b)   # the budgets are the method's on the rest, plus the extra
        budget = self.nominal_budget(b) - extra
        if n <= budget + extra:
            return [n] * self.model.num_layers, None
        budgets = self.method.layer_budgets(budget, self.model.num_layers, n - extra, scores)
        plan = [[extra + c for c in layer] if isinstance(layer, list) else [extra + layer] * self.stored_heads
                for layer in budgets]
        return ([round(sum(heads) / len(heads)) for heads in plan],   # a ragged layer: the mean
                plan if any(isinstance(layer, list) for layer in budgets) else None)

    def _keep_layer(self, layer_idx: int, scored: ScoredLayer, scores: Optional[torch.Tensor] = None,
                    selecting_layer: Optional[int] = None) -> list[KeptKV]:
        """Per prompt: split its layer budget over the heads, select, merge, gather. scores [B, H, n] and
        selecting_layer (its seeds): what selects, when not the layer's own (a merged pair's sum)."""
        method = self.method
        keys, values = scored.keys, scored.values
        scores = scored.scores if scores is None else scores
        selecting = layer_idx if selecting_layer is None else selecting_layer
        n = keys.shape[2]
        kept = []
        for b, (pad, seen) in enumerate(zip(self.pad_lens, self.layer_pads(layer_idx, n))):
            positions = self.kept_positions(b, layer_idx, n, scores, self.layer_budgets[b][layer_idx],
                                            self.head_plans[b] if self.head_plans else None, selecting)
            if positions is None:
                kept.append(KeptKV.gather(keys[b], values[b], [torch.arange(seen, n, device=keys.device)] * keys.shape[1],
                                          pad))
                continue
            merged = None
            if method.merge is not None:
                seed = method.merge.seed_for(layer_idx)  # one generator per prompt and layer
                generator = None if seed is None else torch.Generator(device=keys.device).manual_seed(seed)
                attention = None if scored.merge_attention is None else scored.merge_attention[b]
                merged = merge_prompt(method.merge, keys[b], values[b], positions, seen, attention, method.window_size,
                                      generator)
            kept.append(KeptKV.gather(keys[b], values[b], positions, pad, merged))
        return self.thin_keys(kept, scored.last_queries)

    def kept_positions(self, b: int, layer_idx: int, n: int, scores: Optional[torch.Tensor], budget: int,
                       plan: Optional[list[list[int]]], selecting: int) -> Optional[list[torch.Tensor]]:
        """Prompt b's kept padded positions per stored head at a layer (None: all it sees), from its scores [B, H, n],
        its layer budget and its plan (per layer and head; None: the method splits the budget)."""
        seen = self.layer_pads(layer_idx, n)[b]
        if n - seen <= (budget if plan is None else min(plan[layer_idx])):
            return None
        first, stop = self.candidates(b, n, seen)
        extra = self.extra(b)
        head_budgets = plan[layer_idx] if plan is not None else \
            [extra + h for h in self.method.head_budgets(scores[b, :, first:stop], budget - extra, selecting, self.model)]
        sinks, window = self.protected(b, n, seen)
        return select_kept_positions(scores[b], seen, head_budgets, window, sinks, self.method.selection.random_fraction,
                                     lambda head: sampling_generator(self.method, selecting, head))

    def thin_keys(self, kept: list[KeptKV], last_queries: Optional[torch.Tensor]) -> list[KeptKV]:
        """ThinK's key channels (where the method has them) of a layer's kept tokens, per prompt."""
        if last_queries is None:
            return kept
        w, channels = last_queries.shape[2], self.method.channels
        return [prune_key_channels(k, last_queries[b, :, w - min(w, real):], channels.key_channel_ratio,
                                   channels.key_recent_size) for b, (k, real) in enumerate(zip(kept, self.real_lens))]
