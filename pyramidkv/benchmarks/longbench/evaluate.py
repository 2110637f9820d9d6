"""Score LongBench runs: `{dataset}.jsonl` prediction files -> results.json + results.csv.

`eval.py` at the repository root and `run_longbench.py --eval` both call this module.
A run folder holds `{dataset}.jsonl` files (rows with pred, answers, all_classes, length)
and usually `run_meta.json`; a tree (e.g. the --save_dir) is searched for run folders.

results.json (common schema of this project's benchmarks):
    {"benchmark": "longbench", "model", "method", "budget", "scores": {dataset: score},
     "average": float, "num_samples": {dataset: n}}
budget is the per-layer token budget (int), "r<ratio>" for a ratio budget, or null (full cache).
With --e (LongBench-E) it scores `{dataset}_e.jsonl` files (this project's layout) and
`{dataset}.jsonl` files in a folder directly below one named `pred_e` (the official layout
`pred_e/<model>/<dataset>.jsonl`), and writes results_e.json / results_e.csv whose scores are
{dataset: {"0-4k", "4-8k", "8k+"}} and whose average is per bucket.

A prediction file is refused, with an error naming the file and line, if it repeats an `_id`
(a sample must never count twice), if a row's `answers` is not a list, or if it is not UTF-8.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.runner.results import iter_jsonl
from pyramidkv.benchmarks.longbench.metrics import (
    DATASET2METRIC, LENGTH_BUCKETS, length_bucket, score_dataset, score_dataset_e,
)


OFFICIAL_E_FOLDER = "pred_e"  # the official eval.py --e reads pred_e/<model>/<dataset>.jsonl


def _dataset_of(path: Path, longbench_e: bool) -> Optional[str]:
    """The dataset a prediction file holds, or None if the file is not one (for this mode)."""
    stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else None
    if stem is None:
        return None
    if not longbench_e:
        return stem if stem in DATASET2METRIC else None
    if stem.endswith("_e") and stem[:-2] in DATASET2METRIC:
        return stem[:-2]
    in_official_layout = Path(path).resolve().parent.parent.name == OFFICIAL_E_FOLDER
    return stem if in_official_layout and stem in DATASET2METRIC else None


def prediction_files(run_dir: Path, longbench_e: bool = False) -> dict[str, Path]:
    """{dataset: file} for the LongBench prediction files directly inside run_dir."""
    found: dict[str, Path] = {}
    for path in sorted(Path(run_dir).glob("*.jsonl")):
        dataset = _dataset_of(path, longbench_e)
        if dataset is None:
            continue
        if dataset in found:
            raise ValueError(f"{run_dir}: both {found[dataset].name} and {path.name} hold LongBench-E "
                             f"predictions for {dataset}; keep one")
        found[dataset] = path
    return found


def find_run_dirs(root: Path, longbench_e: bool = False) -> list[Path]:
    """root itself if it holds prediction files, else every folder below it that does."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results folder {root} does not exist")
    if prediction_files(root, longbench_e):
        return [root]
    runs = sorted({p.parent for p in root.rglob("*.jsonl") if _dataset_of(p, longbench_e) is not None})
    if not runs:
        kind = ("{dataset}_e.jsonl, or pred_e/<model>/{dataset}.jsonl" if longbench_e
                else "{dataset}.jsonl")
        raise FileNotFoundError(f"no LongBench prediction files ({kind}) in or below {root}")
    return runs


def read_predictions(path: Path) -> list[dict]:
    """Rows of a prediction file, checked. An unterminated last line (a run still writing, or
    killed mid-write) is skipped; any other problem is an error naming file:line: a malformed
    line, a row without pred or answers, answers that are not a list, a repeated _id."""
    rows, first_line_of = [], {}
    for number, row in iter_jsonl(path, skip_torn_last_line=True):
        for field in ("pred", "answers"):
            if field not in row:
                raise ValueError(f"{path}:{number}: row lacks {field!r}")
        if not isinstance(row["answers"], list):
            raise ValueError(f"{path}:{number}: 'answers' must be a list of reference answers, "
                             f"got {type(row['answers']).__name__} {row['answers']!r}")
        key = row.get("_id")
        if key is not None:
            if key in first_line_of:
                raise ValueError(f"{path}:{number}: repeated _id {key!r} (first on line {first_line_of[key]}); "
                                 f"a sample must not be scored twice: remove the extra row")
            first_line_of[key] = number
        rows.append(row)
    return rows


def run_identity(run_dir: Path) -> dict:
    """model, method and budget of a run: from run_meta.json, else from {model}_{budget}/{method}."""
    from pyramidkv.runner.cli import model_label, recorded_budget, recorded_method_label

    run_dir = Path(run_dir).resolve()
    meta_path = run_dir / "run_meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            arguments = meta.get("arguments") or {}
            return {"model": model_label(str(arguments.get("model_path", ""))) or None,
                    "method": recorded_method_label(meta, run_dir), "budget": recorded_budget(meta)}
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            print(f"warning: {meta_path} is unreadable; naming the run after its folders", file=sys.stderr)
    if run_dir.parent.name in ("pred", OFFICIAL_E_FOLDER):  # the official layout pred[_e]/<model>/
        return {"model": run_dir.name, "method": None, "budget": None}
    model, _, budget = run_dir.parent.name.rpartition("_")
    if budget.isdigit():
        recorded = int(budget)
    elif budget in ("full", ""):
        recorded = None
    else:
        recorded = budget
    return {"model": model or run_dir.parent.name or None, "method": run_dir.name, "budget": recorded}


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return round(math.fsum(present) / len(present), 2)


