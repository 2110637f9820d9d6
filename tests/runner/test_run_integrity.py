"""A published number must come from the configuration it claims: resume guards, duplicates, locks,
early checks, unreadable inputs. Each test drives a runner's CLI and checks files and messages."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyramidkv.benchmarks.longbench import run as longbench
from pyramidkv.benchmarks.ruler.run import main as ruler_main
from tests.helpers import ROOT, load_script, longbench_data_dir

MULTI_NEWS = longbench_data_dir() / "multi_news.jsonl"


needle = load_script("run_needle_in_haystack_integrity", ROOT / "run_needle_in_haystack.py")


def _ruler_data(folder: Path) -> Path:
    """Two short RULER-format samples that decode in a second (4 new tokens each)."""
    path = folder / "niah_single_1_256.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"index": i, "input": f"The magic number is {n}. Repeat it: the magic number is",
             "outputs": [str(n)], "length": 40, "max_new_tokens": 4} for i, n in enumerate((4711, 2024))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ruler(model, data: Path, save: Path, *extra, method=("--method", "snapkv", "--max_capacity_prompts", "64")):
    return ["--model_path", str(model), *method, "--data_file", str(data), "--save_dir", str(save),
            "--device", "cpu", "--num_threads", "1", *extra]


def _exit(main, argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# --- item 1: a rerun with other settings never reuses old predictions -----------------------------

def test_ruler_rerun_with_other_settings_is_refused_or_gets_its_own_folder(tmp_path, capsys):
    data = _ruler_data(tmp_path / "data")
    save = tmp_path / "out"
    assert ruler_main(_ruler("smollm2-135m", data, save)) == 0
    run = save / "smollm2-135m_64" / "snapkv"           # the public layout for a method at its defaults
    meta_before = (run / "run_meta.json").read_bytes()
    preds_before = (run / "niah_single_1_256.jsonl").read_bytes()

    # A setting the folder name does not carry: refused, naming it; nothing rewritten.
    for flag in (["--no_chat_template"], ["--dtype", "bfloat16"], ["--attn_implementation", "eager"]):
        err = _exit(ruler_main, _ruler("smollm2-135m", data, save, *flag), capsys)
        assert flag[0].lstrip("-") in err and "--overwrite" in err and "scoring only" not in err
        assert (run / "run_meta.json").read_bytes() == meta_before
        assert (run / "niah_single_1_256.jsonl").read_bytes() == preds_before

    # A method setting: its own folder, its own predictions.
    capsys.readouterr()
    assert ruler_main(_ruler("smollm2-135m", data, save, "--window_sizes", "8", "--pooling", "avg")) == 0
    assert "scoring only" not in capsys.readouterr().out
    other = save / "smollm2-135m_64" / "snapkv_window_size=8_pooling=avg"
    assert json.loads((other / "run_meta.json").read_text())["method"]["window_size"] == 8
    assert len((other / "niah_single_1_256.jsonl").read_text().splitlines()) == 2
    assert (run / "run_meta.json").read_bytes() == meta_before

    # Same settings again: a plain resume; --overwrite replaces the old configuration.
    capsys.readouterr()
    assert ruler_main(_ruler("smollm2-135m", data, save)) == 0
    assert "scoring only" in capsys.readouterr().out
    assert ruler_main(_ruler("smollm2-135m", data, save, "--no_chat_template", "--overwrite")) == 0
    assert json.loads((run / "run_meta.json").read_text())["arguments"]["no_chat_template"] is True


def test_other_model_files_under_the_same_name_are_refused(tiny_model_dir, tmp_path, capsys):
    from transformers import LlamaForCausalLM

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    data = _ruler_data(tmp_path / "data")
    assert ruler_main(_ruler(model, data, tmp_path / "out")) == 0
    torch.manual_seed(1)
    other = LlamaForCausalLM(LlamaForCausalLM.from_pretrained(tiny_model_dir).config)
    other.save_pretrained(model, safe_serialization=True)          # same name, same shapes, other weights
    err = _exit(ruler_main, _ruler(model, data, tmp_path / "out"), capsys)
    assert "model file model.safetensors" in err


def test_longbench_and_needle_resume_compare_the_configuration(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    with open(MULTI_NEWS, encoding="utf-8") as src:
        (data / "multi_news.jsonl").write_text(next(src), encoding="utf-8")
    lb = ["--method", "snapkv", "--max_capacity_prompts", "64", "--model_path", tiny_model_dir, "--device", "cpu",
          "--data_dir", str(data), "--datasets", "multi_news", "--save_dir", str(tmp_path / "lb"),
          "--max_new_tokens", "2", "--max_length", "300"]
    assert longbench.main(lb) == 0
    err = _exit(longbench.main, [*lb[:-1], "200"], capsys)
    assert "arguments.max_length: 300 -> 200" in err

    nd = ["--method", "snapkv", "--max_capacity_prompts", "64", "--model_path", tiny_model_dir, "--device", "cpu",
          "--save_dir", str(tmp_path / "nd"), "--s_len", "400", "--e_len", "400", "--num_depths", "1",
          "--max_new_tokens", "2"]
    assert needle.main(nd) == 0
    err = _exit(needle.main, [*nd, "--answer_prefix", "The answer:"], capsys)
    assert "answer_prefix" in err


def test_folder_name_carries_non_default_method_settings():
    from pyramidkv import make_method
    from pyramidkv.runner.labels import run_dir

    assert run_dir("s", "m", make_method("snapkv", budget=128)) == Path("s/m_128/snapkv")
    assert run_dir("s", "m", make_method("snapkv", budget=128, window_size=8, kernel_size=5, pooling="avg")) == \
        Path("s/m_128/snapkv_window_size=8_kernel_size=5_pooling=avg")
    assert run_dir("s", "m", make_method("pyramidkv", budget_ratio=0.25, beta=10.0, gqa_layout="query_head")) == \
        Path("s/m_r0.25/pyramidkv_gqa_layout=query_head_beta=10")
    assert run_dir("s", "m", make_method("fullkv")) == Path("s/m_full/fullkv")


# --- items 2 and 3: each sample counts once; one run per folder -----------------------------------

def test_duplicate_prediction_rows_are_refused_not_scored_twice(tmp_path, capsys):
    data = _ruler_data(tmp_path / "data")
    save = tmp_path / "out"
    assert ruler_main(_ruler("smollm2-135m", data, save)) == 0
    preds = save / "smollm2-135m_64" / "snapkv" / "niah_single_1_256.jsonl"
    first = preds.read_text().splitlines()[0]
    with open(preds, "a") as f:
        f.write(first + "\n")                     # what two runs into one folder at once leave behind
    err = _exit(ruler_main, _ruler("smollm2-135m", data, save), capsys)
    assert f"{preds}:3: index 0 repeats line 1" in err
    # The summary refuses it as well.
    out = subprocess.run([sys.executable, "scripts/summarize_results.py", str(save)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "index 0 repeats line 1" in out.stderr


def test_needle_scorer_refuses_duplicate_cells(tmp_path):
    from pyramidkv.runner.results import read_unique_rows

    path = tmp_path / "needle.jsonl"
    path.write_text('{"key": "400_0", "recall": 1}\n{"key": "400_50", "recall": 0}\n{"key": "400_0", "recall": 1}\n')
    with pytest.raises(ValueError, match=r"needle.jsonl:3: key '400_0' repeats line 1"):
        read_unique_rows(path, "key")


def _lock(run: Path, pid: int, host: str | None = None) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    lock = run / ".run.lock"
    lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": "2025-01-01T00:00:00"}))
    return lock


def test_a_second_run_into_a_locked_folder_fails_naming_the_holder(tmp_path, capsys):
    data = _ruler_data(tmp_path / "data")
    run = tmp_path / "out" / "smollm2-135m_64" / "snapkv"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(run, holder.pid)
        err = _exit(ruler_main, _ruler("smollm2-135m", data, tmp_path / "out"), capsys)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in err and "2025-01-01" in err
        assert not (run / "niah_single_1_256.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone now: its lock is stale, taken over with a note, and released at the end.
    assert ruler_main(_ruler("smollm2-135m", data, tmp_path / "out")) == 0
    assert "taking over the stale lock" in capsys.readouterr().err
    assert not (run / ".run.lock").exists()


# --- items 6, 7, 13: checked before anything loads, one line, exit 2, nothing left on disk ---------

@pytest.fixture
def no_model_load(monkeypatch):
    import pyramidkv
    import pyramidkv.models.loading as loading

    boom = lambda *a, **k: pytest.fail("the model was loaded before the bad input was found")  # noqa: E731
    monkeypatch.setattr(pyramidkv, "load_model", boom)
    monkeypatch.setattr(loading, "load_model", boom)


def _gpt2_dir(tmp_path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)).save_pretrained(folder)
    shutil.copy(ROOT / "tests" / "prompts.py", folder / "unused.txt")
    return folder


BAD_SETUPS = {
    "gpt2": (lambda tmp: ["--model_path", str(_gpt2_dir(tmp))], r"unsupported model type 'gpt2'"),
    "flash": (lambda tmp: ["--attn_implementation", "flash_attention_2"], r"flash-attn"),
    "cuda": (lambda tmp: ["--device", "cuda"], r"CUDA is not available"),
}


@pytest.mark.parametrize("runner", ["ruler", "longbench", "needle"])
@pytest.mark.parametrize("bad", list(BAD_SETUPS))
def test_model_and_device_errors_are_one_line_before_loading(runner, bad, tmp_path, no_model_load, smollm2_path):
    if bad == "flash" and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    if bad == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    extra, message = BAD_SETUPS[bad]
    extra = extra(tmp_path)
    save = tmp_path / "out"
    common = ["--method", "snapkv", "--max_capacity_prompts", "64", "--save_dir", str(save)]
    if "--model_path" not in extra:
        common += ["--model_path", smollm2_path]
    if "--device" not in extra:
        common += ["--device", "cpu"]
    if runner == "ruler":
        cmd = ["run_ruler.py", *common, "--data_file", str(_ruler_data(tmp_path / "data"))]
    elif runner == "longbench":
        cmd = ["run_longbench.py", *common, "--data_dir", str(MULTI_NEWS.parent), "--datasets", "multi_news",
               "--max_num_examples", "1"]
    else:
        cmd = ["run_needle_in_haystack.py", *common, "--s_len", "400", "--e_len", "400", "--num_depths", "1"]
    out = subprocess.run([sys.executable, *cmd, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], out.stderr
    import re

    assert re.search(message, lines[0])
    assert not save.exists()          # nothing half-written


def test_needle_s_len_too_short_is_found_before_loading(tiny_model_dir, tmp_path, capsys, no_model_load):
    err = _exit(needle.main, ["--method", "fullkv", "--model_path", tiny_model_dir, "--device", "cpu",
                              "--save_dir", str(tmp_path / "out"), "--s_len", "20", "--e_len", "400",
                              "--step", "380", "--num_depths", "1"], capsys)
    assert "--s_len 20 is too short" in err
    assert not (tmp_path / "out").exists()


def test_unwritable_save_dir_is_named_at_start_up(tmp_path, capsys, no_model_load):
    data = _ruler_data(tmp_path / "data")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    err = _exit(ruler_main, _ruler("smollm2-135m", data, blocker / "out"), capsys)
    assert f"cannot write results to {blocker / 'out'}" in err and "is a file, not a folder" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_save_dir_is_named_at_start_up(tmp_path, capsys, no_model_load):
    data = _ruler_data(tmp_path / "data")
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        err = _exit(ruler_main, _ruler("smollm2-135m", data, locked), capsys)
        assert f"{locked} is not writable" in err
    finally:
        locked.chmod(0o755)


def test_disk_full_mid_run_keeps_completed_rows_and_says_so(tmp_path, capsys, monkeypatch):
    import errno

    from pyramidkv.runner import results

    data = _ruler_data(tmp_path / "data")
    real_append = results.ResultsWriter.append
    calls = []

    def append_then_fill_disk(self, row):
        calls.append(row)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(self, row)

    monkeypatch.setattr(results.ResultsWriter, "append", append_then_fill_disk)
    with pytest.raises(SystemExit) as exc:
        ruler_main(_ruler("smollm2-135m", data, tmp_path / "out"))
    run = tmp_path / "out" / "smollm2-135m_64" / "snapkv"
    assert exc.value.code == f"error: disk full while writing {run} (No space left on device); the 1 completed " \
                             f"row(s) there are kept; free space and rerun the same command to resume"
    assert len((run / "niah_single_1_256.jsonl").read_text().splitlines()) == 1
    assert not (run / ".run.lock").exists()


# --- item 12: unreadable data files are named; empty and binary inputs refused ---------------------

def test_non_utf8_ruler_data_file_is_named(tmp_path, capsys, no_model_load):
    data = _ruler_data(tmp_path / "data")
    data.write_bytes(data.read_bytes() + b'{"index": 9, "input": "caf\xe9", "outputs": ["x"]}\n')
    err = _exit(ruler_main, _ruler("smollm2-135m", data, tmp_path / "out"), capsys)
    assert f"{data}:3: not UTF-8 text (byte 0xe9" in err


def test_longbench_non_utf8_and_empty_data_files_are_refused(tmp_path, capsys, no_model_load, smollm2_path):
    data = tmp_path / "data"
    data.mkdir()
    argv = ["--method", "fullkv", "--model_path", smollm2_path, "--device", "cpu", "--data_dir", str(data),
            "--datasets", "trec", "--save_dir", str(tmp_path / "out")]
    (data / "trec.jsonl").write_bytes(b'{"_id": "a", "input": "\xff"}\n')
    assert f"{data / 'trec.jsonl'}:1: not UTF-8 text (byte 0xff" in _exit(longbench.main, argv, capsys)
    (data / "trec.jsonl").write_bytes(b"")
    assert f"{data / 'trec.jsonl'}: no rows (an empty data file)" in _exit(longbench.main, argv, capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, message", [
    (b"Some essay text.\x00\x01\x02\x00", "a binary file (NUL bytes)"),
    (b"Caf\xe9 essay text.", "not UTF-8 text (byte 0xe9"),
])
def test_binary_or_non_utf8_haystack_is_refused(content, message, tiny_model_dir, tmp_path, capsys, no_model_load):
    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "a.txt").write_text("A normal essay sentence. " * 50)
    (hay / "b.txt").write_bytes(content)
    err = _exit(needle.main, ["--method", "fullkv", "--model_path", tiny_model_dir, "--device", "cpu",
                              "--haystack_dir", str(hay), "--save_dir", str(tmp_path / "out"),
                              "--s_len", "400", "--e_len", "400", "--num_depths", "1"], capsys)
    assert f"{hay / 'b.txt'}: {message}" in err


# --- item 14: --num_threads on every runner --------------------------------------------------------

@pytest.mark.parametrize("script", ["run_ruler.py", "run_longbench.py", "run_needle_in_haystack.py"])
def test_every_runner_has_num_threads_and_overwrite(script, capsys):
    """The script's own main in this process (each runner starting as a process: the one-line errors above)."""
    runner = load_script(f"help_{script[:-3]}", ROOT / script)
    with pytest.raises(SystemExit) as done:
        runner.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--num_threads" in out and "--overwrite" in out


