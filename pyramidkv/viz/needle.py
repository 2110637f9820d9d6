"""The needle-in-a-haystack heatmap (depth x context length), exposed next to the other figures.

The drawing code lives in `scripts/scripts_needle/visualize.py` (the CLI the needle docs use);
this module loads it from the repository checkout (pyramidkv is installed editable) so there is
one implementation. `plot_needle_heatmap` returns `Plot(figure, data)` like the other plots;
`plot_run` / `plot_grid` write PNGs exactly as the CLI does.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import matplotlib.pyplot as plt

from pyramidkv.viz.plots import Plot

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scripts_needle" / "visualize.py"


def _load():
    name = "pyramidkv_needle_visualize"
    if name in sys.modules:
        return sys.modules[name]
    if not SCRIPT.is_file():
        raise ImportError(f"the needle heatmap needs {SCRIPT} (a source checkout of pyramidkv, installed with pip -e)")
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


visualize = _load()
NeedleRun = visualize.Run
METRICS = visualize.METRICS
plot_run = visualize.plot_run
plot_grid = visualize.plot_grid


def plot_needle_heatmap(run_dir, metric: str = "rouge1_f", annotate: bool = False) -> Plot:
    """One run folder's heatmap (what run_needle_in_haystack.py wrote); data is the `NeedleRun`
    (its `.grid` is depths x lengths, `.depths`, `.lengths`)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(METRICS)}")
    run = NeedleRun(run_dir, metric)
    fig, ax = plt.subplots(figsize=(9, 6), layout="constrained")
    image = visualize._draw(ax, run, annotate)
    fig.colorbar(image, ax=ax, label=METRICS[metric])
    ax.set_title(f"Needle in a haystack: {run.label()}\n{METRICS[metric]}, average {run.average:.3f}")
    return Plot(fig, run)
