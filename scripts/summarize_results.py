"""Turn a results folder into tables and plots.

    python scripts/summarize_results.py RESULTS_DIR [--out OUT_DIR]

Reads every results.json under RESULTS_DIR (the schema all runners write: benchmark, model,
method, budget, scores, average, num_samples) and checks the prediction files next to it (a
sample listed twice is an error naming the file and the repeated id). For each (benchmark,
model) it writes summary_<benchmark>_<model>.md / .csv (rows: one per run, the fullkv row first;
columns: method, budget, tasks, the average, the sample count and the run folder) and
summary_<benchmark>_<model>.png (average score vs budget, one line per method folder, so runs
with other method settings get their own line; ratio budgets in a second panel; the true full cache
(fullkv with no variant: not `fullkv --cross_layer_merge`, which is MiniCache) as a dashed black reference
line, other methods that keep a full-size cache (minicache, minference) as dotted lines of their own;
runs without a score are named under the plot). A run a sweep listed in its sweep_runs.txt
(scripts/sweep_tasks.sh) that has no results.json (it failed, was killed or never started) gets a row
with no scores, its run cell saying so, and a warning on stderr: never left out. A needle run's
average is one metric (its "average_metric", recall), never a mean across metrics. Prints the
Markdown tables.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.runner.labels import QUESTION_AS_DECODE_SUFFIX
from pyramidkv.runner.results import (
    PREDICTION_KEYS, atomic_write_text, read_jsonl, read_unique_rows,
)

REQUIRED = ("benchmark", "model", "method", "budget", "scores", "average")
SWEEP_RUNS = "sweep_runs.txt"   # "<benchmark> <run folder relative to this file's folder>" lines: record_sweep_runs
NO_RESULTS = "no results.json: failed or not run"


def _check_predictions(run_folder: Path) -> None:
    """Each prediction file of the run lists every sample once (see results.read_unique_rows)."""
    for path in sorted(run_folder.glob("*.jsonl")):
        rows = read_jsonl(path, skip_torn_last_line=True)
        key = next((k for k in PREDICTION_KEYS if rows and k in rows[0]), None)
        if key is not None:
            read_unique_rows(path, key, skip_torn_last_line=True)


def _check_result(path: Path, data) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{path}: not a pyramidkv results.json (missing {', '.join(missing)})")
    for name in ("benchmark", "model", "method"):
        if not isinstance(data[name], str) or not data[name]:
            raise ValueError(f"{path}: {name} must be a non-empty string, got {data[name]!r}")
    if not isinstance(data["scores"], dict):
        raise ValueError(f"{path}: \"scores\" must be an object of task -> score, got {type(data['scores']).__name__}")
    for name, value in [("average", data["average"]), *((f"scores.{k}", v) for k, v in data["scores"].items())]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{path}: {name} must be a number or null, got {value!r}")
        if value is not None and not (math.isfinite(value) and 0 <= value <= 100):
            raise ValueError(f"{path}: {name} must be a score in [0, 100], got {value!r}")
    budget = data["budget"]
    ratio = _ratio(budget)
    if not (budget is None or (ratio is not None and 0 < ratio <= 1) or
            (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1)):
        raise ValueError(f"{path}: budget must be an integer >= 1, \"r<ratio>\" with a ratio in (0, 1], or null "
                         f"(the full cache), got {budget!r}")
    metric = data.get("average_metric")
    if metric is not None and metric not in data["scores"]:
        raise ValueError(f"{path}: average_metric {metric!r} is none of its scores ({', '.join(data['scores'])})")
    expected = data["scores"][metric] if metric is not None else _expected_average(data)
    if expected is not None and data["average"] is not None and abs(expected - data["average"]) > 0.011:
        what = f"its {metric} score" if metric is not None else "the mean of its scores"
        raise ValueError(f"{path}: average {data['average']} disagrees with {what} ({expected:.2f}"
                         f"{AVERAGED.get(data['benchmark'], ('', ''))[1] if metric is None else ''})")
    folder = path.parent.parent.name
    label = "full" if budget is None else str(budget)
    if "_" in folder and folder.rsplit("_", 1)[1] != label and _looks_like_a_budget(folder.rsplit("_", 1)[1]):
        raise ValueError(f"{path}: budget {budget!r} disagrees with its folder {folder} (the runners write "
                         f"{{model}}_{{budget}}/{{method}}/)")


# The scores a benchmark's average is the mean of (all of them where not named) and how messages say it, for
# results.json files that name no "average_metric" (needle runs from before it: their average, a mean of two
# metrics, is checked, then replaced by NEEDLE_METRIC's score).
AVERAGED = {"needle": (("rouge1_f", "recall"), " of rouge1_f and recall")}
NEEDLE_METRIC = "recall"


def _expected_average(data: dict):
    names, _ = AVERAGED.get(data["benchmark"], (None, ""))
    values = [v for k, v in data["scores"].items() if names is None or k in names]
    if not values or any(not isinstance(v, (int, float)) for v in values):
        return None
    return math.fsum(values) / len(values)


def _looks_like_a_budget(text: str) -> bool:
    return text == "full" or text.isdigit() or _ratio(text) is not None
    if not isinstance(data.get("num_samples", {}), dict):
        raise ValueError(f"{path}: num_samples must be an object of task -> count")


def load_results(root: Path) -> list[dict]:
    if not root.is_dir():
        raise FileNotFoundError(f"results folder {root} does not exist")
    results = []
    for path in sorted(root.rglob("results.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        _check_result(path, data)
        _check_predictions(path.parent)
        if data["benchmark"] == "needle" and "average_metric" not in data:
            data["average"], data["average_metric"] = data["scores"].get(NEEDLE_METRIC), NEEDLE_METRIC
        data["_path"] = str(path)
        data["_run"] = path.parent.relative_to(root).as_posix() or "."
        results.append(data)
    results += missing_runs(root)
    if not results:
        raise FileNotFoundError(f"no results.json under {root}")
    _name_series(results)
    return results


def missing_runs(root: Path) -> list[dict]:
    """The runs listed in a sweep_runs.txt under `root` that have no results.json, as results without scores
    (`_missing`); model and budget read from the runners' {model}_{budget}/{method}/ layout."""
    missing = {}
    for listing in sorted(root.rglob(SWEEP_RUNS)):
        for line in listing.read_text(encoding="utf-8").splitlines():
            benchmark, _, run = line.strip().partition(" ")
            folder = listing.parent / run
            if not run or (folder / "results.json").is_file():
                continue
            model, _, label = folder.parent.name.rpartition("_")
            name = Path(os.path.relpath(folder, root)).as_posix()
            missing[name] = {"benchmark": benchmark, "model": model, "method": folder.name, "scores": {},
                             "budget": None if label == "full" else int(label) if label.isdigit() else label,
                             "average": None, "num_samples": {}, "_path": str(folder / "results.json"),
                             "_run": name, "_missing": True}
    return list(missing.values())


