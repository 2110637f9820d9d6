"""Uniform allocation: every layer, and every head of a layer, selects the same number of tokens."""

from __future__ import annotations

from dataclasses import dataclass

from pyramidkv.allocation.base import HeadAllocation, LayerAllocation


@dataclass(frozen=True)
class UniformLayers(LayerAllocation):
    name = "uniform"

    def selected_per_layer(self, selected, num_layers, prompt_len, candidates, layer_scores=None):
        return [selected] * num_layers


@dataclass(frozen=True)
class UniformHeads(HeadAllocation):
    name = "uniform"

    def selected_per_head(self, scores, selected, layer_idx, model, protected=0):
        return [selected] * scores.shape[0]
