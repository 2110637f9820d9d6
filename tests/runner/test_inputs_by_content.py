"""Every run is labelled by what it really did (issue 25): the files it reads enter its fingerprint by content,
packaged tables find a model by its content (never its folder's name), results carry the method's label, result
files get the permissions any file gets, and a stored setting is never replaced by today's default."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from pyramidkv.benchmarks.ruler.run import main as ruler_main


def _data(folder: Path, n: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "niah_single_1_256.jsonl"
    rows = [{"index": i, "input": f"The magic number is {7 * i + 11}. Repeat it: the magic number is",
             "outputs": [str(7 * i + 11)], "length": 40, "max_new_tokens": 2} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _patterns(path: Path, vertical: int) -> str:
    """A pattern table for the 2-layer, 4-head tiny model."""
    path.write_text(json.dumps([{str(h): ["vertical_and_slash", vertical, 8, 1.0] for h in range(4)}
                                for _ in range(2)]))
    return str(path)


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ruler_main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# --- item 1: an input's content is in the fingerprint -----------------------------------------------------

def test_a_pattern_table_edited_in_place_or_read_from_another_folder_is_refused(tiny_model_dir, tmp_path,
                                                                               monkeypatch, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    data = _data(tmp_path / "data")
    argv = ["--model_path", tiny_model_dir, "--device", "cpu", "--method", "minference", "--pattern_table", "t.json",
            "--data_file", str(data), "--num_samples", "1", "--save_dir", str(tmp_path / "out")]
    monkeypatch.chdir(first)
    _patterns(first / "t.json", 4)
    assert ruler_main(argv) == 0
    run = tmp_path / "out" / f"{Path(tiny_model_dir).name}_full" / "minference_pattern_table=t.json"
    meta = json.loads((run / "run_meta.json").read_text())
    assert meta["input_files"]["pattern_table=t.json"] == str(first / "t.json")     # recorded resolved
    preds = (run / "niah_single_1_256.jsonl").read_bytes()

    _patterns(first / "t.json", 16)                                                 # edited in place
    err = _refused([*argv[:-3], "2", *argv[-2:]], capsys)
    assert "holds results of another configuration (input file pattern_table=t.json: " in err
    assert (run / "niah_single_1_256.jsonl").read_bytes() == preds

    monkeypatch.chdir(second)                                                       # same path, another folder
    _patterns(second / "t.json", 8)
    assert "input file pattern_table=t.json: " in _refused(argv, capsys)
    _patterns(second / "t.json", 4)                                                 # the same content: resumes
    assert ruler_main([*argv[:-3], "2", *argv[-2:]]) == 0
    assert len((run / "niah_single_1_256.jsonl").read_text().splitlines()) == 2


def test_benchmark_data_files_and_folders_are_fingerprinted_by_content(tiny_model_dir, tmp_path, capsys):
    data = _data(tmp_path / "data")
    argv = ["--model_path", tiny_model_dir, "--device", "cpu", "--method", "snapkv", "--max_capacity_prompts", "8",
            "--window_sizes", "4", "--data_file", str(data), "--num_samples", "1", "--save_dir", str(tmp_path / "o")]
    assert ruler_main(argv) == 0
    # Same references (the sample check passes), another prompt: the file's content differs.
    data.write_text(data.read_text().replace("Repeat it", "Say it again"))
    assert f"input file --data_file={data}: " in _refused(argv, capsys)

    folder = tmp_path / "folder"
    _data(folder)
    argv = [*argv[:-6], "--data_dir", str(folder), "--tasks", "niah_single_1", "--context_lengths", "256",
            "--num_samples", "1", "--save_dir", str(tmp_path / "o2")]
    assert ruler_main(argv) == 0
    (folder / "niah_single_1_256.jsonl").write_text((folder / "niah_single_1_256.jsonl").read_text()
                                                    .replace("magic", "secret"))
    assert f"input file --data_dir={folder}/niah_single_1_256.jsonl: " in _refused(argv, capsys)


def test_a_fingerprint_from_before_input_digests_keeps_its_head_table_digest():
    """A run folder written when only a head table was digested ("head_scores_file") compares that digest."""
    from pyramidkv.runner.run_folder import fingerprint_differences

    method = {"method": "headkv", "head_allocation": {"name": "headkv", "head_scores": "t.json"}}
    old = {"method": method, "head_scores_file": "10:aa"}
    assert fingerprint_differences(old, {"method": method, "input_files": {"head_scores=t.json": "10:aa"}}) == []
    assert fingerprint_differences(old, {"method": method, "input_files": {"head_scores=t.json": "11:bb"}}) == [
        "input file head_scores=t.json: '10:aa' -> '11:bb'"]


# --- item 10: a model is known by its content, not its folder's name --------------------------------------

def _linked(source: str, folder: Path) -> Path:
    """The files of `source` in a folder of another name (symbolic links: the same content)."""
    folder.mkdir()
    for path in Path(source).iterdir():
        if path.is_file():
            (folder / path.name).symlink_to(path)
    return folder


def test_the_default_model_in_a_folder_of_any_name_finds_its_tables(smollm2_path, tmp_path):
    from pyramidkv.allocation.head_tables import PACKAGED_TABLES_DIR, default_head_scores_path
    from pyramidkv.sparse_prefill.tables import PACKAGED_PATTERNS_DIR, default_pattern_table

    folder = _linked(smollm2_path, tmp_path / "my-cache")       # as $PYRAMIDKV_MODEL_CACHE may name it
    assert default_head_scores_path(str(folder)) == PACKAGED_TABLES_DIR / "smollm2-135m_reasoning.json"
    assert default_pattern_table(str(folder)) == PACKAGED_PATTERNS_DIR / "smollm2-135m.json"


def test_a_folder_named_like_the_default_model_with_other_content_is_refused(smollm2_path, tiny_model_dir, tmp_path):
    from pyramidkv.allocation.head_tables import default_head_scores_path
    from pyramidkv.sparse_prefill.tables import default_pattern_table

    config = _linked(smollm2_path, tmp_path / "smollm2-135m-longer")          # another config, the same weights
    (config / "config.json").unlink()
    settings = json.loads(Path(smollm2_path, "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**settings, "rope_theta": 2 * settings["rope_theta"]}))
    weights = _linked(smollm2_path, tmp_path / "SmolLM2-135M-finetune")       # the same config, other weights
    (weights / "model.safetensors").unlink()
    shutil.copy(Path(tiny_model_dir, "model.safetensors"), weights / "model.safetensors")
    for folder in (config, weights):
        for find, flag in ((default_head_scores_path, "--head_path FILE"), (default_pattern_table, "pattern_table=FILE")):
            with pytest.raises(ValueError) as e:
                find(str(folder))
            assert f"'{folder}' is named like smollm2-135m but is not the model" in str(e.value) and flag in str(e.value)
    with pytest.raises(ValueError, match="no smollm2|no packaged MInference|no reasoning head-score table"):
        default_head_scores_path(tiny_model_dir)                              # no look-alike: as before


def test_a_conversion_record_names_the_model_while_its_content_is_unchanged(tiny_model_dir, tmp_path):
    """The default model's conversion records its name and digest: a conversion that differs in a byte from the
    packaged digest is still known, until its weights change."""
    from pyramidkv.allocation.head_tables import default_head_scores_path
    from pyramidkv.components import MODEL_RECORD, model_digest

    folder = tmp_path / "converted"
    shutil.copytree(tiny_model_dir, folder)
    (folder / MODEL_RECORD).write_text(json.dumps({"model": "smollm2-135m", "content_digest": model_digest(folder)}))
    assert default_head_scores_path(str(folder)).name == "smollm2-135m_reasoning.json"
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="no reasoning head-score table"):
        default_head_scores_path(str(folder))


# --- item 9: results carry the method's label; result files get a normal file's permissions ---------------

def test_results_and_the_closing_line_carry_the_variant(tiny_model_dir, tmp_path, capsys):
    from pyramidkv.viz.needle import run_identity

    data = _data(tmp_path / "data")
    argv = ["--model_path", tiny_model_dir, "--device", "cpu", "--method", "snapkv", "--max_capacity_prompts", "8",
            "--window_sizes", "4", "--merge", "pivot", "--data_file", str(data), "--save_dir", str(tmp_path / "o")]
    capsys.readouterr()
    assert ruler_main(argv) == 0
    run = tmp_path / "o" / f"{Path(tiny_model_dir).name}_8" / "snapkv_window_size=4_merge=pivot"
    result = json.loads((run / "results.json").read_text())
    assert result["method"] == "snapkv_window_size=4_merge=pivot"
    assert result["method_spec"] == "snapkv:budget=8,window_size=4,merge=pivot"
    assert " / snapkv_window_size=4_merge=pivot / budget 8" in capsys.readouterr().out
    assert run_identity(run)["method"] == "snapkv_window_size=4_merge=pivot"         # what grid titles show
    (run / "results.json").unlink()
    assert run_identity(run)["method"] == "snapkv_window_size=4_merge=pivot"         # from run_meta.json


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_writes_get_the_permissions_open_gives(tmp_path, umask):
    from pyramidkv.runner.results import atomic_write_json

    old = os.umask(umask)
    try:
        with open(tmp_path / "plain.jsonl", "w") as f:
            f.write("{}\n")
        atomic_write_json(tmp_path / "results.json", {})
    finally:
        os.umask(old)
    mode = lambda name: stat.S_IMODE((tmp_path / name).stat().st_mode)  # noqa: E731
    assert mode("results.json") == mode("plain.jsonl") == 0o666 & ~umask


# --- item 11: a stored setting is never replaced by today's default ----------------------------------------

def test_a_stored_non_default_setting_is_not_overridden_by_todays_default(tmp_path):
    """A folder made when snapkv's window_size default was 8 (stored: 8) resumed by a run that leaves it at
    today's default (32): the stored value is what made its rows, so the resume is refused."""
    from pyramidkv import make_method
    from pyramidkv.runner.run_folder import RunFolderError, open_run_folder

    method = make_method("snapkv", budget=64)
    assert method.window_size == 32 and "window_size" in method.settings_at_default()
    now = {"method": method.describe(), "arguments": {}, "model_files": {}}
    stored = json.loads(json.dumps(now))
    stored["method"]["window_size"] = 8
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run_meta.json").write_text(json.dumps({"fingerprint": stored}))
    (folder / "niah_single_1_256.jsonl").write_text('{"index": 0, "pred": "x"}\n')
    with pytest.raises(RunFolderError, match=r"another configuration \(method\.window_size: 8 -> 32\)"):
        open_run_folder(folder, now, method_at_default=method.settings_at_default())
    assert not (folder / ".run.lock").exists()
