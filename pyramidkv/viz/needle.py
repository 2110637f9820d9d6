"""Needle-in-a-haystack heatmaps: depth (rows) x context length (columns), red -> yellow -> green.

In Python: `plot_needle_heatmap(run_dir)` returns `Plot(figure, data)` like the other figures;
`plot_run` / `plot_grid` write PNGs. The command line (scripts/scripts_needle/visualize.py calls `main`):

One run:
    python scripts/scripts_needle/visualize.py RUN_DIR [--metric METRIC] [--out PNG] [--annotate]
Several runs side by side (e.g. methods at one budget), as folders or one parent folder to search:
    python scripts/scripts_needle/visualize.py --grid RUN_DIR1 RUN_DIR2 ... [--out PNG]
    python scripts/scripts_needle/visualize.py --grid results/needle

RUN_DIR is what run_needle_in_haystack.py writes ({save_dir}/{model}_{budget}/{method}/ with needle.jsonl).
Default output: RUN_DIR/needle_{metric}.png, or needle_grid_{metric}.png in the runs' common parent.
METRIC: rouge1_f (default), recall, harness_rouge1_x10 or harness_word_recall (docs/needle.md).
The colour scale is fixed to the metric's full range (0..1; 0..10 for harness_rouge1_x10); a missing
cell is left blank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LinearSegmentedColormap

from pyramidkv.benchmarks.needle import SCORES
from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.runner.results import read_jsonl
from pyramidkv.viz.plots import Plot

RESULTS_FILE = "needle.jsonl"
METRICS = {"rouge1_f": "ROUGE-1 F", "recall": "needle word recall",
           "harness_rouge1_x10": "ROUGE-1 F x 10 (rouge_score, stemmed; public harness)",
           "harness_word_recall": "answer word-set recall (public harness)"}
assert set(METRICS) == set(SCORES), "every score needs a heatmap label"
COLORS = ["#F0496E", "#EBB839", "#0CD79F"]
CMAP = LinearSegmentedColormap.from_list("needle", COLORS)
METHOD_ORDER = ["fullkv", "streamingllm", "h2o", "snapkv", "pyramidkv", "l2norm"]


def read_rows(path: Path) -> list[dict]:
    """needle.jsonl rows; a cut-off last line (a run killed mid-write) is skipped, other bad lines are errors."""
    return read_jsonl(path, skip_torn_last_line=True)


def run_identity(run_dir: Path) -> dict:
    """model, method (its label: snapkv_merge=pivot), budget: from results.json, else run_meta.json, else the
    folder names."""
    from pyramidkv.runner.cli import recorded_budget, recorded_method_label

    run_dir = Path(run_dir)
    results = run_dir / "results.json"
    if results.is_file():
        try:
            data = json.loads(results.read_text(encoding="utf-8"))
            # A results.json from before it carried the label names only the method: its folder has the label.
            method = data.get("method") if "method_spec" in data else run_dir.resolve().name
            return {"model": data.get("model"), "method": method, "budget": data.get("budget")}
        except (json.JSONDecodeError, AttributeError):
            pass
    meta = run_dir / "run_meta.json"
    if meta.is_file():
        try:
            data = json.loads(meta.read_text(encoding="utf-8"))
            return {"model": data.get("model_version"), "method": recorded_method_label(data, run_dir.resolve()),
                    "budget": recorded_budget(data)}
        except (json.JSONDecodeError, AttributeError):
            pass
    model, _, budget = run_dir.resolve().parent.name.rpartition("_")
    return {"model": model or None, "method": run_dir.name, "budget": None if budget == "full" else budget}


class Run:
    """One run folder's grid of scores (`grid`: depths x lengths, NaN where a cell is missing)."""

    def __init__(self, run_dir: Path, metric: str):
        self.dir = Path(run_dir)
        path = self.dir / RESULTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: RUN_DIR must be a folder written by run_needle_in_haystack.py")
        rows = read_rows(path)
        if not rows:
            raise ValueError(f"{path} has no rows")
        missing = [k for k in ("context_length", "depth_percent", metric) if k not in rows[0]]
        if missing:
            raise ValueError(f"{path}: rows lack {', '.join(missing)}")
        self.identity = run_identity(self.dir)
        self.lengths = sorted({int(r["context_length"]) for r in rows})
        self.depths = sorted({int(r["depth_percent"]) for r in rows})
        self.grid = np.full((len(self.depths), len(self.lengths)), np.nan)
        for r in rows:
            self.grid[self.depths.index(int(r["depth_percent"])), self.lengths.index(int(r["context_length"]))] = \
                float(r[metric])
        self.metric = metric

    @property
    def average(self) -> float:
        return float(np.nanmean(self.grid))

    def label(self, with_model: bool = True) -> str:
        ident = self.identity
        budget = ident.get("budget")
        parts = [str(ident.get("method") or self.dir.name)]
        parts.append("full cache" if budget is None else f"budget {budget}")
        if with_model and ident.get("model"):
            parts.insert(0, str(ident["model"]))
        return " | ".join(parts)


