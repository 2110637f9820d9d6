"""The SLURM scripts on a real scheduler: a one-node cluster (scripts/slurm/local_cluster.sh: started here, or
the one already running) runs scripts/slurm/sweep.sbatch and scripts/slurm/leaderboard.sbatch as arrays on the
tiny random Llama: every task's results, the summaries, and a task failing for a real reason, FAILED in sacct and
in the summary. Never skipped: a cluster that cannot start fails the test with its reason (CI installs the
packages: .ci/run). One test, so that pytest-xdist's workers never start or stop the cluster under each other."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT

CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
STATE_DIR = Path(os.environ.get("PYRAMIDKV_SLURM_DIR", "/tmp/pyramidkv-slurm"))
# What sweep.sbatch asks of a GPU node (--gres=gpu:1, 8 CPUs, 64G), cut down for one small node; the command
# line wins over the #SBATCH lines, so users on a real cluster still get what the script asks for.
SMALL_NODE = ["--gres=none", "--cpus-per-task=1", "--mem=2G", "--time=20"]


def run(cmd, env, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


@contextlib.contextmanager
def local_cluster():
    """The environment sbatch and the jobs see (SLURM_CONF of the local cluster; this interpreter and checkout);
    stops the cluster afterwards when it started it here."""
    env = {**os.environ, "SLURM_CONF": str(STATE_DIR / "slurm.conf"), "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT)}
    try:
        running = run(["bash", str(CLUSTER), "status"], env).returncode == 0
        if not running:
            started = run(["bash", str(CLUSTER), "start"], env)
            if started.returncode != 0:
                pytest.fail(f"the local SLURM cluster did not start:\n{started.stderr}{started.stdout}")
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"the local SLURM cluster did not start: {e}")
    try:
        yield env
    finally:
        if not running:
            run(["bash", str(CLUSTER), "stop"], env)


def sbatch_wait(args, env, timeout=600) -> tuple[str, subprocess.CompletedProcess]:
    """sbatch --wait --parsable ARGS -> (job id, the finished sbatch); cancels the job if it outlives `timeout`."""
    proc = subprocess.Popen(["sbatch", "--wait", "--parsable", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    job = proc.stdout.readline().strip().split(";")[0]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", job], env=env)
        proc.kill()
        pytest.fail(f"job {job} still ran after {timeout}s")
    assert job.isdigit(), err
    return job, subprocess.CompletedProcess(proc.args, proc.returncode, job + "\n" + out, err)


def sacct_ended(job: str, count: int, env) -> dict[str, tuple[str, str]]:
    """{job id (array tasks: JOB_INDEX): (state, exit code)} of the job's `count` jobs once sacct has each one's
    end (slurmctld tells slurmdbd a moment after sbatch --wait returns)."""
    deadline = time.monotonic() + 60
    while True:
        out = run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobID,State,ExitCode"], env).stdout
        jobs = {line.split("|")[0]: tuple(line.split("|")[1:]) for line in out.splitlines()}
        if len(jobs) == count and all(state not in ("PENDING", "RUNNING") for state, _ in jobs.values()):
            return jobs
        if time.monotonic() > deadline:
            pytest.fail(f"sacct shows {jobs} for job {job} a minute after it ended")
        time.sleep(0.5)


def ruler_args(model_dir: str) -> list[str]:
    return ["--model_path", model_dir, "--tasks", "niah_single_1", "--context_lengths", "512", "--num_samples", "1",
            "--device", "cpu", "--num_threads", "1"]


def test_sweep_and_leaderboard_arrays_on_the_real_scheduler(tiny_model_dir, tmp_path):
    with local_cluster() as env:
        check_sweep(env, tiny_model_dir, tmp_path / "sweep")
        check_leaderboard(env, tiny_model_dir, tmp_path / "leaderboard")


def check_sweep(env, tiny_model_dir: str, folder: Path):
    """Two tasks, one round on the two-CPU node: snapkv and h2o at 64 tokens, h2o failing (a file sits where its run
    folder goes). fullkv's task (a run with no budget) is the leaderboard's first shard below."""
    folder.mkdir()
    save, model = folder / "results", Path(tiny_model_dir).name
    args = ruler_args(tiny_model_dir)
    env = {**env, "METHODS": "snapkv h2o", "BUDGETS": "64", "FULLKV": "0"}   # tasks: snapkv, h2o
    # h2o fails for a real reason: a regular file sits where its run folder must go.
    h2o = run([sys.executable, "run_ruler.py", "--method", "h2o", "--max_capacity_prompts", "64", "--save_dir",
               str(save), *args, "--print_run_dir"], env)
    assert h2o.returncode == 0, h2o.stderr
    blocker = Path(h2o.stdout.strip())
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a run folder\n")

    job, sbatch = sbatch_wait(["--array=0-1", *SMALL_NODE, f"--output={folder}/slurm-%A_%a.out",
                               "scripts/slurm/sweep.sbatch", "ruler", str(save), *args], env)
    logs = {i: (folder / f"slurm-{job}_{i}.out").read_text() for i in range(2)}
    assert sbatch.returncode == 2, (sbatch.stderr, logs)                  # the highest exit status of its tasks
    assert sacct_ended(job, 2, env) == {f"{job}_0": ("COMPLETED", "0:0"), f"{job}_1": ("FAILED", "2:0")}, logs
    assert f"cannot write results to {blocker}: {blocker} is a file, not a folder" in logs[1]

    for run_dir, method, budget in ((f"{model}_64/snapkv", "snapkv", 64),):
        result = json.loads((save / run_dir / "results.json").read_text())
        assert (result["benchmark"], result["model"], result["method"], result["budget"]) == \
            ("ruler", model, method, budget), logs
        assert result["num_samples"] == {"niah_single_1@512": 1}
        assert len((save / run_dir / "niah_single_1_512.jsonl").read_text().splitlines()) == 1
    assert blocker.read_text() == "not a run folder\n"
    assert (save / "sweep_runs.txt").read_text().splitlines() == [
        f"ruler {model}_64/snapkv", f"ruler {model}_64/h2o"]

    summary = run([sys.executable, "scripts/summarize_results.py", str(save), "--no_plot"], env)
    assert summary.returncode == 0, summary.stderr
    assert f"1 run(s) listed in sweep_runs.txt have no results.json (failed or not run): {model}_64/h2o" \
        in summary.stderr
    rows = [line.split(",") for line in (save / f"summary_ruler_{model}.csv").read_text().splitlines()]
    assert rows[0] == ["method", "budget", "niah_single_1@512", "average", "n", "run"]
    assert [(r[0], r[1], r[4], r[5]) for r in rows[1:]] == [
        ("h2o", "64", "", f"{model}_64/h2o (no results.json: failed or not run)"),
        ("snapkv", "64", "1", f"{model}_64/snapkv")]


def check_leaderboard(env, tiny_model_dir: str, folder: Path):
    """Two shards (fullkv; snapkv at half the prompt, which fails: a file sits where its run folder goes), then the
    summarize job after both (afterany): the failed cell is in the CSV as failed, and FAILED in sacct."""
    from pyramidkv.leaderboard import cells
    from pyramidkv.leaderboard.__main__ import build_parser, grid_of

    folder.mkdir()
    save = folder / "results"
    args = ["--model_path", tiny_model_dir, "--methods", "snapkv", "--ratios", "0.5", "--tasks", "niah_single_1",
            "--context_length", "512", "--num_samples", "1", "--runner_args", "--device cpu --num_threads 1"]
    grid = grid_of(build_parser().parse_args(args))
    assert [u.entry.spec for u in grid.units()] == ["fullkv", "snapkv:budget_ratio=0.5"]
    blocker = cells.run_dir_of(grid, grid.units()[1], save)
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a run folder\n")

    array = run(["sbatch", "--parsable", "--array=0-1", *SMALL_NODE, f"--output={folder}/slurm-%A_%a.out",
                 "scripts/slurm/leaderboard.sbatch", str(save), *args], env)
    assert array.returncode == 0, array.stderr
    array_job = array.stdout.strip().split(";")[0]
    job, summary = sbatch_wait([f"--dependency=afterany:{array_job}", *SMALL_NODE,
                                f"--output={folder}/slurm-%j.out", "scripts/slurm/leaderboard.sbatch", "--summarize",
                                str(save)], env)
    logs = {p.name: p.read_text() for p in folder.glob("slurm-*.out")}
    assert summary.returncode == 1, (summary.stderr, logs)             # it ran after both, and a cell failed
    assert sacct_ended(array_job, 2, env) == {f"{array_job}_0": ("COMPLETED", "0:0"),
                                              f"{array_job}_1": ("FAILED", "1:0")}, logs
    assert sacct_ended(job, 1, env) == {job: ("FAILED", "1:0")}, logs
    assert "1 cell(s) failed" in logs[f"slurm-{job}.out"]

    rows = {r["method"]: r for r in csv.DictReader((save / "leaderboard.csv").open())}
    assert rows["fullkv"]["status"] == "done" and rows["fullkv"]["samples"] == "1"
    assert rows["snapkv"]["status"] == "failed" and "is a file, not a folder" in rows["snapkv"]["error"]
    assert all((save / name).is_file() for name in ("leaderboard.json", "leaderboard.md", "leaderboard.svg"))
    assert blocker.read_text() == "not a run folder\n"
