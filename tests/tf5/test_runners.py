"""The four runners and the leaderboard end to end under the 5.x line, on the tiny random Llama (with SmolLM2's
tokenizer): each run finishes, writes its results and names the method. What the runs compute is tested on the
pinned line (tests/benchmarks/, tests/leaderboard/) and the engine under 5.x by tests/tf5/'s other files; this
checks that the runners' own paths (data, templates, generation, rows, scoring, the leaderboard's units) run
through the attention interface. Skipped on the pinned line, where tests/benchmarks/ runs the same commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyramidkv.models.line import INTERFACE_LINE
from tests.helpers import ROOT, longbench_data_dir

pytestmark = pytest.mark.skipif(not INTERFACE_LINE, reason="the pinned line's runners: tests/benchmarks/")

COMMON = ["--num_threads", "1", "--device", "cpu"]


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def results(folder: Path) -> dict:
    found = sorted(folder.rglob("results.json"))
    assert found, f"no results.json under {folder}"
    return json.loads(found[-1].read_text())


def test_ruler_needle_and_longbench(tiny_model_dir, tmp_path):
    model = ["--model_path", tiny_model_dir, "--method", "snapkv", "--max_capacity_prompts", "48", *COMMON]
    ruler = run(["run_ruler.py", *model, "--tasks", "niah_single_1", "--context_lengths", "256", "--num_samples", "1",
                 "--save_dir", str(tmp_path / "ruler")])
    assert ruler.returncode == 0, ruler.stderr[-2000:]
    assert results(tmp_path / "ruler")["method"] == "snapkv"
    needle = run(["run_needle_in_haystack.py", *model, "--s_len", "300", "--e_len", "300", "--step", "100",
                  "--num_depths", "2", "--max_new_tokens", "4", "--save_dir", str(tmp_path / "needle")])
    assert needle.returncode == 0, needle.stderr[-2000:]
    assert len((next((tmp_path / "needle").rglob("needle.jsonl"))).read_text().splitlines()) == 2
    longbench = run(["run_longbench.py", *model, "--data_dir", str(longbench_data_dir()), "--datasets", "multi_news",
                     "--max_num_examples", "1", "--max_length", "512", "--save_dir", str(tmp_path / "lb"), "--eval"])
    assert longbench.returncode == 0, longbench.stderr[-2000:]
    assert "multi_news" in results(tmp_path / "lb")["scores"]


def test_reasoning_fullkv_then_a_decode_time_method(tiny_model_dir, tmp_path):
    base = ["run_reasoning.py", "--model_path", tiny_model_dir, "--tasks", "chain", "--num_samples", "1",
            "--max_new_tokens", "16", "--save_dir", str(tmp_path), *COMMON]
    fullkv = run([*base, "--method", "fullkv"])
    assert fullkv.returncode == 0, fullkv.stderr[-2000:]
    h2o = run([*base, "--method", "h2o", "--max_capacity_prompts_ratio", "1", "--decode_budget", "40"])
    assert h2o.returncode == 0, h2o.stderr[-2000:]
    assert "KL" in h2o.stdout


def test_leaderboard_grid(tiny_model_dir, tmp_path):
    board = run(["-m", "pyramidkv.leaderboard", "--model_path", tiny_model_dir, "--save_dir", str(tmp_path),
                 "--methods", "snapkv", "--ratios", "0.5", "--tasks", "niah_single_1", "--context_length", "256",
                 "--num_samples", "1", "--runner_args", "--num_threads 1 --device cpu"])
    assert board.returncode == 0, board.stderr[-2000:]
    rows = (tmp_path / "leaderboard.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",done," in row for row in rows[1:]), rows


def test_longbench_hub_fallback_loads_datasets_beside_transformers_5(monkeypatch):
    """requirements-tf5.txt's `datasets` imports beside transformers 5 and the hub client it pins (a hub-client
    clash fails at that import), and without --data_dir offline the runner ends in one line with the advice, not
    with 'not installed'."""
    from pyramidkv.benchmarks.longbench import run as longbench

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError) as error:
        longbench._load_from_hub("multi_news", False)
    message = str(error.value)
    assert "could not load" in message and "--data_dir" in message and "not installed" not in message
