"""The prefill pipeline of a method scored by repeat passes (KVzip, core/reconstruction.py): each layer's K/V wait
until the repeat inputs have run through that layer, then the layer is kept as any scorer's is.

The repeat passes run in one of two orders (models/repeat.py drives them):

    layer-major    after the prompt passes layer l, every repeat input passes layer l (`repeat_scored`): the layer
                   is kept at once (budgets per layer), cut with the layers before it (one budget over every layer:
                   core/running_top.py), or waits for the last layer (budgets over every layer's scores otherwise);
                   peak prefill K/V: the final cache + one layer's whole prompt K/V + a repeat input's own K/V
    two forwards   the repeat inputs run after the prompt's whole forward, every layer waiting whole until they end
                   (`reconstructed`): peak prefill K/V = fullkv's (the 5.x line)
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.prefill import PromptCompressor, ScoredLayer
from pyramidkv.core.running_top import RunningTop, runs_top
from pyramidkv.core.scoring import scores_per_stored_head


class ReconstructingCompressor(PromptCompressor):
    """The prefill pipeline of one batch of prompts whose scores come from repeat passes."""

    scores_at_prefill = False

    def keep(self, layer_idx: int, scored: ScoredLayer) -> dict[int, list[KeptKV]]:
        """The prompt has passed the layer: it waits, whole, for its repeat passes."""
        self._wait(layer_idx, scored)
        return {}

    def start_repeats(self, edges: list[tuple[int, int]], layer_major: bool) -> None:
        """Before any repeat pass: per prompt the (prefix, suffix) it protects (which decide the budgets and whether it
        is compressed); layer_major: the layers are scored one by one, so one budget over every layer is cut as they
        are (the running top)."""
        self.edges = edges
        if layer_major and runs_top(self.method) and self.any_compressed():
            self.running = RunningTop(self)

    def repeat_scored(self, layer_idx: int, scores: Optional[torch.Tensor]) -> dict[int, list[KeptKV]]:
        """Layer-major: the repeat passes have run through layer layer_idx, scores [B, Hq, n] (None: no prompt is
        compressed). Returns the layers whose kept tokens are known now (PromptCompressor.keep)."""
        scored = self.waiting.pop(layer_idx)
        self._score(layer_idx, scored, scores)
        return super().keep(layer_idx, scored)

    def reconstructed(self, scores: dict[int, torch.Tensor]) -> dict[int, list[KeptKV]]:
        """Two forwards: every layer's kept tokens once the repeat passes have run, scores per layer [B, Hq, n]."""
        for layer, scored in self.waiting.items():
            self._score(layer, scored, scores.get(layer))
        self.fix_layer_budgets(self._candidate_scores())
        return {layer: self._keep_layer(layer, self.waiting.pop(layer)) for layer in range(self.model.num_layers)}

    def _score(self, layer_idx: int, scored: ScoredLayer, scores: Optional[torch.Tensor]) -> None:
        """The method's scores of a layer from its repeat passes' [B, Hq, n], per stored head, into `scored`."""
        if not self.any_compressed():
            return
        raw = self.method.score(ScoreContext(layer_idx, self.model.num_layers, None, scored.keys, scored.values, None,
                                             reconstruction=scores, model=self.model))
        scored.scores = scores_per_stored_head(raw, self.method, self.model.num_kv_heads, self.model.num_query_heads)


class RepeatEntryPoints:
    """The compressed cache's entry points for repeat passes (mixed into core/cache.py's CompressedCache, whose
    `reconstruction`, `prompt`, `_store` and byte counts they use)."""

    def start_repeats(self, layer_major: bool) -> None:
        """Before the first repeat pass of the `reconstruction` (layer_major: as ReconstructingCompressor's)."""
        recon = self.reconstruction
        recon.last_layer = self.num_layers - 1
        self.prompt.start_repeats([(plan.prefix, plan.suffix) for plan in recon.plans], layer_major)

    def repeat_attend(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
        """One layer of a repeat input (`reconstruction.current`; queries [1, Hq, m, D], keys, values [1, Hkv, m, D]):
        its attention output [1, Hq, m, D] over the prompt's waiting K/V and its own; nothing is stored, but its own
        K/V count towards the peak prefill K/V while they exist."""
        b, held = self.reconstruction.current[0], self.prompt.waiting[layer_idx]
        own = sum(t.numel() * t.element_size() for t in (keys, values))
        now = self.kv_bytes() + self.prompt.waiting_bytes() + own
        self.peak_prefill_kv_bytes = max(self.peak_prefill_kv_bytes, now)
        return self.reconstruction.attend(layer_idx, queries, keys, values, held.keys[b], held.values[b],
                                          self.pad_lens[b], self.form)

    @torch.no_grad()
    def repeat_scored(self, layer_idx: int) -> None:
        """Layer-major: the repeat passes have run through a layer, which keeps what they scored."""
        self._store(self.prompt.repeat_scored(layer_idx, self.reconstruction.scores.get(layer_idx)))

    @torch.no_grad()
    def reconstructed(self) -> None:
        """Two forwards: the repeat passes have run through every layer (`reconstruction`, kept for inspection: its
        scores, the tokens it ran), and every layer keeps what they scored."""
        self._store(self.prompt.reconstructed(self.reconstruction.scores))