def _name_series(results: list[dict]) -> None:
    """_series: the run's method folder (e.g. snapkv, snapkv_window_size=8), prefixed by the folders
    above {model}_{budget} when two runs of one (benchmark, model) would otherwise share a point."""
    for r in results:
        parts = r["_run"].split("/")
        r["_series"] = parts[-1] if len(parts) < 2 else "/".join(parts[:-2] + parts[-1:])
    seen = defaultdict(list)
    for r in results:
        seen[(r["benchmark"], r["model"], r["_series"], str(r["budget"]))].append(r)
    for group in seen.values():
        if len(group) > 1:
            for r in group:
                r["_series"] = r["_run"]


def _sample_count(r: dict):
    counts = r.get("num_samples") or {}
    values = [v for v in counts.values() if isinstance(v, int)]
    if r.get("benchmark") == "needle":
        return max(values) if values else None   # one count per score key, the same cells
    return sum(values) if values else None


def _budget_key(budget):
    if budget is None:
        return (0, 0.0, "")
    if isinstance(budget, (int, float)):
        return (1, float(budget), "")
    return (2, _ratio(budget) or 0.0, str(budget))


def _ratio(budget):
    """0.25 for "r0.25"; None otherwise."""
    if isinstance(budget, str) and budget.startswith("r"):
        try:
            return float(budget[1:])
        except ValueError:
            return None
    return None


def is_full_cache(r: dict) -> bool:
    """A true full cache: fullkv with no variant (its spec, or for a results.json from before the spec was
    recorded, its method folder, is plain `fullkv`); `fullkv --cross_layer_merge` (MiniCache) is none."""
    if "method_spec" in r:
        return r["method_spec"] == "fullkv"
    folder = Path(r["_path"]).parent.name.removesuffix(QUESTION_AS_DECODE_SUFFIX)
    return r["method"] == "fullkv" and folder == "fullkv"


def _row_order(r: dict):
    return (not is_full_cache(r), r["method"], _budget_key(r["budget"]), r["_run"])


def table(results: list[dict]) -> tuple[list[str], list[list]]:
    tasks = sorted({t for r in results for t in r["scores"]})
    header = ["method", "budget", *tasks, "average", "n", "run"]
    rows = []
    for r in sorted(results, key=_row_order):
        budget = "full" if r["budget"] is None else r["budget"]
        run = f"{r['_run']} ({NO_RESULTS})" if r.get("_missing") else r["_run"]
        rows.append([r["method"], budget, *(r["scores"].get(t) for t in tasks), r["average"], _sample_count(r), run])
    return header, rows


