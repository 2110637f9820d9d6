#!/usr/bin/env python3
"""Every run of a sweep checked in one process: what each runner's --print_run_dir does (arguments, method and
model config checked, nothing loaded), without one interpreter start per run (scripts/sweep_tasks.sh: a grid of
hundreds of runs, checked again by every SLURM array task, spent seconds per run importing torch).

    python scripts/run_dirs.py BENCHMARK < RUNS

BENCHMARK: longbench | ruler | needle. RUNS on stdin: per run its argument count, then its arguments, each
NUL-terminated (bash: printf '%s\\0' "${#args[@]}" "${args[@]}"). Prints one line per run, in order:
"ok<TAB>FOLDER", or "error<TAB>the runner's one-line error". Exit status 0 when every run printed a line (an
invalid run is a line, not a failure), 2 for bad input.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Callable, Sequence

USAGE = "usage: python scripts/run_dirs.py {longbench,ruler,needle} < RUNS (module docstring)"


def runner_main(benchmark: str) -> Callable[[Sequence[str]], int]:
    if benchmark == "longbench":
        from pyramidkv.benchmarks.longbench.run import main
    elif benchmark == "ruler":
        from pyramidkv.benchmarks.ruler.run import main
    elif benchmark == "needle":
        from pyramidkv.benchmarks.needle.run import main
    else:
        raise ValueError(f"unknown benchmark {benchmark!r}; use longbench, ruler or needle")
    return main


def parse_runs(data: bytes) -> list[list[str]]:
    """stdin's bytes -> one argument list per run (the format in the module docstring)."""
    fields = data.split(b"\0")
    if fields[-1] != b"":
        raise ValueError("the runs must end with a NUL (each field NUL-terminated)")
    fields.pop()
    runs, i = [], 0
    while i < len(fields):
        count = fields[i].decode()
        if not count.isdigit():
            raise ValueError(f"expected a run's argument count at field {i}, got {count!r}")
        start, i = i + 1, i + 1 + int(count)
        if i > len(fields):
            raise ValueError(f"the last run announces {count} arguments but {len(fields) - start} follow")
        runs.append([f.decode() for f in fields[start:i]])
    return runs


def check_run(main: Callable[[Sequence[str]], int], argv: list[str]) -> tuple[str, str]:
    """("ok", folder) or ("error", the runner's last error line) for one run's arguments."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    lines = out.getvalue().strip().splitlines()
    if status in (0, None) and lines:
        return "ok", lines[-1]
    message = err.getvalue().strip().splitlines()
    return "error", message[-1] if message else f"exit status {status}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        main_of_runner = runner_main(argv[0])
        runs = parse_runs(sys.stdin.buffer.read())
    except ValueError as e:
        print(f"run_dirs.py: error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        status, text = check_run(main_of_runner, run)
        print(f"{status}\t{' '.join(text.split())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