def test_a_fingerprint_from_before_new_settings_matches_when_they_stay_at_their_defaults():
    """A folder written before settings were added resumes while the new run leaves them at their defaults
    (checked by hand on results made by the previous command line); a changed one is still a difference."""
    from pyramidkv.runner.run_folder import fingerprint_differences

    stored = {"method": {"method": "think", "budget": 128, "key_channel_ratio": 0.4},
              "arguments": {"context_lengths": [2048], "history_window": None}}
    new = {"method": {"method": "think", "budget": 128, "key_channel_ratio": 0.4, "page_budget": None,
                      "page_size": 16},
           "arguments": {"context_lengths": [2048]}}
    assert fingerprint_differences(stored, new, {}, ["page_budget", "page_size"]) == []
    # The new setting away from its default, or a removed flag that was given, differ.
    assert fingerprint_differences(stored, new, {}, ["page_budget"]) == ["method.page_size: '<unset>' -> 16"]
    stored["arguments"]["history_window"] = 64
    assert fingerprint_differences(stored, new, {}, ["page_budget", "page_size"]) == [
        "arguments.history_window: 64 -> '<unset>'"]
    # An argument stored then, found since not to change predictions (the benchmark's selection_args), is not compared.
    from pyramidkv.benchmarks.ruler.run import Ruler
    from pyramidkv.runner.protocol import not_generating_args

    stored["arguments"]["history_window"] = None
    stored["arguments"]["questions_per_context"] = 4
    assert fingerprint_differences(stored, new, {}, ["page_budget", "page_size"], not_generating_args(Ruler())) == []


def test_a_unit_setting_added_since_matches_at_its_default():
    """An adakv folder made before AdaKV's `safeguard` existed resumes with the default rule; kvpress's rule, or
    another floor, is a difference."""
    from pyramidkv import make_method
    from pyramidkv.runner.run_folder import fingerprint_differences

    stored = {"method": {"method": "adakv", "budget": 128,
                         "head_allocation": {"name": "adakv", "floor_ratio": 0.2, "normalize": False}}}

    def now(**settings):
        method = make_method("adakv", budget=128, **settings)
        described = json.loads(json.dumps({"method": method.describe()}, default=str))
        return fingerprint_differences(stored, described, {}, method.settings_at_default())

    assert now() == []
    assert now(safeguard="first") == [
        "method.head_allocation: {'name': 'adakv', 'floor_ratio': 0.2, 'normalize': False} -> "
        "{'name': 'adakv', 'floor_ratio': 0.2, 'normalize': False, 'safeguard': 'first'}"]
    assert now(floor_ratio=0.3) != []
