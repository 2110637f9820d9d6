"""The leaderboard's cells read from the runs (one CSV row per entry x task), and the page and figure made from the
CSV alone, so a committed page and figure can be checked against the committed CSV (tests/leaderboard).

Per cell: the benchmark's own score (its results.json), and from the prediction rows: the mean KL divergence of
the next-token distributions from fullkv's over the reference answer (teacher forced, `--kl_vs_fullkv`; not
measured under the shared-context protocol), the greedy agreement with fullkv's answer (per sample the length
of the answers' common prefix over the longer answer, in characters; 1 = the same answer), the K/V bytes held
when the answer ended, and the teacher-forced pass's prefill ms and decode ms per token.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Optional

from pyramidkv.leaderboard.intervals import differences, paired_interval
from pyramidkv.sizing.blocks import BLOCK_SIZES
from pyramidkv.leaderboard.grid import NEEDLE, RULER_TASKS, SHARED, SHARED_QUESTIONS, SHARED_TASK, Grid, Unit

COLUMNS = ("model", "context_length", "part", "task", "method", "base", "spec", "treatment", "ratio",
           "compression_ratio", "kept", "samples", "score", "vs_fullkv", "vs_fullkv_low", "vs_fullkv_high",
           "score_turn_1", "score_later_turns", "kl", "agreement", "kv_bytes", "kv_bytes_x_fullkv", "block_free_16",
           "block_free_32", "kept_share", "prefill_ms", "decode_ms_per_token", "unit_seconds", "status", "error",
           "torch", "transformers", "pyramidkv", "git_commit", "sample_scores")


def cell_tasks(grid: Grid, unit: Unit) -> list[tuple[str, str, str, str]]:
    """(task, predictions file, results key, row key field) of each cell a unit makes."""
    length = grid.context_length
    if unit.part == "ruler":
        return [(t, f"{t}_{length}.jsonl", f"{t}@{length}", "index") for t in grid.tasks if t in RULER_TASKS]
    if unit.part == NEEDLE:
        return [(NEEDLE, "needle.jsonl", None, "key")]
    return [(SHARED, f"{SHARED_TASK}_{length}_q{SHARED_QUESTIONS}.jsonl", f"{SHARED_TASK}@{length}", "qid")]


def collect(grid: Grid, save_dir: Path, folders: dict[str, Optional[Path]], unfit: Optional[dict] = None) -> list[dict]:
    """Every cell of the grid as a CSV row (failed, pending and n/a cells included); folders: unit name -> run folder
    (None for a unit in `unfit`: unit name -> why its method does not apply at the grid's length)."""
    from pyramidkv.leaderboard.cells import read_status
    from pyramidkv.runner.results import read_jsonl

    units = grid.units()
    fullkv = {u.part: u for u in units if u.entry.spec == "fullkv"}
    rows = []
    unfit = unfit or {}
    for unit in units:
        if unit.name in unfit:
            for task, *_ in cell_tasks(grid, unit):
                rows.append(_cell(grid, unit, task, {"state": "n/a", "error": unfit[unit.name]}, None, None, None,
                                  [], {}, None))
            continue
        status = read_status(save_dir, unit) or {}
        folder = folders[unit.name]
        results, meta = _json(folder / "results.json"), _json(folder / "run_meta.json")
        done = status.get("state") == "done" and results is not None
        for task, file_name, key, row_key in cell_tasks(grid, unit):
            preds = read_jsonl(folder / file_name, skip_torn_last_line=True) if done and (folder / file_name).is_file() else []
            reference = {}
            if unit.part in fullkv and unit is not fullkv[unit.part] and folders[fullkv[unit.part].name]:
                path = folders[fullkv[unit.part].name] / file_name
                reference = {r[row_key]: r for r in read_jsonl(path, skip_torn_last_line=True)} if path.is_file() else {}
            own_full = {r[row_key]: r for r in preds} if unit.entry.spec == "fullkv" else reference
            row = _cell(grid, unit, task, status, results, meta, key, preds, own_full, row_key)
            rows.append(row)
    by_task = {(r["part"], r["task"]): r for r in rows if r["spec"] == "fullkv"}
    for row in rows:
        full = by_task.get((row["part"], row["task"]))
        if full and row["kv_bytes"] is not None and full["kv_bytes"]:
            row["kv_bytes_x_fullkv"] = _round(row["kv_bytes"] / full["kv_bytes"])
        if row["treatment"] in ("fixed", "outcome"):
            row["kept"] = row["kept_share"] if row["kept_share"] is not None else row["kv_bytes_x_fullkv"]
        if full and row is not full and row["sample_scores"] and full["sample_scores"]:
            mine, theirs = json.loads(row["sample_scores"]), json.loads(full["sample_scores"])
            interval = paired_interval(differences({"t": mine}, {"t": theirs}))
            if interval is not None:
                row["vs_fullkv"], row["vs_fullkv_low"], row["vs_fullkv_high"] = (_round(v) for v in interval)
    return rows


def _cell(grid, unit, task, status, results, meta, key, preds, full, row_key) -> dict:
    entry = unit.entry
    state = status.get("state") or "pending"
    if state == "done" and not preds:
        state = "pending"
    versions = (meta or {}).get("versions", {})
    row = {c: None for c in COLUMNS}
    row.update(model=grid.model_path, context_length=grid.context_length, part=unit.part, task=task,
               method=entry.method, base=entry.base, spec=entry.spec, treatment=entry.treatment, ratio=entry.ratio,
               compression_ratio=None if entry.ratio is None else _round(1 - entry.ratio),
               kept=entry.ratio if entry.treatment == "ratio" else (1.0 if entry.treatment == "read" else None),
               status=state, error=status.get("error"), unit_seconds=status.get("seconds"),
               torch=versions.get("torch"), transformers=versions.get("transformers"),
               pyramidkv=versions.get("pyramidkv"), git_commit=(meta or {}).get("git_commit"))
    if state != "done":
        return row
    row["samples"] = len(preds)
    if unit.part == NEEDLE:
        row["score"] = results.get("average")
    else:
        row["score"] = results.get("scores", {}).get(key)
        turns = results.get("turn_scores", {}).get(key)
        if turns:
            row["score_turn_1"], row["score_later_turns"] = turns.get("1"), turns.get(f"2-{SHARED_QUESTIONS}")
    row["kl"] = _mean([r["kl_vs_fullkv"] for r in preds if "kl_vs_fullkv" in r])
    row["kv_bytes"] = _mean([r["kv_bytes"] for r in preds if "kv_bytes" in r])
    row["kept_share"] = _mean([r["kept_share"] for r in preds if "kept_share" in r])
    for size in BLOCK_SIZES:
        row[f"block_free_{size}"] = _mean([r.get(f"block_free_{size}") for r in preds])
    if unit.part == "ruler":      # per sample, the task's own metric (its mean over the samples is the score)
        from pyramidkv.benchmarks.ruler.scoring import score_task

        row["sample_scores"] = json.dumps({str(r[row_key]): score_task(task, [r["pred"]], [r["outputs"]])
                                           for r in preds}, separators=(",", ":"))
    row["prefill_ms"] = _mean([r["prefill_ms"] for r in preds if "prefill_ms" in r])
    row["decode_ms_per_token"] = _mean([r["decode_ms_per_token"] for r in preds if "decode_ms_per_token" in r])
    pairs = [(r["pred"], full[r[row_key]]["pred"]) for r in preds if r[row_key] in full]
    row["agreement"] = _mean([agreement(a, b) for a, b in pairs]) if pairs else None
    return row


def agreement(answer: str, reference: str) -> float:
    """The common prefix of two answers (stripped) over the longer one, in characters; 1.0 for equal answers."""
    a, b = answer.strip(), reference.strip()
    if not a and not b:
        return 1.0
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common / max(len(a), len(b))


def _json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _mean(values) -> Optional[float]:
    values = [float(v) for v in values if v is not None]
    return _round(math.fsum(values) / len(values)) if values else None


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(f"{value:.6g}")


# The CSV: the one file the page and the figure are made from.

def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in COLUMNS})
    return out.getvalue()


NUMERIC = {"context_length", "ratio", "compression_ratio", "kept", "samples", "score", "vs_fullkv", "vs_fullkv_low",
           "vs_fullkv_high", "block_free_16", "block_free_32", "score_turn_1",
           "score_later_turns", "kl", "agreement", "kv_bytes", "kv_bytes_x_fullkv", "kept_share", "prefill_ms",
           "decode_ms_per_token", "unit_seconds"}


def read_csv(path: Path) -> list[dict]:
    return parse_csv(Path(path).read_text(encoding="utf-8"))


def parse_csv(text: str) -> list[dict]:
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    for row in rows:       # a CSV written before a column existed reads it as empty
        for k in NUMERIC:
            row[k] = None if row.get(k) in ("", None) else float(row[k])
        for k in COLUMNS:
            if k not in NUMERIC and row.get(k) in ("", None):
                row[k] = None
    return rows
