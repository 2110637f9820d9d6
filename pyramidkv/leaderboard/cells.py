"""Running the grid's units through the benchmark runners (the run protocol: one folder per unit, rows appended and
fsynced per sample, a killed run resumed without lost or duplicated rows), with each unit's outcome kept in
`status/{unit}.json` so a failed unit is reported, never dropped."""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from pyramidkv.leaderboard.grid import NEEDLE, RULER_TASKS, SHARED, SHARED_MODE, SHARED_QUESTIONS, SHARED_TASK, Grid, Unit

STATUS_FOLDER = "status"


def runs_dir(save_dir: Path, part: str) -> Path:
    return Path(save_dir) / "runs" / part


def unit_command(grid: Grid, unit: Unit, save_dir: Path) -> tuple[str, list[str]]:
    """(runner: "ruler" | "needle", its argv) of a unit."""
    common = ["--model_path", grid.model_path, "--method", unit.entry.spec, "--attn_implementation",
              grid.attn_implementation, "--dtype", grid.dtype, "--save_dir", str(runs_dir(save_dir, unit.part)),
              *grid.extra]
    length = str(grid.context_length)
    if unit.part == "ruler":
        tasks = [t for t in grid.tasks if t in RULER_TASKS]
        return "ruler", [*common, "--tasks", *tasks, "--context_lengths", length, "--num_samples",
                         str(grid.num_samples), "--kl_vs_fullkv"]
    if unit.part == NEEDLE:
        return "needle", [*common, "--s_len", length, "--e_len", length, "--num_depths", str(grid.needle_depths),
                          "--kl_vs_fullkv"]
    if unit.part == SHARED:
        return "ruler", [*common, "--tasks", SHARED_TASK, "--context_lengths", length, "--num_samples",
                         str(grid.num_samples), "--questions_per_context", str(SHARED_QUESTIONS),
                         "--shared_context", SHARED_MODE]
    raise ValueError(f"unknown part {unit.part!r}")


def runner_main(runner: str):
    if runner == "ruler":
        from pyramidkv.benchmarks.ruler.run import main
    else:
        from pyramidkv.benchmarks.needle.run import main
    return main


class NotApplicable(Exception):
    """A unit whose method cannot do what its settings say on one of its prompts (its runner's UnfitPrompt, exit
    status 3: a ratio budget below the window at this length, ...): its cells are `n/a`, with this reason."""


def run_dir_of(grid: Grid, unit: Unit, save_dir: Path) -> Path:
    """The unit's run folder, after every check its runner makes without weights on every sample
    (--prepare_only: RULER's data generated, the needle's haystack built, each prompt checked against the model
    and the method). NotApplicable where the method does not fit a prompt; ValueError for any other refusal."""
    from pyramidkv.runner.cli import UNFIT_EXIT_STATUS

    runner, argv = unit_command(grid, unit, save_dir)
    code, out, err = _call(runner_main(runner), [*argv, "--prepare_only"])
    if code == UNFIT_EXIT_STATUS:   # the reason without this machine's folders: a published page names the file
        raise NotApplicable(re.sub(r"(?:/[^\s/:]+)+/([^\s/:]+)", r"\1", _last_line(err).split(": error: ", 1)[-1]))
    if code != 0:
        raise ValueError(f"{unit.name}: {_last_line(err) or f'exit status {code}'}")
    return Path(out.strip().splitlines()[-1])


def status_path(save_dir: Path, unit: Unit) -> Path:
    return Path(save_dir) / STATUS_FOLDER / f"{unit.name}.json"


def read_status(save_dir: Path, unit: Unit) -> Optional[dict]:
    path = status_path(save_dir, unit)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def run_unit(grid: Grid, unit: Unit, save_dir: Path) -> dict:
    """Run (or resume) one unit; its status record ({"state": "done" | "failed", ...}), written atomically."""
    from pyramidkv.runner.results import atomic_write_json

    runner, argv = unit_command(grid, unit, save_dir)
    started = time.time()
    code, _, err = _call(runner_main(runner), argv, echo=True)
    status = {"unit": unit.name, "method_spec": unit.entry.spec, "part": unit.part,
              "state": "done" if code == 0 else "failed", "exit_status": code,
              "error": None if code == 0 else (_last_line(err) or f"exit status {code}"),
              "seconds": round(time.time() - started, 1), "host": socket.gethostname(),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_json(status_path(save_dir, unit), status)
    return status


def _call(main, argv: list[str], echo: bool = False) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a runner's main in this process; an unexpected exception is a failure
    whose last traceback line is kept."""
    out, err = io.StringIO(), io.StringIO()
    streams = (_Tee(out, sys.stdout), _Tee(err, sys.stderr)) if echo else (out, err)
    with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
        try:
            code = main(argv) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:   # a unit's crash is recorded as its failure; the other units go on
            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[-1][:500]


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
