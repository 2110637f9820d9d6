"""--shared_context in the runners: with one question per context it is --question_as_decode's protocol (the
context compressed without its question, the question fed after it), so the predictions must be those of a
--question_as_decode run (an independent path: generate(..., questions=...)); rows carry qid and turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyramidkv.benchmarks.longbench import run as LB
from pyramidkv.benchmarks.needle import run as needle_runner
from pyramidkv.benchmarks.ruler import run as RU
from tests.helpers import longbench_data_dir


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_one_question_per_context_equals_question_as_decode(sharp_model_dir, tmp_path):
    method = ["--method", "snapkv", "--max_capacity_prompts", "64", "--model_path", sharp_model_dir, "--device", "cpu",
              "--num_threads", "1"]
    runs = {
        "ruler": (RU.main, [*method, "--tasks", "niah_single_1", "--context_lengths", "512", "--num_samples", "2",
                            "--cache_dir", str(tmp_path / "data")], "niah_single_1_512.jsonl"),
        "longbench": (LB.main, [*method, "--data_dir", str(longbench_data_dir()), "--datasets", "multifieldqa_zh",
                                "--max_num_examples", "2", "--max_length", "400", "--max_new_tokens", "8"],
                      "multifieldqa_zh.jsonl"),
        "needle": (needle_runner.main, [*method, "--s_len", "400", "--e_len", "400", "--num_depths", "2",
                                        "--max_new_tokens", "8"], "needle.jsonl"),
    }
    model = Path(sharp_model_dir).name
    for name, (main, argv, file_name) in runs.items():
        assert main([*argv, "--save_dir", str(tmp_path / name / "fed"), "--question_as_decode"]) == 0
        assert main([*argv, "--save_dir", str(tmp_path / name / "shared"), "--shared_context", "multi_request"]) == 0
        fed = rows(tmp_path / name / "fed" / f"{model}_64" / "snapkv_question_as_decode" / file_name)
        shared = rows(tmp_path / name / "shared" / f"{model}_64" / "snapkv_multi_request" / file_name)
        assert [r["pred"] for r in shared] == [r["pred"] for r in fed], name
        assert [r["kv_bytes"] for r in shared] == [r["kv_bytes"] for r in fed], name
        assert all(r["turn"] == 1 and r["qid"].endswith("#1") and r["context_kv_bytes"] < r["kv_bytes"]
                   for r in shared), name
        assert len({r["pred"] for r in fed}) > 1, name   # the predictions depend on the prompt


@pytest.mark.parametrize("extra,error", [
    (["--shared_context", "multi_requests"], "invalid choice: 'multi_requests'"),
    (["--shared_context", "multi_turn", "--question_as_decode"], "leave out --question_as_decode"),
    (["--questions_per_context", "0"], "--questions_per_context must be >= 1, got 0"),
])
def test_bad_shared_context_flags_end_in_one_line(tiny_model_dir, tmp_path, capsys, extra, error):
    with pytest.raises(SystemExit) as exit_info:
        RU.main(["--model_path", tiny_model_dir, "--method", "fullkv", "--tasks", "niah_single_1", "--save_dir",
                 str(tmp_path), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert error in err[-1] and err[-1].startswith("run_ruler.py: error:")
