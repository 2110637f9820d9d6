"""The leaderboard's outputs: leaderboard.csv (every cell), leaderboard.json (the grid, the cells, each unit's
status), leaderboard.svg and leaderboard.md, made from the CSV; each written atomically. With a docs folder they are
published as DOCS/leaderboard.md and DOCS/leaderboard/{grid.json, leaderboard.csv, leaderboard.json,
leaderboard.svg}."""

from __future__ import annotations

import shlex
import csv
import io
import json
from pathlib import Path
from typing import Optional

from pyramidkv.leaderboard.grid import DEFAULTS, RATIOS, TASKS, Grid

NAMES = {"csv": "leaderboard.csv", "json": "leaderboard.json", "figure": "leaderboard.svg", "page": "leaderboard.md",
         "grid": "grid.json"}


def command(grid: Grid) -> str:
    """The command line that regenerates the grid (defaults left out)."""
    from pyramidkv.methods import METHODS
    from pyramidkv.models.default_model import DEFAULT_MODEL_NAME

    words = ["python", "-m", "pyramidkv.leaderboard"]
    if grid.model_path != DEFAULT_MODEL_NAME:
        words += ["--model_path", grid.model_path]
    if grid.methods != list(METHODS):
        words += ["--methods", *(m for m in grid.methods if m != "fullkv")]
    if list(grid.ratios) != list(RATIOS):
        words += ["--ratios", *(f"{r:g}" for r in grid.ratios)]
    if list(grid.tasks) != list(TASKS):
        words += ["--tasks", *grid.tasks]
    for flag in ("context_length", "num_samples", "needle_depths"):
        if getattr(grid, flag) != DEFAULTS[flag]:
            words += [f"--{flag}", str(getattr(grid, flag))]
    if grid.attn_implementation != "sdpa":
        words += ["--attn_implementation", grid.attn_implementation]
    if grid.dtype != "float32":
        words += ["--dtype", grid.dtype]
    if grid.extra:
        words += ["--runner_args", shlex.join(grid.extra)]
    return shlex.join(words)


def render(rows: list[dict], grid: Grid, links: str = "") -> dict[str, str]:
    """{file name: text} of the figure and the page made from the CSV rows (`links`: the page's path to them)."""
    from pyramidkv.leaderboard.page import figure, page

    return {NAMES["figure"]: figure(rows),
            NAMES["page"]: page(rows, links + NAMES["csv"], links + NAMES["figure"], command(grid))}


def write(grid: Grid, save_dir: Path, folders: dict, publish: Optional[str] = None, unfit: Optional[dict] = None,
          published: Optional[list[dict]] = None) -> tuple[list[Path], int]:
    """Every output from the cells as they stand (unfit: {unit name: why it is n/a}), in SAVE_DIR and with `publish`
    in DOCS; (paths written, failed cells). published: the rows of DOCS's CSV (--merge_published): a cell this grid
    has pending takes its published row, and only DOCS is written (SAVE_DIR's outputs stay its own)."""
    from pyramidkv.leaderboard.cells import read_status
    from pyramidkv.leaderboard.table import cell_tasks, collect, parse_csv, to_csv
    from pyramidkv.runner.results import atomic_write_json, atomic_write_text

    save_dir, unfit = Path(save_dir), unfit or {}
    rows = collect(grid, save_dir, folders, unfit)
    states = {u.name: {"unit": u.name, "state": "n/a", "error": unfit[u.name]} if u.name in unfit else
              read_status(save_dir, u) or {"unit": u.name, "state": "pending"} for u in grid.units()}
    if published is not None:
        kept = {(r["part"], r["task"], r["spec"]): r for r in published}
        rows = [kept.get((r["part"], r["task"], r["spec"]), r) if r["status"] == "pending" else r for r in rows]
        for unit in grid.units():
            row = kept.get((unit.part, next(iter(cell_tasks(grid, unit)))[0], unit.entry.spec))
            if states[unit.name]["state"] == "pending" and row is not None:
                states[unit.name] = {"unit": unit.name, "state": row["status"], "published": True}
    csv_text = to_csv(rows)
    rows = parse_csv(csv_text)                           # the page and figure come from the CSV alone
    record = {"grid": grid.record(), "command": command(grid), "cells": rows, "units": list(states.values())}
    outputs = {} if published is not None else {
        save_dir / NAMES["csv"]: csv_text, save_dir / NAMES["json"]: record,
        **{save_dir / name: text for name, text in render(rows, grid).items()}}
    if publish is not None:
        docs = Path(publish)
        folder = docs / "leaderboard"
        rendered = render(rows, grid, links="leaderboard/")
        outputs.update({folder / NAMES["grid"]: grid.record(), folder / NAMES["csv"]: csv_text,
                        folder / NAMES["json"]: record, folder / NAMES["figure"]: rendered[NAMES["figure"]],
                        docs / NAMES["page"]: rendered[NAMES["page"]]})
    for path, content in outputs.items():
        (atomic_write_text if isinstance(content, str) else atomic_write_json)(path, content)
    return list(outputs), sum(1 for r in rows if r["status"] == "failed")


