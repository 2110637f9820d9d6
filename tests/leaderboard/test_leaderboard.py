"""The leaderboard end to end on the tiny model: the CSV, the figure and the page; a killed unit resumed; two
shards merged equal to one run; a failed cell recorded, never dropped; bad input refused in one line before any
weights load. The committed page and figure must be what the committed CSV gives."""

import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyramidkv.leaderboard.grid import Grid
from pyramidkv.leaderboard.outputs import render
from pyramidkv.leaderboard.table import read_csv

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"unit_seconds", "prefill_ms", "decode_ms_per_token"}


def leaderboard(*args, check=True):
    """python -m pyramidkv.leaderboard ARGS, in this process (the imports are paid once): (exit status, out, err)."""
    import contextlib
    import io
    import types

    from pyramidkv.leaderboard.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    got = types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    if check and code != 0:
        raise AssertionError(got.stderr[-3000:])
    return got


def cells(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def grid_args(tiny_model_dir):
    return ["--model_path", tiny_model_dir, "--methods", "snapkv", "streamingllm", "--ratios", "0.25", "0.5",
            "--tasks", "niah_single_1", "--context_length", 512, "--num_samples", 2]


@pytest.fixture(scope="module")
def whole(tmp_path_factory, grid_args):
    out = tmp_path_factory.mktemp("leaderboard")
    leaderboard(*grid_args, "--save_dir", out)
    return out


def test_a_run_writes_every_cell_the_figure_and_the_page(whole):
    rows = cells(whole / "leaderboard.csv")
    assert [(r["spec"], r["task"]) for r in rows] == [
        ("fullkv", "niah_single_1"), ("snapkv:budget_ratio=0.25", "niah_single_1"),
        ("snapkv:budget_ratio=0.5", "niah_single_1"), ("streamingllm:budget_ratio=0.25", "niah_single_1"),
        ("streamingllm:budget_ratio=0.5", "niah_single_1")]
    assert {r["status"] for r in rows} == {"done"} and {r["samples"] for r in rows} == {"2"}
    by_spec = {r["spec"]: r for r in rows}
    assert float(by_spec["fullkv"]["kl"]) == 0.0 and float(by_spec["fullkv"]["agreement"]) == 1.0
    assert float(by_spec["snapkv:budget_ratio=0.25"]["kl"]) > 0
    # bytes held follow the fraction kept (a quarter of the prompt holds less than half of it)
    assert float(by_spec["snapkv:budget_ratio=0.25"]["kv_bytes_x_fullkv"]) < \
        float(by_spec["snapkv:budget_ratio=0.5"]["kv_bytes_x_fullkv"]) < 1.0
    # the teacher-forced KL of each row is what the run folder's rows hold, averaged
    folder = next((whole / "runs" / "ruler").glob("*_r0.25/snapkv"))
    kls = [json.loads(line)["kl_vs_fullkv"] for line in (folder / "niah_single_1_512.jsonl").open()]
    assert float(by_spec["snapkv:budget_ratio=0.25"]["kl"]) == pytest.approx(sum(kls) / 2, rel=1e-5)
    page = (whole / "leaderboard.md").read_text()
    assert "| snapkv @ 0.25 | 0.25 |" in page and "samples per cell: 2" in page
    assert (whole / "leaderboard.svg").read_bytes().startswith(b"<?xml")
    record = json.loads((whole / "leaderboard.json").read_text())
    assert [u["state"] for u in record["units"]] == ["done"] * 5


def test_a_killed_unit_resumes_to_the_same_csv(whole, grid_args, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    before = cells(whole / "leaderboard.csv")
    # kill -9 in the middle of snapkv@0.5: no status written, its second row torn mid-line
    (copy / "status" / "ruler__snapkv@0.5.json").unlink()
    rows = next((copy / "runs" / "ruler").glob("*_r0.5/snapkv")) / "niah_single_1_512.jsonl"
    first, second = rows.read_text().splitlines(keepends=True)
    rows.write_text(first + second[:25])
    (copy / "leaderboard.csv").unlink()
    got = leaderboard(*grid_args, "--save_dir", copy)
    assert got.stdout.count("[leaderboard] unit") == 1        # only the killed unit ran again
    assert "1 sample(s) in" in got.stdout and "1 already done" in got.stdout
    assert cells(copy / "leaderboard.csv") == [{**r, "git_commit": r["git_commit"]} for r in before]
    assert len(rows.read_text().splitlines()) == 2


def test_two_shards_merged_equal_one_run(whole, grid_args, tmp_path):
    out = tmp_path / "sharded"
    counted = leaderboard(*grid_args, "--save_dir", out, "--count")
    assert counted.stdout.strip() == "5 units"
    for shard in ("0/2", "1/2"):
        got = leaderboard(*grid_args, "--save_dir", out, "--shard", shard)
        assert not (out / "leaderboard.csv").exists()            # a shard leaves the outputs to the summary
    leaderboard("--save_dir", out, "--summarize")
    assert cells(out / "leaderboard.csv") == cells(whole / "leaderboard.csv")


def test_a_failed_cell_is_recorded_not_dropped(grid_args, tmp_path):
    out = tmp_path / "failing"
    folder = leaderboard(*grid_args[:2], "--tasks", "niah_single_1", "--context_length", 512,
                         "--num_samples", 1, "--methods", "streamingllm", "--ratios", 0.5, "--save_dir", out,
                         "--count")
    assert folder.stdout.strip() == "2 units"
    # a regular file where streamingllm's run folder must go: that unit's runner fails, fullkv's runs
    blocked = out / "runs" / "ruler" / "tiny-llama0_r0.5" / "streamingllm"
    got = subprocess.run([sys.executable, "run_ruler.py", *grid_args[:2], "--method", "streamingllm",
                          "--max_capacity_prompts_ratio", "0.5", "--save_dir", out / "runs" / "ruler",
                          "--print_run_dir"], cwd=ROOT, capture_output=True, text=True)
    blocked = Path(got.stdout.strip().splitlines()[-1])
    blocked.parent.mkdir(parents=True)
    blocked.write_text("in the way")
    got = leaderboard(*grid_args[:2], "--tasks", "niah_single_1", "--context_length", 512, "--num_samples", 1,
                      "--methods", "streamingllm", "--ratios", 0.5, "--save_dir", out, check=False)
    assert got.returncode == 1 and "1 cell(s) failed" in got.stderr
    rows = {r["spec"]: r for r in cells(out / "leaderboard.csv")}
    assert rows["fullkv"]["status"] == "done"
    assert rows["streamingllm:budget_ratio=0.5"]["status"] == "failed"
    assert str(blocked) in rows["streamingllm:budget_ratio=0.5"]["error"]
    assert "| failed: " in (out / "leaderboard.md").read_text()
    assert b"#ff0000" in (out / "leaderboard.svg").read_bytes()     # the red cross of a failed cell


@pytest.mark.parametrize("args, message", [
    (["--ratios", "0"], "ratio 0.0 is outside (0, 1)"),
    (["--ratios", "1.5"], "ratio 1.5 is outside (0, 1)"),
    (["--ratios", "1"], "ratio 1.0 is outside (0, 1)"),                          # keeps every token: fullkv
    (["--compression_ratios", "1"], "--compression_ratios 1.0 is outside (0, 1)"),
    (["--compression_ratios", "0"], "--compression_ratios 0.0 is outside (0, 1)"),    # removes nothing
    (["--compression_ratios", "1e-12"], "--compression_ratios 1e-12 is outside (0, 1)"),
    (["--methods", "snapkvv"], "unknown method 'snapkvv'"),
    (["--methods", "snapkv:budget=64"], "the grid sets the budget (budget given)"),
    (["--methods", "fullkv", "minicache", "--ratios", "0.5"], "none of --methods fullkv minicache takes a ratio"),
    (["--shard", "3/2"], "--shard 3/2: needs 0 <= i < n"),
    (["--shard", "0/0"], "--shard 0/0: needs 0 <= i < n"),
    (["--shard", "a/b"], "--shard 'a/b': give i/n"),
    (["--shard", "-1/2"], "--shard -1/2: needs 0 <= i < n"),                 # not argparse's "expected one argument"
    (["--shard", "1/-2"], "--shard 1/-2: needs 0 <= i < n"),
    (["--runner_args", "--device 'cuda"], "--runner_args: \"--device 'cuda\" does not split into flags"),
    (["--tasks", "niah_single_9"], "unknown leaderboard task 'niah_single_9'"),
    (["--context_length", "99999"], "above the model's window"),
])
def test_bad_input_is_refused_in_one_line_before_any_weights_load(tiny_model_dir, tmp_path, args, message, capsys,
                                                                  monkeypatch):
    from pyramidkv.leaderboard.__main__ import main
    from pyramidkv.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    methods = [] if "--methods" in args else ["--methods", "snapkv"]
    with pytest.raises(SystemExit) as exit_:
        main(["--model_path", tiny_model_dir, "--save_dir", str(tmp_path / "out"), *methods, *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") <= 2, err
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_another_grid_is_refused(whole, grid_args, capsys):
    from pyramidkv.leaderboard.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([*map(str, grid_args[:-1]), "3", "--save_dir", str(whole)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "holds another grid's cells" in err and "num_samples 2 here, 3 asked" in err


def test_kvpress_compression_ratios_name_the_same_grid(tiny_model_dir):
    from pyramidkv.leaderboard.__main__ import build_parser, grid_of

    parse = build_parser().parse_args
    kept = grid_of(parse(["--model_path", tiny_model_dir, "--methods", "snapkv", "--ratios", "0.25", "0.5"]))
    removed = grid_of(parse(["--model_path", tiny_model_dir, "--methods", "snapkv", "--compression_ratios", "0.75",
                             "0.5"]))
    assert kept == removed and [e.spec for e in kept.entries()] == \
        ["fullkv", "snapkv:budget_ratio=0.25", "snapkv:budget_ratio=0.5"]



def test_runner_args_that_start_with_a_flag_are_a_value(tiny_model_dir):
    """`--runner_args '--device cpu'` got argparse's "expected one argument"; its words reach every run, and the
    command the page prints gives them back quoted."""
    from pyramidkv.leaderboard.__main__ import build_parser, grid_of
    from pyramidkv.leaderboard.outputs import command

    for argv in (["--runner_args", "--device cpu --answer_prefix 'a b'"],
                 ["--runner_args=--device cpu --answer_prefix 'a b'"]):
        grid = grid_of(build_parser().parse_args(["--model_path", tiny_model_dir, "--methods", "snapkv", *argv]))
        assert grid.extra == ["--device", "cpu", "--answer_prefix", "a b"]
        assert "--runner_args '--device cpu --answer_prefix '\"'\"'a b'\"'\"''" in command(grid)


def test_count_shows_its_progress_while_it_checks_every_unit(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Issue 40, item 10: `--count` prepares every unit (about 35 s each on SmolLM2) silently: a bar counts the
    units, with the time left, once the check has run PROGRESS_DELAY seconds (0 here)."""
    from pyramidkv.leaderboard import __main__ as cli

    monkeypatch.setattr(cli, "PROGRESS_DELAY", 0.0)
    assert cli.main(["--model_path", tiny_model_dir, "--methods", "streamingllm", "--ratios", "0.5", "--tasks",
                     "niah_single_1", "--context_length", "512", "--num_samples", "1", "--save_dir",
                     str(tmp_path / "out"), "--count"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "2 units" and "checking every unit (no weights)" in err and "/2 [" in err, err[-300:]


def test_the_committed_page_and_figure_are_what_the_committed_csv_gives():
    """The published page (3 samples per cell, 32:1 to 0.9 kept)."""
    docs = ROOT / "docs"
    grid = Grid(**json.loads((docs / "leaderboard" / "grid.json").read_text()))
    rendered = render(read_csv(docs / "leaderboard" / "leaderboard.csv"), grid, links="leaderboard/")
    assert rendered["leaderboard.md"] == (docs / "leaderboard.md").read_text()
    assert rendered["leaderboard.svg"] == (docs / "leaderboard" / "leaderboard.svg").read_text()


def test_one_method_written_several_ways_is_one_entry(tiny_model_dir, tmp_path):
    """Issue 40, item 6: `snapkv`, `snapkv` again and `snapkv:window_size=32` (32: its default) are one method of the
    grid: one entry per ratio, counted once (fullkv and snapkv at one ratio: 2 units)."""
    from pyramidkv.leaderboard.__main__ import build_parser, grid_of

    argv = ["--model_path", tiny_model_dir, "--tasks", "niah_single_1", "--context_length", 512, "--ratios", 0.5]
    grid = grid_of(build_parser().parse_args([str(a) for a in [*argv, "--methods", "snapkv", "snapkv",
                                                                  "snapkv:window_size=32", "snapkv:window_size=16"]]))
    assert grid.methods == ["fullkv", "snapkv", "snapkv:window_size=16"]    # another setting: another method
    assert [e.spec for e in grid.entries()] == ["fullkv", "snapkv:budget_ratio=0.5",
                                                "snapkv:budget_ratio=0.5,window_size=16"]
    counted = leaderboard(*argv, "--methods", "snapkv", "snapkv", "snapkv:window_size=32", "--save_dir",
                          tmp_path / "out", "--count")
    assert counted.stdout.strip() == "2 units"


def test_extend_takes_over_a_folder_only_by_adding_methods_or_ratios(tmp_path):
    """--extend: a grid that only adds ratios or methods takes the folder over (grid.json rewritten, the status of
    its cells untouched); one that drops a ratio or changes another setting is refused, naming it."""
    from pyramidkv.leaderboard.grid import GRID_FILE, claim_folder

    def grid(methods=("fullkv", "snapkv"), ratios=(0.5,), samples=2):
        return Grid("m", list(methods), list(ratios), ["niah_single_1"], 512, samples, 3)

    small, wide = grid(), grid(methods=("fullkv", "snapkv", "tova"), ratios=(0.25, 0.5))
    claim_folder(tmp_path, small)
    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "ruler__snapkv@0.5.json").write_text('{"state": "done"}')
    with pytest.raises(ValueError, match="holds another grid's cells.*--extend adds"):
        claim_folder(tmp_path, wide)
    claim_folder(tmp_path, wide, write=False, extend=True)          # checked only: the folder keeps its grid
    assert json.loads((tmp_path / GRID_FILE).read_text()) == small.record()
    claim_folder(tmp_path, wide, extend=True)
    assert json.loads((tmp_path / GRID_FILE).read_text()) == wide.record()
    assert (tmp_path / "status" / "ruler__snapkv@0.5.json").read_text() == '{"state": "done"}'
    claim_folder(tmp_path, wide, extend=True)                        # the same grid again: nothing to do
    with pytest.raises(ValueError, match=r"does not contain \(ratios \[0\.25\]\)"):
        claim_folder(tmp_path, grid(ratios=(0.5, 0.75), methods=("fullkv", "snapkv", "tova")), extend=True)
    with pytest.raises(ValueError, match=r"methods \['tova'\]"):
        claim_folder(tmp_path, grid(ratios=(0.25, 0.5)), extend=True)
    with pytest.raises(ValueError, match="num_samples 2 here, 3 asked"):
        claim_folder(tmp_path, grid(methods=("fullkv", "snapkv", "tova"), ratios=(0.25, 0.5), samples=3),
                     extend=True)
    assert json.loads((tmp_path / GRID_FILE).read_text()) == wide.record()


@pytest.fixture(scope="module")
def extreme(tmp_path_factory, grid_args, whole):
    """The grid of `whole` at 16:1 in another folder: snapkv's 32-token window is above 0.0625 x each prompt here,
    streamingllm fits; then published together with `whole`'s page (--merge_published)."""
    out, docs = tmp_path_factory.mktemp("extreme"), tmp_path_factory.mktemp("docs")
    leaderboard("--save_dir", whole, "--summarize", "--publish", docs)
    ran = leaderboard(*grid_args[:5], "--ratios", "0.0625", *grid_args[8:], "--save_dir", out)
    published = (docs / "leaderboard" / "leaderboard.csv").read_text()
    merged = leaderboard("--save_dir", out, "--summarize", "--publish", docs, "--merge_published")
    return out, docs, ran, published, merged


def test_a_cell_whose_budget_is_below_the_window_is_n_a_never_run(extreme):
    """Issue 43: at 16:1 a window-32 method does not fit a ~450-token prompt. Its cell is `n/a` with the runner's
    own one-line reason (the grid is not refused, the cell is not run with an emptied compression); the others run."""
    out, _, ran, _, _ = extreme
    assert ran.returncode == 0 and ran.stdout.count("[leaderboard] unit") == 2     # fullkv, streamingllm
    rows = {r["spec"]: r for r in cells(out / "leaderboard.csv")}
    unfit = rows["snapkv:budget_ratio=0.0625"]
    assert unfit["status"] == "n/a" and unfit["score"] == "" and unfit["samples"] == ""
    assert re.search(r"round\(0\.0625 x \d+\) = \d+ tokens .* below the 32 the budget must hold", unfit["error"])
    assert unfit["error"].startswith("niah_single_1_512.jsonl: sample ")     # the file, not this machine's folders
    assert rows["streamingllm:budget_ratio=0.0625"]["status"] == "done"
    assert not list((out / "runs" / "ruler").glob("*_r0.0625/snapkv"))             # never run
    assert not (out / "status" / "ruler__snapkv@0.0625.json").exists()
    units = {u["unit"]: u for u in json.loads((out / "leaderboard.json").read_text())["units"]}
    assert units["ruler__snapkv@0.0625"]["state"] == "n/a"
    page = (out / "leaderboard.md").read_text()
    assert "(2 done, 0 failed, 0 pending, 1 n/a)" in page and "| snapkv @ 0.0625 | 0.06 | - |" in page
    assert "| n/a: " in page


def test_a_grid_no_cell_of_which_applies_is_refused(grid_args, tmp_path, capsys):
    from pyramidkv.leaderboard.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([*map(str, grid_args[:2]), "--methods", "snapkv", "--ratios", "0.0625", *map(str, grid_args[8:]),
              "--save_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no cell of the grid but fullkv's applies at --context_length 512" in err
    assert "below the 32 the budget must hold" in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "grid.json").exists() and not (tmp_path / "out" / "status").exists()


def test_a_published_page_merged_with_a_new_ratio_keeps_its_cells(extreme, whole):
    """--merge_published: the page holds the union grid; cells the new folder did not run keep their published
    rows byte for byte, fullkv's is the new run's, and the regenerate line names every ratio."""
    out, docs, _, published, merged = extreme
    assert merged.returncode == 0
    grid = json.loads((docs / "leaderboard" / "grid.json").read_text())
    assert grid["ratios"] == [0.0625, 0.25, 0.5] and grid["methods"] == ["fullkv", "snapkv", "streamingllm"]
    text = (docs / "leaderboard" / "leaderboard.csv").read_text().splitlines()
    old = published.splitlines()
    assert text[0] == old[0] and [line for line in old[2:] if line in text] == old[2:]    # every published cell
    specs = [r["spec"] for r in cells(docs / "leaderboard" / "leaderboard.csv")]
    assert specs == ["fullkv", "snapkv:budget_ratio=0.0625", "snapkv:budget_ratio=0.25", "snapkv:budget_ratio=0.5",
                     "streamingllm:budget_ratio=0.0625", "streamingllm:budget_ratio=0.25",
                     "streamingllm:budget_ratio=0.5"]
    rows = cells(docs / "leaderboard" / "leaderboard.csv")
    assert rows[0] == next(r for r in cells(out / "leaderboard.csv") if r["spec"] == "fullkv")
    assert "--ratios 0.0625 0.25 0.5" in (docs / "leaderboard.md").read_text()
    check = Grid(**grid)
    assert render(read_csv(docs / "leaderboard" / "leaderboard.csv"), check, links="leaderboard/")["leaderboard.md"] \
        == (docs / "leaderboard.md").read_text()


def test_merge_published_refuses_another_grid_and_goes_with_publish(extreme, grid_args, tmp_path, capsys):
    from pyramidkv.leaderboard.__main__ import main

    out, docs, *_ = extreme
    other = tmp_path / "other"
    shutil.copytree(out, other)
    record = json.loads((other / "grid.json").read_text())
    (other / "grid.json").write_text(json.dumps({**record, "num_samples": 3}))
    for argv, says in ((["--save_dir", other, "--summarize", "--publish", docs, "--merge_published"],
                        "differ in num_samples (2 there, 3 here); only methods and ratios may differ"),
                       (["--save_dir", out, "--summarize", "--merge_published"],
                        "--merge_published goes with --summarize --publish DOCS")):
        with pytest.raises(SystemExit) as exit_:
            main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and says in err, err
