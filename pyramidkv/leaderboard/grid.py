"""The leaderboard's grid: method entries x benchmark parts, cut into units (one run folder each) and shards.

An entry is one method configuration. How a method enters the grid (its `treatment`):

  ratio    takes a budget: one entry per ratio, budget_ratio = the fraction of the prompt kept (kvpress's
           compression_ratio is 1 - it); decode-time methods (scissorhands, tova) also hold that many tokens
           while decoding: decode_budget = round(ratio x context_length)
  read     quest keeps every token and reads a page budget per decode step: one entry per ratio, page_budget_ratio =
           the fraction read; its bytes held are fullkv's
  fixed    keeps a fixed share by construction (fullkv, minicache's paired layers, minference's sparse prefill):
           one entry at its defaults, placed at the share of fullkv's bytes it holds (measured)
  outcome  the budget is an outcome (head_allocation threshold: kvzap, duo_attention): one entry at its defaults,
           placed at the kept share it achieved (measured)

A part is one runner invocation per entry: RULER's tasks at one length (one folder, a predictions file per task),
the needle at that length, and the shared-context protocol (RULER's niah_multikey_1 with several questions per
context, compressed once: runner/shared.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

# 0.0625 and 0.03125: 16:1 and 32:1. A cell whose budget on one of its prompts is below the method's window (or
# otherwise cannot do what the method's settings say: Method.check_prompt) is never run with an empty or skipped
# compression: its runner refuses it before the weights load (exit status 3), and the grid marks it `n/a` with that
# one-line reason (cells.NotApplicable); a grid in which no cell but fullkv's applies is refused.
RATIOS = (0.03125, 0.0625, 0.25, 0.5, 0.75, 0.9)
# The default grid's sizes (python -m pyramidkv.leaderboard's defaults): about one night on 2 CPU cores for the
# embedded model (docs/results.md, "The leaderboard").
DEFAULTS = {"save_dir": "results/leaderboard", "context_length": 4096, "num_samples": 1, "needle_depths": 3}
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "niah_multivalue", "vt", "cwe",
               "fwe")
NEEDLE, SHARED = "needle", "shared_context"
TASKS = RULER_TASKS + (NEEDLE, SHARED)
SHARED_TASK, SHARED_QUESTIONS, SHARED_MODE = "niah_multikey_1", 4, "multi_request"
BUDGET_SETTINGS = ("budget", "budget_ratio", "compression_ratio", "page_budget", "page_budget_ratio", "decode_budget")


@dataclass(frozen=True)
class Entry:
    """One method configuration of the grid."""

    spec: str                   # the method spec the runners get (--method)
    method: str                 # its registered name
    treatment: str              # ratio | read | fixed | outcome (module docstring)
    ratio: Optional[float]      # the fraction kept (read: the fraction read); None for fixed and outcome

    @property
    def label(self) -> str:
        return self.spec if self.ratio is None else f"{self.base}@{self.ratio:g}"

    @property
    def base(self) -> str:
        """The spec without the grid's own budget settings (the plot's line)."""
        return base_spec(self.spec)


@dataclass(frozen=True)
class Unit:
    entry: Entry
    part: str                   # "ruler" | NEEDLE | SHARED

    @property
    def name(self) -> str:
        return f"{self.part}__{re.sub(r'[^A-Za-z0-9_.=,@-]+', '_', self.entry.label)}"


@dataclass
class Grid:
    """What decides the cells: a save_dir holds one grid (grid.json), never two."""

    model_path: str
    methods: list[str]
    ratios: list[float]
    tasks: list[str]
    context_length: int
    num_samples: int
    needle_depths: int          # the needle's depths, spread over 0..100% (its runner's --num_depths)
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    extra: list[str] = field(default_factory=list)    # runner flags given to every run

    def entries(self) -> list[Entry]:
        entries = (e for spec in self.methods for e in entries_of(spec, self.ratios, self.context_length))
        return list(dict.fromkeys(entries))   # a grid.json written before the specs were made canonical

    def parts(self) -> list[str]:
        ruler = [t for t in self.tasks if t in RULER_TASKS]
        return (["ruler"] if ruler else []) + [p for p in (NEEDLE, SHARED) if p in self.tasks]

    def units(self) -> list[Unit]:
        return [Unit(entry, part) for part in self.parts() for entry in self.entries()]

    def record(self) -> dict:
        return asdict(self)


def base_spec(spec: str) -> str:
    name, _, settings = spec.partition(":")
    kept = [s for s in settings.split(",") if s and s.split("=")[0] not in BUDGET_SETTINGS]
    return name + (":" + ",".join(kept) if kept else "")


def entries_of(spec: str, ratios, context_length: int) -> list[Entry]:
    """The entries of one --methods spec (NAME or NAME:setting=value,...) under the grid's ratios."""
    from pyramidkv.methods import get_method_class, method_spec, sizing_of, split_spec
    from pyramidkv.methods.settings import build_method, default_units, read_settings

    name, items = split_spec(spec)
    cls = get_method_class(name)
    given = read_settings(cls, items)
    if set(given) & set(BUDGET_SETTINGS):
        raise ValueError(f"--methods {spec}: the grid sets the budget ({', '.join(sorted(set(given) & set(BUDGET_SETTINGS)))} "
                         f"given); give the method without it and the fractions kept with --ratios")
    sizing, units = sizing_of(cls, given), default_units(cls)
    if not sizing.reads_budget_flag(units):
        method = build_method(cls, given)
        treatment = "outcome" if method.sizing.outcome else "fixed"
        return [Entry(method_spec(method), cls.name, treatment, None)]
    treatment = "read" if sizing.budget_names(units) else "ratio"   # quest: the ratio is the page budget read
    out = []
    for ratio in ratios:
        budget = {"budget_ratio": ratio}
        if cls.decodes_at_budget:   # evicts while decoding by its own rule: holds ratio x length there too
            budget["decode_budget"] = max(1, round(ratio * context_length))
        try:     # whether the budget holds the window is each prompt's question: the runners check it (n/a cells)
            method = build_method(cls, {**given, **budget})
        except ValueError as e:
            raise ValueError(f"--methods {spec} at ratio {ratio:g} and --context_length {context_length}: "
                             f"{e}") from None
        out.append(Entry(method_spec(method), cls.name, treatment, ratio))
    return out


