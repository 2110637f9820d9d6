"""Needle runner and heatmaps end to end on a tiny random model: rows, results.json, PNG, resume, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyramidkv.viz import needle as visualize  # the module scripts/scripts_needle/visualize.py runs
from tests.helpers import ROOT, load_script

SCORE_KEYS = {"rouge1_f", "recall", "harness_rouge1_x10", "harness_word_recall"}
ROW_KEYS = {"key", "context_length", "depth_percent", "pred", "prompt_tokens", "kv_bytes", *SCORE_KEYS}


runner = load_script("run_needle_in_haystack", ROOT / "run_needle_in_haystack.py")


def _args(model_dir, save_dir, *extra, method=("--method", "snapkv", "--max_capacity_prompts", "64")):
    """The test grid's flags, those in `extra` replacing the defaults (a runner refuses a flag given twice)."""
    grid = {"--s_len": "400", "--e_len": "600", "--step": "200", "--num_depths": "3", "--max_new_tokens": "3"}
    defaults = [word for flag, value in grid.items() if flag not in extra for word in (flag, value)]
    return [*method, "--model_path", str(model_dir), "--device", "cpu", "--save_dir", str(save_dir), *defaults,
            *extra]


def _rows(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("needle")
    assert runner.main(_args(tiny_model_dir, save_dir, "--eval_batch_size", "2")) == 0
    return save_dir / f"{Path(tiny_model_dir).name}_64" / "snapkv"


def test_end_to_end_rows_and_results(finished_run):
    rows = _rows(finished_run / "needle.jsonl")
    meta = json.loads((finished_run / "run_meta.json").read_text())
    assert sorted(r["key"] for r in rows) == sorted(f"{n}_{d}" for n in (400, 600) for d in (0, 50, 100))
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["key"] == f"{r['context_length']}_{r['depth_percent']}"
        # Default length budget: haystack + needle <= L - 200, the template (68 tokens with SmolLM2's) on top.
        assert meta["template_tokens"] == 68
        assert r["context_length"] - 200 < r["prompt_tokens"] <= r["context_length"] - 200 + 68
        assert 0.0 <= r["rouge1_f"] <= 1.0 and 0.0 <= r["recall"] <= 1.0
        assert 0.0 <= r["harness_rouge1_x10"] <= 10.0 and 0.0 <= r["harness_word_recall"] <= 1.0
        # The public harness's scores, recomputed here from the answer (rouge_score directly; word sets by hand).
        from rouge_score import rouge_scorer

        expected = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True).score(
            "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
            r["pred"])["rouge1"].fmeasure * 10 if r["pred"] else 0.0
        assert r["harness_rouge1_x10"] == pytest.approx(expected)
        words = {"eat", "a", "sandwich", "and", "sit", "in", "dolores", "park", "on", "sunny", "day."}
        assert r["harness_word_recall"] == pytest.approx(len(words & set(r["pred"].lower().split())) / 11)
        assert r["kv_bytes"] > 0
    result = json.loads((finished_run / "results.json").read_text())
    assert result["benchmark"] == "needle" and result["method"] == "snapkv" and result["budget"] == 64
    assert set(result["scores"]) == SCORE_KEYS
    assert result["num_samples"] == {k: 6 for k in SCORE_KEYS}
    mean = 100 * sum(r["rouge1_f"] for r in rows) / len(rows)
    assert result["scores"]["rouge1_f"] == pytest.approx(mean, abs=0.01)
    # Every score is a percent of its full scale: harness_rouge1_x10 (0..10) is divided by 10.
    mean_x10 = 10 * sum(r["harness_rouge1_x10"] for r in rows) / len(rows)
    assert result["scores"]["harness_rouge1_x10"] == pytest.approx(mean_x10, abs=0.01)
    # The average is one named metric (recall over the cells), never a mean across metrics.
    assert result["average_metric"] == "recall"
    assert result["average"] == pytest.approx(100 * sum(r["recall"] for r in rows) / len(rows), abs=0.01)
    assert meta["context_lengths"] == [400, 600] and meta["depth_percents"] == [0, 50, 100]
    assert meta["method"]["budget"] == 64