def _draw(ax, run: Run, annotate: bool, show_ylabel: bool = True):
    image = ax.imshow(run.grid, cmap=CMAP, vmin=0.0, vmax=SCORES[run.metric][1], aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(len(run.lengths)), [str(n) for n in run.lengths], rotation=45 if len(run.lengths) > 8 else 0)
    ax.set_yticks(range(len(run.depths)), [str(d) for d in run.depths])
    ax.set_xticks(np.arange(-0.5, len(run.lengths), 1), minor=True)
    ax.set_yticks(np.arange(-0.5, len(run.depths), 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("Context length (tokens)")
    if show_ylabel:
        ax.set_ylabel("Depth (%)")
    if annotate:
        for i in range(len(run.depths)):
            for j in range(len(run.lengths)):
                value = run.grid[i, j]
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8, color="black")
    return image


def plot_run(run_dir: Path, out: Optional[Path] = None, metric: str = "rouge1_f", annotate: bool = False,
             width: float = 9.0, height: float = 6.0, dpi: int = 100) -> Path:
    """One heatmap; returns the PNG path. The image is exactly width*dpi x height*dpi pixels."""
    run = Run(run_dir, metric)
    out = Path(out) if out else run.dir / f"needle_{metric}.png"
    fig, ax = plt.subplots(figsize=(width, height), dpi=dpi)
    image = _draw(ax, run, annotate)
    fig.colorbar(image, ax=ax, label=METRICS[metric])
    ax.set_title(f"Needle in a haystack: {run.label()}\n{METRICS[metric]}, average {run.average:.3f}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def plot_needle_heatmap(run_dir, metric: str = "rouge1_f", annotate: bool = False) -> Plot:
    """One run folder's heatmap as `Plot(figure, data)` like the other figures; data is the `Run`
    (its `.grid` is depths x lengths, `.depths`, `.lengths`)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(METRICS)}")
    run = Run(run_dir, metric)
    fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
    image = _draw(ax, run, annotate)
    fig.colorbar(image, ax=ax, label=METRICS[metric])
    ax.set_title(f"Needle in a haystack: {run.label()}\n{METRICS[metric]}, average {run.average:.3f}")
    return Plot(fig, run)


def find_runs(paths: Sequence[Path]) -> list[Path]:
    """Run folders: the given folders that hold needle.jsonl, and those found below the others."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / RESULTS_FILE).is_file():
            runs.append(p)
        elif p.is_dir():
            found = sorted(f.parent for f in p.rglob(RESULTS_FILE))
            if not found:
                raise FileNotFoundError(f"no {RESULTS_FILE} in or below {p}")
            runs.extend(found)
        else:
            raise FileNotFoundError(f"{p} does not exist")
    unique = list(dict.fromkeys(r.resolve() for r in runs))
    return unique


def _order(run: Run):
    ident = run.identity
    method = str(ident.get("method") or "")
    budget = ident.get("budget")
    return (str(ident.get("model") or ""), METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER),
            method, -1 if budget is None else (budget if isinstance(budget, (int, float)) else 0), str(budget))


def plot_grid(paths: Sequence[Path], out: Optional[Path] = None, metric: str = "rouge1_f", annotate: bool = False,
              panel_width: float = 5.0, height: float = 5.0, dpi: int = 100) -> Path:
    """Heatmaps side by side, one per run, one shared colour bar."""
    runs = sorted((Run(p, metric) for p in find_runs(paths)), key=_order)
    if out is None:
        parent = Path(os.path.commonpath([str(r.dir) for r in runs]))
        if len(runs) == 1:
            parent = parent.parent
        out = parent / f"needle_grid_{metric}.png"
    out = Path(out)
    models = {r.identity.get("model") for r in runs}
    fig, axes = plt.subplots(1, len(runs), figsize=(panel_width * len(runs) + 1.0, height), dpi=dpi, squeeze=False,
                             layout="constrained")
    image = None
    for k, (ax, run) in enumerate(zip(axes[0], runs)):
        image = _draw(ax, run, annotate, show_ylabel=(k == 0))
        ax.set_title(f"{run.label(with_model=len(models) > 1)}\naverage {run.average:.3f}", fontsize=10)
    fig.colorbar(image, ax=list(axes[0]), label=METRICS[metric], fraction=0.03, pad=0.01)
    title = "Needle in a haystack"
    if len(models) == 1 and None not in models:
        title += f": {models.pop()}"
    fig.suptitle(f"{title} ({METRICS[metric]})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (scripts/scripts_needle/visualize.py)."""
    p = ArgumentParser(prog="visualize.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results_dir", nargs="?", help="a run folder (holding needle.jsonl)")
    p.add_argument("--grid", nargs="+", metavar="DIR", help="run folders (or parents to search) to draw side by side")
    p.add_argument("--out", default=None, help="PNG path (default: next to the results)")
    p.add_argument("--metric", choices=list(METRICS), default="rouge1_f",
                   help="score to draw (default rouge1_f); harness_* are the public PyramidKV harness's scores")
    p.add_argument("--annotate", action="store_true", help="write each cell's score in it")
    p.add_argument("--dpi", type=int, default=100)
    args = p.parse_args(argv)
    if bool(args.results_dir) == bool(args.grid):
        p.error("give either RESULTS_DIR or --grid DIR [DIR ...]")
    try:
        if args.grid:
            out = plot_grid(args.grid, args.out, args.metric, args.annotate, dpi=args.dpi)
        else:
            out = plot_run(args.results_dir, args.out, args.metric, args.annotate, dpi=args.dpi)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
