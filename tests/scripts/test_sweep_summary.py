"""Sweep grid, SLURM array mapping and the results summary."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import ROOT, stand_in_python


def bash(cmd: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env})


def test_sweep_grid_has_fullkv_once_plus_methods_times_budgets():
    out = bash('source scripts/sweep_tasks.sh; printf "%s\\n" "${SWEEP_TASKS[@]}"',
               METHODS="snapkv fullkv h2o", BUDGETS="64 128 256")
    assert out.stdout.splitlines() == ["fullkv -|-", "snapkv 64|-", "snapkv 128|-", "snapkv 256|-",
                                       "h2o 64|-", "h2o 128|-", "h2o 256|-"]


def test_sweep_runs_a_method_without_a_budget_once():
    """minicache and minference keep every token (no budget): one run each, like fullkv, never one per budget."""
    out = bash('source scripts/sweep_tasks.sh; printf "%s\\n" "${SWEEP_TASKS[@]}"', PYTHON=sys.executable,
               METHODS="minicache quest minference", BUDGETS="64 128", FULLKV="0")
    assert out.stdout.splitlines() == ["minicache -|-", "quest 64|-", "quest 128|-", "minference -|-"], out.stderr


def test_sweep_variants_run_each_method_and_budget_with_each_flag_set():
    env = dict(METHODS="snapkv", BUDGETS="64", VARIANTS="-|--merge mergingpress --merge_fraction 0.5|--merge pivot",
               PYTHON="echo", FULLKV="1")
    got = bash('source scripts/sweep_tasks.sh; for t in "${SWEEP_TASKS[@]}"; do run_sweep_task ruler "$t" '
               '--save_dir out; done', **env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [
        "run_ruler.py --method fullkv --save_dir out",
        "run_ruler.py --method snapkv --max_capacity_prompts 64 --save_dir out",
        "run_ruler.py --method snapkv --max_capacity_prompts 64 --merge mergingpress --merge_fraction 0.5 --save_dir out",
        "run_ruler.py --method snapkv --max_capacity_prompts 64 --merge pivot --save_dir out"]


def test_slurm_array_index_runs_its_own_task(tmp_path):
    env = dict(METHODS="snapkv h2o", BUDGETS="64 128", PYTHON=stand_in_python(tmp_path, 'echo "$@"'))
    out = str(tmp_path / "out")
    assert "5 tasks: --array=0-4" in bash(f"bash scripts/slurm/sweep.sbatch --count ruler {out}", **env).stdout
    assert not (tmp_path / "out").exists()                                  # counting writes nothing
    got = bash(f"bash scripts/slurm/sweep.sbatch ruler {out} --context_lengths 2048", SLURM_ARRAY_TASK_ID="3", **env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["run_ruler.py", "--method", "h2o", "--max_capacity_prompts", "64",
                                  "--save_dir", out, "--context_lengths", "2048"]
    got = bash(f"bash scripts/slurm/sweep.sbatch ruler {out}", SLURM_ARRAY_TASK_ID="0", **env)
    assert got.stdout.split() == ["run_ruler.py", "--method", "fullkv", "--save_dir", out]
    got = bash(f"bash scripts/slurm/sweep.sbatch ruler {out}", SLURM_ARRAY_TASK_ID="9", **env)
    assert got.returncode == 2 and "past the 5 tasks" in got.stderr
    got = bash(f"bash scripts/sweep.sh bogus {out}", PYTHON=env["PYTHON"], METHODS="snapkv", BUDGETS="64", FULLKV="0")
    assert got.returncode != 0 and "unknown benchmark 'bogus'" in got.stderr


def test_sweep_lists_its_runs_once_for_the_summary(tmp_path):
    """Each array task adds the grid's run folders (as the runners' --print_run_dir names them) to sweep_runs.txt,
    each once."""
    python = stand_in_python(tmp_path, 'echo "$@"')
    out = tmp_path / "out"
    for index in ("0", "1", "0"):
        got = bash(f"bash scripts/slurm/sweep.sbatch ruler {out}", SLURM_ARRAY_TASK_ID=index, PYTHON=python,
                   METHODS="snapkv", BUDGETS="64")
        assert got.returncode == 0, got.stderr
    assert (out / "sweep_runs.txt").read_text().splitlines() == ["ruler m_x/fullkv", "ruler m_x/snapkv"]


def write_result(root: Path, method: str, budget, scores: dict, folder_name: str | None = None, average="mean"):
    folder = root / f"m_{budget or 'full'}" / (folder_name or method)
    folder.mkdir(parents=True)
    avg = round(sum(scores.values()) / len(scores), 2) if average == "mean" else average
    (folder / "results.json").write_text(json.dumps({
        "benchmark": "ruler", "model": "m", "method": method, "budget": budget, "scores": scores,
        "average": avg, "num_samples": {k: 5 for k in scores}}))
    return folder


def summarize(root: Path) -> subprocess.CompletedProcess:
    """scripts/summarize_results.py's main run in this process, ended as the process would end: its exit status,
    and an exit message on stderr. Any other exception propagates (the process would print a Traceback). The
    script started as a process: test_summary_table_and_plot."""
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            _load_summary_module().main([str(root)])
        except SystemExit as done:
            code = done.code
    if isinstance(code, str):
        stderr.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(["scripts/summarize_results.py", str(root)], code or 0, stdout.getvalue(),
                                       stderr.getvalue())


def test_summary_table_and_plot(tmp_path):
    write_result(tmp_path, "snapkv", 128, {"a": 80.0, "b": 60.0})
    write_result(tmp_path, "snapkv", 64, {"a": 40.0, "b": 20.0})
    write_result(tmp_path, "fullkv", None, {"a": 100.0, "b": 90.0})
    write_result(tmp_path, "h2o", 64, {"a": 10.0})
    out = subprocess.run([sys.executable, "scripts/summarize_results.py", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "summary_ruler_m.md").read_text().splitlines()
    assert md[0] == "| method | budget | a | b | average | n | run |"
    assert md[2:] == ["| fullkv | full | 100.00 | 90.00 | 95.00 | 10 | m_full/fullkv |",
                      "| h2o | 64 | 10.00 |  | 10.00 | 5 | m_64/h2o |",
                      "| snapkv | 64 | 40.00 | 20.00 | 30.00 | 10 | m_64/snapkv |",
                      "| snapkv | 128 | 80.00 | 60.00 | 70.00 | 10 | m_128/snapkv |"]
    assert (tmp_path / "summary_ruler_m.csv").read_text().splitlines()[1] == \
        "fullkv,full,100.0,90.0,95.0,10,m_full/fullkv"
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "summary_ruler_m.png").shape[2] in (3, 4)


def test_summary_lists_a_swept_run_without_results(tmp_path):
    """A run of the sweep's list with no results.json (failed, killed, never started) is a row saying so, never
    dropped; an empty line or a run that has its results.json adds nothing."""
    write_result(tmp_path, "snapkv", 64, {"a": 40.0})
    (tmp_path / "m_128").mkdir()
    (tmp_path / "m_128" / "h2o").write_text("a file where the run folder goes")
    (tmp_path / "sweep_runs.txt").write_text("ruler m_64/snapkv\nruler m_128/h2o\n\nruler m_full/fullkv\n")
    out = summarize(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "2 run(s) listed in sweep_runs.txt have no results.json (failed or not run): m_128/h2o, m_full/fullkv" \
        in out.stderr
    assert (tmp_path / "summary_ruler_m.md").read_text().splitlines()[2:] == [
        "| fullkv | full |  |  |  | m_full/fullkv (no results.json: failed or not run) |",
        "| h2o | 128 |  |  |  | m_128/h2o (no results.json: failed or not run) |",
        "| snapkv | 64 | 40.00 | 40.00 | 5 | m_64/snapkv |"]


def test_summary_errors(tmp_path):
    assert "does not exist" in summarize(tmp_path / "nope").stderr
    assert "no results.json under" in summarize(tmp_path).stderr
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.json").write_text(json.dumps({"scores": {}}))
    assert "missing benchmark" in summarize(tmp_path).stderr


def _load_summary_module():
    from tests.helpers import load_script

    return load_script("summarize_results", ROOT / "scripts" / "summarize_results.py")


def test_summary_plot_shows_every_run(tmp_path):
    """Null fullkv average, ratio budgets and two settings of one (method, budget): all shown, apart."""
    write_result(tmp_path, "fullkv", None, {"a": 1.0}, average=None)
    write_result(tmp_path, "snapkv", 64, {"a": 40.0})
    write_result(tmp_path, "snapkv", 64, {"a": 42.0}, folder_name="snapkv_window_size=8")
    write_result(tmp_path, "snapkv", "r0.25", {"a": 55.0})
    write_result(tmp_path, "snapkv", "r0.5", {"a": 65.0})
    out = summarize(tmp_path)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "summary_ruler_m.md").read_text()
    assert "| fullkv | full | 1.00 |  | 5 | m_full/fullkv |" in md      # null average: blank, not a crash
    assert "| snapkv | 64 | 42.00 | 42.00 | 5 | m_64/snapkv_window_size=8 |" in md
    summary = _load_summary_module()
    results = summary.load_results(tmp_path)
    fig = summary.plot(results, summary.plot_title("ruler", "m", results), tmp_path / "p.png")
    drawn = sorted((line.get_label(), [(float(x), float(y)) for x, y in zip(line.get_xdata(), line.get_ydata())])
                   for ax in fig.axes for line in ax.lines)
    assert drawn == [("snapkv", [(0.25, 55.0), (0.5, 65.0)]), ("snapkv", [(64.0, 40.0)]),
                     ("snapkv_window_size=8", [(64.0, 42.0)])]              # own lines, not a vertical segment
    assert any("m_full/fullkv" in t.get_text() for t in fig.texts)           # the unscored run is named
    for ax in fig.axes:
        low, high = ax.get_ylim()
        assert low <= 0 and high >= 100                                      # no +-0.04 autoscale
    assert fig.legends and not any(ax.get_legend() for ax in fig.axes)       # legend outside the axes
    assert "n=5" in fig._suptitle.get_text() and "5 runs" in fig._suptitle.get_text()


def test_summary_title_carries_context_length():
    summary = _load_summary_module()
    runs = [{"scores": {"niah_single_1@2048": 1.0}, "num_samples": {"niah_single_1@2048": 5}, "benchmark": "ruler"}]
    assert summary.plot_title("ruler", "m", runs) == "ruler - m; context 2048; n=5; 1 runs"


@pytest.mark.parametrize("content, message", [
    ("42", "expected a JSON object, got int"),
    ("{broken", "not valid JSON"),
    (json.dumps({"benchmark": "ruler", "model": "m", "method": "snapkv", "budget": 64, "scores": {"a": "high"},
                 "average": 1.0}), "scores.a must be a number or null, got 'high'"),
    (json.dumps({"benchmark": "ruler", "model": "m", "method": "snapkv", "budget": 64, "scores": [],
                 "average": 1.0}), '"scores" must be an object'),
])
def test_summary_malformed_results_json_names_the_file(tmp_path, content, message):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.json").write_text(content)
    out = summarize(tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"{tmp_path / 'x' / 'results.json'}: {message}" in out.stderr


def test_summary_refuses_duplicate_prediction_rows(tmp_path):
    folder = write_result(tmp_path, "snapkv", 64, {"vt@1024": 50.0})
    (folder / "vt_1024.jsonl").write_text('{"index": 0, "pred": "a"}\n{"index": 1, "pred": "b"}\n{"index": 0, "pred": "a"}\n')
    out = summarize(tmp_path)
    assert out.returncode == 1 and f"{folder / 'vt_1024.jsonl'}:3: index 0 repeats line 1" in out.stderr