def markdown(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def context_lengths(results: list[dict]) -> list[int]:
    """Context lengths the runs cover: RULER's task@length keys, needle's by_context_length."""
    lengths = set()
    for r in results:
        for key in r["scores"]:
            if "@" in key and key.rsplit("@", 1)[1].isdigit():
                lengths.add(int(key.rsplit("@", 1)[1]))
        lengths.update(int(k) for k in (r.get("by_context_length") or {}) if str(k).isdigit())
    return sorted(lengths)


def plot_title(benchmark: str, model: str, results: list[dict]) -> str:
    lengths = context_lengths(results)
    counts = sorted({c for c in map(_sample_count, results) if c is not None})
    parts = [f"{benchmark} - {model}"]
    if lengths:
        parts.append("context " + ", ".join(map(str, lengths)))
    if counts:
        parts.append(f"n={counts[0]}" if len(counts) == 1 else f"n={counts[0]}..{counts[-1]}")
    parts.append(f"{len(results)} runs")
    return "; ".join(parts)


def plot(results: list[dict], title: str, path: Path):
    """Average score vs budget; returns the figure (closed) so callers can inspect what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"tokens": defaultdict(list), "ratio": defaultdict(list)}
    unscored = [r for r in results if r["average"] is None]
    # Runs that keep a full-size cache (no budget): reference lines, the true full cache black and dashed.
    references = [r for r in results if r["budget"] is None and r["average"] is not None]
    for r in results:
        if r["budget"] is None or r["average"] is None:
            continue
        if isinstance(r["budget"], (int, float)):
            series["tokens"][r["_series"]].append((r["budget"], r["average"]))
        elif _ratio(r["budget"]) is not None:
            series["ratio"][r["_series"]].append((_ratio(r["budget"]), r["average"]))
        else:
            unscored.append(r)
    panels = [kind for kind in ("tokens", "ratio") if series[kind]] or ["tokens"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels) + 2.2, 4.6), squeeze=False)
    names = {n for s in series.values() for n in s} | {r["_series"] for r in references if not is_full_cache(r)}
    colors = {name: f"C{i % 10}" for i, name in enumerate(sorted(names))}
    all_values = [r["average"] for r in results if r["average"] is not None]
    for ax, kind in zip(axes[0], panels):
        for name, points in sorted(series[kind].items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name, color=colors[name])
        for r in references:
            if is_full_cache(r):
                ax.axhline(r["average"], color="black", linestyle="--", label=f"full cache ({r['_series']})")
            else:
                ax.axhline(r["average"], color=colors[r["_series"]], linestyle=":",
                           label=f"{r['_series']} (full-size cache)")
        xs = sorted({p[0] for pts in series[kind].values() for p in pts})
        if kind == "tokens":
            if xs:
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [str(b) for b in xs])
            ax.set_xlabel("KV budget (tokens per layer per head)")
        else:
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.set_xlabel("KV budget (fraction of the prompt)")
        # Scores are percentages: a fixed 0..100 axis, so one point or close values are not blown up.
        ax.set_ylim(min([0.0, *all_values]) - 2, max([100.0, *all_values]) + 2)
        metrics = {r.get("average_metric") for r in results}
        ax.set_ylabel(f"{next(iter(metrics))} (x100)" if len(metrics) == 1 and None not in metrics else "average score")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=8)   # outside the axes: covers no line
    fig.suptitle(title, fontsize=10)
    if unscored:
        fig.text(0.01, 0.01, "no score (plotted nowhere): " + ", ".join(r["_run"] for r in unscored), fontsize=7)
    fig.tight_layout(rect=(0, 0.04 if unscored else 0, 1 - 2.2 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where to write the summaries (default: RESULTS_DIR)")
    parser.add_argument("--no_plot", action="store_true")
    args = parser.parse_args(argv)
    try:
        results = load_results(args.results_dir)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    missing = [r["_run"] for r in results if r.get("_missing")]
    if missing:
        print(f"warning: {len(missing)} run(s) listed in {SWEEP_RUNS} have no results.json (failed or not run): "
              f"{', '.join(missing)}", file=sys.stderr)
    out = args.out or args.results_dir
    out.mkdir(parents=True, exist_ok=True)
    groups = defaultdict(list)
    for r in results:
        groups[(r["benchmark"], r["model"])].append(r)
    for (benchmark, model), results in sorted(groups.items()):
        header, rows = table(results)
        stem = f"summary_{benchmark}_{model}"
        md = markdown(header, rows)
        buf = io.StringIO()
        csv.writer(buf).writerows([header, *rows])
        atomic_write_text(out / f"{stem}.md", md + "\n")
        atomic_write_text(out / f"{stem}.csv", buf.getvalue())
        if not args.no_plot:
            plot(results, plot_title(benchmark, model, results), out / f"{stem}.png")
        print(f"\n## {benchmark} - {model}\n\n{md}")


if __name__ == "__main__":
    main()
