"""One budget over every layer (head_allocation global) while the prefill runs: each scored layer holds only what can
still be kept, so the prompt's K/V never waits whole in every layer.

The global allocation keeps the B best of every layer's candidate scores under one strict order (the score, then
the lower layer, the more recent position, the lower head: allocation/global_.py), B = layers x heads x selected.
What is not among the B best of the layers scored so far is not among the B best of all of them (a later layer only
adds rivals). So when layer l is scored the method is asked for its budgets as if the layers after l had no
candidates (`layer_budgets` with empty [H, 0] scores for them: the total stays B, each count is its head's share of
the B best scored so far), and every scored layer keeps, per prompt and head, its count of the head's best
candidates: the same top-k, more recent first among equals, that the final selection takes (core/selection.py),
whose smaller counts are prefixes of its larger ones. A count only falls from one layer to the next, so each layer's
final kept set lies inside what it holds; at the last layer the budgets are computed as before, over every layer's
scores, and the kept tokens are exactly the global allocation's (a row the final set needs and the layer dropped
raises, never silently). A unit promises this by `running_top` (GlobalHeads).

Peak prefill K/V: after each layer the scored layers hold at most the final cache (l x H x (window + sinks) + at
most B tokens), and the layer being scored holds its whole prompt K/V: peak <= final cache + one layer's full K/V
(<= fullkv x (budget / n + 1 / L) per compressed prompt; tests/core/test_running_top.py counts it by hand).

Used when the counts are all a layer's K/V waits for; not with a merge rule (it reads the evicted tokens), a random
share (drawn from outside the top), a threshold sizing, MiniCache's layer pairs, or KVzip's repeat pass (which reads
every layer's whole prompt K/V after the prefill: core/reconstruction.py); those wait as before.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.core.context import CompressionMethod
from pyramidkv.core.kept import KeptKV


def runs_top(method: CompressionMethod) -> bool:
    """True: the method's budgets over every layer are a running top (a unit with `running_top`) and nothing else
    needs a layer's evicted tokens."""
    return (any(getattr(unit, "running_top", False) for unit in method.units) and method.merge is None
            and not method.selection.random_fraction and not method.sizing.outcome and method.layer_sharing is None)


class RunningTop:
    """The layers of one prompt batch scored so far, each holding per prompt what its counts under the running cut
    keep. compressor: the batch's PromptCompressor (core/prefill.py), whose budgets and selection this reuses."""

    def __init__(self, compressor):
        self.prompt = compressor
        self.kept: dict[int, list[KeptKV]] = {}                        # per layer, per prompt
        self.scores: dict[int, torch.Tensor] = {}                      # per layer [B, H, n]
        self.last_queries: dict[int, Optional[torch.Tensor]] = {}      # per layer, for ThinK's channels
        self.counts: dict[int, list] = {}                              # per layer, the counts it holds

    def nbytes(self) -> int:
        return sum(k.nbytes() for kept in self.kept.values() for k in kept)

    def add(self, layer_idx: int, scored) -> dict[int, list[KeptKV]]:
        """Layer layer_idx scored (a ScoredLayer: its whole K/V): every scored layer cut to the running counts. Returns
        {} before the last layer, then every layer's kept tokens."""
        prompt = self.prompt
        prompt.peak_waiting_bytes = max(prompt.peak_waiting_bytes, self.nbytes() + scored.nbytes())
        self.scores[layer_idx], self.last_queries[layer_idx] = scored.scores, scored.last_queries
        n = scored.keys.shape[2]
        batch = range(len(prompt.real_lens))
        last = layer_idx == prompt.model.num_layers - 1
        if last:   # the budgets as without the running cut, over every layer's scores
            prompt.fix_layer_budgets([self.candidate_scores(b, n) if prompt.compressed(b) else None for b in batch])
            plans = list(zip(prompt.layer_budgets, prompt.head_plans))
        else:
            plans = [prompt.prompt_plan(b, self.candidate_scores(b, n) if prompt.compressed(b) else None)
                     for b in batch]
        for layer in sorted(self.scores):
            counts = [(budgets[layer], None if plan is None else plan[layer]) for budgets, plan in plans]
            if self.counts.get(layer) == counts:   # the new layer took none of its places
                continue
            self.counts[layer] = counts
            positions = [prompt.kept_positions(b, layer, n, self.scores[layer], budgets[layer], plan, layer)
                         for b, (budgets, plan) in enumerate(plans)]
            self.kept[layer] = [self.cut(layer, b, n, scored, where) for b, where in enumerate(positions)]
        if not last:
            return {}
        kept = {layer: prompt.thin_keys(self.kept.pop(layer), self.last_queries[layer]) for layer in sorted(self.kept)}
        for held in (self.scores, self.last_queries, self.counts):
            held.clear()
        return kept

    def cut(self, layer: int, b: int, n: int, scored, positions: Optional[list[torch.Tensor]]) -> KeptKV:
        """Prompt b's rows of a layer at `positions` (padded, per head; None: all it sees): gathered from the whole
        K/V of the layer just scored, else taken from what the layer holds."""
        pad, seen = self.prompt.pad_lens[b], self.prompt.layer_pads(layer, n)[b]
        if positions is None:
            positions = [torch.arange(seen, n, device=self.scores[layer].device)] * self.prompt.stored_heads
        if layer not in self.kept:
            return KeptKV.gather(scored.keys[b], scored.values[b], positions, pad)
        return self.kept[layer][b].subset([p - pad for p in positions])

    def candidate_scores(self, b: int, n: int) -> list[torch.Tensor]:
        """Prompt b's candidate scores [H, candidates] per layer (as PromptCompressor._candidate_scores), empty for
        the layers not scored yet."""
        prompt, first_scores = self.prompt, next(iter(self.scores.values()))
        empty = first_scores.new_zeros(prompt.stored_heads, 0)
        out = []
        for layer in range(prompt.model.num_layers):
            if layer not in self.scores:
                out.append(empty)
                continue
            first, stop = prompt.candidates(b, n, prompt.layer_pads(layer, n)[b])
            out.append(self.scores[layer][b, :, first:stop])
        return out
