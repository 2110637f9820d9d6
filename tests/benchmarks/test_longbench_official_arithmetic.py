"""eval.py against the official LongBench eval.py arithmetic, on the shipped data with random predictions.

The per-sample metric is ours (checked case by case in test_longbench_metrics.py); the
aggregation below is written from the official eval.py: `total += score` in file order and
round(100 * total / n, 2) per dataset; per LongBench-E bucket round(100 * np.mean(scores), 2).
"""

from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest

from pyramidkv.benchmarks.longbench import evaluate as E
from pyramidkv.benchmarks.longbench import metrics as M
from tests.helpers import longbench_data_dir

DATA = longbench_data_dir()
DATASETS = ("multi_news", "multifieldqa_zh", "passage_retrieval_zh")
SETS_PER_DATASET = 1000
ROWS_PER_FILE = 12
CANDIDATES_PER_ROW = 6


def _official_sample_score(dataset: str, prediction: str, answers: list, all_classes) -> float:
    score = 0.0
    if dataset in ("trec", "triviaqa", "samsum", "lsht"):
        prediction = prediction.lstrip("\n").split("\n")[0]
    for answer in answers:
        score = max(score, M.DATASET2METRIC[dataset](prediction, answer, all_classes=all_classes))
    return score


def _official_dataset_score(scores: list) -> float:
    total = 0.0
    for score in scores:
        total += score
    return round(100 * total / len(scores), 2)


def _official_buckets(scores: list, lengths: list) -> dict:
    buckets = {"0-4k": [], "4-8k": [], "8k+": []}
    for score, length in zip(scores, lengths):
        if length < 4000:
            buckets["0-4k"].append(score)
        elif length < 8000:
            buckets["4-8k"].append(score)
        else:
            buckets["8k+"].append(score)
    # an empty bucket is NaN in the official code, None (null) in ours
    return {k: (round(100 * np.mean(v), 2) if v else None) for k, v in buckets.items()}


def _candidates(dataset: str, row: dict, rng: random.Random) -> list:
    """Random predictions. passage_retrieval_zh gets k right of n paragraphs (n in 1, 2, 3, 4, 6, 8),
    so that sums of thirds and eighths hit the rounding ties where summation order matters."""
    if dataset == "passage_retrieval_zh":
        truth = row["answers"][0]
        out = []
        for _ in range(CANDIDATES_PER_ROW):
            n = rng.choice([1, 2, 3, 4, 6, 8])
            out.append("".join(truth if rng.random() < 0.5 else f"段落{rng.randint(1, 30)}" for _ in range(n)))
        return out
    words = (row["answers"][0].split() if dataset == "multi_news" else list(row["answers"][0])) or ["x"]
    out = []
    for _ in range(CANDIDATES_PER_ROW):
        start = rng.randrange(len(words))
        piece = words[start:start + rng.randint(1, 12)] + [rng.choice(["noise", "其他", "the"])] * rng.randint(0, 3)
        out.append((" " if dataset == "multi_news" else "").join(piece))
    return out


@pytest.fixture(scope="module")
def shipped_rows():
    rows = {}
    for dataset in DATASETS:
        with open(DATA / f"{dataset}.jsonl", encoding="utf-8") as f:
            rows[dataset] = [json.loads(next(f)) for _ in range(ROWS_PER_FILE)]
    return rows


def test_eval_matches_official_arithmetic_on_random_predictions(shipped_rows, tmp_path, monkeypatch):
    rng = random.Random(20240607)
    # Memoise our per-sample metric (the expensive part; not what this test checks).
    for dataset in DATASETS:
        cached = functools.lru_cache(maxsize=None)(M.DATASET2METRIC[dataset])
        monkeypatch.setitem(M.DATASET2METRIC, dataset,
                            lambda p, g, all_classes=None, _m=cached: _m(p, g, all_classes=None))
    candidates = {d: [_candidates(d, row, rng) for row in rows] for d, rows in shipped_rows.items()}

    mismatches = []
    for set_index in range(SETS_PER_DATASET):
        run = tmp_path / "pred_e" / f"set{set_index}"  # the official LongBench-E layout
        run.mkdir(parents=True)
        expected, expected_e = {}, {}
        for dataset, rows in shipped_rows.items():
            picked = rng.sample(range(len(rows)), rng.choice([1, 2, 3, 4, 4, 8, 8, 8, rng.randint(1, len(rows))]))
            lines, scores, lengths = [], [], []
            for i in picked:
                row = rows[i]
                prediction = rng.choice(candidates[dataset][i])
                length = rng.choice([row["length"], rng.randint(0, 12000)])
                lines.append(json.dumps({"_id": row["_id"], "pred": prediction, "answers": row["answers"],
                                         "all_classes": row["all_classes"], "length": length}, ensure_ascii=False))
                scores.append(_official_sample_score(dataset, prediction, row["answers"], row["all_classes"]))
                lengths.append(length)
            (run / f"{dataset}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
            expected[dataset] = _official_dataset_score(scores)
            expected_e[dataset] = _official_buckets(scores, lengths)
        got = E.evaluate_run_dir(run, write=False)["scores"]
        got_e = E.evaluate_run_dir(run, longbench_e=True, write=False)["scores"]
        if got != expected or got_e != expected_e:
            mismatches.append((set_index, expected, got, expected_e, got_e))
    assert not mismatches, f"{len(mismatches)} of {SETS_PER_DATASET} sets differ; first: {mismatches[0]}"
