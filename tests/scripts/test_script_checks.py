"""Scripts check every value before any work (issue 25): one line `<script>: error: ...`, exit status 2, no
model loaded, nothing run; the sweep reads paths from the caller's folder and the SLURM count checks the grid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script, stand_in_python


SCRIPTS = {name: load_script(name, ROOT / path) for name, path in (
    ("minference_patterns", "scripts/minference_patterns.py"), ("benchmark_quest", "measure/benchmark_quest.py"),
    ("benchmark_minference", "measure/benchmark_minference.py"), ("calibrate_qfilter", "scripts/calibrate_qfilter.py"),
    ("calibrate_duo", "scripts/calibrate_duo.py"), ("calibrate_kvzap", "scripts/calibrate_kvzap.py"),
    ("kvzip_head_scores", "scripts/kvzip_head_scores.py"))}


def one_line_error(name: str, argv, capsys, monkeypatch) -> str:
    """The error of a script's main(argv), run in this process with loading the model failing the test."""
    import pyramidkv.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    monkeypatch.setattr(SCRIPTS[name], "load_model", loading.load_model, raising=False)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[name].main(list(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"{name}.py: error: "), err
    return err


@pytest.mark.parametrize("argv, says", [
    (["--out", "/no/such/folder/patterns.json"], "'/no/such/folder' does not exist"),
    (["--out", "{tmp}"], "is a folder"),
    (["--out", "{tmp}/p.json", "--selection", "cheapest", "--min_recall", "1.5"], "--min_recall 1.5"),
    (["--out", "{tmp}/p.json", "--selection", "cheapest", "--min_recall", "nan"], "'nan'"),
    (["--out", "{tmp}/p.json", "--min_recall", "0.9"], "only applies with --selection cheapest"),
    (["--out", "{tmp}/p.json", "--threads", "0"], "--threads 0"),
    (["--out", "{tmp}/p.json", "--context_length", "10"], "--context_length 10"),
    (["--out", "{tmp}/p.json", "--context_length", "100000"], "above the model's window"),
    (["--out", "{tmp}/p.json", "--rows_from", "5000", "--context_length", "2048"], "--rows_from 5000"),
    (["--out", "{tmp}/p.json", "--min_rec", "0.5"], "unrecognized arguments: --min_rec"),
    (["--out", "{tmp}/p.json", "--threads", "1", "--threads", "2"], "--threads 1 and --threads 2"),
])
def test_minference_patterns_refuses_bad_values_at_once(argv, says, tmp_path, capsys, monkeypatch):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert says in one_line_error("minference_patterns", argv, capsys, monkeypatch)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("argv, says", [
    (["--tasks", "passkey", "--lengths", "10"], "--lengths 10: length 10 is too short for the pass-key task"),
    (["--tasks", "niah_single_1", "--lengths", "10"], "--lengths 10"),
    (["--tasks", "nope", "--lengths", "512"], "unknown RULER task 'nope'"),
    (["--lengths", "0"], "--lengths 0"),
    (["--num_samples", "0"], "--num_samples 0"),
    (["--batch_size", "0"], "--batch_size 0"),
    (["--threads", "٢"], "'٢'"),
    (["--methods", "snapkvv"], "unknown method 'snapkvv'"),
    (["--methods", "fullkv"], "--methods fullkv with --budgets 64"),
    (["--out", "/no/such/folder/q.json"], "does not exist"),
])
def test_benchmark_quest_refuses_bad_values_before_the_model_loads(argv, says, capsys, monkeypatch):
    assert says in one_line_error("benchmark_quest", argv, capsys, monkeypatch)


@pytest.mark.parametrize("argv, says", [
    (["--lengths", "10"], "--lengths 10"),
    (["--task", "nope", "--lengths", "512"], "unknown RULER task 'nope'"),
    (["--method", "snapkv"], "--method snapkv"),
    (["--method", "snapkv:budget=x"], "'x'"),
    (["--method", "snapkv:budget=64"], "no sparse prefill"),
    (["--num_samples", "0"], "--num_samples 0"),
    (["--threads", "0"], "--threads 0"),
    (["--out", "/no/such/folder/m.json"], "does not exist"),
    # issue 40: a pattern table made for another model (a traceback once the model had loaded)
    (["--method", "minference:pattern_table={table}"], "pattern table {table}: expected a list of one"),
])
def test_benchmark_minference_refuses_bad_values_before_the_model_loads(argv, says, capsys, monkeypatch, tmp_path):
    table = tmp_path / "patterns.json"
    table.write_text('{"0": [["vertical_and_slash", 100, 800, 1]]}')
    argv = [a.replace("{table}", str(table)) for a in argv]
    assert says.replace("{table}", str(table)) in one_line_error("benchmark_minference", argv, capsys, monkeypatch)


# --- issue 40, item 7: the calibration scripts check every input before the work, and lose none of it ---------

@pytest.fixture
def gemma2_dir(tmp_path, smollm2_path) -> str:
    """A Gemma2 model folder (config and SmolLM2's tokenizer, no weights: the check comes before they load)."""
    from transformers import AutoTokenizer, Gemma2Config

    out = tmp_path / "gemma2"
    Gemma2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=256).save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("name, argv, says", [
    # IsADirectoryError once calibrated; a folder with no writable place, checked now, not when writing
    ("calibrate_qfilter", ["--out", "{tmp}"], "is a folder; give a file path"),
    ("calibrate_qfilter", ["--out", "/proc/q.safetensors"], "/proc/q.safetensors cannot be written: /proc takes no"),
    ("calibrate_qfilter", ["--length", "10"], "fewer than the --num_svd_samples 3000 each head's SVD reads; give "
                                               "--length >= 1500"),
    ("calibrate_duo", ["--out", "/proc/nope"], "/proc/nope cannot be written: /proc takes no new folder"),
    ("calibrate_duo", ["--out", "{file}"], "is a file; give the path of a folder"),
    ("calibrate_duo", ["--out", "{file}/sub"], "is a file, not a folder"),
    # exited 0 with an artifact made from the other sources alone, its record naming the missing folder
    ("calibrate_kvzap", ["--model_type", "linear", "--out", "{tmp}/k.safetensors", "--haystack_dir", "/nonexistent"],
     "--haystack_dir /nonexistent: no such folder; give a folder of .txt files"),
    ("calibrate_kvzap", ["--model_type", "linear", "--out", "{tmp}/k.safetensors", "--haystack_dir", "{tmp}"],
     "no .txt files"),
    ("calibrate_kvzap", ["--model_type", "linear", "--out", "/proc/k.safetensors"], "cannot be written"),
    ("kvzip_head_scores", ["--out", "{tmp}"], "is a folder; give a file path"),
    # a traceback after loading the model; the runners refuse kvzip on it in one line
    ("kvzip_head_scores", ["--model_path", "{gemma2}"], "kvzip does not support sliding-window layers"),
])
def test_calibration_scripts_refuse_bad_values_before_the_model_loads(name, argv, says, capsys, monkeypatch, tmp_path,
                                                                     request):
    (tmp_path / "a_file").write_text("x")
    values = {"{tmp}": str(tmp_path), "{file}": str(tmp_path / "a_file")}
    if "{gemma2}" in argv:
        values["{gemma2}"] = request.getfixturevalue("gemma2_dir")
    for key, value in values.items():
        argv = [a.replace(key, value) for a in argv]
    assert says in one_line_error(name, argv, capsys, monkeypatch)


