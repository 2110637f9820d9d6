"""The summary names what each run did (issue 25): only a true full cache is the full-cache reference, methods that
keep a full-size cache (minicache, minference) are plotted, and a needle average is one named metric."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import ROOT, load_script

summary = load_script("summarize_results_labels", ROOT / "scripts" / "summarize_results.py")


def write(root: Path, folder: str, budget, average, spec=None, method=None, benchmark="ruler", scores=None,
          **extra) -> None:
    run = root / f"m_{budget or 'full'}" / folder
    run.mkdir(parents=True)
    data = {"benchmark": benchmark, "model": "m", "method": method or folder, "budget": budget,
            "scores": scores or {"a": average}, "average": average, "num_samples": {"a": 5}, **extra}
    if spec is not None:
        data["method_spec"] = spec
    (run / "results.json").write_text(json.dumps(data))


def drawn(fig) -> dict:
    return {line.get_label(): (set(line.get_ydata()), line.get_linestyle(), line.get_color())
            for ax in fig.axes for line in ax.lines}


def test_only_a_true_full_cache_is_the_reference_and_full_size_methods_are_plotted(tmp_path):
    write(tmp_path, "fullkv", None, 50.0, spec="fullkv")
    write(tmp_path, "fullkv_cross_layer_merge=True", None, 30.0, spec="fullkv:cross_layer_merge=true")
    write(tmp_path, "minicache", None, 0.0, spec="minicache")
    write(tmp_path, "minference", None, 100.0, spec="minference")
    write(tmp_path, "snapkv", 64, 40.0, spec="snapkv:budget=64")
    # A results.json from before the spec was recorded: fullkv by name, MiniCache by its folder.
    write(tmp_path / "old", "fullkv_cross_layer_merge=True", None, 20.0, method="fullkv")
    results = summary.load_results(tmp_path)
    fig = summary.plot(results, "t", tmp_path / "p.png")
    lines = drawn(fig)
    black = {label for label, (_, style, color) in lines.items() if style == "--" and color == "black"}
    assert black == {"full cache (fullkv)"}
    for series, score in (("fullkv_cross_layer_merge=True", 30.0), ("minicache", 0.0), ("minference", 100.0),
                          ("old/fullkv_cross_layer_merge=True", 20.0)):
        assert lines[f"{series} (full-size cache)"][0] == {score}
    assert not any("no score" in t.get_text() for t in fig.texts)
    header, rows = summary.table(results)
    assert rows[0][header.index("run")] == "m_full/fullkv"          # the true full cache first, nothing else


def test_a_needle_average_is_one_named_metric(tmp_path):
    scores = {"rouge1_f": 20.0, "recall": 80.0, "harness_rouge1_x10": 30.0, "harness_word_recall": 70.0}
    write(tmp_path, "snapkv", 64, 80.0, spec="snapkv:budget=64", benchmark="needle", scores=scores,
          average_metric="recall")
    write(tmp_path / "old", "snapkv", 64, 50.0, benchmark="needle", scores=scores)   # mean of rouge1_f and recall
    results = summary.load_results(tmp_path)
    assert sorted(r["average"] for r in results) == [80.0, 80.0]
    fig = summary.plot(results, "t", tmp_path / "p.png")
    assert fig.axes[0].get_ylabel() == "recall (x100)"
    # A new-style file whose average is not its named metric is refused.
    bad = tmp_path / "bad"
    write(bad, "snapkv", 64, 50.0, benchmark="needle", scores=scores, average_metric="recall")
    try:
        summary.load_results(bad)
    except ValueError as e:
        assert "average 50.0 disagrees with its recall score (80.00)" in str(e)
    else:
        raise AssertionError("a needle average other than its named metric was accepted")
