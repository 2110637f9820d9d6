"""--shared_context in the runners: with one question per context it is --question_as_decode's protocol (the
context compressed without its question, the question fed after it), so the predictions must be those of a
--question_as_decode run (an independent path: generate(..., questions=...)); rows carry qid and turn."""

from __future__ import annotations

import json
import shutil
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


TIMES = ("time_to_first_token", "prefill_seconds")


@pytest.mark.parametrize("mode", ["multi_request", "multi_turn"])
def test_three_questions_resume_per_question_after_a_kill(sharp_model_dir, tmp_path, mode, capsys):
    """A kill -9 leaves the rows fsynced so far and maybe a torn line; the rerun answers only the questions
    missing (context 0's third, context 1's) and the file equals an uninterrupted run's, times aside."""
    argv = ["--method", "snapkv", "--max_capacity_prompts", "64", "--model_path", sharp_model_dir, "--device", "cpu",
            "--num_threads", "1", "--tasks", "kv_retrieval", "--context_lengths", "640", "--num_samples", "2",
            "--questions_per_context", "3", "--shared_context", mode, "--cache_dir", str(tmp_path / "data")]
    assert RU.main([*argv, "--save_dir", str(tmp_path / "whole")]) == 0
    folder = f"{Path(sharp_model_dir).name}_64/snapkv_{mode}"
    whole_path = tmp_path / "whole" / folder / "kv_retrieval_640_q3.jsonl"
    whole = rows(whole_path)
    assert [r["qid"] for r in whole] == ["0#1", "0#2", "0#3", "1#1", "1#2", "1#3"]
    assert len({r["pred"] for r in whole}) > 2 and len({r["outputs"][0] for r in whole}) == 6
    killed = tmp_path / "killed" / folder / "kv_retrieval_640_q3.jsonl"
    killed.parent.mkdir(parents=True)
    lines = whole_path.read_text(encoding="utf-8").splitlines(keepends=True)
    killed.write_text("".join(lines[:2]) + lines[2][:25], encoding="utf-8")
    for name in ("run_meta.json", ".fingerprint.json"):
        if (whole_path.parent / name).exists():
            (killed.parent / name).write_bytes((whole_path.parent / name).read_bytes())
    capsys.readouterr()
    assert RU.main([*argv, "--save_dir", str(tmp_path / "killed")]) == 0
    assert "4 question(s) in" in capsys.readouterr().out
    resumed = rows(killed)
    strip = [lambda r: {k: v for k, v in r.items() if k not in TIMES}][0]
    assert sorted(map(strip, resumed), key=lambda r: r["qid"]) == [strip(r) for r in whole]
    result = json.loads((killed.parent / "results.json").read_text())
    assert set(result["turn_scores"]["kv_retrieval@640"]) == {"1", "2-3"}


