"""The reasoning board (pyramidkv/leaderboard/reasoning.py) on the tiny random Llama: fullkv then two decode-time
methods at one decode budget, every cell in the CSV with the means of its runner's rows computed here, fullkv's KL
exactly 0, the accuracy difference against a hand count, a rerun that runs nothing, the page regenerated from the
CSV equal to the written one, and bad input refused in one line before anything runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pyramidkv.benchmarks.reasoning.run import main as run_reasoning
from pyramidkv.leaderboard import reasoning, reasoning_table
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
        assert (c["reached"] == "") == (c["method"] == "fullkv"), c      # a budget to reach: the methods' rows
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
    # the largest budget the board allows is the runner's own boundary (run.py's check, fullkv's traces now there)
    line = _refused(_board(tiny_model_dir, tmp_path, "--decode_budgets", "1000"), capsys)
    allowed = int(line.split("decode budgets <= ")[1].split(",")[0])
    runner = ["--model_path", tiny_model_dir, "--save_dir", str(runs), "--tasks", "chain", "gsm8k", "--num_samples",
              "1", "--max_new_tokens", "4", "--num_threads", "1", "--device", "cpu", "--chain_steps", "3",
              "--method", "h2o", "--max_capacity_prompts_ratio", "1", "--prepare_only", "--decode_budget"]
    assert run_reasoning([*runner, str(allowed)]) == 0
    with pytest.raises(SystemExit):
        run_reasoning([*runner, str(allowed + 1)])
    assert "it would never compress while decoding" in capsys.readouterr().err

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


def test_a_failed_unit_is_a_row_with_its_error_and_the_others_still_run(tiny_model_dir, tmp_path, capsys,
                                                                         monkeypatch):
    import pyramidkv.benchmarks.reasoning.run as run

    real = run.main

    def tova_crashes(argv):
        if "tova" in argv and "--print_run_dir" not in argv:
            raise RuntimeError("tova broke")
        return real(argv)
    monkeypatch.setattr(run, "main", tova_crashes)
    assert main(_board(tiny_model_dir, tmp_path)) == 1
    assert "tova@48: RuntimeError: tova broke" in capsys.readouterr().err
    state = {(c["method"], c["task"]): (c["status"], c["error"]) for c in _csv(tmp_path)}
    assert state[("h2o", "chain")] == ("done", "")
    assert state[("tova", "gsm8k")] == ("failed", "RuntimeError: tova broke")
    assert "| `tova` | 48 | - | failed: RuntimeError: tova broke |" in (tmp_path / "reasoning.md").read_text()


def test_page_of_a_hand_written_csv(tmp_path):
    base = dict.fromkeys(reasoning_table.COLUMNS, "")
    rows = [{**base, "model": "m", "max_new_tokens": "96", "task": "chain", "method": "fullkv", "samples": "2",
             "accuracy": "50.0", "vs_fullkv": "0.0", "vs_fullkv_low": "0.0", "vs_fullkv_high": "0.0",
             "new_tokens": "96.0", "kl_vs_fullkv": "0.0", "departed": "0.0", "kv_bytes_peak": "2048",
             "kv_bytes_mean": "1536", "decode_tokens_per_s": "6.25", "decode_cpu_tokens_per_s": "6.0",
             "status": "done"},
            {**base, "model": "m", "max_new_tokens": "96", "task": "chain", "method": "h2o", "decode_budget": "64",
             "samples": "2", "accuracy": "0.0", "vs_fullkv": "-50.0", "vs_fullkv_low": "-100.0",
             "vs_fullkv_high": "0.0", "step_accuracy": "12.5", "new_tokens": "90.5", "kl_vs_fullkv": "0.01234", "departure_step": "3.5",
             "departed": "100.0", "reached": "50.0", "kv_bytes_peak": "1024", "kv_bytes_mean": "1000",
             "decode_tokens_per_s": "7.0",
             "decode_cpu_tokens_per_s": "6.5", "status": "done"}]
    reasoning_table.write(tmp_path, rows)
    assert reasoning_table.read_csv(tmp_path / "reasoning.csv") == rows
    page = (tmp_path / "reasoning.md").read_text()
    assert "| `fullkv` | - | 2 | - | 50.0 | - | - | 96.0 | 0.0000 | never (0%) | 2 | 2 | 6.2 (6.0) |" in page
    assert "| `h2o` | 64 | 2 | 50% | 0.0 | -50.0 [-100.0, 0.0] | 12.5 | 90.5 | 0.0123 | 3.5 (100%) | 1 | 1 | 7.0 (6.5) |" \
        in page
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="is not a reasoning board CSV: columns \\['a', 'b'\\]"):
        reasoning_table.read_csv(tmp_path / "other.csv")


def test_rerender_without_a_csv_is_refused(tmp_path, capsys):
    line = _refused(["--save_dir", str(tmp_path), "--rerender"], capsys)
    assert f"no {tmp_path / 'reasoning.csv'}: run the board first" in line


def test_reached_counts_the_problems_whose_fullkv_trace_outgrows_budget_plus_interval(tmp_path):
    """Hand-made rows: fullkv's traces hold 100 + 20 - 1 = 119, 100 + 29 - 1 = 128 and 100 + 28 - 1 = 127 tokens at
    their end; a budget of 96 with an interval of 32 (h2o's re-selection) is outgrown at 128 only: 1 of 3; tova's
    interval of 1 at 96: all 3; fullkv's own row has no budget, so nothing to reach."""
    def write_rows(folder, new_tokens):
        folder.mkdir()
        (folder / "chain.jsonl").write_text("".join(json.dumps(
            {"index": i, "correct": False, "new_tokens": n, "prompt_tokens": 100, "kl_vs_fullkv": 0.0,
             "departure_step": None, "kv_bytes_peak": 1, "kv_bytes_mean": 1, "decode_tokens_per_s": 1.0}) + "\n"
            for i, n in enumerate(new_tokens)))

    write_rows(tmp_path / "fullkv", [20, 29, 28])
    write_rows(tmp_path / "h2o", [200, 200, 200])       # its own traces are longer: not what `reached` reads
    write_rows(tmp_path / "tova", [5, 5, 5])
    units = [("fullkv", None, tmp_path / "fullkv"), ("h2o", 96, tmp_path / "h2o"), ("tova", 96, tmp_path / "tova")]
    rows = reasoning_table.cells("m", 300, {"chain": [0, 1, 2]}, units, {}, {("h2o", 96): 32, ("tova", 96): 1})
    assert [r["reached"] for r in rows] == [None, round(100 / 3, 2), 100.0]
    assert [r["reached"] for r in reasoning_table.cells("m", 300, {"chain": [0, 1, 2]}, units, {})] == [None] * 3


def test_the_committed_board_is_what_its_csv_gives():
    """docs/reasoning_board: the board at decode budget 512 on the default model (docs/reasoning.md)."""
    folder = Path(__file__).resolve().parents[2] / "docs" / "reasoning_board"
    rows = reasoning_table.read_csv(folder / "reasoning.csv")
    assert reasoning_table.page(rows) == (folder / "reasoning.md").read_text()
    assert {r["method"] for r in rows} == {"fullkv", *reasoning.BoardSettings.methods}
