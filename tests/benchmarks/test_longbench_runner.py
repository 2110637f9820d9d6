"""LongBench runner and scorer: end to end on a tiny model, resume, truncation, bad input."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from pyramidkv.benchmarks.longbench import evaluate as E
from pyramidkv.benchmarks.longbench import run as R
from tests.helpers import ROOT, longbench_data_dir

MULTI_NEWS = longbench_data_dir() / "multi_news.jsonl"
ROW_KEYS = {"_id", "pred", "answers", "all_classes", "length", "prompt_tokens", "kv_bytes", "block_free_16",
            "block_free_32"}


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A LongBench data folder with the first 4 real multi_news rows."""
    folder = tmp_path / "data"
    folder.mkdir()
    with open(MULTI_NEWS, encoding="utf-8") as src:
        lines = [next(src) for _ in range(4)]
    (folder / "multi_news.jsonl").write_text("".join(lines), encoding="utf-8")
    return folder


def _run_args(model_dir, data_dir, save_dir, *extra):
    return ["--method", "snapkv", "--max_capacity_prompts", "64", "--model_path", str(model_dir),
            "--device", "cpu", "--data_dir", str(data_dir), "--datasets", "multi_news",
            "--save_dir", str(save_dir), "--max_new_tokens", "6", "--max_length", "600", *extra]


def _lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


# --- end to end ----------------------------------------------------------------------------------

def test_end_to_end_run_then_eval(tiny_model_dir, data_dir, tmp_path):
    save_dir = tmp_path / "results"
    assert R.main(_run_args(tiny_model_dir, data_dir, save_dir, "--max_num_examples", "2",
                            "--eval_batch_size", "2")) == 0
    run = save_dir / f"{Path(tiny_model_dir).name}_64" / "snapkv"
    rows = _lines(run / "multi_news.jsonl")
    assert len(rows) == 2 and all(set(r) == ROW_KEYS for r in rows)
    source = [json.loads(line) for line in (data_dir / "multi_news.jsonl").read_text().splitlines()]
    assert [r["_id"] for r in rows] == [s["_id"] for s in source[:2]]
    assert all(r["answers"] == s["answers"] and r["length"] == s["length"] for r, s in zip(rows, source))
    # every prompt is far over 600 tokens: 600 kept + the ChatML wrapper
    assert all(600 < r["prompt_tokens"] < 650 and r["kv_bytes"] > 0 for r in rows)
    meta = json.loads((run / "run_meta.json").read_text())
    assert meta["method"]["budget"] == 64 and meta["max_length"] == {"multi_news": 600}

    assert E.main(["--results_dir", str(save_dir)]) == 0  # a tree: finds the run folder
    result = json.loads((run / "results.json").read_text())
    assert result["benchmark"] == "longbench" and result["method"] == "snapkv" and result["budget"] == 64
    assert result["model"] == Path(tiny_model_dir).name
    assert result["num_samples"] == {"multi_news": 2}
    expected = E.score_dataset("multi_news", [r["pred"] for r in rows], [r["answers"] for r in rows])
    assert result["scores"] == {"multi_news": expected} and result["average"] == expected
    csv_lines = (run / "results.csv").read_text().splitlines()
    assert csv_lines[0] == "dataset,score,num_samples" and csv_lines[-1].startswith("average,")
    assert (save_dir / "all_results.csv").is_file()


