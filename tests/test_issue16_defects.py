"""Every bad input of issue 16, refused with one line before the model loads (or, through the API, clearly).
Each case reproduces a defect of the code before the run protocol: a traceback, a silent acceptance, or a
crash inside transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.benchmarks.ruler.run import main as ruler_main

ROOT = Path(__file__).resolve().parents[1]


def _ruler_data(folder: Path, words: int = 12) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "niah_single_1_256.jsonl"
    text = " ".join(["word"] * words)
    rows = [{"index": i, "input": f"{text} The magic number is {n}. Repeat it:", "outputs": [str(n)],
             "length": 40, "max_new_tokens": 2} for i, n in enumerate((4711, 2024))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    import pyramidkv.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded before the error"))


def _refused(argv, capsys, tmp_path, code: int = 2) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ruler_main(argv)
    assert exc.value.code == code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("run_ruler.py: error: "), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.json*"))
    return lines[0]


def _argv(model, tmp_path, *extra, method=("--method", "snapkv", "--max_capacity_prompts", "8", "--window_sizes", "4")):
    return ["--model_path", str(model), *method, "--data_file", str(_ruler_data(tmp_path / "data")), "--save_dir",
            str(tmp_path / "out"), "--device", "cpu", *extra]


# --- HeadKV tables: validated before anything is written, content hash in the fingerprint ---------------

def _table(tmp_path: Path, content) -> str:
    path = tmp_path / "table.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


GRID = {f"{l}-{h}": [1.0] for l in range(2) for h in range(4)}
BAD_TABLES = {
    "missing": (lambda tmp: str(tmp / "nope.json"), "cannot be read"),
    "folder": (lambda tmp: str(tmp), "cannot be read"),
    "empty": (lambda tmp: _table(tmp, ""), "not a complete JSON object"),
    "truncated": (lambda tmp: _table(tmp, '{"0-0": [1.0], "0-1"'), "not a complete JSON object"),
    "wrong_shape": (lambda tmp: _table(tmp, {"0-0": [1.0], "0-1": [2.0]}), "have shape"),
    "empty_lists": (lambda tmp: _table(tmp, {**GRID, "0-0": []}), "non-empty list"),
    "nan": (lambda tmp: _table(tmp, json.dumps(GRID).replace("[1.0]", "[NaN]", 1)), "finite numbers"),
    "inf": (lambda tmp: _table(tmp, json.dumps(GRID).replace("[1.0]", "[Infinity]", 1)), "finite numbers"),
    "all_zero": (lambda tmp: _table(tmp, {k: [0.0] for k in GRID}), "every head scores 0"),
    "strings": (lambda tmp: _table(tmp, {**GRID, "1-1": ["high"]}), "finite numbers"),
    "bad_keys": (lambda tmp: _table(tmp, {**GRID, "layer0": [1.0]}), "is not 'layer-head'"),
    "negative": (lambda tmp: _table(tmp, {**GRID, "0-0": [-5.0]}), "finite numbers >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_bad_head_tables_are_refused_before_anything_is_written(case, tiny_model_dir, tmp_path, capsys,
                                                                 no_model_load):
    make, message = BAD_TABLES[case]
    line = _refused(_argv(tiny_model_dir, tmp_path, "--head_path", make(tmp_path),
                          method=("--method", "headkv", "--max_capacity_prompts", "8", "--window_sizes", "4")),
                    capsys, tmp_path)
    assert message in line
    assert not (tmp_path / "out").exists()


def test_negative_head_scores_never_invert_the_allocation(tmp_path):
    from pyramidkv.allocation.head_tables import load_head_scores

    with pytest.raises(ValueError, match="finite numbers >= 0"):
        load_head_scores(_table(tmp_path, {**GRID, "0-0": [-5.0]}))


def test_a_fixed_table_resumes_and_the_table_content_is_fingerprinted(tiny_model_dir, tmp_path, capsys):
    bad = _table(tmp_path, {**GRID, "0-0": [-1.0]})
    argv = _argv(tiny_model_dir, tmp_path, "--head_path", bad,
                 method=("--method", "headkv", "--max_capacity_prompts", "8", "--window_sizes", "4"))
    with pytest.raises(SystemExit):
        ruler_main(argv)
    Path(bad).write_text(json.dumps({**GRID, "0-0": [3.0]}))            # fixed in place
    assert ruler_main(argv) == 0
    Path(bad).write_text(json.dumps({**GRID, "0-0": [2.0]}))            # another table under the same path
    with pytest.raises(SystemExit):
        ruler_main(argv)
    assert "input file head_scores=" in capsys.readouterr().err


# --- settings that would not do what the folder name says ----------------------------------------------

def test_ratio_budget_below_the_window_is_refused(tiny_model_dir, tmp_path, capsys, no_model_load):
    """Exit status 3, not 2: the method does not fit this prompt (a sweep marks the cell n/a, runner/cli.py)."""
    line = _refused(_argv(tiny_model_dir, tmp_path, method=("--method", "snapkv", "--max_capacity_prompts_ratio",
                                                            "0.01", "--window_sizes", "4")), capsys, tmp_path, code=3)
    assert "budget_ratio (max_capacity_prompts_ratio) 0.01 gives round(0.01 x" in line and "below the 4" in line


def test_skip_layers_at_the_layer_count_is_refused(tiny_model_dir, tmp_path, capsys, no_model_load):
    line = _refused(_argv(tiny_model_dir, tmp_path, "--skip_layers", "2",
                          method=("--method", "l2norm", "--max_capacity_prompts", "8")), capsys, tmp_path)
    assert "--skip_layers 2" in line and "skip_layers 2 leaves none of the model's 2 layers compressed" in line


def test_pooling_kernel_wider_than_the_prompt_is_refused(tiny_model_dir, tmp_path, capsys, no_model_load):
    line = _refused(_argv(tiny_model_dir, tmp_path, "--kernel_sizes", "101"), capsys, tmp_path, code=3)
    assert "kernel_size 101 is wider than the prompt" in line and "every score ties" in line


@pytest.mark.parametrize("flags, message", [
    (["--quant_method", "kivi", "--q_group_size", "1", "--quant_residual_length", "0"],
     "kivi: these settings store 4.25 bytes per quantized key/value entry"),
    (["--quant_method", "gear", "--quant_rank", "1000", "--q_group_size", "16", "--quant_residual_length", "0"],
     "gear: rank 1000 is above the head dim 16"),
    (["--quant_method", "kvquant", "--quant_sink_tokens", "8", "--q_group_size", "16"],
     "sink_tokens 8 covers every one of the 8 prompt tokens"),
    (["--quant_method", "kvquant", "--quant_outlier_fraction", "0.99", "--q_group_size", "16"],
     "more than the 4 bytes of the unquantized cache"),
    (["--quant_method", "gear", "--quant_outlier_fraction", "0.99", "--q_group_size", "16",
      "--quant_residual_length", "0"], "more than the 4 bytes of the unquantized cache"),
    (["--quant_method", "kivi", "--q_group_size", "12", "--quant_residual_length", "0"],
     "group_size 12 does not divide head_dim 16"),
])
def test_quantizer_settings_that_defeat_quantization_are_refused(flags, message, tiny_model_dir, tmp_path, capsys,
                                                                 no_model_load):
    assert message in _refused(_argv(tiny_model_dir, tmp_path, *flags), capsys, tmp_path)


@pytest.mark.parametrize("flags, message", [
    (["--decode_interval", "32"], "decode_interval=32 has no effect without decode_budget"),
    (["--merge", "cam", "--merge_seed", "3"], "seed=3 has no effect without"),
    (["--merge", "cam", "--merge_sampling", "--merge_seed", str(2 ** 64)], "seed must be an integer in [0, 2**64)"),
    (["--seed", "1", "--merge", "cam", "--sampling", "--quant_seed", "1"], "quant_seed is a setting of the quantizer"),
])
def test_settings_that_do_nothing_or_cannot_work_are_refused(flags, message, tiny_model_dir, tmp_path, capsys,
                                                             no_model_load):
    line = _refused(_argv(tiny_model_dir, tmp_path, *flags), capsys, tmp_path)
    assert message in line and flags[-2] in line


def test_a_merge_seed_near_64_bits_runs():
    method = make_method("snapkv", budget=64, merge="cam", merge_sampling=True, merge_seed=2 ** 64 - 1)
    assert 0 <= method.merge.seed_for(29) < 2 ** 64
    torch.Generator().manual_seed(method.merge.seed_for(29))


def test_spelled_out_defaults_resume_the_same_folder(tiny_model_dir, tmp_path, capsys):
    base = _argv(tiny_model_dir, tmp_path, "--quant_method", "kivi", "--q_group_size", "16",
                 "--quant_residual_length", "0", "--num_threads", "1")
    assert ruler_main(base) == 0
    capsys.readouterr()
    assert ruler_main([*base, "--nbits", "2"]) == 0                    # kivi's default, spelled out
    assert "already done; scoring only" in capsys.readouterr().out
    spec = "snapkv:budget=8,window_size=4,quant_method=kivi,nbits=2,group_size=16,residual_length=0"
    assert ruler_main(["--model_path", str(tiny_model_dir), "--method", spec, *base[8:14]]) == 0
    assert "already done; scoring only" in capsys.readouterr().out


def test_an_old_run_folder_resumes(tiny_model_dir, tmp_path, capsys):
    """A run_meta.json written before the method spec (method flags among the arguments) still resumes."""
    argv = _argv(tiny_model_dir, tmp_path, "--num_threads", "1")
    assert ruler_main(argv) == 0
    run = next((tmp_path / "out").glob("*/snapkv_window_size=4"))
    meta = json.loads((run / "run_meta.json").read_text())
    arguments = meta["fingerprint"]["arguments"]
    arguments.update({"method": "snapkv", "max_capacity_prompts": 8, "window_sizes": 4, "kernel_sizes": None,
                      "pooling": None, "merge": None, "quant_method": None, "nbits": None, "decode_interval": None})
    arguments.pop("print_run_dir", None)
    (run / "run_meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert ruler_main(argv) == 0
    assert "already done; scoring only" in capsys.readouterr().out


def test_max_length_shorter_than_the_template_is_refused(tiny_model_dir, tmp_path, capsys):
    from pyramidkv.benchmarks.longbench import run as longbench
    from tests.helpers import longbench_data_dir

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        longbench.main(["--method", "fullkv", "--model_path", tiny_model_dir, "--device", "cpu", "--data_dir",
                        str(longbench_data_dir()), "--datasets", "multi_news", "--max_num_examples", "1",
                        "--max_length", "2", "--save_dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "--max_length 2 is shorter than" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- the API -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from pyramidkv import load_model

    return load_model(tiny_model_dir, device="cpu")


def test_reusing_a_compressed_cache_is_refused_clearly(tiny):
    model, _ = tiny
    ids = torch.arange(10, 50)[None]
    with compress(model, make_method("snapkv", budget=16, window_size=4)) as patch:
        cache = patch.new_cache()
        model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=2)
        with pytest.raises(ValueError, match="already holds a prompt .* serves one generate"):
            model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=2)


def test_use_cache_false_inside_compress_warns(tiny):
    from pyramidkv.models.patch import UncompressedWarning

    model, _ = tiny
    with compress(model, make_method("snapkv", budget=16, window_size=4)):
        with pytest.warns(UncompressedWarning, match="nothing is compressed"):
            model.generate(torch.arange(10, 30)[None], max_new_tokens=1, do_sample=False, use_cache=False,
                           pad_token_id=2)


def test_mixing_text_and_token_id_prompts_is_refused(tiny):
    from pyramidkv.generation import generate

    model, tokenizer = tiny
    with pytest.raises(ValueError, match=r"prompts mix text \(prompt 0\) and token ids \(prompt 1\)"):
        generate(model, tokenizer, ["hello there", [5, 6, 7]], make_method("fullkv"), max_new_tokens=1)


# --- scripts ----------------------------------------------------------------------------------------

def _script(*argv, timeout=300):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("flag", ["--context_length", "--new_tokens", "--repeats"])
def test_latency_benchmark_refuses_zero_counts(flag, tiny_model_dir):
    got = _script("measure/benchmark_latency_memory.py", "--model_path", tiny_model_dir, flag, "0")
    assert got.returncode == 2 and "Traceback" not in got.stderr and f"{flag} must be >= 1, got 0" in got.stderr


def test_head_scores_checks_before_loading(tiny_model_dir, tmp_path):
    got = _script("scripts/head_scores.py", "--model_path", tiny_model_dir, "--context_lengths", "50")
    assert got.returncode != 0 and "Traceback" not in got.stderr
    assert "--context_lengths (shortest) 50 is too short" in got.stderr and "--s_len" not in got.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    got = _script("scripts/head_scores.py", "--model_path", tiny_model_dir, "--haystack_dir", str(empty))
    assert "Traceback" not in got.stderr and "has no .txt files" in got.stderr
    got = _script("scripts/head_scores.py", "--model_path", tiny_model_dir, "--dtype", "float8")
    assert got.returncode == 2 and "invalid choice: 'float8'" in got.stderr


@pytest.mark.parametrize("script, argv", [
    ("examples/batch_generate.py", ["--method", "snapkvv"]),
    ("examples/batch_generate.py", ["--budget", "0"]),
    ("examples/sweep_and_plot.py", ["--budgets", "-4"]),
    ("examples/custom_method.py", ["--budget", "0"]),
    ("examples/see_what_it_keeps.py", ["--budget", "0"]),
    ("scripts/quickstart.py", ["--budget", "0"]),
])
def test_examples_refuse_a_bad_method_or_budget_in_one_line(script, argv):
    got = _script(script, *argv)
    assert got.returncode == 2 and "Traceback" not in got.stderr and "error:" in got.stderr


def test_teacher_forced_nll_needs_its_data_file(tiny_model_dir):
    got = _script("measure/teacher_forced_nll.py", "--model_path", tiny_model_dir)
    assert got.returncode == 2 and "--data_file" in got.stderr
    assert "/work/shared" not in (ROOT / "measure" / "teacher_forced_nll.py").read_text()


def test_no_script_imports_another_through_sys_path():
    offenders = [str(p.relative_to(ROOT)) for folder in ("scripts", "measure", "examples") for p in (ROOT / folder).rglob("*.py")
                 if "sys.path" in p.read_text(encoding="utf-8")]
    assert not offenders, offenders


# --- a sweep is checked whole before its first run ------------------------------------------------------

def test_a_sweep_with_one_invalid_variant_runs_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "METHODS": "snapkv",
           "BUDGETS": "64", "VARIANTS": "-|--merge_fraction 0.5", "FULLKV": "0"}
    got = subprocess.run(["bash", "scripts/sweep.sh", "ruler", str(tmp_path / "out"), "--model_path", "smollm2-135m"],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode != 0 and "merge_fraction" in got.stderr and "1 of 2 runs of the sweep have invalid arguments" in got.stderr
    assert not (tmp_path / "out").exists()