def canonical_methods(specs, ratios, context_length: int, model=None) -> list[str]:
    """The --methods specs as the grid's methods: each written as its canonical spec (the method's name and its
    settings other than the defaults, less the grid's budget settings; with `model`, a ModelShape, as the method
    runs on it: Method.normalized), each once, in the order first given. `snapkv`, `snapkv snapkv` and
    `snapkv:window_size=32` (32: the default) are one method: one entry, one unit per part."""
    from pyramidkv.methods import method_spec, parse_method_spec

    out: list[str] = []
    for spec in specs:
        method = parse_method_spec(entries_of(spec, ratios, context_length)[0].spec)
        canonical = base_spec(method_spec(method.normalized(model) if model is not None else method))
        if canonical not in out:
            out.append(canonical)
    return out


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' -> (i, n), 0 <= i < n (SLURM's array index and count)."""
    match = re.fullmatch(r"(-?\d+)/(-?\d+)", text.strip())
    if not match:
        raise ValueError(f"--shard {text!r}: give i/n, the shard's index from 0 and the number of shards (e.g. 0/4)")
    index, count = int(match[1]), int(match[2])
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard {text}: needs 0 <= i < n and n >= 1 (shards are numbered 0..n-1, as "
                         f"SLURM_ARRAY_TASK_ID)")
    return index, count


def shard_units(units: list[Unit], shard: Optional[tuple[int, int]]) -> list[Unit]:
    """Unit k belongs to shard k mod n: the shards split every part and method evenly."""
    if shard is None:
        return units
    index, count = shard
    return [u for k, u in enumerate(units) if k % count == index]


def check_ratios(ratios) -> list[float]:
    for ratio in ratios:
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"ratio {ratio!r} is outside (0, 1): a ratio is the fraction of the prompt kept (1 keeps "
                             f"every token: that is fullkv, the grid's reference); allowed: 0 < ratio < 1")
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"--ratios {' '.join(f'{r:g}' for r in ratios)} names a ratio twice")
    return sorted(ratios)


def check_tasks(tasks) -> None:
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown leaderboard task {task!r}; choose from: {', '.join(TASKS)}")


GRID_FILE = "grid.json"


def claim_folder(save_dir: Path, grid: Grid, write: bool = True, extend: bool = False) -> None:
    """The folder's grid.json is this grid (written now if absent and `write`); another grid's folder is refused.
    extend: a grid that only adds methods or ratios to the folder's (every other setting the same) takes the folder
    over: its cells done stay done (a cell is one method at one ratio: the same computation in either grid), the
    added ones are pending; grid.json is rewritten to this grid (with `write`)."""
    from pyramidkv.runner.results import atomic_write_json

    path = Path(save_dir) / GRID_FILE
    record = grid.record()
    if path.is_file():
        try:
            held = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable grid record ({e}); delete it or use another --save_dir") from None
        if held == record:
            return
        differ = [k for k in sorted(set(held) | set(record)) if held.get(k) != record.get(k)]
        grows = {"methods", "ratios"}
        if extend and set(differ) <= grows and all(set(held[k]) <= set(record[k]) for k in differ):
            if write:
                atomic_write_json(path, record)
            return
        if extend:
            lost = [f"{k} {sorted(set(held[k]) - set(record[k]))!r}" for k in sorted(grows & set(differ))
                    if not set(held[k]) <= set(record[k])]
            other = [f"{k} {held.get(k)!r} here, {record.get(k)!r} asked" for k in differ if k not in grows]
            raise ValueError(f"--extend: --save_dir {save_dir} holds a grid this one does not contain ("
                             f"{'; '.join(lost + other)}); a grid extends a folder only by adding --methods or --ratios")
        raise ValueError(f"--save_dir {save_dir} holds another grid's cells (its {GRID_FILE} differs in: "
                         f"{', '.join(f'{k} {held.get(k)!r} here, {record.get(k)!r} asked' for k in differ)}); "
                         f"use another --save_dir, never a mixed one (--extend adds methods or ratios to it)")
    if write:
        atomic_write_json(path, record)


def read_grid(save_dir: Path) -> Grid:
    path = Path(save_dir) / GRID_FILE
    if not path.is_file():
        raise ValueError(f"{save_dir} holds no {GRID_FILE}: no leaderboard was run there")
    return Grid(**json.loads(path.read_text(encoding="utf-8")))