def test_resume_after_a_torn_write_has_no_duplicates(tiny_model_dir, data_dir, tmp_path):
    save_dir = tmp_path / "results"
    args = _run_args(tiny_model_dir, data_dir, save_dir)
    assert R.main([*args, "--max_num_examples", "2"]) == 0
    out = save_dir / f"{Path(tiny_model_dir).name}_64" / "snapkv" / "multi_news.jsonl"
    first, second = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text(first + second[: len(second) // 2], encoding="utf-8")  # killed mid-write

    # eval tolerates the unfinished last line of a run in progress
    assert E.evaluate_run_dir(out.parent, write=False)["num_samples"] == {"multi_news": 1}

    assert R.main([*args, "--max_num_examples", "3", "--eval"]) == 0
    rows = _lines(out)
    ids = [r["_id"] for r in rows]
    assert len(ids) == 3 == len(set(ids))
    assert out.read_text(encoding="utf-8").startswith(first)  # finished rows untouched
    assert json.loads((out.parent / "results.json").read_text())["num_samples"] == {"multi_news": 3}


# --- prompts, truncation, stops, max length ------------------------------------------------------

def test_middle_truncation_keeps_both_ends():
    tokens = list(range(10))
    assert R.middle_truncate(tokens, 6) == [0, 1, 2, 7, 8, 9]
    assert R.middle_truncate(tokens, 7) == [0, 1, 2, 7, 8, 9]  # official: int(max_length / 2) per side
    assert R.middle_truncate(tokens, 10) == tokens
    assert R.middle_truncate(tokens, 50) == tokens
    assert R.middle_truncate(tokens, 2) == [0, 9]
    with pytest.raises(ValueError):
        R.middle_truncate(tokens, 1)  # half = 0 would keep everything via x[-0:]


def test_prompt_builder_chat_template_and_truncation(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    builder = R.PromptBuilder(tok)
    row = {"context": "word " * 2000, "input": "What is it?"}
    ids, cut = builder.build("multi_news", row, 100)
    text = tok.decode(ids)
    assert cut and len(ids) == 100 + builder.template_overhead()
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "You are given several news passages" in text and "Summary:" in text  # both ends kept

    ids, cut = builder.build("trec", {"context": "Q: x\nType: Date", "input": "y"}, 100)
    assert not cut and "<|im_start|>" not in tok.decode(ids)  # raw prompt for the few-shot tasks


def test_stop_tokens_add_newline_for_samsum_only(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    generation = types.SimpleNamespace(eos_token_id=[2, 7])
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    assert R.stop_token_ids(generation, tok, "multi_news") == [2, 7]
    assert R.stop_token_ids(generation, tok, "samsum") == [2, 7, newline]


@pytest.mark.parametrize("model_path, official", [
    ("llama2-7b-chat-4k", 3500), ("/models/Llama-2-7b-chat-hf/", 3500),       # the name, its hub id's last part
    ("meta-llama/LLAMA-2-7B-CHAT-HF", 3500), ("lmsys/vicuna-7b-v1.5-16k", 15500), ("THUDM/chatglm2-6b", 31500),
    ("THUDM/chatglm2-6b-32k", 31500), ("xgen-7b-8k", 7500),
    ("meta-llama/Llama-2-7b-chat-hf-finetuned", None), ("my-llama2-7b-chat-4k", None),    # no substrings
    ("meta-llama/Meta-Llama-3-8B-Instruct", None), ("mistralai/Mistral-7B-Instruct-v0.2", None),
    ("Qwen/Qwen2.5-7B-Instruct", None), ("smollm2-135m", None)])
def test_max_length_of_the_models_the_official_config_names(model_path, official):
    """LongBench v1's config/model2maxlen.json (8 models) and model2path.json's hub ids, exact names only."""
    assert R.known_max_length(model_path) == official


def test_max_length_rule_for_other_models():
    config = types.SimpleNamespace(max_position_embeddings=8192)
    rule = "max_position_embeddings 8192 - new tokens - 20 chat-template tokens, at most 31500"
    assert R.resolve_max_length("meta-llama/Meta-Llama-3-8B-Instruct", config, "qasper", 128, 20) == (8044, rule)
    long = types.SimpleNamespace(max_position_embeddings=131072)     # Llama 3.1, Qwen2.5: the official maximum
    assert R.resolve_max_length("Qwen2.5-7B-Instruct", long, "gov_report", 512, 30)[0] == 31500
    assert R.resolve_max_length("Llama-2-7b-chat-hf", config, "qasper", 128, 20) == (3500, "model2maxlen.json "
                                                                                          "(Llama-2-7b-chat-hf)")
    assert R.resolve_max_length("x/unknown", config, "qasper", 128, 20, override=300) == (300, "--max_length")
    with pytest.raises(ValueError, match="--max_length"):
        R.resolve_max_length("someone/unknown-model", types.SimpleNamespace(), "qasper", 128, 20)


def test_dataset_selection_and_sampling():
    assert R.resolve_datasets(None) == list(R.ENGLISH_DATASETS) and len(R.ENGLISH_DATASETS) == 16
    assert R.resolve_datasets(["all"]) == list(R.ALL_DATASETS) and len(R.ALL_DATASETS) == 21
    assert R.resolve_datasets(["trec,lcc", "trec"]) == ["trec", "lcc"]
    assert len(R.resolve_datasets(None, longbench_e=True)) == 13
    rows = [{"_id": i} for i in range(10)]
    assert R.select_rows(rows, 3, "topk") == rows[:3]
    picked = R.select_rows(rows, 3, "random", seed=1)
    assert picked == R.select_rows(rows, 3, "random", seed=1) and picked == sorted(picked, key=lambda r: r["_id"])
    assert R.select_rows(rows, 30, "random") == rows


# --- bad input -----------------------------------------------------------------------------------

def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        R.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_unknown_dataset_lists_the_allowed_ones(tmp_path, capsys):
    err = _fails(["--method", "fullkv", "--datasets", "multi_newz", "--data_dir", str(tmp_path)], capsys)
    assert "unknown LongBench dataset 'multi_newz'" in err and "narrativeqa" in err and "repobench-p" in err


def test_missing_data_dir_and_file(tmp_path, capsys):
    err = _fails(["--method", "fullkv", "--datasets", "multi_news", "--data_dir", str(tmp_path / "nope")], capsys)
    assert "does not exist" in err and str(tmp_path / "nope") in err
    err = _fails(["--method", "fullkv", "--datasets", "qasper", "--data_dir", str(tmp_path)], capsys)
    assert "qasper.jsonl not found" in err


def test_malformed_jsonl_names_file_and_line(data_dir, capsys):
    path = data_dir / "multi_news.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text(lines[0] + "{not json\n" + lines[1], encoding="utf-8")
    err = _fails(["--method", "fullkv", "--datasets", "multi_news", "--data_dir", str(data_dir)], capsys)
    assert f"{path}:2: malformed JSON line" in err


def test_row_without_required_field(data_dir, capsys):
    (data_dir / "multi_news.jsonl").write_text(json.dumps({"_id": "x", "context": "c", "input": ""}) + "\n")
    err = _fails(["--method", "fullkv", "--datasets", "multi_news", "--data_dir", str(data_dir)], capsys)
    assert "row 1 lacks field(s) answers, length" in err


def test_hub_failure_is_a_clear_error(monkeypatch, capsys):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    err = _fails(["--method", "fullkv", "--datasets", "trec"], capsys)
    assert "THUDM/LongBench" in err and "Offline?" in err and "--data_dir" in err


def test_eval_reports_malformed_line_and_missing_results(tmp_path, capsys):
    run = tmp_path / "m_128" / "snapkv"
    run.mkdir(parents=True)
    good = json.dumps({"_id": "a", "pred": "Paris", "answers": ["Paris"], "all_classes": None, "length": 5})
    (run / "hotpotqa.jsonl").write_text(good + "\n{oops\n" + good.replace('"a"', '"b"') + "\n")
    with pytest.raises(SystemExit):
        E.main([str(run)])
    assert f"{run / 'hotpotqa.jsonl'}:2: malformed JSON line" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        E.main(["--results_dir", str(tmp_path / "empty")])
    assert "does not exist" in capsys.readouterr().err


def test_eval_names_the_run_from_folders_without_run_meta(tmp_path):
    run = tmp_path / "Llama-3-8B_2048" / "pyramidkv"
    run.mkdir(parents=True)
    rows = [{"_id": "a", "pred": "Paragraph 2", "answers": ["Paragraph 2"], "all_classes": [], "length": 9000},
            {"_id": "b", "pred": "Paragraph 1", "answers": ["Paragraph 2"], "all_classes": [], "length": 100}]
    (run / "passage_retrieval_en.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "passage_retrieval_en_e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = E.evaluate_run_dir(run)
    assert (result["model"], result["method"], result["budget"]) == ("Llama-3-8B", "pyramidkv", 2048)
    assert result["scores"] == {"passage_retrieval_en": 50.0} and result["average"] == 50.0
    result_e = E.evaluate_run_dir(run, longbench_e=True)
    assert result_e["scores"] == {"passage_retrieval_en": {"0-4k": 0.0, "4-8k": None, "8k+": 100.0}}
    assert (run / "results_e.json").is_file() and (run / "results.json").is_file()


# --- results integrity and the official layouts --------------------------------------------------


def _write_rows(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def _eval_cli(*args: str):
    import subprocess

    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_eval_cli_refuses_a_repeated_id(tmp_path):
    run = tmp_path / "m_128" / "snapkv"
    row = {"_id": "a", "pred": "Paris", "answers": ["Paris"], "all_classes": None, "length": 5}
    _write_rows(run / "hotpotqa.jsonl", [row, {**row, "_id": "b", "pred": "x"}, {**row, "pred": "London"}])
    done = _eval_cli("--results_dir", str(tmp_path))
    assert done.returncode == 2, done.stdout
    assert f"{run / 'hotpotqa.jsonl'}:3: repeated _id 'a' (first on line 1)" in done.stderr
    assert not (run / "results.json").exists()


def test_eval_refuses_bare_string_answers_naming_file_and_line(tmp_path, capsys):
    run = tmp_path / "m_128" / "snapkv"
    rows = [{"_id": "a", "pred": "Paris", "answers": ["Paris"], "all_classes": None, "length": 5},
            {"_id": "b", "pred": "Paris", "answers": "Paris", "all_classes": None, "length": 5}]
    _write_rows(run / "hotpotqa.jsonl", rows)
    with pytest.raises(SystemExit):
        E.main([str(run)])
    err = capsys.readouterr().err
    assert f"{run / 'hotpotqa.jsonl'}:2: 'answers' must be a list" in err and "'Paris'" in err


def test_data_loader_refuses_bare_string_answers(data_dir):
    path = data_dir / "multi_news.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    bad = json.loads(lines[1])
    bad["answers"] = bad["answers"][0]
    path.write_text(lines[0] + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"multi_news.jsonl: row 2: 'answers' must be a list .*got str"):
        R.load_rows("multi_news", data_dir)


def test_eval_names_a_non_utf8_prediction_file(tmp_path, capsys):
    run = tmp_path / "m_128" / "snapkv"
    good = json.dumps({"_id": "a", "pred": "Paris", "answers": ["Paris"], "all_classes": None, "length": 5})
    run.mkdir(parents=True)
    (run / "hotpotqa.jsonl").write_bytes(good.encode() + b"\n" + good.replace("Paris", "Par\xefs").encode("latin-1") + b"\n")
    with pytest.raises(SystemExit):
        E.main([str(run)])
    err = capsys.readouterr().err
    assert f"{run / 'hotpotqa.jsonl'}:2: not UTF-8" in err


def test_eval_e_accepts_the_official_pred_e_layout(tmp_path):
    rows = [{"_id": "a", "pred": "Paragraph 2", "answers": ["Paragraph 2"], "all_classes": [], "length": 9000},
            {"_id": "b", "pred": "Paragraph 1", "answers": ["Paragraph 2"], "all_classes": [], "length": 100}]
    official = tmp_path / "pred_e" / "llama-3-8b"
    _write_rows(official / "passage_retrieval_en.jsonl", rows)
    ours = tmp_path / "ours" / "llama-3-8b_128" / "snapkv"
    _write_rows(ours / "passage_retrieval_en_e.jsonl", rows)
    expected = {"passage_retrieval_en": {"0-4k": 0.0, "4-8k": None, "8k+": 100.0}}
    for root in (tmp_path / "pred_e", official, ours):
        assert E.main(["--e", str(root)]) == 0
    assert json.loads((official / "results_e.json").read_text())["scores"] == expected
    assert json.loads((official / "results_e.json").read_text())["model"] == "llama-3-8b"
    assert json.loads((ours / "results_e.json").read_text())["scores"] == expected
    # outside pred_e, a plain {dataset}.jsonl is a LongBench (not -E) file and --e ignores it
    plain = tmp_path / "plain" / "m_128" / "snapkv"
    _write_rows(plain / "passage_retrieval_en.jsonl", rows)
    with pytest.raises(FileNotFoundError):
        E.find_run_dirs(tmp_path / "plain", longbench_e=True)


def _calls(log: Path) -> list[str]:
    """The runner command lines the fake python recorded (not the registry queries of method_takes_budget)."""
    return [line for line in log.read_text().splitlines() if not line.startswith("-c ")]


def _fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """A PYTHON stand-in for the eval.sh scripts that records each command line."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake_python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "{log}"\n')
    fake.chmod(0o755)
    return fake, log


@pytest.mark.parametrize("source_suffix", ["", "/"])
def test_longbench_eval_sh_joins_source_path_and_uses_public_harness_settings(tmp_path, source_suffix):
    import os
    import subprocess

    fake, log = _fake_python(tmp_path)
    source = tmp_path / "src"
    env = {**os.environ, "PYTHON": str(fake)}
    expected_settings = {"SnapKV": "--window_sizes 8 --kernel_sizes 7 --pooling max",
                         "pyramidkv": "--window_sizes 8 --kernel_sizes 7 --pooling max",
                         "H2O": "--window_sizes 8", "StreamingLLM": "", "l2norm": "", "FullKV": ""}
    for method, settings in expected_settings.items():
        log.unlink(missing_ok=True)
        subprocess.run(["bash", str(ROOT / "scripts/scripts_longBench/eval.sh"), "", method, "128", "sdpa",
                        f"{source}{source_suffix}", "some-model", "--datasets", "trec"],
                       check=True, env=env, cwd=tmp_path, timeout=60)
        run_call, eval_call = _calls(log)
        assert f"--save_dir {source}/results_long_bench --datasets trec" in run_call
        assert eval_call.endswith(f"eval.py --results_dir {source}/results_long_bench")
        for flag in ("--window_sizes", "--kernel_sizes", "--pooling"):
            assert (flag in run_call) == (flag in settings), (method, run_call)
        assert settings in run_call


def test_ruler_and_needle_eval_sh_use_public_harness_settings(tmp_path):
    import os
    import subprocess

    fake, log = _fake_python(tmp_path)
    env = {**os.environ, "PYTHON": str(fake)}
    subprocess.run(["bash", str(ROOT / "scripts/scripts_ruler/eval.sh"), "", "snapkv", "128", "sdpa",
                    str(tmp_path / "src"), "m"], check=True, env=env, cwd=tmp_path, timeout=60)
    call = _calls(log)[-1]
    assert f"--save_dir {tmp_path}/src/results_ruler" in call
    assert "--window_sizes 8 --kernel_sizes 7 --pooling max" in call
    subprocess.run(["bash", str(ROOT / "scripts/scripts_needle/eval.sh"), "", "h2o", "128", "sdpa", "m"],
                   check=True, env=env, cwd=tmp_path, timeout=60)
    assert all("--window_sizes 8 " in c and "--kernel_sizes" not in c for c in _calls(log)[1:3])


def test_default_results_folders_are_git_ignored():
    import subprocess

    for folder in ("results_long_bench", "results_ruler", "results"):
        done = subprocess.run(["git", "check-ignore", "-q", f"{folder}/x/y.jsonl"], cwd=ROOT, timeout=30)
        assert done.returncode == 0, f"{folder}/ is not git-ignored"
