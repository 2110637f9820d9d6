"""The reasoning board's cells read from run_reasoning.py's folders (one CSV row per method x decode budget x task),
and its page made from that CSV alone (so a committed page can be checked against its CSV).

Per cell: the runner's per-task means over the cell's problems (run.py's `summarize`: accuracy, generation length,
KL to fullkv along fullkv's trace, departure step, peak and mean K/V bytes, decode tokens/s), the CPU-clock decode
rate, the paired bootstrap interval (intervals.py) of the accuracy difference against fullkv on the same
problems, in points (each problem scores 100 or 0), and `reached`: the share of the problems (x100) on which
fullkv's trace outgrows the method's decode budget + its re-selection interval (prompt + new tokens - 1 >= budget +
interval, run.py's rule), the ones where the method compressed along the trace its KL and departure are read on;
on the others it holds what fullkv holds.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Optional

from pyramidkv.leaderboard.intervals import paired_interval

COLUMNS = ("model", "max_new_tokens", "task", "method", "decode_budget", "folder", "samples", "accuracy",
           "vs_fullkv", "vs_fullkv_low", "vs_fullkv_high", "step_accuracy", "new_tokens", "kl_vs_fullkv",
           "departure_step", "departed", "reached", "kv_bytes_peak", "kv_bytes_mean", "decode_tokens_per_s",
           "decode_cpu_tokens_per_s", "status", "error")
FULLKV = "fullkv"


def task_rows(folder: Path, task: str, keys: list) -> Optional[list[dict]]:
    """The run's rows of `task` for the problems `keys`, in that order; None when any is missing."""
    from pyramidkv.runner.results import read_unique_rows

    path = Path(folder) / f"{task}.jsonl"
    if not path.is_file():
        return None
    rows = {r["index"]: r for r in read_unique_rows(path, "index", True)}
    found = [rows.get(k) for k in keys]
    return None if any(r is None for r in found) else found


def cells(model: str, max_new_tokens: int, tasks: dict[str, list], units: list[tuple[str, Optional[int], Path]],
          errors: dict[tuple[str, Optional[int]], str], intervals: Optional[dict] = None) -> list[dict]:
    """One row per unit x task. units: (method spec, decode budget or None for fullkv, run folder), fullkv first;
    tasks: {task: the problems' keys}; errors: {(method, budget): why the unit failed}; intervals: {(method,
    budget): its decode_interval} (`reached` is empty for a unit without one)."""
    from pyramidkv.benchmarks.reasoning.run import compresses, summarize

    reference = {task: task_rows(units[0][2], task, keys) for task, keys in tasks.items()}
    out = []
    for method, budget, folder in units:
        for task, keys in tasks.items():
            row = dict.fromkeys(COLUMNS, None)
            row.update(model=model, max_new_tokens=max_new_tokens, task=task, method=method, decode_budget=budget,
                       folder=Path(folder).name)
            rows = task_rows(folder, task, keys)
            if rows is None or reference[task] is None:
                row.update(status="failed" if (method, budget) in errors else "missing",
                           error=errors.get((method, budget)) or "no rows for every problem (not run yet)")
                out.append(row)
                continue
            s = summarize(rows)
            row.update({k: s[k] for k in ("accuracy", "step_accuracy", "new_tokens", "kl_vs_fullkv",
                                           "departure_step", "departed", "kv_bytes_peak", "kv_bytes_mean",
                                           "decode_tokens_per_s")}, samples=s["num_samples"], status="done")
            cpu = [r["decode_cpu_tokens_per_s"] for r in rows if r.get("decode_cpu_tokens_per_s") is not None]
            row["decode_cpu_tokens_per_s"] = round(math.fsum(cpu) / len(cpu), 2) if cpu else None
            diff = [100.0 * (bool(a["correct"]) - bool(b["correct"])) for a, b in zip(rows, reference[task])]
            mean, low, high = paired_interval([diff])
            row.update(vs_fullkv=round(mean, 2), vs_fullkv_low=round(low, 2), vs_fullkv_high=round(high, 2))
            interval = (intervals or {}).get((method, budget))
            if budget is not None and interval is not None:
                reached = [compresses(r["prompt_tokens"], r["new_tokens"], budget, interval) for r in reference[task]]
                row["reached"] = round(100.0 * sum(reached) / len(reached), 2)
            out.append(row)
    return out


def csv_text(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in COLUMNS})
    return buffer.getvalue()


