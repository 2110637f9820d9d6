"""Figures of what a method sees and keeps. Each `plot_*` returns `Plot(figure, data)`.

Markers carry a matplotlib gid so tests and notebooks can find them: "needle" (the highlighted
span), "observation_window" (the forced recent window), "cutoff" (a score curve's cut-off line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap, LogNorm

from pyramidkv.methods.base import Method
from pyramidkv.viz.data import (
    ScoreCurve, attention_weights, check_index, highlight_positions, prefill, score_curve, tokenize,
)

NEEDLE_COLOR = "#d62728"
WINDOW_COLOR = "#1f77b4"
KEPT_CMAP = ListedColormap(["#f2f2f2", "#222222"])


class Plot(NamedTuple):
    figure: plt.Figure
    data: object


def _methods(methods) -> dict[str, Method]:
    """A Method, a sequence of Methods, or a name -> Method mapping -> name -> Method."""
    if isinstance(methods, Method):
        return {methods.name: methods}
    if isinstance(methods, Mapping):
        named = dict(methods)
    else:
        named = {}
        for m in methods:
            if not isinstance(m, Method):
                raise TypeError(f"expected pyramidkv Methods (see pyramidkv.make_method), got {type(m).__name__}")
            key, k = m.name, 2
            while key in named:
                key, k = f"{m.name} ({k})", k + 1
            named[key] = m
    if not named:
        raise ValueError("no methods given")
    bad = {k: type(v).__name__ for k, v in named.items() if not isinstance(v, Method)}
    if bad:
        raise TypeError(f"expected pyramidkv Methods, got {bad}")
    return named


def _mark_span(ax, positions: Sequence[int], axis: str = "x", label: str = "needle") -> None:
    """Shade each contiguous run of highlighted positions (gid 'needle')."""
    runs, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            runs.append((start, p))
            start = None
    for k, (a, b) in enumerate(runs):
        span = ax.axvspan if axis == "x" else ax.axhspan
        artist = span(a - 0.5, b + 0.5, color=NEEDLE_COLOR, alpha=0.35, lw=0, label=label if k == 0 else None)
        artist.set_gid("needle")


def _mark_window(ax, window_start: int, n: int, axis: str = "x") -> None:
    if window_start >= n:
        return
    line = ax.axvline if axis == "x" else ax.axhline
    artist = line(window_start - 0.5, color=WINDOW_COLOR, ls="--", lw=1.2, label="observation window")
    artist.set_gid("observation_window")


# ---- attention maps ---------------------------------------------------------------------------------
@dataclass
class AttentionMap:
    """weights: [len(heads), n, n] eager attention probabilities (rows = queries) of `layer`."""

    layer: int
    heads: list[int]
    weights: np.ndarray
    tokens: list[str]
    window_start: int
    label_span: Optional[tuple[int, int]]
    highlight: list[int]


def plot_attention_map(model, tokenizer, prompt, layer: int, heads: Optional[Sequence[int]] = None,
                       window_size: int = 32, label_span: Optional[tuple[int, int]] = None,
                       highlight=None, floor: float = 1e-4, columns: int = 3) -> Plot:
    """Attention of every prompt query to every key at one layer, one panel per query head.

    Log colour scale from `floor` to 1 (exact zeros, the causal upper triangle, left blank).
    The observation window (last `window_size` queries) is marked by a line; `label_span=(a, b)`
    zooms the key axis to positions a..b-1 and labels them with their tokens; `highlight` (text or
    positions) shades the needle's key columns.
    """
    p = tokenize(tokenizer, prompt)
    n = len(p)
    num_query_heads = model.config.num_attention_heads
    layer = check_index("layer", layer, model.config.num_hidden_layers)
    heads = list(range(num_query_heads)) if heads is None else [check_index("head", h, num_query_heads) for h in heads]
    if not heads:
        raise ValueError("no heads given")
    if label_span is not None:
        a, b = label_span
        if not (0 <= a < b <= n):
            raise ValueError(f"label_span {label_span} must satisfy 0 <= start < stop <= {n} (the prompt length)")
    if window_size < 0:
        raise ValueError(f"window_size must be >= 0, got {window_size}")
    marked = highlight_positions(p, highlight)
    weights = attention_weights(model, p, layer)[heads]
    data = AttentionMap(layer, heads, weights, p.tokens, n - min(window_size, n), label_span, marked)

    cols = min(columns, len(heads))
    rows = math.ceil(len(heads) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 1, 3.8 * rows), squeeze=False, layout="constrained")
    norm = LogNorm(vmin=floor, vmax=1.0)
    image = None
    for ax, head, w in zip(axes.flat, heads, weights):
        shown = np.ma.masked_where(w <= 0, np.clip(w, floor, None))
        image = ax.imshow(shown, norm=norm, cmap="magma", interpolation="nearest", aspect="auto")
        _mark_window(ax, data.window_start, n, axis="y")
        if marked:
            _mark_span(ax, marked, axis="x")
        if label_span is not None:
            a, b = label_span
            ax.set_xlim(a - 0.5, b - 0.5)
            ax.set_xticks(range(a, b), [repr(t)[1:-1] for t in p.tokens[a:b]], rotation=90, fontsize=7)
        ax.set_title(f"layer {layer}, head {head}", fontsize=10)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    for ax in list(axes.flat)[len(heads):]:
        ax.remove()
    fig.colorbar(image, ax=axes, label="attention weight (log)", shrink=0.8)
    return Plot(fig, data)


# ---- kept-token maps --------------------------------------------------------------------------------
@dataclass
class KeptTokenMap:
    """kept: [layers, heads, n] bool, True where the cache keeps the position (stored heads).

    A method that keeps everything (fullkv, or a prompt no longer than the budget) gives an
    all-True map.
    """

    method: str
    kept: np.ndarray
    counts: np.ndarray
    layer_budgets: list[int]
    highlight: list[int]
    window_start: int

    def rows(self) -> np.ndarray:
        """[layers * heads, n]: the image drawn, row = layer * heads + head."""
        layers, heads, n = self.kept.shape
        return self.kept.reshape(layers * heads, n)

    def needle_survival(self) -> np.ndarray:
        """[layers, heads]: the share of highlighted positions kept (NaN without a highlight)."""
        if not self.highlight:
            return np.full(self.kept.shape[:2], np.nan)
        return self.kept[:, :, self.highlight].mean(axis=-1)


def kept_token_maps(model, tokenizer, prompt, methods, highlight=None) -> dict[str, KeptTokenMap]:
    """name -> KeptTokenMap for each method, from a prefill of `prompt` under that method."""
    p = tokenize(tokenizer, prompt)
    marked = highlight_positions(p, highlight)
    maps = {}
    for name, method in _methods(methods).items():
        run = prefill(model, p, method)
        maps[name] = KeptTokenMap(method.name, run.kept_mask(), run.counts, run.layer_budgets, marked,
                                  len(p) - min(method.window_size, len(p)))
    return maps


def plot_kept_tokens(model, tokenizer, prompt, methods, highlight=None) -> Plot:
    """Which prompt positions each method keeps: one panel per method, rows = layer x stored head.

    `methods`: a Method, a list, or a name -> Method mapping (one figure compares them on the same
    prompt). `highlight` (text, e.g. the pass key, or positions) shades the needle columns.
    fullkv keeps every token, so its map is all kept (documented, not an error).
    """
    maps = kept_token_maps(model, tokenizer, prompt, methods, highlight)
    fig, axes = plt.subplots(len(maps), 1, figsize=(11, 2.6 * len(maps) + 0.6), squeeze=False, sharex=True,
                             layout="constrained")
    for ax, (name, m) in zip(axes[:, 0], maps.items()):
        layers, heads, n = m.kept.shape
        ax.imshow(m.rows(), cmap=KEPT_CMAP, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        if m.highlight:
            _mark_span(ax, m.highlight, axis="x")
        _mark_window(ax, m.window_start, n, axis="x")
        step = max(1, layers // 6)
        ax.set_yticks([layer * heads + (heads - 1) / 2 for layer in range(0, layers, step)],
                      [str(layer) for layer in range(0, layers, step)])
        ax.set_ylabel(f"layer (x {heads} heads)")
        survival = m.needle_survival()
        extra = "" if not m.highlight else f"; needle kept {np.nanmean(survival):.0%} of (layer, head, token)"
        ax.set_title(f"{name}: {int(m.counts.sum())} of {layers * heads * n} kept{extra}", fontsize=10)
    axes[-1, 0].set_xlabel("prompt position")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        axes[0, 0].legend(handles, labels, loc="upper left", fontsize=8, framealpha=0.9)
    return Plot(fig, maps)


# ---- score curves -----------------------------------------------------------------------------------
def plot_score_curve(model, tokenizer, prompt, method: Method, layer: int, head: int = 0, highlight=None) -> Plot:
    """A method's score per prompt position for one stored head, with its cut-off and window.

    Kept positions (read from the cache) are dotted; the dashed horizontal line is the cut-off
    (the lowest kept candidate's score), the vertical dashed line the start of the window.
    """
    p = tokenize(tokenizer, prompt)
    marked = highlight_positions(p, highlight)
    curve: ScoreCurve = score_curve(model, p, method, layer, head)
    n = len(p)
    fig, ax = plt.subplots(figsize=(11, 3.6), layout="constrained")
    shown = curve.scores[: curve.window_start]
    ax.plot(np.arange(len(shown)), shown, lw=0.8, color="#555555", label="score")
    kept = curve.kept[curve.kept < curve.window_start]
    ax.plot(kept, curve.scores[kept], ".", ms=3, color="#2ca02c", label=f"kept ({len(curve.kept)} incl. window)")
    if curve.cutoff is not None:
        ax.axhline(curve.cutoff, color="#ff7f0e", ls="--", lw=1, label="cut-off").set_gid("cutoff")
    _mark_window(ax, curve.window_start, n, axis="x")
    if marked:
        _mark_span(ax, marked, axis="x")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel("prompt position")
    ax.set_ylabel("score (higher = keep)")
    ax.set_title(f"{curve.method}: layer {curve.layer}, stored head {curve.head}, budget {curve.budget}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    return Plot(fig, curve)


# ---- budget maps ------------------------------------------------------------------------------------
@dataclass
class BudgetMap:
    """counts: [layers, heads] kept prompt tokens (from cache.kept_counts); layer_budgets: the
    per-layer budget the method gave the prompt (cache.layer_budgets_used)."""

    method: str
    counts: np.ndarray
    layer_budgets: list[int]
    prompt_len: int

    @property
    def per_layer(self) -> np.ndarray:
        return self.counts.sum(axis=1)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def ragged(self) -> bool:
        """True when heads of a layer keep different counts (AdaKV/HeadKV-style allocation)."""
        return bool((self.counts != self.counts[:, :1]).any())


def budget_maps(model, tokenizer, prompt, methods) -> dict[str, BudgetMap]:
    p = tokenize(tokenizer, prompt)
    out = {}
    for name, method in _methods(methods).items():
        run = prefill(model, p, method)
        out[name] = BudgetMap(method.name, run.counts, run.layer_budgets, len(p))
    return out


def plot_budget_maps(model, tokenizer, prompt, methods) -> Plot:
    """Kept tokens per layer (summed over stored heads) for each method; plus a layer x head panel
    for each method whose heads keep different counts. Works for any allocator: it reads only
    what the cache kept."""
    maps = budget_maps(model, tokenizer, prompt, methods)
    ragged = [name for name, m in maps.items() if m.ragged]
    fig, axes = plt.subplots(1, 1 + len(ragged), figsize=(7 + 3.2 * len(ragged), 3.8), squeeze=False,
                             layout="constrained", width_ratios=[2.2] + [1] * len(ragged))
    ax = axes[0, 0]
    for name, m in maps.items():
        ax.plot(np.arange(len(m.per_layer)), m.per_layer, marker="o", ms=3, label=f"{name} (total {m.total})")
    ax.set_xlabel("layer")
    ax.set_ylabel("kept tokens (all heads)")
    ax.set_title(f"Budget per layer, prompt of {next(iter(maps.values())).prompt_len} tokens", fontsize=10)
    ax.legend(fontsize=8)
    for ax, name in zip(axes[0, 1:], ragged):
        image = ax.imshow(maps[name].counts, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(f"{name}: per head", fontsize=10)
        ax.set_xlabel("stored head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, label="kept tokens")
    return Plot(fig, maps)


# ---- checking figures -------------------------------------------------------------------------------
def describe_figure(fig: plt.Figure) -> dict:
    """What a figure holds, for tests and notebooks: panels (axes other than colour bars),
    whether every image and line holds only finite data, and which markers (gids) it has."""
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    finite = True
    gids = set()
    for ax in panels:
        for image in ax.images:
            values = np.ma.asarray(image.get_array())
            finite &= bool(np.isfinite(np.ma.compressed(values)).all())
        for line in ax.lines:
            if line.get_gid():
                gids.add(line.get_gid())
            else:
                finite &= bool(np.isfinite(np.asarray(line.get_ydata(), dtype=float)).all())
        for patch in ax.patches:
            if patch.get_gid():
                gids.add(patch.get_gid())
    return {"panels": len(panels), "finite": finite, "markers": sorted(gids)}