def fake_python(folder) -> str:
    """A stand-in interpreter printing the folder it runs in and its arguments (the grid's check, run_dirs.py,
    runs for real)."""
    return stand_in_python(folder, 'echo "$PWD $*"')


def test_sweep_reads_a_relative_save_dir_from_the_callers_folder(tmp_path):
    got = subprocess.run(["bash", str(ROOT / "scripts" / "sweep.sh"), "ruler", "out", "--data_dir", "data"],
                         cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHON": fake_python(tmp_path), "METHODS": "snapkv", "BUDGETS": "64",
                              "FULLKV": "0"})
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    # the grid check, the run, the summary: each from the caller's folder, so "out" is tmp_path/out
    assert lines[-2] == f"{tmp_path} {ROOT}/run_ruler.py --method snapkv --max_capacity_prompts 64 --save_dir out " \
                        f"--data_dir data"
    assert lines[-1] == f"{tmp_path} {ROOT}/scripts/summarize_results.py out"


def test_slurm_count_checks_every_run_of_the_grid(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "METHODS": "snapkv", "BUDGETS": "64",
           "VARIANTS": "-|--merge_fraction 2", "FULLKV": "0"}
    got = subprocess.run(["bash", "scripts/slurm/sweep.sbatch", "--count", "ruler", str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 2 and "tasks" not in got.stdout
    assert "invalid run 'snapkv 64|--merge_fraction 2'" in got.stderr and "1 of 2 runs" in got.stderr
    # An array task of that grid runs nothing either, not even its own valid run.
    got = subprocess.run(["bash", "scripts/slurm/sweep.sbatch", "ruler", str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True, env={**env, "SLURM_ARRAY_TASK_ID": "0"}, timeout=300)
    assert got.returncode == 2 and "1 of 2 runs" in got.stderr and not (tmp_path / "out").exists()
    # Without the benchmark and its arguments there is nothing to check: the usage.
    got = subprocess.run(["bash", "scripts/slurm/sweep.sbatch", "--count"], cwd=ROOT, capture_output=True, text=True,
                         env=env)
    assert got.returncode == 2 and "--count ruler results/ruler" in got.stdout


def test_run_dirs_checks_each_run_as_its_runner_would(tmp_path, capsys, monkeypatch):
    """scripts/run_dirs.py (the sweep's one-process grid check): per run the folder --print_run_dir prints, or the
    runner's own one-line error, in order; a malformed input is refused."""
    import io

    from pyramidkv.benchmarks.ruler.run import main as ruler_main

    run_dirs = load_script("run_dirs", ROOT / "scripts" / "run_dirs.py")
    good = ["--method", "snapkv", "--max_capacity_prompts", "64", "--save_dir", str(tmp_path), "--print_run_dir"]
    bad = ["--method", "snapkv", "--max_capacity_prompts", "0", "--save_dir", str(tmp_path), "--print_run_dir"]
    assert run_dirs.parse_runs(b"2\0a\0\0" b"0\0" b"1\0c d\0") == [["a", ""], [], ["c d"]]
    for malformed in (b"2\0a\0", b"x\0", b"1\0a"):
        with pytest.raises(ValueError):
            run_dirs.parse_runs(malformed)

    data = b"".join(f"{len(run)}\0".encode() + b"".join(a.encode() + b"\0" for a in run) for run in (good, bad))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert run_dirs.main(["ruler"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the reference: the runner itself, one run at a time
    assert ruler_main(good) == 0
    assert lines[0] == f"ok\t{capsys.readouterr().out.strip()}"
    with pytest.raises(SystemExit):
        ruler_main(bad)
    assert lines[1] == f"error\t{capsys.readouterr().err.strip().splitlines()[-1]}"
    assert "max_capacity_prompts" in lines[1] and len(lines) == 2
    assert run_dirs.main(["bogus"]) == 2 and "unknown benchmark 'bogus'" in capsys.readouterr().err
