"""run_ruler.py end to end on a tiny random Llama: outputs, resume after kill -9, data files, eval.sh, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyramidkv.benchmarks.ruler.run import main
from tests.helpers import ROOT, kill_after_rows


def _args(model_dir, save_dir, *extra, method=("--method", "snapkv", "--max_capacity_prompts", "64")):
    return ["--model_path", model_dir, *method, "--save_dir", str(save_dir), "--num_threads", "1",
            "--device", "cpu", *extra]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_end_to_end_outputs_and_rescore(tiny_model_dir, tmp_path, monkeypatch):
    argv = _args(tiny_model_dir, tmp_path, "--tasks", "niah_single_1", "vt", "--context_lengths", "1024",
                 "--num_samples", "3", "--eval_batch_size", "2")
    assert main(argv) == 0
    run = tmp_path / f"{Path(tiny_model_dir).name}_64" / "snapkv"
    for task, max_new in (("niah_single_1", 128), ("vt", 30)):
        rows = _lines(run / f"{task}_1024.jsonl")
        assert sorted(r["index"] for r in rows) == [0, 1, 2]
        for r in rows:
            assert set(r) == {"index", "pred", "outputs", "length", "prompt_tokens", "kv_bytes", "block_free_16",
                              "block_free_32"}
            # a free 32-token block is two free 16-token blocks: the share at 32 is never above the share at 16
            assert 0.0 <= r["block_free_32"] <= r["block_free_16"] <= 1.0
            assert r["prompt_tokens"] + max_new == r["length"] <= 1024
            assert r["kv_bytes"] > 0 and isinstance(r["pred"], str)
        data = _lines(tmp_path / "data" / Path(tiny_model_dir).name / f"{task}_1024.jsonl")
        assert [d["outputs"] for d in data] == [r["outputs"] for r in sorted(rows, key=lambda r: r["index"])]
    result = json.loads((run / "results.json").read_text())
    assert result["benchmark"] == "ruler" and result["method"] == "snapkv" and result["budget"] == 64
    assert result["model"] == Path(tiny_model_dir).name
    assert set(result["scores"]) == {"niah_single_1@1024", "vt@1024"}
    assert result["num_samples"] == {"niah_single_1@1024": 3, "vt@1024": 3}
    assert all(0 <= s <= 100 for s in result["scores"].values())
    assert result["average"] == round(sum(result["scores"].values()) / 2, 2)
    csv_lines = (run / "results.csv").read_text().splitlines()
    assert csv_lines[0] == "task,length,score,num_samples" and csv_lines[-1].startswith("average,,")
    meta = json.loads((run / "run_meta.json").read_text())
    assert meta["arguments"]["tasks"] == ["niah_single_1", "vt"] and meta["method"]["budget"] == 64

    # Everything done: a rerun only rescores, without loading the model.
    import pyramidkv

    monkeypatch.setattr(pyramidkv, "load_model", lambda *a, **k: pytest.fail("model loaded for nothing"))
    before = {p.name: p.read_bytes() for p in run.glob("*.jsonl")}
    assert main(argv) == 0
    assert {p.name: p.read_bytes() for p in run.glob("*.jsonl")} == before
    assert json.loads((run / "results.json").read_text())["scores"] == result["scores"]

    # Other samples (another seed) into the same folder: refused, not mixed.
    with pytest.raises(SystemExit):
        main(argv + ["--seed", "5"])


def test_resume_after_kill_9(tiny_model_dir, tmp_path):
    num = 16
    cmd = [sys.executable, str(ROOT / "run_ruler.py"),
           *_args(tiny_model_dir, tmp_path, "--tasks", "niah_single_1", "--context_lengths", "512",
                  "--num_samples", str(num))]
    out = tmp_path / f"{Path(tiny_model_dir).name}_64" / "snapkv" / "niah_single_1_512.jsonl"
    partial = kill_after_rows(cmd, out)
    done_before = partial.count(b"\n")
    assert 2 <= done_before < num
    # As if the kill had landed mid-write: a torn last line.
    with open(out, "ab") as f:
        f.write(b'{"index": 7, "pred": "tor')
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    rows = _lines(out)                                       # every line parses
    indices = [r["index"] for r in rows]
    assert len(rows) == num and len(set(indices)) == num and set(indices) == set(range(num))
    assert out.read_bytes().startswith(partial)              # finished rows were kept, not redone
    result = json.loads((out.parent / "results.json").read_text())
    assert result["num_samples"] == {"niah_single_1@512": num}


def test_ruler_format_data_file(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from pyramidkv.benchmarks.ruler.generate import PromptFormatter, generate_rows

    rows = generate_rows("niah_single_2", 1024, 2, PromptFormatter(AutoTokenizer.from_pretrained(tiny_model_dir)))
    path = tmp_path / "elsewhere" / "1024" / "data" / "niah_single_2" / "validation.jsonl"
    path.parent.mkdir(parents=True)
    with open(path, "w") as f:
        for r in rows:   # RULER's own rows: the answer prefix apart from the input, no task/max_new_tokens
            cut = r["input"].rindex("The special magic")
            f.write(json.dumps({"index": r["index"], "input": r["input"][:cut], "outputs": r["outputs"],
                                "length": r["length"], "answer_prefix": r["input"][cut:]}) + "\n")
    assert main(_args(tiny_model_dir, tmp_path / "out", "--data_file", str(path))) == 0
    run = tmp_path / "out" / f"{Path(tiny_model_dir).name}_64" / "snapkv"
    preds = _lines(run / "niah_single_2_1024.jsonl")
    assert [p["prompt_tokens"] + 128 for p in preds] == [r["length"] for r in rows]   # same prompt as generated
    assert json.loads((run / "results.json").read_text())["num_samples"] == {"niah_single_2@1024": 2}

    # --data_dir with this project's own layout ({task}_{length}.jsonl)
    data_dir = tmp_path / "mine"
    data_dir.mkdir()
    (data_dir / "niah_single_2_1024.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(_args(tiny_model_dir, tmp_path / "out2", "--data_dir", str(data_dir), "--tasks", "niah_single_2",
                      "--context_lengths", "1024", "--num_samples", "1")) == 0


def test_eval_sh(tiny_model_dir, tmp_path):
    source = f"{tmp_path}/"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "scripts_ruler" / "eval.sh"), "0", "fullkv", "128", "sdpa", source,
         tiny_model_dir, "--tasks", "niah_single_1", "--context_lengths", "512", "--num_samples", "1",
         "--num_threads", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fullkv takes no budget" in done.stderr
    result = tmp_path / "results_ruler" / f"{Path(tiny_model_dir).name}_full" / "fullkv" / "results.json"
    assert json.loads(result.read_text())["scores"].keys() == {"niah_single_1@512"}
    usage = subprocess.run(["bash", str(ROOT / "scripts" / "scripts_ruler" / "eval.sh"), "0"],
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_bad_inputs(tiny_model_dir, tmp_path, capsys):
    err = _run_error(_args(tiny_model_dir, tmp_path, "--tasks", "niah_single_9"), capsys)
    assert "unknown RULER task 'niah_single_9'" in err and "niah_single_1" in err and "fwe" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, "--context_lengths", "16384"), capsys)
    assert "16384" in err and "max_position_embeddings = 8192" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, "--tasks", "qa_1", "--context_lengths", "1024"), capsys)
    assert "qa_1 needs a SQuAD v2.0 json" in err and "--squad_file" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, "--tasks", "qa_2", "--context_lengths", "1024",
                           "--hotpot_file", str(tmp_path / "nope.json")), capsys)
    assert "nope.json" in err
    bad = tmp_path / "vt_1024.jsonl"
    bad.write_text(json.dumps({"index": 0, "input": "x", "outputs": ["A"]}) + "\n{broken\n")
    err = _run_error(_args(tiny_model_dir, tmp_path, "--data_file", str(bad)), capsys)
    assert f"{bad}:2: malformed JSON" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, method=("--method", "fullkv", "--max_capacity_prompts", "64")),
                     capsys)
    assert "fullkv keeps every token" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, "--data_file", str(bad), "--tasks", "vt"), capsys)
    assert "--tasks does not apply with --data_file" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, "--squad_file", str(bad)), capsys)
    assert "--squad_file given but the matching task is not in --tasks" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, "--num_samples", "0"), capsys)
    assert "--num_samples must be >= 1" in err
    err = _run_error(_args(str(tmp_path / "no-model"), tmp_path), capsys)
    assert "does not exist" in err
    # A malformed prediction file (not a torn last line) is reported with its line, not overwritten.
    run = tmp_path / f"{Path(tiny_model_dir).name}_64" / "snapkv"
    run.mkdir(parents=True)
    (run / "niah_single_1_1024.jsonl").write_text('{"index": 100, "outputs": []}\n{oops}\n{"index": 101}\n')
    err = _run_error(_args(tiny_model_dir, tmp_path, "--tasks", "niah_single_1", "--context_lengths", "1024",
                           "--num_samples", "1"), capsys)
    assert "niah_single_1_1024.jsonl:2: malformed JSON" in err


def test_system_prompt_flag(tiny_model_dir, tmp_path, capsys):
    from pyramidkv.benchmarks.ruler.run import build_parser

    args = build_parser().parse_args(_args(tiny_model_dir, tmp_path, "--system_prompt", "Answer briefly."))
    assert vars(args)["system_prompt"] == "Answer briefly."      # recorded in run_meta.json with vars(args)
    assert build_parser().parse_args(_args(tiny_model_dir, tmp_path)).system_prompt is None   # RULER: none
    common = ("--tasks", "niah_single_1", "--context_lengths", "512", "--num_samples", "1")
    err = _run_error(_args(tiny_model_dir, tmp_path, *common, "--no_chat_template", "--system_prompt", "Hi."),
                     capsys)
    assert "--system_prompt needs the chat template" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, *common, "--system_prompt", " "), capsys)
    assert "--system_prompt ' ' is empty" in err


def test_merge_flags_reach_the_method_and_get_their_own_folder(tiny_model_dir, tmp_path, capsys):
    common = ("--tasks", "vt", "--context_lengths", "1024", "--num_samples", "1")
    assert main(_args(tiny_model_dir, tmp_path, *common)) == 0
    assert main(_args(tiny_model_dir, tmp_path, *common, "--merge", "mergingpress", "--merge_fraction", "0.5")) == 0
    assert main(_args(tiny_model_dir, tmp_path, *common, method=("--method", "cam", "--max_capacity_prompts", "64",
                                                                 "--merge_sampling", "--merge_seed", "3"))) == 0
    budget_dir = tmp_path / f"{Path(tiny_model_dir).name}_64"
    assert sorted(p.name for p in budget_dir.iterdir()) == [
        "cam_sampling=True_seed=3", "snapkv", "snapkv_merge=mergingpress-merge_fraction=0.5"]
    meta = json.loads((budget_dir / "snapkv_merge=mergingpress-merge_fraction=0.5" / "run_meta.json").read_text())
    assert meta["method"]["merge"] == {"name": "mergingpress", "similarity_threshold": 0.0, "merge_fraction": 0.5}
    assert json.loads((budget_dir / "snapkv" / "run_meta.json").read_text())["method"]["merge"] is None
    cam = json.loads((budget_dir / "cam_sampling=True_seed=3" / "run_meta.json").read_text())["method"]["merge"]
    assert cam == {"name": "cam", "start_budget_ratio": 0.1, "merge_budget": None, "sampling": True, "seed": 3}
    err = _run_error(_args(tiny_model_dir, tmp_path, "--merge_fraction", "0.5"), capsys)
    assert "merge_fraction is a setting of the merge rule mergingpress" in err
    err = _run_error(_args(tiny_model_dir, tmp_path, "--merge", "mergingpress", "--similarity_threshold", "2"), capsys)
    assert "similarity_threshold must be in [-1, 1] (a cosine similarity), got 2.0" in err
    with pytest.raises(SystemExit):
        main(_args(tiny_model_dir, tmp_path, "--merge", "average"))
    assert "invalid choice: 'average'" in capsys.readouterr().err