def _csv_text(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(["" if v is None else v for v in row])
    return out.getvalue()


def evaluate_run_dir(run_dir: Path, longbench_e: bool = False, write: bool = True) -> dict:
    """Score every prediction file of one run; write results(.json|.csv) (or results_e.*) atomically."""
    from pyramidkv.runner.results import atomic_write_json, atomic_write_text

    run_dir = Path(run_dir)
    files = prediction_files(run_dir, longbench_e)
    if not files:
        raise FileNotFoundError(f"no LongBench prediction files in {run_dir}")
    scores, counts = {}, {}
    for dataset, path in files.items():
        rows = read_predictions(path)
        if not rows:
            print(f"warning: {path} has no predictions; skipped", file=sys.stderr)
            continue
        preds = [r["pred"] for r in rows]
        answers = [r["answers"] for r in rows]
        classes = [r.get("all_classes") for r in rows]
        if longbench_e:
            lengths = []
            for number, r in enumerate(rows, start=1):
                if "length" not in r:
                    raise ValueError(f"{path}: row {number} lacks 'length', which LongBench-E needs")
                lengths.append(int(r["length"]))
            scores[dataset] = score_dataset_e(dataset, preds, answers, lengths, classes)
            counts[dataset] = {b: sum(1 for n in lengths if length_bucket(n) == b) for b in LENGTH_BUCKETS}
        else:
            scores[dataset] = score_dataset(dataset, preds, answers, classes)
            counts[dataset] = len(rows)
    if longbench_e:
        average = {b: _mean([s[b] for s in scores.values()]) for b in LENGTH_BUCKETS}
    else:
        average = _mean(list(scores.values()))
    result = {"benchmark": "longbench-e" if longbench_e else "longbench", **run_identity(run_dir),
              "scores": scores, "average": average, "num_samples": counts}
    if write:
        stem = "results_e" if longbench_e else "results"
        atomic_write_json(run_dir / f"{stem}.json", result)
        if longbench_e:
            table = [[d, *(s[b] for b in LENGTH_BUCKETS), sum(counts[d].values())] for d, s in scores.items()]
            table.append(["average", *(average[b] for b in LENGTH_BUCKETS), sum(sum(c.values()) for c in counts.values())])
            text = _csv_text(["dataset", *LENGTH_BUCKETS, "num_samples"], table)
        else:
            table = [[d, s, counts[d]] for d, s in scores.items()]
            table.append(["average", average, sum(counts.values())])
            text = _csv_text(["dataset", "score", "num_samples"], table)
        atomic_write_text(run_dir / f"{stem}.csv", text)
    return result


def summary_csv(results: Sequence[dict]) -> str:
    """One row per run (model, method, budget, each dataset, average), for a whole results tree."""
    datasets = list(dict.fromkeys(d for r in results for d in r["scores"]))
    rows = [[r["model"], r["method"], r["budget"], *(r["scores"].get(d) for d in datasets), r["average"]]
            for r in results]
    return _csv_text(["model", "method", "budget", *datasets, "average"], rows)


def format_table(results: Sequence[dict]) -> str:
    lines = []
    for r in results:
        budget = "full" if r["budget"] is None else r["budget"]
        lines.append(f"{r['model']} / {r['method']} / budget {budget}")
        for dataset, score in r["scores"].items():
            lines.append(f"  {dataset:<22} {json.dumps(score):>10}   n={json.dumps(r['num_samples'][dataset])}")
        lines.append(f"  {'average':<22} {json.dumps(r['average']):>10}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pyramidkv.runner.results import atomic_write_text

    parser = ArgumentParser(
        prog="eval.py",
        description="Score LongBench predictions with the official metrics. Give a run folder "
                    "({save_dir}/{model}_{budget}/{method}) or a tree of them (e.g. the --save_dir).",
    )
    parser.add_argument("results_dir_pos", nargs="?", metavar="RESULTS_DIR", help="same as --results_dir")
    parser.add_argument("--results_dir", default=None, help="a run folder or a folder of runs")
    parser.add_argument("--e", action="store_true", help="LongBench-E: score {dataset}_e.jsonl (or the official "
                        "pred_e/<model>/{dataset}.jsonl) by length bucket")
    args = parser.parse_args(argv)
    root = args.results_dir or args.results_dir_pos
    if root is None:
        parser.error("give the results folder (RESULTS_DIR or --results_dir)")
    try:
        runs = find_run_dirs(Path(root), args.e)
        results = [evaluate_run_dir(run, args.e) for run in runs]
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(format_table(results))
    if len(runs) > 1 or runs[0] != Path(root):
        name = "all_results_e.csv" if args.e else "all_results.csv"
        if args.e:
            flat = [{**r, "scores": {f"{d}[{b}]": s[b] for d, s in r["scores"].items() for b in LENGTH_BUCKETS},
                     "average": json.dumps(r["average"])} for r in results]
            atomic_write_text(Path(root) / name, summary_csv(flat))
        else:
            atomic_write_text(Path(root) / name, summary_csv(results))
        print(f"summary -> {Path(root) / name}")
    for run in runs:
        print(f"wrote {run / ('results_e.json' if args.e else 'results.json')}")
    return 0
