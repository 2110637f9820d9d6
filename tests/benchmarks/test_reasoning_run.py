"""run_reasoning.py end to end on a tiny random Llama (sharp_model_dir: its answers depend on the prompt): fullkv's
traces against the unpatched model's greedy generation, its KL exactly 0, a decode-time method's KL against the
unpatched model's distributions along fullkv's trace, K/V bytes against a hand count, the refusals before the
weights load, and kill -9 resume to the same rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyramidkv.benchmarks.reasoning.run import main
from tests.helpers import ROOT, kill_after_rows

SMALL = ["--tasks", "chain", "gsm8k", "--num_samples", "2", "--max_new_tokens", "20", "--chain_steps", "3"]
H2O = ["--method", "h2o", "--max_capacity_prompts_ratio", "1", "--decode_budget", "48", "--decode_interval", "4"]


def _args(model_dir, save_dir, method, *extra, small=tuple(SMALL)):
    return ["--model_path", model_dir, *method, "--save_dir", str(save_dir), "--num_threads", "1", "--device", "cpu",
            *small, *extra]


def _rows(folder: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines() if line.strip()]


def _folder(save_dir: Path, model_dir: str, part: str, method: str) -> Path:
    return save_dir / f"{Path(model_dir).name}_{part}" / method


def _bytes_per_token(config) -> int:
    """K and V of one token in every layer and stored head, float32."""
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 4


def test_fullkv_then_a_decode_time_method(sharp_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(_args(sharp_model_dir, tmp_path, ["--method", "fullkv"])) == 0
    assert main(_args(sharp_model_dir, tmp_path, H2O)) == 0
    full = _folder(tmp_path, sharp_model_dir, "full", "fullkv")
    h2o = _folder(tmp_path, sharp_model_dir, "r1", "h2o_decode_budget=48_decode_interval=4")
    stops = json.loads((full / "run_meta.json").read_text())["stop_token_ids"]["chain"]
    model = AutoModelForCausalLM.from_pretrained(sharp_model_dir, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(sharp_model_dir)
    per_token = _bytes_per_token(model.config)
    departed = 0
    for task in ("chain", "gsm8k"):
        for reference, row in zip(_rows(full, task), _rows(h2o, task)):
            assert reference["index"] == row["index"]
            prompt = _prompt(sharp_model_dir, task, reference["index"], tokenizer)
            # fullkv: the unpatched model's greedy tokens; its KL to itself exactly 0; its bytes all it was fed
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=stops,
                                     pad_token_id=stops[0])
            assert reference["trace"] == out[0, len(prompt):].tolist()
            assert reference["kl_vs_fullkv"] == 0.0 and reference["kl_max"] == 0.0
            assert reference["departure_step"] is None
            fed = len(prompt) + len(reference["trace"]) - 1
            assert reference["kv_bytes_peak"] == fed * per_token
            # h2o: KL along fullkv's trace against the unpatched model's distributions (one forward, float64 KL)
            trace = reference["trace"]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + trace])).logits[0, len(prompt) - 1:-1].double()
            p_log = torch.log_softmax(logits, -1)
            q_log = _method_logprobs(sharp_model_dir, prompt, trace)
            kl = (p_log.exp() * (p_log - q_log)).sum(-1)
            assert row["kl_vs_fullkv"] == pytest.approx(float(kl.mean()), rel=1e-3, abs=1e-6)
            assert row["kl_tokens"] == len(trace)
            first = next((i for i, (a, b) in enumerate(zip(row["trace"], trace)) if a != b), None)
            if first is None and len(row["trace"]) != len(trace):
                first = min(len(row["trace"]), len(trace))
            assert row["departure_step"] == first
            departed += first is not None
            # a decode budget below the prompt compresses it as the prefill ends: at most 48 + 4 tokens a head
            assert row["kv_bytes_peak"] <= (48 + 4) * per_token < reference["kv_bytes_peak"]
    assert departed >= 1, "h2o at 48 tokens never departed from fullkv: the comparison saw nothing"
    result = json.loads((h2o / "results.json").read_text())
    assert result["num_samples"] == {"chain": 2, "gsm8k": 2} and result["scores"]["chain"]["kl_vs_fullkv"] > 0


_MODELS: dict = {}


def _prompt(model_dir, task, index, tokenizer) -> list[int]:
    from pyramidkv.benchmarks.prompting import chat_frame
    from pyramidkv.benchmarks.reasoning import tasks as T

    problem = T.problems(task, index + 1, 3, 0)[index]
    return tokenizer(T.prompt_text(task, problem, chat_frame(tokenizer)), add_special_tokens=False).input_ids


def _method_logprobs(model_dir, prompt, trace) -> torch.Tensor:
    """h2o's distributions along `trace`, teacher forced (generation/teacher_forced.py), float64."""
    from pyramidkv import load_model
    from pyramidkv.generation.teacher_forced import score_reference
    from pyramidkv.methods import make_method

    if model_dir not in _MODELS:
        _MODELS[model_dir] = load_model(model_dir, device="cpu")
    model, tokenizer = _MODELS[model_dir]
    method = make_method("h2o", budget_ratio=1.0, decode_budget=48, decode_interval=4)
    return score_reference(model, tokenizer, prompt, trace, method).logprobs.double()


