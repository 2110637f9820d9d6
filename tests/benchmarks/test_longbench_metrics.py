"""LongBench metrics: hand-worked cases for every metric and the aggregation rules."""

from __future__ import annotations

import pytest

from pyramidkv.benchmarks.longbench import metrics as M

TREC_CLASSES = ["Date", "City", "Country", "Other number", "Number of something"]


# --- normalisation and token F1 ------------------------------------------------------------------

def test_normalize_answer_squad_rules():
    assert M.normalize_answer("The  Cat, sat!") == "cat sat"
    assert M.normalize_answer("An apple a day") == "apple day"
    assert M.normalize_answer("U.S.A.") == "usa"
    assert M.normalize_answer("theater") == "theater"  # articles only as whole words


def test_normalize_zh_answer_strips_chinese_and_english_punctuation():
    assert M.normalize_zh_answer("北京，上海。 ABC!") == "北京上海abc"


def test_token_f1_counts_multiset_overlap():
    assert M.token_f1(["x", "x", "y"], ["x", "y"]) == pytest.approx(0.8)  # P 2/3, R 1
    assert M.token_f1([], ["x"]) == 0.0


# --- qa_f1 / qa_f1_zh ----------------------------------------------------------------------------

def test_qa_f1_partial_overlap():
    # "cat sat" vs "cat sat on mat": P = 1, R = 1/2 -> F1 = 2/3
    assert M.qa_f1_score("The Cat sat.", "a cat sat on the mat") == pytest.approx(2 / 3)


def test_qa_f1_exact_after_normalisation_and_empty():
    assert M.qa_f1_score("An apple!", "apple") == 1.0
    assert M.qa_f1_score("", "apple") == 0.0
    assert M.qa_f1_score("the", "the") == 0.0  # both normalise to nothing


def test_qa_f1_zh():
    assert M.qa_f1_zh_score("北京", "北京，上海") == pytest.approx(2 / 3)  # tokens 北京 | 北京 上海
    assert M.qa_f1_zh_score("ABC。", "abc") == 1.0
    assert M.qa_f1_zh_score("", "北京") == 0.0


# --- rouge / rouge_zh ----------------------------------------------------------------------------

def test_rouge_l_f_uses_the_rouge_package_semantics():
    # rouge 1.0.1 summary-level ROUGE-L divides by UNIQUE words: LCS 3, ref 5 unique words, hyp 3
    # -> R = 0.6, P = 1.0, F = 0.75 (a plain LCS over 6 reference tokens would give 2/3).
    assert M.rouge_score("the cat sat", "the cat sat on the mat") == pytest.approx(0.75, abs=1e-6)
    assert M.rouge_score("same words here", "same words here") == pytest.approx(1.0, abs=1e-6)


def test_rouge_failures_score_zero():
    assert M.rouge_score("", "reference") == 0.0       # "Hypothesis is empty."
    assert M.rouge_score("...", "reference") == 0.0    # empty after the package's cleaning
    assert M.rouge_score("no overlap", "different") == 0.0


def test_rouge_zh():
    assert M.rouge_zh_score("我爱北京天安门", "我爱北京天安门") == pytest.approx(1.0, abs=1e-6)
    assert M.rouge_zh_score("", "我爱北京") == 0.0
    assert 0.0 < M.rouge_zh_score("我爱北京", "我爱北京天安门") < 1.0


# --- classification ------------------------------------------------------------------------------

def test_classification_exact_and_shared_credit():
    assert M.classification_score("Date", "Date", all_classes=TREC_CLASSES) == 1.0
    # two classes named, the truth is one of them -> 1/2
    assert M.classification_score("Date or City", "City", all_classes=TREC_CLASSES) == 0.5
    assert M.classification_score("Country", "City", all_classes=TREC_CLASSES) == 0.0


def test_classification_class_inside_the_true_class_is_not_counted():
    classes = ["Number", "Number of something", "Date"]
    # "Number" occurs in the truth "Number of something" and is dropped -> [Number of something]
    assert M.classification_score("Number of something", "Number of something", all_classes=classes) == 1.0
    # the truth is the shorter name: "Number" == truth stays, the longer one is not in the truth -> 1/2
    assert M.classification_score("Number of something", "Number", all_classes=classes) == 0.5


def test_classification_reproduces_the_official_skip_after_removal():
    # matches = [ab, b, abc]; "ab" is removed, and the official loop then skips "b"
    # (it would have been removed too): [b, abc] -> 1/2, not 1.
    assert M.classification_score("abc", "abc", all_classes=["ab", "b", "abc"]) == 0.5


def test_classification_empty_and_missing_classes():
    assert M.classification_score("", "Date", all_classes=TREC_CLASSES) == 0.0
    assert M.classification_score("no idea", "Date", all_classes=TREC_CLASSES) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        M.classification_score("Date", "Date", all_classes=None)


# --- retrieval / count ---------------------------------------------------------------------------

def test_retrieval_score():
    assert M.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert M.retrieval_score("Paragraph 3 or Paragraph 13", "Paragraph 3") == 0.5
    assert M.retrieval_score("Paragraph 30", "Paragraph 3") == 0.0
    assert M.retrieval_score("I don't know", "Paragraph 3") == 0.0
    assert M.retrieval_score("", "Paragraph 3") == 0.0


