"""HeadKV head-score tables: the loader, the two scoring rules (hand-computed), the script, the packaged lookup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pyramidkv.benchmarks.head_scoring import reasoning_step_scores, retrieval_step_scores
from pyramidkv.allocation.head_tables import check_head_scores, default_head_scores_path, load_head_scores
from tests.helpers import ROOT


def write(tmp_path, first_line: str, name="scores.json") -> Path:
    path = tmp_path / name
    path.write_text(first_line + "\n" + '{"run_meta": {"note": "ignored"}}\n')
    return path


# --------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------

def test_loader_means_and_shape(tmp_path):
    # 2 layers x 3 heads, keys deliberately out of order; means by hand.
    line = ('{"1-2": [3, 5], "0-0": [1.0, 2.0, 3.0], "0-1": [0], "0-2": [0.5], '
            '"1-0": [4], "1-1": [0.25, 0.75]}')
    table = load_head_scores(write(tmp_path, line))
    assert table.dtype == np.float64 and table.shape == (2, 3)
    np.testing.assert_array_equal(table, [[2.0, 0.0, 0.5], [4.0, 0.5, 4.0]])


def test_loader_reads_only_the_first_line_as_headkv_does(tmp_path):
    path = tmp_path / "scores.json"
    path.write_text('{"0-0": [1], "0-1": [3]}\n{"run_meta": {"arguments": {}}}\n')
    with open(path) as f:                       # HeadKV's own loader
        head_list = json.loads(f.readline())
    assert [np.mean(v) for v in head_list.values()] == [1.0, 3.0]
    np.testing.assert_array_equal(load_head_scores(path), [[1.0, 3.0]])


@pytest.mark.parametrize("first_line, problem", [
    ('{"0-0": [1], "0-1": [1], "1-0": [1]}', "gaps: 1-1 missing"),
    ('{"0-0": [1], "0-1": [2], "0-0": [3], "1-0": [1], "1-1": [1]}', "head 0-0 appears twice"),
    ('{"0-0": [1], "00-1": [2], "0-1": [3]}', "head 0-1 appears twice"),
    ('{"0-0": [1], "layer0-head1": [2]}', "key 'layer0-head1' is not 'layer-head'"),
    ('{"0_0": [1]}', "key '0_0' is not 'layer-head'"),
    ('{"0-0": [1], "0-1": ["high"]}', "has the score 'high'"),
    ('{"0-0": [1], "0-1": [NaN]}', "has the score nan"),
    ('{"0-0": [1], "0-1": [true]}', "has the score True"),
    ('{"0-0": [1], "0-1": []}', "needs a non-empty list"),
    ('{"0-0": [1], "0-1": 2.0}', "needs a non-empty list"),
    ('{"0-0": [0], "0-1": [0.0, 0]}', "every head scores 0"),
    ('{}', "non-empty JSON object"),
    ('[1, 2]', "non-empty JSON object"),
    ('{"0-0": [1], ', "not a complete JSON object"),
])
def test_loader_rejects_bad_tables(tmp_path, first_line, problem):
    path = write(tmp_path, first_line)
    with pytest.raises(ValueError) as e:
        load_head_scores(path)
    assert str(path) in str(e.value) and problem in str(e.value)


def test_loader_rejects_pretty_printed_json_and_missing_file(tmp_path):
    path = tmp_path / "pretty.json"
    path.write_text(json.dumps({"0-0": [1]}, indent=2))
    with pytest.raises(ValueError, match="first line is not a complete JSON object"):
        load_head_scores(path)
    with pytest.raises(ValueError, match="cannot be read"):
        load_head_scores(tmp_path / "absent.json")


def test_check_head_scores_names_source_and_both_shapes():
    check_head_scores(np.ones((30, 9)), 30, 9, "t.json")
    with pytest.raises(ValueError) as e:
        check_head_scores(np.ones((32, 32)), 30, 9, "llama3.json")
    assert "llama3.json" in str(e.value) and "(32, 32)" in str(e.value) and "(30, 9)" in str(e.value)


# --------------------------------------------------------------------------------------------
# Scoring rules on a hand-made attention tensor
# --------------------------------------------------------------------------------------------

# Prompt of 8 tokens, needle span [3, 6) (needle_length 3); one layer, three heads.
PROMPT = [10, 11, 12, 40, 41, 42, 13, 14]
SPAN = (3, 6)
ATTENTION = torch.tensor([[
    # head 0: argmax at 4 (token 41) -- copy when 41 is generated
    [0.05, 0.05, 0.05, 0.10, 0.50, 0.05, 0.10, 0.10],
    # head 1: argmax at 1 (outside the needle); needle positions carry 0.15, 0.04, 0.01
    [0.05, 0.60, 0.05, 0.15, 0.04, 0.01, 0.05, 0.05],
    # head 2: argmax at 5 (token 42)
    [0.10, 0.00, 0.00, 0.20, 0.00, 0.30, 0.25, 0.15],
]])  # [layers=1, heads=3, keys=8]


def test_retrieval_rule_by_hand():
    # generated 41: head 0 copies (argmax 4, prompt[4] == 41) -> 1/3; head 1 points outside; head 2 points at 42 != 41.
    np.testing.assert_allclose(retrieval_step_scores(ATTENTION, 41, PROMPT, SPAN), [[1 / 3, 0.0, 0.0]])
    # generated 42: only head 2 copies.
    np.testing.assert_allclose(retrieval_step_scores(ATTENTION, 42, PROMPT, SPAN), [[0.0, 0.0, 1 / 3]])
    # argmax in the span but the token differs: no score.
    np.testing.assert_allclose(retrieval_step_scores(ATTENTION, 99, PROMPT, SPAN), [[0.0, 0.0, 0.0]])


def test_reasoning_rule_by_hand():
    # top-3 positions per head; each inside [3, 6) adds 10 * a / (3 * answer_tokens), answer_tokens = 2.
    # Head 0 gets tie-free values (ATTENTION's head 0 has three 0.10s competing for the 2nd place).
    att = ATTENTION.clone()
    att[0, 0] = torch.tensor([0.05, 0.05, 0.05, 0.12, 0.50, 0.05, 0.11, 0.07])
    scores = reasoning_step_scores(att, SPAN, answer_tokens=2)
    scale = 10 / (3 * 2)
    # head 0: top-3 = 0.50@4, 0.12@3, 0.11@6 -> inside: 0.50 + 0.12
    # head 1: top-3 = 0.60@1, 0.15@3, then 0.05 ties outside the span (0, 2, 6, 7) -> inside: 0.15
    # head 2: top-3 = 0.30@5, 0.25@6, 0.20@3 -> inside: 0.30 + 0.20
    np.testing.assert_allclose(scores, [[scale * 0.62, scale * 0.15, scale * 0.50]])


# --------------------------------------------------------------------------------------------
# The script on the default model, reduced setting
# --------------------------------------------------------------------------------------------

def run_script(out: Path, *extra: str, probes: int = 2) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "head_scores.py"), "--model_path", "smollm2-135m",
                    "--num_probes", str(probes), "--context_lengths", "300", "--out", str(out), *extra],
                   check=True, cwd=out.parent, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def top_heads(table: np.ndarray, k: int = 5) -> list[tuple[int, int]]:
    order = np.argsort(-table.ravel(), kind="stable")[:k]
    return [divmod(int(i), table.shape[1]) for i in order]


def test_script_on_default_model_reduced(tmp_path, smollm2_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    run_script(first, "--kind", "reasoning", "--keep_unanswered", "--seed", "1")
    run_script(second, "--kind", "reasoning", "--keep_unanswered", "--seed", "1")
    table_a, table_b = load_head_scores(first), load_head_scores(second)
    assert table_a.shape == table_b.shape == (30, 9)
    assert top_heads(table_a) == top_heads(table_b)
    lines = first.read_text().splitlines()
    assert len(json.loads(lines[0])["0-0"]) == 2                 # one score per probe
    meta = json.loads(lines[1])["run_meta"]
    assert meta["kind"] == "reasoning" and meta["probes_run"] == 2 and meta["arguments"]["seed"] == 1


def test_script_both_kinds_naming(tmp_path, smollm2_path):
    # one probe per kind: the file names and the table's shape do not depend on how many probes were scored
    run_script(tmp_path / "t.json", "--kind", "both", "--keep_unanswered", probes=1)
    for kind in ("retrieval", "reasoning"):
        assert load_head_scores(tmp_path / f"t_{kind}.json").shape == (30, 9)


# --------------------------------------------------------------------------------------------
# Packaged tables
# --------------------------------------------------------------------------------------------

def test_default_head_scores_path_finds_packaged_table(smollm2_path):
    expected = ROOT / "pyramidkv" / "allocation" / "data" / "head_scores" / "smollm2-135m_reasoning.json"
    assert default_head_scores_path(smollm2_path) == expected           # found by the folder's content
    assert default_head_scores_path(smollm2_path, kind="retrieval").name == "smollm2-135m_retrieval.json"
    assert load_head_scores(expected).shape == (30, 9)
    assert load_head_scores(default_head_scores_path(smollm2_path, kind="retrieval")).shape == (30, 9)
    for name in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"):   # a name alone cannot show its content
        with pytest.raises(ValueError, match="is named like smollm2-135m but is not the model"):
            default_head_scores_path(name)


def test_default_head_scores_path_refuses_other_models():
    with pytest.raises(ValueError) as e:
        default_head_scores_path("meta-llama/Meta-Llama-3-8B-Instruct")
    message = str(e.value)
    assert "no reasoning head-score table" in message and "Meta-Llama-3-8B-Instruct" in message
    assert ("python scripts/head_scores.py --model_path meta-llama/Meta-Llama-3-8B-Instruct --kind reasoning --out "
            "FILE" in message and "--head_path FILE" in message and "\n" not in message)
    with pytest.raises(ValueError, match="unknown head-score kind 'copy'"):
        default_head_scores_path("smollm2-135m", kind="copy")


def test_packaged_tables_are_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"pyramidkv.allocation" = ["data/head_scores/*.json", "data/models.json"]' in text
