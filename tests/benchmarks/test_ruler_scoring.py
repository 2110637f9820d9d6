"""RULER metrics on hand-worked cases."""

import pytest

from pyramidkv.benchmarks.ruler.scoring import (
    metric_for, postprocess, score_task, string_match_all, string_match_part,
)


def test_string_match_all_hand_worked():
    # sample 1: both references found -> 1; sample 2: none -> 0; mean 0.5 -> 50.0
    assert string_match_all(["The numbers are 1234567 and 7654321.", "nothing here"],
                            [["1234567", "7654321"], ["1111111"]]) == 50.0
    # one of three references -> 1/3 -> 33.33 (rounded to 2 decimals)
    assert string_match_all(["only AAA"], [["aaa", "bbb", "ccc"]]) == 33.33
    # (2/3 + 1 + 0) / 3 = 0.5555... -> 55.56
    assert string_match_all(["a b", "x", "z"], [["a", "b", "c"], ["x"], ["y"]]) == 55.56


def test_string_match_all_is_case_insensitive_containment():
    assert string_match_all(["ANSWER: Gentle-Otter is it"], [["gentle-otter"]]) == 100.0
    assert string_match_all(["12345678"], [["1234567"]]) == 100.0      # containment, not equality
    assert string_match_all(["123456"], [["1234567"]]) == 0.0


def test_string_match_part_takes_the_best_reference():
    assert string_match_part(["Paris, France"], [["London", "paris"]]) == 100.0
    assert string_match_part(["Lyon"], [["London", "Paris"]]) == 0.0
    # (1 + 0 + 1) / 3 -> 66.67
    assert string_match_part(["a", "b", "c"], [["a", "q"], ["x"], ["C"]]) == 66.67


def test_metric_per_task():
    assert metric_for("qa_1") == metric_for("qa_2") == "string_match_part"
    assert all(metric_for(t) == "string_match_all" for t in ("niah_single_1", "niah_multivalue", "vt", "cwe", "fwe"))
    # the same predictions score differently under the two metrics
    preds, refs = ["alpha"], [["alpha", "beta"]]
    assert score_task("niah_multivalue", preds, refs) == 50.0
    assert score_task("qa_1", preds, refs) == 100.0


def test_postprocess():
    assert postprocess("  7654321\x00tail \n") == "7654321\ntail"
    assert score_task("vt", [" AAAAA\x07BBBBB "], [["aaaaa", "bbbbb"]]) == 100.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="2 predictions but 1"):
        string_match_all(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="no predictions"):
        string_match_part([], [])
    with pytest.raises(ValueError, match="no references"):
        string_match_all(["a"], [[]])


# --- the order of the arithmetic: the official code divides by n, then multiplies by 100 --------------

def official_string_match_all(preds, refs):
    """NVIDIA/RULER scripts/eval/synthetic/constants.py, restated: sum of per-sample fractions / n * 100."""
    return round(sum([sum([1.0 if r.lower() in p.lower() else 0.0 for r in ref]) / len(ref)
                      for p, ref in zip(preds, refs)]) / len(preds) * 100, 2)


def official_string_match_part(preds, refs):
    return round(sum([max([1.0 if r.lower() in p.lower() else 0.0 for r in ref])
                      for p, ref in zip(preds, refs)]) / len(preds) * 100, 2)


def _samples(n: int, refs_per_sample: int, hits: int):
    """n samples of `refs_per_sample` references, `hits` of them found in total (filled sample by sample)."""
    preds, refs = [], []
    left = hits
    for i in range(n):
        found = min(left, refs_per_sample)
        left -= found
        refs.append([f"ref{i}x{j}" for j in range(refs_per_sample)])
        preds.append(" ".join(refs[-1][:found]) or "nothing")
    return preds, refs


def test_the_issue_example_rounds_as_the_official_code():
    preds, refs = _samples(40, 4, 23)
    assert 100 * (23 / 4) / 40 == 14.375 and round(100 * (23 / 4) / 40, 2) == 14.38   # the other order
    assert string_match_all(preds, refs) == official_string_match_all(preds, refs) == 14.37


def test_every_size_where_the_order_matters_matches_the_official():
    """All (n, references, hits) up to 200 samples where 100 * t / n and t / n * 100 round apart."""
    differing = 0
    for refs_per_sample in (1, 2, 4):
        for n in range(1, 201):
            for hits in range(0, n * refs_per_sample + 1):
                total = hits / refs_per_sample
                if round(100 * total / n, 2) == round(total / n * 100, 2):
                    continue
                differing += 1
                preds, refs = _samples(n, refs_per_sample, hits)
                assert string_match_all(preds, refs) == official_string_match_all(preds, refs), (n, hits)
                if refs_per_sample == 1:
                    assert string_match_part(preds, refs) == official_string_match_part(preds, refs), (n, hits)
    assert differing > 50          # the sweep really visits sizes where the order matters
