"""Answer extraction on hand-made cases (nested \\boxed{}, GSM8K's ####, units), the generated chain against a
hand-worked one, the shipped data against its sources' hashes, and the sampler against a hand count."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from pyramidkv.benchmarks.reasoning.answers import (
    chain_steps, gsm8k_answer, last_boxed, math_equal, normalize_math,
)
from pyramidkv.benchmarks.reasoning.compare import departure_step
from pyramidkv.benchmarks.reasoning.run import grade
from pyramidkv.benchmarks.reasoning.tasks import FILES, chain_problem, read_rows


@pytest.mark.parametrize("text,expected", [
    ("so she makes 9 * 2 = 18 dollars.\n#### 18", "18"),
    ("#### 1,250 dollars", "1250"),                # commas out, the unit after the number ignored
    ("#### -3.5\n#### 7", "-3.5"),                  # the first ####, as grade_school_math/dataset.py reads
    ("#### $18", None),                             # the official pattern wants the number right after "#### "
    ("The answer is 18.", None),
    ("####18", None),
])
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{\\sqrt{\\frac{3}{4}}}", "\\sqrt{\\frac{3}{4}}"),   # the last, braces nested
    ("$\\boxed {x^{2}}$", "x^{2}"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$ and more", "5"),
    ("\\boxed{\\frac{1}{2}", None),                 # never closes
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("predicted,reference,equal", [
    ("5\\text{ cm}", "5", True),                    # units on the right
    ("\\dfrac{1}{2}", "\\frac12", True),
    ("0.5", "\\frac{1}{2}", True),
    ("1/2", "\\frac{1}{2}", True),
    ("x = 3", "3", True),
    ("90^\\circ", "90", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("50\\%", "50", True),
    ("\\sqrt3", "\\sqrt{3}", True),
    ("4", "5", False),
    ("\\frac{1}{3}", "\\frac{1}{2}", False),
    (None, "5", False),
])
def test_math_equal(predicted, reference, equal):
    assert math_equal(predicted, reference) is equal


def test_normalize_math_keeps_what_it_does_not_know():
    assert normalize_math("\\{1,2\\}") == "\\{1,2\\}"


def test_chain_is_deterministic_and_its_values_follow_its_steps():
    problem = chain_problem(3, 12, seed=5)
    assert problem == chain_problem(3, 12, seed=5) and problem != chain_problem(4, 12, seed=5)
    x = int(problem.text.split("x = ")[1].split(".")[0])
    for op, value in zip(problem.text.split("Steps: ")[1].rstrip(".").split("; "), problem.steps):
        words = op.split(". ", 1)[1]
        k = int(words.split()[-1])
        x = x + k if words.startswith("add") else x - k if words.startswith("subtract") else x * k
        assert x == value and 0 <= x <= 500
    assert problem.answer == str(problem.steps[-1]) and len(problem.steps) == 12


def test_chain_grading_counts_right_steps():
    row = {"reference": "21", "steps": [7, 21, 18]}
    text = "Step 1: x = 7\nStep 2: x = 20\nStep 3: x = 18\nStep 2: x = 21\n#### 21"
    assert chain_steps(text) == {1: 7, 2: 20, 3: 18}              # a step's first line counts
    assert grade("chain", text, row) == {"answer": "21", "correct": True, "step_accuracy": 2 / 3}
    assert grade("math500", "so \\boxed{\\dfrac{1}{2}}", {"reference": "\\frac12"})["correct"]


def test_departure_step():
    assert departure_step([1, 2, 3], [1, 2, 3]) is None
    assert departure_step([1, 2, 4], [1, 2, 3]) == 2
    assert departure_step([1, 2], [1, 2, 3]) == 2
    assert departure_step([9], [1]) == 0


def test_shipped_data_is_the_sources():
    """MATH-500: byte for byte prm800k's math_splits/test.jsonl (the sha256 its Git LFS pointer names); GSM8K: the
    first 200 lines of grade-school-math's test.jsonl (data/README.md)."""
    assert hashlib.sha256(FILES["math500"].read_bytes()).hexdigest() == \
        "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"
    assert hashlib.sha256(FILES["gsm8k"].read_bytes()).hexdigest() == \
        "bd70035c7acaf107b4e0d077c605a23c3d3a0acb4342e5bc60099e6ad9ff4284"
    gsm = read_rows(FILES["gsm8k"], "gsm8k", 200)
    assert gsm[0].answer == "18" and len(gsm) == 200
    assert read_rows(FILES["math500"], "math500", 500)[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_a_row_without_an_answer_is_refused_naming_it(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n" + json.dumps({"question": "3+3?"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2 has no 'answer'"):
        read_rows(path, "gsm8k", 2)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"question": f"{i}+{i}?", "answer": f"#### {2 * i}"}) + "\n" for i in (1, 2)))
    with pytest.raises(ValueError, match=r"--num_samples 3: .* holds 2"):
        read_rows(good, "gsm8k", 3)


def test_sampling_draws_by_inverse_cdf():
    """Hand count: probabilities [0.5, 0.3, 0.2] (logits their logs); the draw is the first token whose cumulative
    probability exceeds u, so the frequencies of 20,000 draws are the probabilities; top_p 0.6 keeps {0, 1}."""
    from pyramidkv.generation.trace import Sampling, next_token

    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([next_token(logits, Sampling(), g) for _ in range(20000)]), minlength=3)
    assert torch.allclose(counts / 20000, torch.tensor([0.5, 0.3, 0.2]), atol=0.015)
    g = torch.Generator().manual_seed(0)
    kept = {next_token(logits, Sampling(top_p=0.6), g) for _ in range(2000)}
    assert kept == {0, 1}
    same = [torch.Generator().manual_seed(7) for _ in range(2)]      # one seed, one stream: the same draw
    assert next_token(logits, Sampling(), same[0]) == next_token(logits * 1.0001, Sampling(), same[1])
    assert next_token(logits, None, None) == 0
