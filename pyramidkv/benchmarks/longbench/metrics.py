"""LongBench v1 scoring, with the same semantics as the official THUDM evaluation.

Every per-answer metric has the signature ``metric(prediction, ground_truth, all_classes=None) -> float``
in [0, 1]. A sample's score is the maximum over its reference answers; for trec, triviaqa,
samsum and lsht only the first line of the prediction is scored. The aggregation uses the
official arithmetic to the last bit: a dataset scores ``round(100 * total / n, 2)`` where
``total`` sums the sample scores one at a time in file order (Python's ``round``);
LongBench-E splits the samples by their ``length`` field into 0-4k, 4-8k and 8k+ buckets and
scores each bucket ``round(100 * np.mean(scores), 2)`` (numpy's pairwise sum and numpy's
rounding). Other summation or rounding orders differ by 0.01 on some inputs.

Two behaviours of the official code are reproduced on purpose, so that scores match it:

* classification: the official loop removes list items while iterating over the same list,
  so an item right after a removed one is never examined (see ``classification_score``);
  its ``difflib`` fallback is unreachable there (``list != 0`` is always true) and is
  therefore absent here: no class named in the prediction scores 0.
* rouge: any exception from the ``rouge`` package (an empty hypothesis after its own
  cleaning, a recursion limit on huge inputs, ...) scores 0.

Deliberate differences: the official scorer passes the ``all_classes`` of the LAST row of a
file to every row; we use each row's own list (the two agree on the released data, where every
row of trec/lsht carries the same list). ``answers`` must be a list: the official loop would
iterate over the characters of a bare string. An empty LongBench-E bucket is None, not NaN.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Optional, Sequence

__all__ = [
    "DATASET2METRIC", "FIRST_LINE_DATASETS", "LENGTH_BUCKETS",
    "normalize_answer", "normalize_zh_answer", "token_f1",
    "qa_f1_score", "qa_f1_zh_score", "rouge_score", "rouge_zh_score", "classification_score",
    "retrieval_score", "retrieval_zh_score", "count_score", "code_sim_score",
    "score_sample", "score_dataset", "score_dataset_e", "length_bucket",
]

_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"
    "–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# --- normalisation ------------------------------------------------------------------------------

def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop a/an/the, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _EN_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lowercase, drop Chinese and ASCII punctuation, remove all whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


def token_f1(prediction_tokens: Sequence[str], truth_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap)."""
    overlap = sum((Counter(prediction_tokens) & Counter(truth_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def _jieba_words(text: str) -> list[str]:
    import jieba

    return list(jieba.cut(text, cut_all=False))


# --- per-answer metrics --------------------------------------------------------------------------

def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    pred = [w for w in (normalize_zh_answer(t) for t in _jieba_words(prediction)) if w]
    truth = [w for w in (normalize_zh_answer(t) for t in _jieba_words(ground_truth)) if w]
    return token_f1(pred, truth)


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F from the `rouge` package (1.0.1); any failure scores 0."""
    from rouge import Rouge

    try:
        result = Rouge().get_scores([prediction], [ground_truth], avg=True)
        return float(result["rouge-l"]["f"])
    except Exception:  # noqa: BLE001 - the official scorer maps every rouge failure to 0
        return 0.0


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_score(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


def classification_score(prediction: str, ground_truth: str, all_classes: Optional[Sequence[str]] = None,
                         **_) -> float:
    """1/len(matches) if the true class is among the classes named in the prediction, else 0.

    matches = the classes whose name occurs in the prediction; a match that occurs inside the
    true class name without being equal to it (e.g. "Money" for truth "Money amount") is then
    dropped. The official code drops while iterating over the same list, which skips the item
    right after each dropped one; the loop below has exactly that behaviour.
    """
    if not all_classes:
        raise ValueError("classification_score needs all_classes (the dataset's label set)")
    matches = [name for name in all_classes if name in prediction]
    position = 0
    while position < len(matches):
        name = matches[position]
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
        position += 1  # advances even after a removal: the official iteration skips one item
    if ground_truth in matches:
        return 1.0 / len(matches)
    return 0.0


def _number_agreement(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """Fraction of the numbers in the prediction equal to N of the answer's "Paragraph N"."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval answer {ground_truth!r} has no 'Paragraph N'")
    return _number_agreement(prediction, found[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """As retrieval_score, for answers of the form "段落N"."""
    found = re.findall(r"段落(\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval answer {ground_truth!r} has no '段落N'")
    return _number_agreement(prediction, found[0])


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """Fraction of the numbers in the prediction equal to the true count."""
    return _number_agreement(prediction, str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """fuzzywuzzy ratio / 100 between the answer and the first predicted line without ` # or //."""
    from fuzzywuzzy import fuzz

    first_code_line = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" in line or "#" in line or "//" in line:
            continue
        first_code_line = line
        break
    return fuzz.ratio(first_code_line, ground_truth) / 100


Metric = Callable[..., float]

DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

# Few-shot datasets whose models tend to continue with another example: only line one counts.
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


# --- aggregation ---------------------------------------------------------------------------------

def _metric_for(dataset: str) -> Metric:
    try:
        return DATASET2METRIC[dataset]
    except KeyError:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; known: {', '.join(DATASET2METRIC)}") from None


def score_sample(dataset: str, prediction: str, answers: Sequence[str],
                 all_classes: Optional[Sequence[str]] = None) -> float:
    """One sample's score in [0, 1]: the best over its reference answers."""
    metric = _metric_for(dataset)
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    if isinstance(answers, str) or not isinstance(answers, (list, tuple)):
        raise ValueError(f"answers must be a list of reference answers, got {type(answers).__name__} {answers!r}")
    best = 0.0
    for answer in answers:
        best = max(best, metric(prediction, answer, all_classes=all_classes))
    return best


def _official_percent(scores: Sequence[float]) -> Optional[float]:
    """The official eval.py ``scorer``: ``total += score`` in order, then ``round(100 * total / n, 2)``."""
    if not scores:
        return None
    total = 0.0
    for score in scores:
        total += score
    return round(100 * total / len(scores), 2)


def _official_bucket_percent(scores: Sequence[float]) -> Optional[float]:
    """The official ``scorer_e`` bucket score ``round(100 * np.mean(scores), 2)`` (numpy rounding); None if empty."""
    import numpy as np

    if not scores:
        return None
    return float(round(100 * np.mean(scores), 2))


def score_dataset(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]],
                  all_classes: Optional[Sequence[Optional[Sequence[str]]]] = None) -> Optional[float]:
    """round(100 * total / n, 2), total summed in order as the official scorer does; None for no samples.

    all_classes: one list per sample (or None for datasets without classes).
    """
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    classes = all_classes if all_classes is not None else [None] * len(predictions)
    scores = [score_sample(dataset, p, a, c) for p, a, c in zip(predictions, answers, classes)]
    return _official_percent(scores)


def length_bucket(length: int) -> str:
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def score_dataset_e(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]],
                    lengths: Sequence[int],
                    all_classes: Optional[Sequence[Optional[Sequence[str]]]] = None) -> dict[str, Optional[float]]:
    """LongBench-E: {"0-4k", "4-8k", "8k+"} -> score of the samples in that length bucket.

    A bucket without samples is None (the official code gives NaN there).
    """
    if not (len(predictions) == len(answers) == len(lengths)):
        raise ValueError("predictions, answers and lengths differ in length")
    classes = all_classes if all_classes is not None else [None] * len(predictions)
    buckets: dict[str, list[float]] = {name: [] for name in LENGTH_BUCKETS}
    for p, a, n, c in zip(predictions, answers, lengths, classes):
        buckets[length_bucket(n)].append(score_sample(dataset, p, a, c))
    return {name: _official_bucket_percent(values) for name, values in buckets.items()}