def test_heatmap_png(finished_run, tmp_path):
    import matplotlib.image as mpimg

    out = tmp_path / "heat.png"
    assert visualize.main([str(finished_run), "--out", str(out), "--annotate"]) == 0
    image = mpimg.imread(out)
    assert image.shape[:2] == (600, 900)          # 9 x 6 inches at 100 dpi
    assert image.shape[2] in (3, 4) and image.std() > 0.01
    # Default output path, other metrics (the public harness's scores too).
    assert visualize.main([str(finished_run), "--metric", "recall"]) == 0
    assert mpimg.imread(finished_run / "needle_recall.png").shape[:2] == (600, 900)
    for metric in ("harness_rouge1_x10", "harness_word_recall"):
        assert visualize.main([str(finished_run), "--metric", metric, "--annotate"]) == 0
        assert mpimg.imread(finished_run / f"needle_{metric}.png").shape[:2] == (600, 900)


def test_heatmap_colour_scale_follows_the_metric(finished_run):
    """harness_rouge1_x10 is 0..10: a 5.0 cell is the middle colour (#EBB839), as 0.5 is for 0..1 scores."""
    import matplotlib.pyplot as plt

    run = visualize.Run(finished_run, "harness_rouge1_x10")
    fig, ax = plt.subplots()
    image = visualize._draw(ax, run, annotate=False)
    assert image.get_clim() == (0.0, 10.0)
    assert visualize._draw(ax, visualize.Run(finished_run, "recall"), annotate=False).get_clim() == (0.0, 1.0)
    plt.close(fig)


def test_visualize_bad_metric(finished_run, capsys):
    with pytest.raises(SystemExit):
        visualize.main([str(finished_run), "--metric", "rouge"])
    assert "invalid choice: 'rouge'" in capsys.readouterr().err


def test_grid_png(finished_run, tiny_model_dir, tmp_path):
    import matplotlib.image as mpimg

    save_dir = finished_run.parents[1]
    assert runner.main(_args(tiny_model_dir, save_dir, method=("--method", "fullkv"))) == 0
    full = save_dir / f"{Path(tiny_model_dir).name}_full" / "fullkv"
    out = tmp_path / "grid.png"
    assert visualize.main(["--grid", str(finished_run), str(full), "--out", str(out)]) == 0
    assert mpimg.imread(out).shape[:2] == (500, 1100)   # 2 panels x 5 in + 1 in, 5 in high, 100 dpi
    # A parent folder is searched for runs; the default output lands in it.
    assert visualize.main(["--grid", str(save_dir)]) == 0
    assert mpimg.imread(save_dir / "needle_grid_rouge1_f.png").shape[:2] == (500, 1100)
    runs = visualize.find_runs([save_dir])
    assert {r.name for r in runs} == {"snapkv", "fullkv"}


def test_visualize_script_is_a_shim_of_the_module(finished_run, tmp_path):
    """The script draws through pyramidkv.viz.needle, in a fresh process (no display needed)."""
    out = tmp_path / "shim.png"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "scripts_needle" / "visualize.py"), str(finished_run),
                           "--out", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert out.is_file() and done.stdout.strip() == str(out)


def test_visualize_errors(tmp_path, capsys):
    assert visualize.main([str(tmp_path)]) == 2
    assert "needle.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        visualize.main([])


