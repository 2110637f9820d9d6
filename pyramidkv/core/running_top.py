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
raises, never silently). A unit promises this by `running_top` (GlobalHeads). A layer's rows are held in rank order
(`Held`: per head its window and sinks, then its candidates best first), so a cut takes each head's first rows in one
gather; at the last layer they are put back in position order.

Peak prefill K/V: after each layer the scored layers hold at most the final cache (l x H x (window + sinks) + at
most B tokens), and the layer being scored holds its whole prompt K/V: peak <= final cache + one layer's full K/V
(<= fullkv x (budget / n + 1 / L) per compressed prompt; tests/core/test_running_top.py counts it by hand).

Used when the counts are all a layer's K/V waits for; not with a merge rule (it reads the evicted tokens), a random
share (drawn from outside the top), a threshold sizing, MiniCache's layer pairs, or KVzip's repeat passes run after
the forward (the 5.x line: they read every layer's whole prompt K/V then; layer-major, each layer is cut once its
own repeat passes have run: core/reconstructing.py); those wait as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.core.context import CompressionMethod
from pyramidkv.core.kept import KeptKV


def runs_top(method: CompressionMethod) -> bool:
    """True: the method's budgets over every layer are a running top (a unit with `running_top`) and nothing else
    needs a layer's evicted tokens."""
    return (any(getattr(unit, "running_top", False) for unit in method.units) and method.merge is None
            and not method.selection.random_fraction and not method.sizing.outcome and method.layer_sharing is None)


@dataclass
class Held:
    """What one layer holds of one prompt while the cut runs: per stored head its protected rows (sinks, window), then
    its best candidates in rank order (the selection's order: the score, the more recent position among equals).
    keys, values: [T, D]; positions: [T] padded; lengths: per head."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    lengths: list[int]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def rows(self, lengths: list[int]) -> torch.Tensor:
        """The indices of each head's first lengths[h] rows (lengths[h] <= self.lengths[h])."""
        device = self.positions.device
        keep, have = torch.tensor(lengths, device=device), torch.tensor(self.lengths, device=device)
        shift = torch.repeat_interleave(have.cumsum(0) - have - keep.cumsum(0) + keep, keep)
        return torch.arange(int(keep.sum()), device=device) + shift

    def first(self, lengths: list[int]) -> "Held":
        if lengths == self.lengths:
            return self
        rows = self.rows(lengths)
        return Held(self.keys.index_select(0, rows), self.values.index_select(0, rows), self.positions[rows], lengths)

    def in_order(self, pad: int, n: int) -> KeptKV:
        """The rows per head in ascending position (as KeptKV keeps them; positions from the first real token)."""
        device = self.positions.device
        heads = torch.repeat_interleave(torch.arange(len(self.lengths), device=device),
                                        torch.tensor(self.lengths, device=device))
        rows = torch.argsort(heads * n + self.positions)
        return KeptKV(self.keys.index_select(0, rows), self.values.index_select(0, rows), list(self.lengths),
                      self.positions[rows] - pad)


class RunningTop:
    """The layers of one prompt batch scored so far, each holding per prompt what its counts under the running cut
    keep. compressor: the batch's PromptCompressor (core/prefill.py), whose budgets and selection this reuses."""

    def __init__(self, compressor):
        self.prompt = compressor
        self.held: dict[int, list[Held]] = {}                          # per layer, per prompt
        self.scores: dict[int, torch.Tensor] = {}                      # per layer [B, H, n]
        self.last_queries: dict[int, Optional[torch.Tensor]] = {}      # per layer, for ThinK's channels

    def nbytes(self) -> int:
        return sum(h.nbytes() for held in self.held.values() for h in held)

    def add(self, layer_idx: int, scored) -> dict[int, list[KeptKV]]:
        """Layer layer_idx scored (a ScoredLayer: its whole K/V): every scored layer cut to the running counts. Returns
        {} before the last layer, then every layer's kept tokens (the selection's own, checked against what was held)."""
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
            self.held[layer] = [self.cut(layer, b, n, scored, budgets[layer], plan)
                                for b, (budgets, plan) in enumerate(plans)]
        if not last:
            return {}
        kept = {}
        for layer in sorted(self.held):
            kept[layer] = [self.final(layer, b, n, budgets[layer], plan) for b, (budgets, plan) in enumerate(plans)]
            kept[layer] = prompt.thin_keys(kept[layer], self.last_queries[layer])
            del self.held[layer]
        for held in (self.scores, self.last_queries):
            held.clear()
        return kept

    def cut(self, layer: int, b: int, n: int, scored, budget: int, plan: Optional[list[list[int]]]) -> Held:
        """Prompt b's rows of a layer under its counts (budget: its layer budget; plan: per layer and head, or None):
        the protected rows and the best min(count, candidates) per head, taken from what the layer holds, or from the
        whole K/V of the layer just scored (ranked once)."""
        prompt, seen = self.prompt, self.prompt.layer_pads(layer, n)[b]
        sinks, window = prompt.protected(b, n, seen)
        first, stop = prompt.candidates(b, n, seen)
        budgets = plan[layer] if plan is not None else [budget] * prompt.stored_heads
        counts = [(window + sinks) + max(0, min(h - window - sinks, stop - first)) for h in budgets]
        if layer in self.held:
            return self.held[layer][b].first(counts)
        scores = self.scores[layer][b, :, first:stop]
        ranked = stop - 1 - torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices  # [H, m]
        device = ranked.device
        protected = torch.cat([torch.arange(seen, seen + sinks, device=device), torch.arange(n - window, n, device=device)])
        positions = torch.cat([protected.expand(ranked.shape[0], -1), ranked], dim=1)                   # [H, P + m]
        whole = Held(None, None, positions.reshape(-1), [positions.shape[1]] * ranked.shape[0])
        rows = whole.rows(counts)
        held = whole.positions[rows]
        return Held(*(self.gather(t[b], held, rows // positions.shape[1], counts) for t in (scored.keys, scored.values)),
                    held, counts)

    @staticmethod
    def gather(rows: torch.Tensor, positions: torch.Tensor, heads: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [H, n, D] at (heads[i], positions[i]) -> [T, D]: one index_select where the rows are contiguous."""
        if rows.is_contiguous():
            return rows.reshape(-1, rows.shape[-1]).index_select(0, heads * rows.shape[1] + positions)
        return torch.cat([rows[h].index_select(0, p) for h, p in enumerate(positions.split(counts))])

    def final(self, layer: int, b: int, n: int, budget: int, plan: Optional[list[list[int]]]) -> KeptKV:
        """Prompt b's kept tokens of a layer: the selection's (PromptCompressor.kept_positions), which must be what the
        layer holds (a row it dropped raises)."""
        prompt, seen = self.prompt, self.prompt.layer_pads(layer, n)[b]
        kept = self.held[layer][b].in_order(prompt.pad_lens[b], n)
        positions = prompt.kept_positions(b, layer, n, self.scores[layer], budget, plan, layer)
        if positions is None:
            positions = [torch.arange(seen, n, device=kept.positions.device)] * prompt.stored_heads
        if [len(p) for p in positions] != kept.lengths or \
                not torch.equal(torch.cat(positions) - prompt.pad_lens[b], kept.positions):
            raise RuntimeError(f"layer {layer}, prompt {b}: the running cut dropped a token the global selection keeps")
        return kept

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