def test_retrieval_zh_score():
    assert M.retrieval_zh_score("答案是段落5", "段落5") == 1.0
    assert M.retrieval_zh_score("段落5或段落2", "段落5") == 0.5
    assert M.retrieval_zh_score("", "段落5") == 0.0


def test_count_score():
    assert M.count_score("There are 4 unique paragraphs out of 12", "4") == 0.5
    assert M.count_score("4", 4) == 1.0
    assert M.count_score("", "4") == 0.0
    assert M.count_score("14", "4") == 0.0


# --- code_sim ------------------------------------------------------------------------------------

def test_code_sim_takes_first_line_without_backtick_hash_or_slashes():
    pred = "```python\n# add one\n// not this\nreturn x + 1\nmore()\n```"
    assert M.code_sim_score(pred, "return x + 1") == 1.0
    assert M.code_sim_score("\n\nfoo()\nbar()", "foo()") == 1.0       # leading newlines stripped
    assert M.code_sim_score("abc", "abd") == pytest.approx(0.67)      # fuzz.ratio 67
    assert M.code_sim_score("# only comments\n// here", "x = 1") == 0.0
    assert M.code_sim_score("", "x = 1") == 0.0


# --- per-sample rules and aggregation ------------------------------------------------------------

def test_first_line_rule_applies_to_trec_triviaqa_samsum_lsht_only():
    pred = "\nParis\nLondon is big"
    assert M.score_sample("triviaqa", pred, ["Paris"]) == 1.0
    # hotpotqa scores the whole text: "paris london is big" vs "paris" -> P 1/4, R 1 -> 0.4
    assert M.score_sample("hotpotqa", pred, ["Paris"]) == pytest.approx(0.4)
    assert M.score_sample("trec", "Date\nCity", ["Date"], TREC_CLASSES) == 1.0
    assert M.score_sample("lsht", "City\nDate", ["Date"], TREC_CLASSES) == 0.0
    summary = "Anna meets Bob."
    assert M.score_sample("samsum", summary + "\nDialogue: more text", [summary]) == pytest.approx(1.0, abs=1e-6)


def test_multiple_answers_take_the_max():
    assert M.score_sample("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    assert M.score_sample("hotpotqa", "Paris", ["Paris", "London"]) == 1.0
    assert M.score_sample("hotpotqa", "Paris France", ["Paris", "France", "Lyon"]) == pytest.approx(2 / 3)


def test_score_dataset_rounds_100_times_the_mean():
    score = M.score_dataset("hotpotqa", ["Paris", "The Cat sat."], [["Paris"], ["a cat sat on the mat"]])
    assert score == 83.33  # (1 + 2/3) / 2
    assert M.score_dataset("hotpotqa", [], []) is None
    with pytest.raises(ValueError):
        M.score_dataset("hotpotqa", ["a"], [])


def test_score_dataset_uses_each_rows_classes():
    score = M.score_dataset("trec", ["Date", "City"], [["Date"], ["City"]], [TREC_CLASSES, ["Date"]])
    assert score == 50.0  # second row: "City" is not among its classes


def test_longbench_e_length_buckets():
    assert [M.length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 20000)] == \
        ["0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"]
    got = M.score_dataset_e("hotpotqa", ["a b", "x", "x", "y"], [["a b"], ["x"], ["z"], ["y"]],
                            [100, 5000, 6000, 300])
    assert got == {"0-4k": 100.0, "4-8k": 50.0, "8k+": None}


def test_unknown_dataset_is_an_error():
    with pytest.raises(ValueError, match="unknown LongBench dataset 'nope'"):
        M.score_sample("nope", "a", ["a"])


def test_every_official_dataset_has_a_metric():
    import json
    from pathlib import Path

    prompts = json.loads((Path(M.__file__).parent / "data" / "dataset2prompt.json").read_text(encoding="utf-8"))
    assert set(prompts) == set(M.DATASET2METRIC) and len(prompts) == 21


# --- the official aggregation arithmetic ---------------------------------------------------------

def _count_prediction(right: int, wrong: int) -> str:
    """A passage_count prediction whose score for answer "7" is right / (right + wrong)."""
    return " ".join(["7"] * right + ["1"] * wrong)


def test_dataset_score_sums_in_file_order_like_the_official_scorer():
    # sample scores 7/8, 0, 2/3, 1/3: exact mean 0.46875 would round to 46.88, but the official
    # `total += score` loop gives 1.8749999999999998 and round(100 * total / 4, 2) = 46.87
    predictions = ["7 7 7 7 7 7 7 1", "1", "7 7 1", "7 1 1"]
    assert M.score_dataset("passage_count", predictions, [["7"]] * 4) == 46.87


def test_longbench_e_bucket_uses_numpy_mean_and_rounding():
    # scores 3/5, 1/4, 3/8, 4/5 (mean 0.50625): official round(100 * np.mean(s), 2) = 50.63,
    # an exactly summed mean with Python's round gives 50.62
    predictions = [_count_prediction(3, 2), _count_prediction(1, 3), _count_prediction(3, 5), _count_prediction(4, 1)]
    got = M.score_dataset_e("passage_count", predictions, [["7"]] * 4, [100, 200, 300, 400])
    assert got == {"0-4k": 50.63, "4-8k": None, "8k+": None}


def test_bare_string_answers_are_refused():
    # the official loop iterates over the characters of a bare string; we refuse it
    with pytest.raises(ValueError, match="answers must be a list.*'Paris'"):
        M.score_sample("hotpotqa", "Paris", "Paris")
