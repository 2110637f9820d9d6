"""Small helpers the tests share (they drive pyramidkv; the references live in tests/reference.py)."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import torch

from pyramidkv import compress
from pyramidkv.models.line import CACHE_ARGUMENT

# The repository root, for tests in any subfolder of tests/.
ROOT = Path(__file__).resolve().parents[1]
_SHARED_CANDIDATES = (ROOT.parent / "shared", Path("/work/shared"))


def longbench_data_dir() -> Path:
    """The real LongBench files (multi_news, multifieldqa_zh, passage_retrieval_zh) in the `shared/`
    folder beside the checkout (as CI lays it out), else /work/shared. Missing data is an error, not a skip."""
    for root in _SHARED_CANDIDATES:
        folder = root / "longbench" / "data"
        if (folder / "multi_news.jsonl").is_file():
            return folder
    raise FileNotFoundError(f"LongBench test data not found in any of: "
                            f"{', '.join(str(r / 'longbench' / 'data') for r in _SHARED_CANDIDATES)}")


def cached_type_hints():
    """typing.get_type_hints with a cache, for the matrices that build every combination. Every construction of a
    method or unit checks its settings against the type hints of its class, re-read each time (about 1 ms per
    make_method); a class's hints never change, so the cache changes no decision, only the time."""
    return functools.cache(typing.get_type_hints)


def prefill(model, ids, method, attention_mask=None, position_ids=None, tokenizer=None):
    """The CompressedCache `method` leaves after one prefill forward of `ids` (the model is unpatched after).
    Left-padded prompts get their true RoPE positions only when position_ids are given (as generate does).
    tokenizer: for a method that repeats the prompts (KVzip), which it builds its repeat inputs with."""
    with compress(model, method) as patch:
        rows = ids.tolist() if attention_mask is None else \
            [[t for t, real in zip(row, mask) if real] for row, mask in zip(ids.tolist(), attention_mask.tolist())]
        cache = patch.new_cache(rows if tokenizer is not None else None, tokenizer)
        with torch.no_grad():
            model(ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                  **{CACHE_ARGUMENT: cache})
    return cache


def load_script(name: str, path: Path):
    """Import a script that is not part of the package (runners, scripts/, measure/, examples/) as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kvzap_artifact(model, path, tokens: int = 40, seed: int = 0) -> str:
    """Write a KVzap linear predictor for `model` (any Llama-family model, in memory) to `path` with the calibration
    functions of scripts/calibrate_kvzap.py, on one repeat of `tokens` seeded random token ids (the user copy, then
    the assistant copy): the artifact a method's model check accepts for this model. Returns the path."""
    from pyramidkv.methods.calibrated import model_record, save_artifact

    calibrate = load_script("calibrate_kvzap", Path(__file__).resolve().parents[1] / "scripts" / "calibrate_kvzap.py")
    ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    x, y = calibrate.targets(model, ids + ids, (0, tokens), (tokens, 2 * tokens))
    sums = calibrate.RidgeSums()
    sums.add(x, y)
    record = {"kind": "kvzap-linear", "model": model_record(model.config._name_or_path or "", model.config),
              "settings": {"tokens": tokens}, "seed": seed}
    return str(save_artifact(path, sums.solve(1.0), record))


def write_calibrations(folder: Path, config, seed: int = 0) -> dict[str, str]:
    """Random calibration files of the shape an in-memory model (`config`) needs, by the method setting that reads
    each: Q-Filters' filters, KVzip's head scores and TriAttention's query centres (tests where only the shape matters: the matrices)."""
    from pyramidkv.methods.calibrated import model_record, save_artifact

    generator = torch.Generator().manual_seed(seed)
    record = model_record(str(folder / "in-memory-model"), config)   # no folder there: known by shape alone
    layers, kv_heads, dim = record["num_layers"], record["num_kv_heads"], record["head_dim"]
    filters = torch.nn.functional.normalize(torch.randn(layers, kv_heads, dim, generator=generator), dim=-1)
    heads = record["num_query_heads"]
    real, imag = (torch.randn(layers, heads, dim // 2, generator=generator) for _ in range(2))
    centres = {"q_mean_real": real, "q_mean_imag": imag,
               "q_abs_mean": torch.complex(real, imag).abs() + torch.rand(layers, heads, dim // 2, generator=generator)}
    files = {"qfilter_path": ("qfilter", {"filters": filters}),
             "kvzip_head_path": ("kvzip-head", {"head_scores": torch.rand(layers, kv_heads, generator=generator)}),
             "triattention_path": ("triattention", centres)}
    return {setting: str(save_artifact(folder / f"{kind}.safetensors", tensors, {"kind": kind, "model": record}))
            for setting, (kind, tensors) in files.items()}


class TokenIds:
    """The tokenizer generate() needs for prompts given as token ids: a pad id and decode()."""

    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(i) for i in ids)


def kill_after_rows(cmd: list[str], out: Path, rows: int = 2, env: dict | None = None) -> bytes:
    """Start the runner `cmd`, kill -9 it once `out` holds `rows` lines (at most 300 s), and return what `out` held
    then. Fails if the run ended before it could be killed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_file() and out.read_bytes().count(b"\n") >= rows:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out.read_bytes()


@contextlib.contextmanager
def float64_tiny_llama():
    """A 2-layer tiny random Llama (vocab 96) in float64, computed on one thread while the context is open."""
    from tests.conftest import tiny_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield copy.deepcopy(tiny_llama(layers=2, vocab=96, std=0.2)).double()
    finally:
        torch.set_num_threads(threads)


def stand_in_python(folder: Path, body: str) -> str:
    """An interpreter for the sweep scripts' PYTHON that runs `body` (sh) for each run, and answers the grid's check
    (scripts/run_dirs.py) itself: every run "ok", its folder SAVE_DIR/m_x/METHOD read from the run's own --save_dir
    and --method (the real check has its own tests: tests/scripts/test_script_checks.py, the SLURM cluster's)."""
    answer = ("import sys; sys.path.insert(0, sys.argv[1]); import run_dirs\n"
              "for run in run_dirs.parse_runs(sys.stdin.buffer.read()):\n"
              "    arg = lambda flag: run[run.index(flag) + 1]\n"
              "    print(\"ok\\t\" + arg(\"--save_dir\") + \"/m_x/\" + arg(\"--method\"))")
    path = Path(folder) / "python"
    check = f'exec "{sys.executable}" -c \'{answer}\' "{ROOT / "scripts"}"'
    path.write_text(f'#!/bin/sh\ncase "$1" in */run_dirs.py) {check};; esac\n{body}\n')
    path.chmod(0o755)
    return str(path)
