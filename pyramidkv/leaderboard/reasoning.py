"""python -m pyramidkv.leaderboard.reasoning: the leaderboard's reasoning part (issue 43, item 3). run_reasoning.py
(docs/reasoning.md) for fullkv first (its traces are every method's reference), then each decode-time method at
each decode budget with the whole prompt kept (`--max_capacity_prompts_ratio 1 --decode_budget B`), on the
generated chain task and GSM8K; then SAVE_DIR/reasoning.csv (one row per method x budget x task) and
SAVE_DIR/reasoning.md, made from the CSV alone.

    python -m pyramidkv.leaderboard.reasoning --save_dir results/reasoning_board
    python -m pyramidkv.leaderboard.reasoning --methods h2o tova --decode_budgets 64 --num_samples 2 --max_new_tokens 96
    python -m pyramidkv.leaderboard.reasoning --save_dir DIR --rerender     # reasoning.md again, from its CSV

Every unit is checked before any weights load (a method that takes no decode budget, a budget the traces never
reach). A rerun resumes: a unit whose rows cover every problem is skipped, and run_reasoning.py resumes a killed
unit at its missing rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.leaderboard import reasoning_table as table
from pyramidkv.leaderboard.cells import _call, _last_line

RUNS = "runs"
# the decode-time methods of the registry that take a decode budget (docs/decoding.md)
DECODE_METHODS = ("h2o", "snapkv", "tova", "scissorhands", "streamingllm", "rkv", "triattention")


@dataclass(frozen=True)
class BoardSettings:
    """The board's settings (flags of the same names).

    methods: decode-time method specs NAME[:setting=value,...], each run at every decode budget with the whole
        prompt kept; fullkv always runs first (the reference of KL, departure and the accuracy interval).
    decode_budgets: tokens a head holds while decoding (run_reasoning.py's --decode_budget).
    tasks: run_reasoning.py's tasks (chain: generated; gsm8k: GSM8K's test rows shipped; math500).
    num_samples: problems per task (the first ones).
    max_new_tokens: the most tokens a trace may generate (a budget must be reached within prompt + it).
    model_path: the model (a Hugging Face name or folder).
    save_dir: the board's folder: runs/ (the runner's folders), reasoning.csv, reasoning.md.
    runner_args: more flags for every run, one string (e.g. '--device cuda --num_threads 1').
    """

    methods: tuple = DECODE_METHODS
    decode_budgets: tuple = (512, 1024, 2048)
    tasks: tuple = ("chain", "gsm8k")
    num_samples: int = 100
    max_new_tokens: int = 4096
    model_path: Optional[str] = None        # None: the default model (pyramidkv/models/default_model.py)
    save_dir: str = "results/reasoning_board"
    runner_args: str = ""


@dataclass(frozen=True)
class Unit:
    method: str
    budget: Optional[int]                   # None: fullkv
    argv: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"


def build_parser() -> argparse.ArgumentParser:
    from pyramidkv.components import setting_help
    from pyramidkv.runner.arguments import ArgumentParser, flags_text

    parser = ArgumentParser(prog="python -m pyramidkv.leaderboard.reasoning", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    helps = setting_help(BoardSettings)
    for f in dataclasses.fields(BoardSettings):
        default = f.default
        shown = "the default model" if default is None else " ".join(map(str, default)) \
            if isinstance(default, tuple) else default
        text = helps[f.name].rstrip(".") + (f" (default: {shown})" if shown != "" else "")
        if isinstance(default, tuple):
            kind = int if f.name == "decode_budgets" else str
            parser.add_argument(f"--{f.name}", nargs="+", type=kind, default=list(default), help=text)
        else:
            kind = flags_text if f.name == "runner_args" else type(default) if default is not None else str
            parser.add_argument(f"--{f.name}", type=kind, default=default, help=text)
    parser.add_argument("--rerender", action="store_true", help="rewrite SAVE_DIR/reasoning.md from "
                                                                 "SAVE_DIR/reasoning.csv alone and exit")
    return parser


def units_of(args) -> list[Unit]:
    """fullkv, then every method x budget, with their run_reasoning.py argv (ValueError, one line, for bad input)."""
    from pyramidkv.benchmarks.reasoning.tasks import TASKS
    from pyramidkv.models.default_model import DEFAULT_MODEL_NAME

    for flag in ("num_samples", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    bad = [b for b in args.decode_budgets if b < 1]
    if bad:
        raise ValueError(f"--decode_budgets {bad[0]} is not allowed: a decode budget is a token count >= 1")
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"--tasks {unknown[0]!r} is not a reasoning task; allowed: {', '.join(TASKS)}")
    common = ["--model_path", args.model_path or DEFAULT_MODEL_NAME, "--tasks", *dict.fromkeys(args.tasks),
              "--num_samples", str(args.num_samples), "--max_new_tokens", str(args.max_new_tokens),
              "--save_dir", str(Path(args.save_dir) / RUNS), *shlex.split(args.runner_args)]
    units = [Unit("fullkv", None, ["--method", "fullkv", *common])]
    for method in dict.fromkeys(m for m in args.methods if m != "fullkv"):
        for budget in dict.fromkeys(args.decode_budgets):
            units.append(Unit(method, budget, ["--method", method, "--max_capacity_prompts_ratio", "1",
                                               "--decode_budget", str(budget), *common]))
    return units


def check_units(units: list[Unit]) -> tuple[dict, dict, dict]:
    """Every unit's run folder ({unit name: folder}), the problems' keys ({task: keys}) and each method's
    re-selection interval ({(method, budget): decode_interval}), after every check that needs no weights: each
    unit's flags as its runner checks them (--print_run_dir), and each decode budget reachable by every problem's
    trace (prompt + max_new_tokens - 1 >= budget + the method's decode_interval)."""
    from pyramidkv.benchmarks.reasoning.run import compresses, main

    folders = {}
    for unit in units:
        code, out, err = _call(main, [*unit.argv, "--print_run_dir"])
        if code != 0:
            raise ValueError(f"{unit.name}: {_last_line(err) or f'exit status {code}'}")
        folders[unit.name] = Path(out.strip().splitlines()[-1])
    prompts, keys = _prompt_lengths(units[0].argv)
    shortest = min(prompts, key=lambda item: item[0])
    intervals = {}
    for unit in units[1:]:
        interval = intervals[(unit.method, unit.budget)] = _decode_interval(unit.argv)
        held = shortest[0] + shortest[1] - 1
        if not compresses(shortest[0], shortest[1], unit.budget, interval):
            raise ValueError(f"--decode_budgets {unit.budget} is too large for {unit.method} (decode_interval "
                             f"{interval}): {shortest[2]} holds {shortest[0]} prompt + {shortest[1]} new tokens at "
                             f"most, it would never compress; allowed: decode budgets <= {held - interval}, or "
                             f"more --max_new_tokens")
    return folders, keys, intervals


def _runner_args(argv: list[str]):
    from pyramidkv.benchmarks.reasoning.run import build_parser as reasoning_parser

    parser = reasoning_parser()
    return parser, parser.parse_args(argv)


def _prompt_lengths(argv: list[str]) -> tuple[list[tuple[int, int, str]], dict]:
    """([(prompt tokens, max_new_tokens, label)] of every problem, {task: the problems' keys}), tokenized as the
    runner does (tokenizer only)."""
    from transformers import AutoTokenizer

    from pyramidkv.benchmarks.prompting import chat_frame
    from pyramidkv.benchmarks.reasoning import tasks as T
    from pyramidkv.models.loading import check_model

    _, args = _runner_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(check_model(args.model_path, args.attn_implementation, "cpu")[0])
    frame = chat_frame(tokenizer)
    lengths, keys = [], {}
    for task in dict.fromkeys(args.tasks):
        problems = T.problems(task, args.num_samples, args.chain_steps, args.chain_seed, args.data_file)
        keys[task] = [p.index for p in problems]
        for p in problems:
            ids = tokenizer(T.prompt_text(task, p, frame), add_special_tokens=False).input_ids
            lengths.append((len(ids), args.max_new_tokens, f"{task} problem {p.index}"))
    return lengths, keys


def _decode_interval(argv: list[str]) -> int:
    from pyramidkv.runner.method_args import method_from_args

    parser, args = _runner_args(argv)
    return method_from_args(args, parser).decode.decode_interval


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pyramidkv.benchmarks.reasoning.run import main as run_reasoning

    parser = build_parser()
    args = parser.parse_args(argv)
    save_dir = Path(args.save_dir)
    try:
        if args.rerender:
            print(f"[reasoning] rerendered {table.rerender(save_dir)}")
            return 0
        units = units_of(args)
        folders, keys, intervals = check_units(units)
    except ValueError as e:
        parser.error(" ".join(str(e).split()))
    errors = {}
    for k, unit in enumerate(units, 1):
        if all(table.task_rows(folders[unit.name], t, ks) is not None for t, ks in keys.items()):
            continue                                                    # done: every problem has its row
        if unit.budget is not None and ("fullkv", None) in errors:
            errors[(unit.method, unit.budget)] = "not run: fullkv's run failed"
            continue
        print(f"[reasoning] unit {k}/{len(units)}: {unit.name}", flush=True)
        code, _, err = _call(run_reasoning, unit.argv, echo=True)
        if code != 0:
            errors[(unit.method, unit.budget)] = _last_line(err) or f"exit status {code}"
    model = units[0].argv[units[0].argv.index("--model_path") + 1]
    rows = table.cells(model, args.max_new_tokens, keys, [(u.method, u.budget, folders[u.name]) for u in units],
                       errors, intervals)
    written = table.write(save_dir, rows)
    print("[reasoning] outputs:\n  " + "\n  ".join(map(str, written)))
    if errors:
        print(f"[reasoning] {len(errors)} unit(s) failed:\n  " +
              "\n  ".join(f"{m}@{b}: {e}" for (m, b), e in errors.items()), file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