@pytest.mark.parametrize("method,extra,message", [
    (H2O, [], r"no fullkv trace of chain problem 0 in .*chain\.jsonl: run fullkv first with the same flags"),
    (["--method", "fullkv"], ["--temperature", "0.7"], r"--temperature only with --do_sample"),
    (["--method", "fullkv"], ["--do_sample", "--top_p", "0"], r"top_p must be in \(0, 1\]"),
    (["--method", "fullkv"], ["--eval_batch_size", "2"], r"--eval_batch_size must be 1"),
    (["--method", "fullkv"], ["--kl_vs_fullkv"], r"--kl_vs_fullkv does not apply"),
    (["--method", "fullkv"], ["--data_file", "x.jsonl"], r"--data_file replaces one dataset's rows"),
])
def test_bad_input_is_one_line_before_the_weights(tiny_model_dir, tmp_path, capsys, monkeypatch, method, extra,
                                                   message):
    import re

    monkeypatch.setattr("pyramidkv.runner.protocol.load_run_model", _no_weights)
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny_model_dir, tmp_path, method, *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, err), err


def test_a_decode_budget_above_the_generation_and_a_task_without_answers_are_refused(tiny_model_dir, tmp_path,
                                                                                      capsys, monkeypatch):
    monkeypatch.setattr("pyramidkv.runner.protocol.load_run_model", _no_weights)
    _seed_fullkv_rows(tiny_model_dir, tmp_path)
    big = ["--method", "h2o", "--max_capacity_prompts_ratio", "1", "--decode_budget", "4000"]
    with pytest.raises(SystemExit):
        main(_args(tiny_model_dir, tmp_path, big))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--decode_budget 4000 (+ decode_interval 32) is above what chain problem 0 ever holds" in err, err
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "What is 2 + 2?"}) + "\n")
    with pytest.raises(SystemExit):
        main(_args(tiny_model_dir, tmp_path, ["--method", "fullkv"], "--tasks", "gsm8k", "--data_file", str(rows),
                   "--num_samples", "1", small=()))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "line 1 has no 'answer' text" in err, err


def _seed_fullkv_rows(model_dir, save_dir):
    """fullkv rows with the digests a run of SMALL expects (their traces are never decoded here)."""
    from pyramidkv.benchmarks.reasoning.run import Reasoning
    from pyramidkv.runner.protocol import build_parser
    from transformers import AutoConfig, AutoTokenizer

    benchmark = Reasoning()
    parser = build_parser(benchmark, [])
    args = parser.parse_args(_args(model_dir, save_dir, ["--method", "fullkv"]))
    benchmark.given = parser.given
    benchmark.check_arguments(args)
    files = benchmark.prepare(args, AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir),
                              save_dir)
    folder = _folder(save_dir, model_dir, "full", "fullkv")
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f.file_name).write_text("".join(json.dumps({"index": s.key, "trace": [1],
                                                              "trace_digest": s.row["trace_digest"]}) + "\n"
                                                  for s in f.samples))


def _no_weights(*args, **kwargs):
    raise AssertionError("the weights loaded")


def test_resume_after_kill_9_gives_the_same_rows(sharp_model_dir, tmp_path):
    num = 6
    argv = ["--model_path", sharp_model_dir, "--method", "fullkv", "--num_threads", "1", "--device", "cpu",
            "--tasks", "chain", "--num_samples", str(num), "--max_new_tokens", "12", "--chain_steps", "2",
            "--do_sample", "--temperature", "1.0"]
    cmd = [sys.executable, str(ROOT / "run_reasoning.py"), *argv, "--save_dir", str(tmp_path / "killed")]
    out = _folder(tmp_path / "killed", sharp_model_dir, "full", "fullkv") / "chain.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    partial = kill_after_rows(cmd, out, env=env)
    assert 2 <= partial.count(b"\n") < num
    with open(out, "ab") as f:                     # as if the kill had landed mid-write
        f.write(b'{"index": 5, "pred": "tor')
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert out.read_bytes().startswith(partial)    # finished rows kept, not redone
    assert main([*argv, "--save_dir", str(tmp_path / "whole")]) == 0
    whole = _folder(tmp_path / "whole", sharp_model_dir, "full", "fullkv") / "chain.jsonl"
    kept = ("index", "pred", "trace", "answer", "step_accuracy", "kl_vs_fullkv", "kv_bytes_peak", "trace_digest")

    def rows(path):
        return sorted(({k: r[k] for k in kept} for r in map(json.loads, path.read_text().splitlines())),
                      key=lambda r: r["index"])
    assert rows(out) == rows(whole) and len(rows(out)) == num


def test_fullkv_and_a_decode_time_method_on_the_default_model(smollm2_path, tmp_path):
    """SmolLM2-135M, one chain of two steps: fullkv's KL to itself exactly 0 along its own trace (its free-running
    distributions against its teacher-forced ones), tova's finite and its bytes held to the decode budget."""
    tiny = ("--tasks", "chain", "--num_samples", "1", "--max_new_tokens", "12", "--chain_steps", "2")
    tova = ["--method", "tova", "--max_capacity_prompts_ratio", "1", "--decode_budget", "64"]
    for method in (["--method", "fullkv"], tova):
        assert main(_args(smollm2_path, tmp_path, method, small=tiny)) == 0
    full = _rows(next(tmp_path.glob("*_full")) / "fullkv", "chain")[0]
    row = _rows(next(tmp_path.glob("*_r1")) / "tova_decode_budget=64", "chain")[0]
    assert full["kl_vs_fullkv"] == 0.0 and full["departure_step"] is None and full["kl_tokens"] == len(full["trace"])
    assert 0 <= row["kl_vs_fullkv"] < float("inf") and row["kl_tokens"] == len(full["trace"])
    assert row["kv_bytes_peak"] < full["kv_bytes_peak"]
