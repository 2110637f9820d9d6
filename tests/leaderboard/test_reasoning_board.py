"""The reasoning board (pyramidkv/leaderboard/reasoning.py) on the tiny random Llama: fullkv then two decode-time
methods at one decode budget, every cell in the CSV with the means of its runner's rows computed here, fullkv's KL
exactly 0, the accuracy difference against a hand count, a rerun that runs nothing, the page regenerated from the
CSV equal to the written one, and bad input refused in one line before anything runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pyramidkv.leaderboard.reasoning import main

SMALL = {"--methods": ["h2o", "tova"], "--decode_budgets": ["48"], "--tasks": ["chain", "gsm8k"],
         "--num_samples": ["1"], "--max_new_tokens": ["4"],
         "--runner_args": ["--num_threads 1 --device cpu --chain_steps 3"]}


def _board(model_dir, save_dir, *changed):
    """The board's argv at SMALL's sizes, with the flags in `changed` (flag, values..., flag, ...) replacing them."""
    flags, flag = dict(SMALL), None
    for item in changed:
        if item.startswith("--"):
            flag = item
            flags[flag] = []
        else:
            flags[flag].append(item)
    return ["--model_path", model_dir, "--save_dir", str(save_dir), *(x for k, v in flags.items() for x in (k, *v))]


def _csv(save_dir: Path) -> list[dict]:
    with open(save_dir / "reasoning.csv", newline="") as f:
        return list(csv.DictReader(f))


def _rows(folder: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines() if line.strip()]


def test_board_runs_every_cell_then_resumes_and_rerenders(tiny_model_dir, tmp_path, capsys):
    assert main(_board(tiny_model_dir, tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.count("[reasoning] unit ") == 3                  # fullkv, h2o@48, tova@48
    assert out.index("unit 1/3: fullkv") < out.index("unit 2/3: h2o@48")
    cells = _csv(tmp_path)
    assert [(c["method"], c["decode_budget"], c["task"]) for c in cells] == [
        ("fullkv", "", "chain"), ("fullkv", "", "gsm8k"), ("h2o", "48", "chain"), ("h2o", "48", "gsm8k"),
        ("tova", "48", "chain"), ("tova", "48", "gsm8k")]
    runs = tmp_path / "runs"
    model = Path(tiny_model_dir).name
    for c in cells:
        assert c["status"] == "done" and c["samples"] == "1", c
        part = "full" if c["method"] == "fullkv" else "r1"
        folder = runs / f"{model}_{part}" / c["folder"]
        assert c["folder"] == ("fullkv" if c["method"] == "fullkv" else f"{c['method']}_decode_budget=48")
        (row,) = _rows(folder, c["task"])
        (reference,) = _rows(runs / f"{model}_full" / "fullkv", c["task"])
        assert float(c["accuracy"]) == 100.0 * bool(row["correct"])
        assert float(c["new_tokens"]) == row["new_tokens"]
        assert float(c["kl_vs_fullkv"]) == pytest.approx(row["kl_vs_fullkv"], abs=5e-7)
        assert float(c["kv_bytes_peak"]) == row["kv_bytes_peak"]
        assert float(c["kv_bytes_mean"]) == pytest.approx(row["kv_bytes_mean"], abs=0.5)
        # one problem: the paired difference is the one difference, its interval that point
        diff = 100.0 * (bool(row["correct"]) - bool(reference["correct"]))
        assert [float(c[k]) for k in ("vs_fullkv", "vs_fullkv_low", "vs_fullkv_high")] == [diff, diff, diff]
        if c["method"] == "fullkv":
            assert c["kl_vs_fullkv"] == "0.0" and c["departure_step"] == "" and c["departed"] == "0.0"
        else:
            assert row["kv_bytes_peak"] < reference["kv_bytes_peak"]     # the budget held below fullkv's cache
    page = (tmp_path / "reasoning.md").read_text()
    assert "## chain" in page and "`tova` | 48 | 1 |" in page

    # a rerun runs nothing and writes the same CSV; the page comes back from the CSV alone
    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*.jsonl")}
    csv_before = (tmp_path / "reasoning.csv").read_text()
    assert main(_board(tiny_model_dir, tmp_path)) == 0
    assert "[reasoning] unit " not in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*.jsonl")} == stamps
    assert (tmp_path / "reasoning.csv").read_text() == csv_before
    (tmp_path / "reasoning.md").unlink()
    assert main(["--save_dir", str(tmp_path), "--rerender"]) == 0
    assert (tmp_path / "reasoning.md").read_text() == page


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("extra, expected", [
    (["--decode_budgets", "0"], "--decode_budgets 0 is not allowed: a decode budget is a token count >= 1"),
    (["--tasks", "mmlu"], "--tasks 'mmlu' is not a reasoning task; allowed: chain, gsm8k, math500"),
    (["--num_samples", "0"], "--num_samples must be >= 1, got 0"),
    (["--decode_budgets", "1000"], "--decode_budgets 1000 is too large for h2o (decode_interval 32)"),
    (["--methods", "kvzip"], "kvzip@48: "),
])
def test_bad_input_is_refused_in_one_line_before_anything_runs(tiny_model_dir, tmp_path, capsys, extra, expected):
    line = _refused(_board(tiny_model_dir, tmp_path, *extra), capsys)
    assert expected in line, line
    assert line.startswith("python -m pyramidkv.leaderboard.reasoning: error: ")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reasoning.csv").exists()


def test_the_largest_budget_named_is_the_boundary(tiny_model_dir, tmp_path, capsys):
    from pyramidkv.leaderboard.reasoning import build_parser, check_units, units_of

    line = _refused(_board(tiny_model_dir, tmp_path, "--decode_budgets", "1000"), capsys)
    held = int(line.split(" holds ")[1].split(" prompt")[0])
    allowed = int(line.split("decode budgets <= ")[1].split(",")[0])
    assert allowed == held + 4 - 1 - 32           # prompt + max_new_tokens - 1 - h2o's decode_interval
    for budget, ok in ((allowed, True), (allowed + 1, False)):
        units = units_of(build_parser().parse_args(_board(tiny_model_dir, tmp_path, "--decode_budgets", str(budget))))
        if ok:
            check_units(units)
        else:
            with pytest.raises(ValueError, match=f"--decode_budgets {budget} is too large"):
                check_units(units)


def test_rerender_without_a_csv_is_refused(tmp_path, capsys):
    line = _refused(["--save_dir", str(tmp_path), "--rerender"], capsys)
    assert f"no {tmp_path / 'reasoning.csv'}: run the board first" in line
