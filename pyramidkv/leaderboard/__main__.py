"""python -m pyramidkv.leaderboard: every method at several fractions kept, on RULER's tasks, the needle and the
shared-context protocol, through the benchmark runners; then one CSV/JSON of every cell, a figure and a page.

    python -m pyramidkv.leaderboard                                   # the whole grid on the embedded model
    python -m pyramidkv.leaderboard --methods snapkv h2o --ratios 0.25 0.5 --tasks niah_single_1 --num_samples 2
    python -m pyramidkv.leaderboard --shard 3/16                      # one SLURM array task's share
    python -m pyramidkv.leaderboard --summarize                       # the outputs from the cells done so far
    python -m pyramidkv.leaderboard --summarize --publish docs        # docs/leaderboard.md + docs/leaderboard/
    python -m pyramidkv.leaderboard --rerender docs                   # docs/leaderboard.md again, from its CSV

A rerun resumes (finished units are skipped, a killed unit continues at its missing rows). A save_dir holds one
grid: another grid's arguments are refused (docs/leaderboard.md: treatments of methods that take no ratio), except
with --extend a grid that only adds methods or ratios (its cells done stay done).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.leaderboard.grid import (
    DEFAULTS, RATIOS, TASKS, Grid, check_ratios, check_tasks, claim_folder, parse_shard, shard_units,
)

# The units are checked one by one (their runners generate and tokenize every sample, ~35 s each on SmolLM2): a bar
# with the time left shows once the check has run this many seconds.
PROGRESS_DELAY = 2.0


def build_parser():
    from pyramidkv.models.default_model import DEFAULT_MODEL_NAME
    from pyramidkv.runner.arguments import ArgumentParser, flags_text

    parser = ArgumentParser(prog="python -m pyramidkv.leaderboard", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    g = parser.add_argument_group("grid (recorded in SAVE_DIR/grid.json)")
    g.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    g.add_argument("--methods", nargs="+", default=None, metavar="SPEC",
                   help="method specs NAME[:setting=value,...] without a budget (default: every registered method); "
                        "fullkv is always in the grid: the reference of KL, agreement and bytes")
    ratios = g.add_mutually_exclusive_group()
    ratios.add_argument("--ratios", nargs="+", type=float, default=None,
                        help=f"fractions of the prompt kept (default: {' '.join(map(str, RATIOS))})")
    ratios.add_argument("--compression_ratios", nargs="+", type=float, default=None,
                        help="kvpress's convention, the fraction removed: kept = 1 - it")
    g.add_argument("--tasks", nargs="+", default=list(TASKS), help=f"from: {', '.join(TASKS)}")
    g.add_argument("--context_length", type=int, default=DEFAULTS["context_length"])
    g.add_argument("--num_samples", type=int, default=DEFAULTS["num_samples"],
                   help="samples per RULER task (and contexts of the shared-context protocol)")
    g.add_argument("--needle_depths", type=int, default=DEFAULTS["needle_depths"],
                   help="needle depths spread over 0..100%%")
    g.add_argument("--attn_implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    g.add_argument("--dtype", default="float32")
    g.add_argument("--runner_args", default="", type=flags_text,
                   help="more flags for every run, one string (e.g. '--device cuda'; it may start with '-')")
    r = parser.add_argument_group("running")
    r.add_argument("--save_dir", default=DEFAULTS["save_dir"])
    r.add_argument("--shard", default=None, metavar="i/n", help="run units k with k mod n == i only (0 <= i < n)")
    r.add_argument("--extend", action="store_true",
                   help="SAVE_DIR holds a grid with fewer methods or ratios (every other setting the same): this "
                        "grid takes it over, its cells done stay done, the added cells run")
    r.add_argument("--count", action="store_true", help="print the number of units and exit")
    r.add_argument("--summarize", action="store_true",
                   help="write the outputs from the cells done so far (the grid of SAVE_DIR/grid.json) and exit")
    r.add_argument("--publish", default=None, metavar="DOCS",
                   help="with the outputs, write DOCS/leaderboard.md and DOCS/leaderboard/ (CSV, JSON, figure)")
    r.add_argument("--merge_published", action="store_true",
                   help="with --summarize --publish DOCS: publish the cells of SAVE_DIR together with those DOCS "
                        "holds (a grid with the same settings but other methods or ratios): a cell SAVE_DIR has not "
                        "run keeps its published row; the page's grid is the union of both")
    r.add_argument("--rerender", default=None, metavar="DOCS",
                   help="rewrite a published DOCS/leaderboard.md, its figure and JSON from DOCS/leaderboard's CSV "
                        "alone (the CSV given today's columns, empty where never measured) and exit")
    return parser


def grid_of(args) -> Grid:
    """The grid the arguments ask for (ValueError, one line, for a bad one)."""
    from pyramidkv.leaderboard.grid import canonical_methods, entries_of
    from pyramidkv.methods import METHODS

    given_ratios = args.ratios is not None or args.compression_ratios is not None
    ratios = args.ratios if args.ratios is not None else \
        [round(1 - c, 10) for c in args.compression_ratios] if args.compression_ratios is not None else list(RATIOS)
    if args.compression_ratios is not None:
        for c in args.compression_ratios:
            if not 0.0 < c < 1.0 or round(1 - c, 10) >= 1:
                raise ValueError(f"--compression_ratios {c!r} is outside (0, 1): the fraction removed (0, or one that "
                                 f"rounds to 0 at 10 digits, removes nothing: that is fullkv); allowed: "
                                 f"1e-10 <= compression ratio < 1")
    ratios = check_ratios(ratios)
    check_tasks(args.tasks)
    for flag in ("context_length", "num_samples", "needle_depths"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    from pyramidkv.models.loading import DTYPES, check_model
    from pyramidkv.models.patch import model_shape

    _, config, _, dtype = check_model(args.model_path, args.attn_implementation, "auto", args.dtype)
    # one name per computation: a spec written another way (a default given, a packaged file by its path, twice)
    methods = canonical_methods(args.methods or list(METHODS), ratios, args.context_length,
                                model_shape(config, DTYPES[dtype].itemsize, args.attn_implementation))
    if "fullkv" not in methods:
        methods = ["fullkv", *methods]     # the reference of every cell's KL, agreement and bytes
    grid = Grid(args.model_path, methods, ratios, list(dict.fromkeys(args.tasks)), args.context_length,
                args.num_samples, args.needle_depths, args.attn_implementation, args.dtype,
                shlex.split(args.runner_args))
    window = getattr(config, "max_position_embeddings", None)
    if window and args.context_length > window:
        raise ValueError(f"--context_length {args.context_length} is above the model's window: {args.model_path} has "
                         f"max_position_embeddings = {window}")
    swept = [spec for spec in methods if any(e.ratio is not None for e in entries_of(spec, ratios, args.context_length))]
    if given_ratios and not swept:
        raise ValueError(f"--ratios given, but none of --methods {' '.join(methods)} takes a ratio (each runs once "
                         f"at its own settings: docs/leaderboard.md)")
    return grid


def check_units(grid: Grid, units, save_dir: Path, some_cell_applies: bool = True) -> tuple[dict, dict]:
    """({unit name: run folder}, {unit name: why it is n/a}) after each unit's runner checked its samples; with
    some_cell_applies, a grid none of whose cells but fullkv's applies is refused (ValueError naming a reason)."""
    from tqdm import tqdm

    from pyramidkv.leaderboard import cells

    folders, unfit = {}, {}
    with tqdm(units, desc="checking every unit (no weights)", unit="unit", dynamic_ncols=True, leave=False,
              delay=PROGRESS_DELAY) as bar:   # each unit's runner prepares its samples: seconds to a minute each
        for unit in bar:
            try:
                folders[unit.name] = cells.run_dir_of(grid, unit, save_dir)
            except cells.NotApplicable as e:
                folders[unit.name], unfit[unit.name] = None, str(e)
    compressed = [u for u in units if u.entry.spec != "fullkv"]
    if some_cell_applies and compressed and all(u.name in unfit for u in compressed):
        raise ValueError(f"no cell of the grid but fullkv's applies at --context_length {grid.context_length} "
                         f"({compressed[0].entry.label}: {unfit[compressed[0].name]}); give the methods settings "
                         f"that fit (a smaller window), larger --ratios or a longer --context_length")
    return folders, unfit


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pyramidkv.leaderboard import cells, outputs

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rerender is not None:
        try:
            written = outputs.rerender(Path(args.rerender))
        except ValueError as e:
            parser.error(" ".join(str(e).split()))
        print("[leaderboard] rerendered:\n  " + "\n  ".join(str(p) for p in written))
        return 0
    save_dir = Path(args.save_dir)
    try:
        if args.summarize:
            from pyramidkv.leaderboard.grid import read_grid

            grid = read_grid(save_dir)
        else:
            grid = grid_of(args)
        shard = parse_shard(args.shard) if args.shard is not None else None
        if not args.summarize:
            claim_folder(save_dir, grid, write=False, extend=args.extend)   # another grid's: refused before anything
        if args.merge_published and (not args.summarize or args.publish is None):
            raise ValueError("--merge_published goes with --summarize --publish DOCS: it merges the cells of "
                             "SAVE_DIR with those published in DOCS")
        published = outputs.read_published(Path(args.publish)) if args.merge_published else None
        if published is not None:
            grid = outputs.merged_grid(published[0], grid, save_dir, Path(args.publish))
        units = grid.units()
        folders, unfit = check_units(grid, units, save_dir, some_cell_applies=not args.summarize)
    except ValueError as e:
        parser.error(" ".join(str(e).split()))
    if args.count:
        print(f"{len(units)} units")
        return 0
    if not args.summarize:
        claim_folder(save_dir, grid, extend=args.extend)
        mine = shard_units(units, shard)
        failed = []
        for k, unit in enumerate(mine, 1):
            status = cells.read_status(save_dir, unit)
            if unit.name in unfit or (status and status.get("state") == "done" and
                                      (folders[unit.name] / "results.json").is_file()):
                continue
            print(f"[leaderboard] unit {k}/{len(mine)}: {unit.name}", flush=True)
            status = cells.run_unit(grid, unit, save_dir)
            if status["state"] != "done":
                failed.append(f"{unit.name}: {status['error']}")
        if failed:
            print(f"[leaderboard] {len(failed)} unit(s) failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        if shard is not None:
            return 1 if failed else 0
    written, failed_cells = outputs.write(grid, save_dir, folders, args.publish, unfit,
                                          published[1] if published is not None else None)
    print("[leaderboard] outputs:\n  " + "\n  ".join(str(p) for p in written))
    if failed_cells:
        print(f"[leaderboard] {failed_cells} cell(s) failed (marked in the CSV, the page and the figure)",
              file=sys.stderr)
    return 1 if failed_cells else 0


if __name__ == "__main__":
    sys.exit(main())
