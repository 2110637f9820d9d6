"""The measuring scripts of measure/ end to end, with tiny settings on the tiny random Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, load_script


def run_measure(script: str, argv: list[str]) -> None:
    """measure/SCRIPT's main(argv) in this process, torch's thread count put back after; each script started as
    a process from measure/: test_every_measuring_script_runs_from_measure."""
    threads = torch.get_num_threads()
    try:
        load_script(f"measure_{script[:-3]}", ROOT / "measure" / script).main(argv)
    finally:
        torch.set_num_threads(threads)


def test_benchmark_writes_plain_row_and_ratios(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    run_measure("benchmark_latency_memory.py", [
        "--model_path", tiny_model_dir, "--device", "cpu", "--context_length", "96", "--max_capacity_prompts", "40",
        "--new_tokens", "2", "--repeats", "1", "--threads", "1", "--methods", "fullkv", "snapkv",
        "snapkv:merge=mergingpress,merge_fraction=0.5", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["plain", "fullkv", "snapkv", "snapkv:merge=mergingpress,merge_fraction=0.5"]
    assert results["snapkv:merge=mergingpress,merge_fraction=0.5"]["kv_bytes_after_prefill"] == \
        results["snapkv"]["kv_bytes_after_prefill"]  # merging changes what is stored, not how much
    plain, full, snap = results["plain"], results["fullkv"], results["snapkv"]
    # 2 layers x 2 KV heads x 96 tokens x head_dim 16 x (K + V) x float32
    assert plain["kv_bytes_after_prefill"] == full["kv_bytes_after_prefill"] == 2 * 2 * 96 * 16 * 2 * 4
    assert snap["kv_bytes_after_prefill"] == 2 * 2 * 40 * 16 * 2 * 4
    assert snap["peak_prefill_kv_bytes"] >= snap["kv_bytes_after_prefill"]
    for row in results.values():
        assert row["decode_s_per_token"] > 0 and row["prefill_s"] > 0
        assert row["decode_ratio_plain"] == row["decode_s_per_token"] / plain["decode_s_per_token"]
        assert row["decode_ratio"] == row["decode_s_per_token"] / full["decode_s_per_token"]
        assert row["kv_ratio_plain"] == row["kv_bytes_after_prefill"] / plain["kv_bytes_after_prefill"]
        assert "prefill_ratio_plain" in row and "peak_prefill_kv_ratio_plain" in row
    assert snap["kv_ratio"] == 40 / 96


def test_benchmark_peak_over_the_run_with_decode_compression(tiny_model_dir, tmp_path):
    """Peak KV bytes cover the whole generation: fullkv ends at 96 + 40 tokens; with
    decode_budget 48 / interval 8 a head never holds more than 56 tokens (the peak just before a
    re-selection); snapkv without it ends at 40 + 40."""
    out = tmp_path / "bench.json"
    run_measure("benchmark_latency_memory.py", [
        "--model_path", tiny_model_dir, "--device", "cpu", "--context_length", "96", "--max_capacity_prompts", "40",
        "--new_tokens", "40", "--repeats", "1", "--threads", "1", "--methods", "fullkv", "snapkv",
        "snapkv:decode_budget=48,decode_interval=8,window_size=16", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    per_token = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head_dim x (K + V) x float32
    assert results["fullkv"]["peak_kv_bytes"] == results["plain"]["peak_kv_bytes"] == (96 + 40) * per_token
    assert results["snapkv"]["peak_kv_bytes"] == results["snapkv"]["kv_bytes_final"] == (40 + 40) * per_token
    decoded = results["snapkv:decode_budget=48,decode_interval=8,window_size=16"]
    # the most at once: layer 0 at 56 just before it re-selects, layer 1 still at 55 (its append comes next)
    assert decoded["peak_kv_bytes"] == (56 + 55) * per_token // 2
    assert decoded["kv_bytes_final"] <= 56 * per_token


def test_benchmark_chunked_rows_and_the_layer_in_flight(tiny_model_dir, tmp_path, capsys):
    """A `SPEC chunk=N` row per method chunked prefill is defined for (kvzip left out, saying why); its peak is the
    two layer budgets + one chunk, where the whole prompt's peak with the layer in flight is budget + prompt."""
    out = tmp_path / "bench.json"
    run_measure("benchmark_latency_memory.py", [
        "--model_path", tiny_model_dir, "--device", "cpu", "--context_length", "96", "--max_capacity_prompts", "40",
        "--new_tokens", "1", "--repeats", "1", "--threads", "1", "--methods", "snapkv", "kvzip",
        "--prefill_chunk_sizes", "32", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert "left out: kvzip chunk=32: prefill_chunk_size is not defined for kvzip" in capsys.readouterr().out
    assert list(results) == ["plain", "fullkv", "snapkv", "kvzip", "snapkv chunk=32"]
    row = 2 * 16 * 2 * 4   # one token of one layer: KV heads x head_dim x (K + V) x float32
    assert results["snapkv chunk=32"]["peak_prefill_kv_bytes"] == (40 + 40 + 32) * row
    assert results["snapkv chunk=32"]["kv_bytes_after_prefill"] == 2 * (40 + 1) * row   # + the last token's step
    assert results["snapkv"]["peak_in_flight_kv_bytes"] == (40 + 96) * row
    assert results["snapkv"]["peak_prefill_kv_bytes"] == 2 * 40 * row    # the stored bytes' peak, as before


def test_benchmark_refuses_a_bad_method_spec(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as done:
        run_measure("benchmark_latency_memory.py", ["--model_path", tiny_model_dir, "--methods", "snapkv:merge"])
    assert done.value.code == 2 and "expected NAME:setting=value" in capsys.readouterr().err


def test_merge_overhead_script_times_every_rule(tiny_model_dir):
    got = subprocess.run([sys.executable, str(ROOT / "measure" / "merge_overhead.py"), "--model_path", tiny_model_dir,
                          "--context_length", "96", "--max_capacity_prompts", "40"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["pivot", "weighted", "mergingpress", "cam"]
    assert all("vs no merge" in line for line in lines[1:])


def test_teacher_forced_nll_script_reports_ratios_to_fullkv(tiny_model_dir, tmp_path):
    from tests.helpers import longbench_data_dir

    out = tmp_path / "nll.json"
    run_measure("teacher_forced_nll.py", [
        "--model_path", tiny_model_dir, "--context_length", "96", "--continuation", "4", "--max_capacity_prompts", "40",
        "--methods", "snapkv", "fullkv:quant_method=kivi,nbits=8,group_size=16,residual_length=32",
        "--data_file", str(longbench_data_dir() / "multi_news.jsonl"), "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == ["fullkv", "snapkv", "fullkv:quant_method=kivi,nbits=8,group_size=16,residual_length=32"]
    assert rows["fullkv"]["ratio_to_fullkv"] == 1.0
    for row in rows.values():
        assert row["mean_nll"] > 0 and row["ratio_to_fullkv"] == row["mean_nll"] / rows["fullkv"]["mean_nll"]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "measure").glob("*.py")))
def test_every_measuring_script_runs_from_measure(script):
    """Each script of measure/ starts from its folder (imports, paths computed from __file__) and states its flags."""
    got = subprocess.run([sys.executable, str(ROOT / "measure" / script), "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert got.returncode == 0 and got.stdout.startswith(f"usage: {script}"), got.stderr