def test_a_later_run_answers_from_the_saved_compressed_contexts(sharp_model_dir, tmp_path, capsys):
    """--save_compressed writes each context's cache after compression; a run with --load_compressed answers from
    them without compressing (prefill 0 s) and writes the same predictions; another method's files are refused."""
    argv = ["--max_capacity_prompts", "64", "--model_path", sharp_model_dir, "--device", "cpu",
            "--num_threads", "1", "--tasks", "kv_retrieval", "--context_lengths", "640", "--num_samples", "2",
            "--questions_per_context", "2", "--shared_context", "multi_request", "--cache_dir", str(tmp_path / "data")]
    saved = tmp_path / "compressed"
    assert RU.main(["--method", "snapkv", *argv, "--save_dir", str(tmp_path / "first"), "--save_compressed",
                    str(saved)]) == 0
    files = sorted(p.name for p in (saved / f"{Path(sharp_model_dir).name}_64/snapkv/kv_retrieval_640_q2").iterdir())
    assert files == ["0.safetensors", "1.safetensors"]
    assert RU.main(["--method", "snapkv", *argv, "--save_dir", str(tmp_path / "second"), "--load_compressed",
                    str(saved)]) == 0
    folder = f"{Path(sharp_model_dir).name}_64/snapkv_multi_request/kv_retrieval_640_q2.jsonl"
    first, second = rows(tmp_path / "first" / folder), rows(tmp_path / "second" / folder)
    assert [r["compressed_cache"] for r in first] == ["compressed"] * 4
    assert [r["compressed_cache"] for r in second] == ["loaded"] * 4
    assert all(r["prefill_seconds"] == 0 for r in second) and all(r["prefill_seconds"] > 0 for r in first)
    same = ("pred", "kv_bytes", "context_kv_bytes", "qid")
    assert [{k: r[k] for k in same} for r in second] == [{k: r[k] for k in same} for r in first]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        RU.main(["--method", "pyramidkv", *argv, "--save_dir", str(tmp_path / "third"), "--load_compressed",
                 str(saved)])
    err = capsys.readouterr().err.strip().splitlines()[-1]   # its files are looked for under its own configuration
    assert "holds no cache file of this run's contexts" in err and f"_64/pyramidkv/kv_retrieval_640_q2/0." in err
    with pytest.raises(SystemExit):
        RU.main(["--method", "snapkv", *argv[:-6], "--save_dir", str(tmp_path / "x"), "--save_compressed", str(saved)])
    assert "--save_compressed needs --shared_context" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):   # a folder with none of the run's contexts: the flag would do nothing
        RU.main(["--method", "snapkv", *argv, "--save_dir", str(tmp_path / "y"), "--load_compressed",
                 str(tmp_path / "empty")])
    assert "holds no cache file of this run's contexts" in capsys.readouterr().err