def read_csv(path: Path) -> list[dict]:
    """The CSV's rows as strings (empty: not measured); ValueError (one line) for a file of other columns."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path} is not a reasoning board CSV: columns {reader.fieldnames}, expected "
                             f"{', '.join(COLUMNS)}")
        return list(reader)


def _num(text: str, digits: int) -> str:
    return "-" if text in ("", None) else f"{float(text):.{digits}f}"


def _kb(text: str) -> str:
    return "-" if text in ("", None) else f"{float(text) / 1024:.0f}"


def page(rows: list[dict]) -> str:
    """The Markdown page of the CSV's rows (strings, as read_csv gives them): per task a table, fullkv first, then
    each method by decode budget."""
    models = sorted({r["model"] for r in rows})
    lengths = sorted({r["max_new_tokens"] for r in rows})
    lines = ["# Reasoning board: decode-time methods on long generations", "",
             f"Model {', '.join(models)}; up to {', '.join(lengths)} new tokens a trace; each method keeps the whole "
             "prompt and holds at most its decode budget (+ its re-selection interval) a head while decoding. "
             "Made by `python -m pyramidkv.leaderboard.reasoning` (docs/reasoning.md) from reasoning.csv alone.", "",
             "Accuracy and its difference to fullkv in points (x100), the difference with its paired bootstrap 95 % "
             "interval on the same problems; step acc.: chain, the share of steps right (x100); KL: mean KL(fullkv || method) of the next-token distributions along "
             "fullkv's trace, nats a token; departs at: the mean first token where the method's own trace leaves "
             "fullkv's, over the traces that leave (their share); KV: K/V bytes held, the peak and the mean over "
             "the trace; decode tok/s: wall clock (thread CPU clock); reached: the share of the problems on which "
             "fullkv's trace outgrows the method's budget + re-selection interval (on the others the method holds "
             "what fullkv holds, and matches it).", ""]
    for task in dict.fromkeys(r["task"] for r in rows):
        lines += [f"## {task}", "",
                  "| method | decode budget | n | reached | accuracy | vs fullkv [95 % CI] | step acc. | tokens | KL "
                  "| departs at (share) | peak KV (KB) | mean KV (KB) | decode tok/s (CPU) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["task"] != task:
                continue
            budget = r["decode_budget"] or "-"
            if r["status"] != "done":
                lines.append(f"| `{r['method']}` | {budget} | - | {r['status']}: {r['error']} |" + "  |" * 9)
                continue
            vs = "-" if r["method"] == FULLKV else \
                f"{_num(r['vs_fullkv'], 1)} [{_num(r['vs_fullkv_low'], 1)}, {_num(r['vs_fullkv_high'], 1)}]"
            departs = "never" if r["departure_step"] == "" else _num(r["departure_step"], 1)
            reached = "-" if r["reached"] == "" else f"{_num(r['reached'], 0)}%"
            lines.append(f"| `{r['method']}` | {budget} | {r['samples']} | {reached} | {_num(r['accuracy'], 1)} | "
                         f"{vs} | "
                         f"{_num(r['step_accuracy'], 1)} | {_num(r['new_tokens'], 1)} | {_num(r['kl_vs_fullkv'], 4)} | {departs} "
                         f"({_num(r['departed'], 0)}%) | {_kb(r['kv_bytes_peak'])} | {_kb(r['kv_bytes_mean'])} | "
                         f"{_num(r['decode_tokens_per_s'], 1)} ({_num(r['decode_cpu_tokens_per_s'], 1)}) |")
        lines.append("")
    return "\n".join(lines)


def write(save_dir: Path, rows: list[dict]) -> tuple[Path, Path]:
    """SAVE_DIR/reasoning.csv, then SAVE_DIR/reasoning.md from the CSV as written."""
    from pyramidkv.runner.results import atomic_write_text

    csv_path, md_path = Path(save_dir) / "reasoning.csv", Path(save_dir) / "reasoning.md"
    atomic_write_text(csv_path, csv_text(rows))
    atomic_write_text(md_path, page(read_csv(csv_path)))
    return csv_path, md_path


def rerender(save_dir: Path) -> Path:
    """SAVE_DIR/reasoning.md again from SAVE_DIR/reasoning.csv alone."""
    from pyramidkv.runner.results import atomic_write_text

    csv_path = Path(save_dir) / "reasoning.csv"
    if not csv_path.is_file():
        raise ValueError(f"no {csv_path}: run the board first (it writes the CSV)")
    md_path = Path(save_dir) / "reasoning.md"
    atomic_write_text(md_path, page(read_csv(csv_path)))
    return md_path
