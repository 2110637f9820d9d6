"""The leaderboard's outputs: leaderboard.csv (every cell), leaderboard.json (the grid, the cells, each unit's
status), leaderboard.svg and leaderboard.md, made from the CSV; each written atomically. With a docs folder they are
published as DOCS/leaderboard.md and DOCS/leaderboard/{grid.json, leaderboard.csv, leaderboard.json,
leaderboard.svg}."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional

from pyramidkv.leaderboard.grid import RATIOS, TASKS, Grid

NAMES = {"csv": "leaderboard.csv", "json": "leaderboard.json", "figure": "leaderboard.svg", "page": "leaderboard.md",
         "grid": "grid.json"}


def command(grid: Grid) -> str:
    """The command line that regenerates the grid (defaults left out)."""
    from pyramidkv.leaderboard.__main__ import DEFAULTS
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
        words += ["--runner_args", " ".join(grid.extra)]
    return shlex.join(words)


def render(rows: list[dict], grid: Grid, folder: Path, links: str = "") -> dict[str, bytes]:
    """{file name: bytes} of the figure and the page made from the CSV rows (`links`: the page's path to them)."""
    import tempfile

    from pyramidkv.leaderboard.page import figure, page

    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        figure(rows, Path(tmp) / NAMES["figure"])
        svg = (Path(tmp) / NAMES["figure"]).read_bytes()
    text = page(rows, links + NAMES["csv"], links + NAMES["figure"], command(grid))
    return {NAMES["figure"]: svg, NAMES["page"]: text.encode()}


def write(grid: Grid, save_dir: Path, folders: dict, publish: Optional[str] = None) -> tuple[list[Path], int]:
    """Every output from the cells as they stand; (paths written, failed cells)."""
    import json

    from pyramidkv.leaderboard.cells import read_status
    from pyramidkv.leaderboard.table import collect, read_csv, to_csv

    save_dir = Path(save_dir)
    rows = collect(grid, save_dir, folders)
    csv_text = to_csv(rows)
    _write(save_dir / NAMES["csv"], csv_text.encode())
    rows = read_csv(save_dir / NAMES["csv"])             # the page and figure come from the CSV alone
    record = {"grid": grid.record(), "command": command(grid), "cells": rows,
              "units": [read_status(save_dir, u) or {"unit": u.name, "state": "pending"} for u in grid.units()]}
    _write(save_dir / NAMES["json"], json.dumps(record, indent=1).encode())
    written = [save_dir / NAMES["csv"], save_dir / NAMES["json"]]
    for name, data in render(rows, grid, save_dir).items():
        _write(save_dir / name, data)
        written.append(save_dir / name)
    if publish is not None:
        docs = Path(publish)
        folder = docs / "leaderboard"
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / NAMES["grid"], json.dumps(grid.record(), indent=1).encode())
        _write(folder / NAMES["csv"], csv_text.encode())
        _write(folder / NAMES["json"], json.dumps(record, indent=1).encode())
        rendered = render(rows, grid, folder, links="leaderboard/")
        _write(folder / NAMES["figure"], rendered[NAMES["figure"]])
        _write(docs / NAMES["page"], rendered[NAMES["page"]])
        written += [folder / NAMES[k] for k in ("grid", "csv", "json", "figure")] + [docs / NAMES["page"]]
    return written, sum(1 for r in rows if r["status"] == "failed")


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
