"""RULER metrics: case-insensitive containment of the references in the prediction.

string_match_all (every task but qa): per sample, the fraction of references found in the prediction;
string_match_part (qa_1, qa_2): per sample, 1 if any reference is found. Task score = the sum over samples
divided by their count, times 100, rounded to 2 decimals: in that order, as the official code computes it
(`sum(...) / len(preds) * 100`); `100 * sum / n` rounds differently at some sizes (40 samples x 4
references with 23 hits: official 14.37, the other order 14.38). Predictions are cleaned first: control characters become newlines and
surrounding whitespace is stripped.
"""

from __future__ import annotations

import re
from typing import Sequence

from pyramidkv.benchmarks.ruler.tasks import TASKS

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    return _CONTROL.sub("\n", pred.strip()).strip()


def _mean_over_samples(preds: Sequence[str], refs: Sequence[Sequence[str]], per_sample) -> float:
    """The mean of per_sample(hits) over samples x 100 (hits[i]: reference i is in the prediction), summed in
    sample order and divided before multiplying, as the official code does."""
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions but {len(refs)} reference lists")
    if not preds:
        raise ValueError("no predictions to score")
    total = 0.0
    for pred, ref in zip(preds, refs):
        if not ref:
            raise ValueError("a sample has no references")
        low = pred.lower()
        total += per_sample([r.lower() in low for r in ref])
    return round(total / len(preds) * 100, 2)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's metric for all but QA: the fraction of references contained in the prediction (case-insensitive)."""
    return _mean_over_samples(preds, refs, lambda hits: sum(hits) / len(hits))


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's QA metric: 1 if any reference is contained in the prediction (case-insensitive)."""
    return _mean_over_samples(preds, refs, lambda hits: float(any(hits)))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def metric_for(task: str) -> str:
    return TASKS[task].metric if task in TASKS else "string_match_all"


def score_task(task: str, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """The task's score (0..100, 2 decimals) from raw predictions and their reference lists."""
    return METRICS[metric_for(task)]([postprocess(p) for p in preds], refs)