def test_resume_skips_finished_cells(tiny_model_dir, tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, "--e_len", "400", "--num_depths", "2")
    assert runner.main(args) == 0
    path = tmp_path / f"{Path(tiny_model_dir).name}_64" / "snapkv" / "needle.jsonl"
    first = _rows(path)
    assert [r["key"] for r in first] == ["400_0", "400_100"]
    # Rerun: nothing new, no duplicates, rows untouched.
    capsys.readouterr()
    assert runner.main(args) == 0
    assert _rows(path) == first
    assert "all 2 sample(s) already done" in capsys.readouterr().out
    # A run killed mid-write leaves a cut-off line: it is dropped and that cell redone.
    path.write_text(path.read_text().splitlines()[0] + "\n" + '{"key": "400_1', encoding="utf-8")
    assert runner.main(args) == 0
    assert sorted(r["key"] for r in _rows(path)) == ["400_0", "400_100"]
    # A bigger grid only adds its new cells.
    assert runner.main(_args(tiny_model_dir, tmp_path, "--num_depths", "2")) == 0
    keys = [r["key"] for r in _rows(path)]
    assert sorted(keys) == ["400_0", "400_100", "600_0", "600_100"] and len(keys) == len(set(keys))
    result = json.loads((path.parent / "results.json").read_text())
    assert result["num_samples"]["recall"] == 4


@pytest.mark.parametrize("extra, message", [
    (("--s_len", "800", "--e_len", "600"), "s_len"),
    (("--step", "0"), "step"),
    (("--e_len", "9000"), "context window"),
    (("--s_len", "100"), "too short"),
    (("--num_depths", "0"), "num_depths"),
    (("--length_budget", "whole"), "invalid choice: 'whole' (choose from 'context', 'prompt')"),
    # 8192 - 200 + 68 template tokens = 8060-token prompts, + 200 new tokens > the tiny model's 8192 window.
    (("--s_len", "8000", "--e_len", "8192", "--step", "192", "--max_new_tokens", "200"),
     "exceed the model's context window (8192); use --e_len <= 8124"),
])
def test_bad_grid(tiny_model_dir, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        runner.main(_args(tiny_model_dir, tmp_path, *extra))
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.rglob("needle.jsonl"))


def test_bad_haystack_dir(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        runner.main(_args(tiny_model_dir, tmp_path, "--haystack_dir", str(tmp_path / "missing")))
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        runner.main(_args(tiny_model_dir, tmp_path, "--haystack_dir", str(tmp_path / "empty")))
    assert "no .txt files" in capsys.readouterr().err


def test_custom_haystack_and_model_version(tiny_model_dir, tmp_path):
    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "one.txt").write_text("Water boils at one hundred degrees. Ice melts at zero. " * 20, encoding="utf-8")
    args = _args(tiny_model_dir, tmp_path / "out", "--haystack_dir", str(hay), "--model_version", "tiny-v1",
                 "--e_len", "400", "--num_depths", "1", "--length_budget", "prompt")
    assert runner.main(args) == 0
    run = tmp_path / "out" / "tiny-v1_64" / "snapkv"
    assert [r["key"] for r in _rows(run / "needle.jsonl")] == ["400_50"]
    # --length_budget prompt: the whole prompt within 400 - 200 (the sentences are at most 7 tokens, so >= 193).
    assert 193 <= _rows(run / "needle.jsonl")[0]["prompt_tokens"] <= 200
    assert json.loads((run / "results.json").read_text())["model"] == "tiny-v1"
    assert json.loads((run / "run_meta.json").read_text())["haystack_dir"] == str(hay)


def test_eval_sh(tiny_model_dir, tmp_path):
    """The shell entry point: positional arguments in the public harness's order, then the heatmap."""
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "scripts" / "scripts_needle" / "eval.sh"), "0", "SnapKV", "64", "sdpa",
           str(tiny_model_dir), "400", "400", "100", "--num_depths", "2", "--max_new_tokens", "2",
           "--save_dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # eval.sh passes the public harness's window (8): a non-default setting, so it is in the folder name.
    run = tmp_path / f"{Path(tiny_model_dir).name}_64" / "snapkv_window_size=8"
    assert len(_rows(run / "needle.jsonl")) == 2
    assert (run / "needle_rouge1_f.png").is_file()