def test_saved_caches_are_kept_per_configuration_and_checked_against_their_context(sharp_model_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """Issue 40, items 3 and 5: an h2o run saving into the folder where snapkv saved its caches writes files of its
    own and leaves snapkv's as they were; a file of another configuration where a save would go, a saved context used
    for another context of the same length (as another generator seed's can be) or on the model in another dtype, are
    refused in one line before the weights load."""
    from pyramidkv.generation.cache_file import read_record

    argv = ["--max_capacity_prompts", "64", "--model_path", sharp_model_dir, "--device", "cpu", "--num_threads", "1",
            "--tasks", "kv_retrieval", "--context_lengths", "640", "--num_samples", "1", "--questions_per_context", "2",
            "--shared_context", "multi_request"]
    saved, data = tmp_path / "compressed", ["--cache_dir", str(tmp_path / "data")]
    where = {m: saved / f"{Path(sharp_model_dir).name}_64/{m}/kv_retrieval_640_q2/0.safetensors"
             for m in ("snapkv", "h2o")}
    assert RU.main(["--method", "snapkv", *argv, *data, "--save_dir", str(tmp_path / "a"), "--save_compressed",
                    str(saved)]) == 0
    before = where["snapkv"].read_bytes()
    assert RU.main(["--method", "h2o", *argv, *data, "--save_dir", str(tmp_path / "b"), "--save_compressed",
                    str(saved)]) == 0
    assert where["snapkv"].read_bytes() == before
    assert read_record(where["h2o"])[0]["method"].startswith("h2o:")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr("pyramidkv.runner.shared.load_run_model", no_weights)
    where["h2o"].write_bytes(before)   # snapkv's cache where h2o's goes: not replaced
    refusals = [
        (["--method", "h2o", *argv, *data, "--save_dir", str(tmp_path / "c"), "--save_compressed", str(saved)],
         "it holds the cache of another configuration ('snapkv:budget=64"),
        (["--method", "snapkv", *argv, "--cache_dir", str(tmp_path / "other"), "--save_dir", str(tmp_path / "d"),
          "--load_compressed", str(saved)], "holds another context of the same length"),
        (["--method", "snapkv", *argv, *data, "--dtype", "bfloat16", "--save_dir", str(tmp_path / "e"),
          "--load_compressed", str(saved)], "(dtype_bytes 4); this model has dtype_bytes 2"),
    ]
    shutil.copytree(tmp_path / "data", tmp_path / "other")   # one digit of the context changed: as many tokens
    data_file = next((tmp_path / "other").rglob("kv_retrieval_640_q2.jsonl"))
    row = json.loads(data_file.read_text(encoding="utf-8"))
    at = next(i for i in range(row["input"].index("JSON data:"), len(row["input"])) if row["input"][i].isdigit())
    row["input"] = row["input"][:at] + str((int(row["input"][at]) + 1) % 10) + row["input"][at + 1:]
    data_file.write_text(json.dumps(row) + "\n", encoding="utf-8")
    capsys.readouterr()
    for command, said in refusals:
        with pytest.raises(SystemExit):
            RU.main(command)
        err = capsys.readouterr().err.strip().splitlines()
        assert said in err[-1] and err[-1].startswith("run_ruler.py: error:"), err[-1]
    assert where["h2o"].read_bytes() == before


def test_fullkv_needle_questions_are_the_same_in_both_protocols(sharp_model_dir, tmp_path):
    """Under fullkv a question asked inside its own prompt and one asked after the context prefilled alone attend
    to the same tokens: two needles per cell, the same answers either way, each scored against its own needle."""
    from pyramidkv.benchmarks import needle as nd

    argv = ["--method", "fullkv", "--model_path", sharp_model_dir, "--device", "cpu", "--num_threads", "1",
            "--s_len", "500", "--e_len", "500", "--num_depths", "2", "--max_new_tokens", "8",
            "--questions_per_context", "2"]
    assert needle_runner.main([*argv, "--save_dir", str(tmp_path / "own")]) == 0
    assert needle_runner.main([*argv, "--save_dir", str(tmp_path / "shared"), "--shared_context", "multi_request"]) == 0
    model = Path(sharp_model_dir).name
    own = rows(tmp_path / "own" / f"{model}_full" / "fullkv" / "needle_q2.jsonl")
    shared = rows(tmp_path / "shared" / f"{model}_full" / "fullkv_multi_request" / "needle_q2.jsonl")
    assert [r["qid"] for r in own] == ["500_0#1", "500_0#2", "500_100#1", "500_100#2"]
    assert [r["pred"] for r in shared] == [r["pred"] for r in own] and len({r["pred"] for r in own}) > 1
    assert [r["needle"] for r in own[:2]] == [nd.NEEDLE, nd.NEEDLES[1][0]]
    assert own[1]["recall"] == nd.needle_recall(own[1]["pred"], nd.NEEDLES[1][0], nd.NEEDLES[1][1])
    result = json.loads((tmp_path / "shared" / f"{model}_full" / "fullkv_multi_request" / "results.json").read_text())
    assert set(result["by_turn"]) == {"1", "2-2"}


@pytest.mark.parametrize("folder, says", [
    ("/proc/nope", "--save_compressed: /proc/nope cannot be written: /proc takes no new folder"),
    ("{file}/sub", "is a file, not a folder"),
])
def test_a_save_compressed_folder_that_cannot_be_written_is_refused_before_the_model_loads(
        tiny_model_dir, tmp_path, capsys, monkeypatch, folder, says):
    """Issue 40, item 7: /proc/nope passed the checks and failed once the model had loaded and the run folder was
    written."""
    import pyramidkv.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit) as stop:
        RU.main(["--method", "snapkv", "--max_capacity_prompts", "64", "--model_path", tiny_model_dir, "--tasks",
                 "kv_retrieval", "--context_lengths", "640", "--num_samples", "1", "--shared_context", "multi_request",
                 "--save_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "data"), "--save_compressed",
                 folder.replace("{file}", str(tmp_path / "a_file"))])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err and says in err, err
    assert not (tmp_path / "out").exists()