def read_published(docs: Path) -> tuple[Grid, list[dict]]:
    """(grid, CSV rows as written: text) of the leaderboard published in DOCS (DOCS/leaderboard/{grid.json,
    leaderboard.csv}; ValueError naming a missing one)."""
    folder = Path(docs) / "leaderboard"
    for name in (NAMES["grid"], NAMES["csv"]):
        if not (folder / name).is_file():
            raise ValueError(f"{folder / name} is missing: a published leaderboard is DOCS/leaderboard/{NAMES['grid']} "
                             f"and {NAMES['csv']} (written by --publish DOCS)")
    with open(folder / NAMES["csv"], encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    return Grid(**json.loads((folder / NAMES["grid"]).read_text(encoding="utf-8"))), rows


def merged_grid(published: Grid, grid: Grid, save_dir: Path, docs: Path) -> Grid:
    """The union of a published grid and SAVE_DIR's: every setting but the methods and the ratios must agree (else
    ValueError naming them); the methods in the published order, then SAVE_DIR's others; the ratios sorted."""
    held, record = published.record(), grid.record()
    differ = [k for k in held if k not in ("methods", "ratios") and held[k] != record[k]]
    if differ:
        raise ValueError(f"--merge_published: the grid published in {docs} and the one of --save_dir {save_dir} "
                         f"differ in {', '.join(f'{k} ({held[k]!r} there, {record[k]!r} here)' for k in differ)}; "
                         f"only methods and ratios may differ")
    methods = list(published.methods) + [m for m in grid.methods if m not in published.methods]
    return Grid(**{**held, "methods": methods, "ratios": sorted(set(published.ratios) | set(grid.ratios))})


def rerender(docs: Path) -> list[Path]:
    """Rewrite a published leaderboard from its CSV alone (DOCS/leaderboard/{grid.json, leaderboard.csv}): the CSV
    with today's columns (a column it lacks is written empty: never measured), the JSON's cells, the figure and
    DOCS/leaderboard.md; the paths written."""
    from pyramidkv.leaderboard.table import COLUMNS, read_csv
    from pyramidkv.runner.results import atomic_write_json, atomic_write_text

    docs = Path(docs)
    folder = docs / "leaderboard"
    grid, raw = read_published(docs)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: row.get(k) or "" for k in COLUMNS} for row in raw)
    atomic_write_text(folder / NAMES["csv"], out.getvalue())
    rows = read_csv(folder / NAMES["csv"])
    written = [folder / NAMES["csv"]]
    if (folder / NAMES["json"]).is_file():
        record = json.loads((folder / NAMES["json"]).read_text(encoding="utf-8"))
        atomic_write_json(folder / NAMES["json"], {**record, "command": command(grid), "cells": rows})
        written.append(folder / NAMES["json"])
    rendered = render(rows, grid, links="leaderboard/")
    atomic_write_text(folder / NAMES["figure"], rendered[NAMES["figure"]])
    atomic_write_text(docs / NAMES["page"], rendered[NAMES["page"]])
    return written + [folder / NAMES["figure"], docs / NAMES["page"]]
