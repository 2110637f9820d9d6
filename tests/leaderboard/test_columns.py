"""The leaderboard's new columns on hand-made CSV rows: the block-freeable share beside the bytes, the paired
intervals against fullkv and between neighbouring entries (marked where they hold 0), the 16:1 and 32:1 ratios
(a budget below a method's window refused), and a published page rewritten from its CSV alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pyramidkv.leaderboard.grid import DEFAULTS, RATIOS, entries_of
from pyramidkv.leaderboard.page import entries, page
from pyramidkv.leaderboard.table import COLUMNS

ROOT = Path(__file__).resolve().parents[2]


def _row(spec, base, ratio, scores, free=None):
    row = {c: None for c in COLUMNS}
    row.update(model="m", context_length=512.0, part="ruler", task="niah_single_1", method=base, base=base, spec=spec,
               treatment="fixed" if ratio is None else "ratio", ratio=ratio, kept=1.0 if ratio is None else ratio,
               samples=float(len(scores)), score=sum(scores) / len(scores), status="done", kv_bytes_x_fullkv=ratio,
               block_free_16=free, block_free_32=free,
               sample_scores=json.dumps({str(i): s for i, s in enumerate(scores)}))
    return row


ROWS = [_row("fullkv", "fullkv", None, [100.0, 100.0, 100.0, 100.0]),
        _row("a:budget_ratio=0.5", "a", 0.5, [100.0, 100.0, 100.0, 100.0], free=0.4),
        _row("b:budget_ratio=0.5", "b", 0.5, [100.0, 100.0, 100.0, 0.0], free=0.1),
        _row("c:budget_ratio=0.5", "c", 0.5, [0.0, 0.0, 0.0, 0.0], free=0.0)]


def test_intervals_against_fullkv_and_the_next_entry_below():
    by_spec = {e["spec"]: e for e in entries(ROWS)}
    # a equals fullkv on every sample: 0 [0, 0], which holds 0
    assert by_spec["a:budget_ratio=0.5"]["vs_fullkv"] == (0.0, 0.0, 0.0)
    # b - fullkv = (0, 0, 0, -100): by enumeration (test_intervals) the mean -25, interval [-75, 0]
    assert by_spec["b:budget_ratio=0.5"]["vs_fullkv"] == pytest.approx((-25.0, -75.0, 0.0))
    # at ratio 0.5, ranked a > b > c: a vs b = (0, 0, 0, 100) -> +25 [0, 75]; b vs c = (100, 100, 100, 0) -> +75,
    # k draws of the 0 ~ Binomial(4, 1/4): P(k >= 3) = 13/256 > 2.5 % -> low 25; P(k = 0) = 81/256 -> high 100
    assert by_spec["a:budget_ratio=0.5"]["next"] == "b"
    assert by_spec["a:budget_ratio=0.5"]["vs_next"] == pytest.approx((25.0, 0.0, 75.0))
    assert by_spec["b:budget_ratio=0.5"]["vs_next"] == pytest.approx((75.0, 25.0, 100.0))
    assert by_spec["c:budget_ratio=0.5"]["vs_next"] is None


def test_the_page_marks_intervals_holding_zero_and_shows_the_freeable_blocks():
    text = page(ROWS, "x.csv", "x.svg", "cmd")
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert "+0.0 [+0.0, +0.0] ≈" in lines["| a @ 0.5"] and "+25.0 [+0.0, +75.0] ≈ vs b" in lines["| a @ 0.5"]
    assert "+75.0 [+25.0, +100.0] vs c" in lines["| b @ 0.5"]            # 0 outside: no mark
    assert "| 0.50 | 0.40 | 0.40 |" in lines["| a @ 0.5"]                # bytes, free@16, free@32
    old = [{**r, "sample_scores": None, "block_free_16": None, "block_free_32": None} for r in ROWS]
    assert "| - | 100 | - |" in page(old, "x.csv", "x.svg", "cmd").splitlines()[-3]   # never measured: "-"


def test_the_default_grid_has_16_and_32_to_1_and_every_budget_holds_the_window():
    from pyramidkv.methods import METHODS, parse_method_spec

    assert 0.0625 in RATIOS and 0.03125 in RATIOS
    for name in METHODS:
        for entry in entries_of(name, RATIOS, DEFAULTS["context_length"]):
            parse_method_spec(entry.spec).check_prompt(DEFAULTS["context_length"])   # below the window: raises


def test_whether_a_budget_holds_the_window_is_each_prompts_question():
    """The grid enters snapkv at 32:1 on 512 tokens (its runner refuses each prompt it does not fit: an n/a cell,
    test_leaderboard.py); a budget the method cannot even be built with is refused in one line naming the ratio."""
    from pyramidkv.methods import parse_method_spec

    [entry] = entries_of("snapkv", [0.03125], 512)
    with pytest.raises(ValueError, match=r"round\(0.03125 x 512\) = 16 tokens.*below the 32"):
        parse_method_spec(entry.spec).check_prompt(512)
    parse_method_spec(entries_of("snapkv:window_size=8", [0.03125], 512)[0].spec).check_prompt(512)
    with pytest.raises(ValueError, match=r"--methods scissorhands at ratio 0.03125 and --context_length 512: .*"
                                         r"decode_budget must be >= 32"):
        entries_of("scissorhands", [0.03125], 512)


def test_a_published_page_is_rewritten_from_its_csv_alone(tmp_path):
    from pyramidkv.leaderboard.outputs import rerender

    shutil.copytree(ROOT / "docs" / "leaderboard", tmp_path / "leaderboard")
    rerender(tmp_path)
    for name in ("leaderboard/leaderboard.csv", "leaderboard/leaderboard.svg", "leaderboard/leaderboard.json"):
        assert (tmp_path / name).read_text() == (ROOT / "docs" / name).read_text(), name
    assert (tmp_path / "leaderboard.md").read_text() == (ROOT / "docs" / "leaderboard.md").read_text()
    with pytest.raises(ValueError, match="grid.json is missing"):
        rerender(tmp_path / "nowhere")
