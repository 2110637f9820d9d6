"""Per-head importance tables for HeadKV (Fu et al. 2024, "Not All Heads Matter").

A table file uses HeadKV's published layout: its FIRST LINE is one JSON object
``{"layer-head": [s1, s2, ...]}`` with one score per probe (HeadKV's own loader
reads exactly that line). Our script may add a second line (``{"run_meta": ...}``),
which HeadKV ignores and so do we. A head's importance is the mean of its list.

Packaged tables live in ``pyramidkv/allocation/data/head_scores/`` and are named
``{model}_{kind}.json``: ``kind`` is ``reasoning`` (retrieval-reasoning score, HeadKV's
default) or ``retrieval`` (Wu et al. 2024's retrieval score); ``model`` is the model the
table was computed on, known by its content (``components.model_digest``, listed in
``data/models.json``), never by its folder's name: a fine-tune in a folder named like it
is refused, the same model in a folder of any name finds its table.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from pyramidkv.components import packaged_table

HEAD_SCORE_KINDS = ("reasoning", "retrieval")
DEFAULT_HEAD_SCORE_KIND = "reasoning"
PACKAGED_TABLES_DIR = Path(__file__).resolve().parent / "data" / "head_scores"
# {model: content digest} of the models the packaged tables were computed on.
PACKAGED_MODELS = Path(__file__).resolve().parent / "data" / "models.json"
_KEY = re.compile(r"(\d+)-(\d+)")


class _KeyValuePairs(list):
    """A JSON object as its (key, value) pairs in file order, duplicates kept."""


def load_head_scores(path) -> np.ndarray:
    """Read a HeadKV head-score file; return the mean score per head, float64 [num_layers, num_query_heads].

    ValueError (naming the file) unless the first line is a JSON object whose keys
    "L-H" cover the full L x H grid exactly once, each with a non-empty list of
    finite numbers >= 0, and not every score is zero.
    """
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            first_line = f.readline()
    except OSError as e:
        raise ValueError(f"head-score file {path}: cannot be read ({e.strerror or e})") from e
    try:
        raw = json.loads(first_line, object_pairs_hook=_KeyValuePairs)   # keeps duplicate keys visible
    except json.JSONDecodeError as e:
        raise ValueError(f"head-score file {path}: the first line is not a complete JSON object ({e.msg}); "
                         f"HeadKV's layout puts the whole {{\"layer-head\": [scores]}} dict on line 1") from e
    if not isinstance(raw, _KeyValuePairs) or not raw:
        raise ValueError(f"head-score file {path}: the first line must be a non-empty JSON object "
                         f"{{\"layer-head\": [scores]}}, got {first_line.strip()[:40]!r}")

    means: dict[tuple[int, int], float] = {}
    for key, scores in raw:
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"head-score file {path}: key {key!r} is not 'layer-head' (two non-negative integers, "
                             f"e.g. '0-3')")
        layer, head = int(match.group(1)), int(match.group(2))
        if (layer, head) in means:   # a repeated key, or "01-2" next to "1-2"
            raise ValueError(f"head-score file {path}: head {layer}-{head} appears twice (key {key!r})")
        if not isinstance(scores, list) or not scores:
            raise ValueError(f"head-score file {path}: head {key!r} needs a non-empty list of scores, got {scores!r}")
        for s in scores:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
                raise ValueError(f"head-score file {path}: head {key!r} has the score {s!r}; scores must be finite "
                                 f"numbers >= 0 (a negative importance would give the most important head the "
                                 f"fewest tokens)")
        means[(layer, head)] = float(np.mean(np.asarray(scores, dtype=np.float64)))

    num_layers = 1 + max(layer for layer, _ in means)
    num_heads = 1 + max(head for _, head in means)
    missing = [f"{l}-{h}" for l in range(num_layers) for h in range(num_heads) if (l, h) not in means]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"head-score file {path}: the grid of {num_layers} layers x {num_heads} heads has gaps: "
                         f"{shown} missing")
    table = np.zeros((num_layers, num_heads), dtype=np.float64)   # [num_layers, num_query_heads]
    for (layer, head), mean in means.items():
        table[layer, head] = mean
    if not np.any(table):
        raise ValueError(f"head-score file {path}: every head scores 0, so it gives no allocation")
    return table


def check_head_scores(table: np.ndarray, num_layers: int, num_query_heads: int, source) -> None:
    """ValueError naming `source` and both shapes unless `table` is [num_layers, num_query_heads]."""
    expected = (num_layers, num_query_heads)
    if tuple(np.shape(table)) != expected:
        raise ValueError(f"head scores from {source} have shape {tuple(np.shape(table))} (layers, query heads), "
                         f"but the model has {expected}; compute a table for this model with "
                         f"`python scripts/head_scores.py --model_path M --out FILE`")


def default_head_scores_path(model_name_or_path: str, kind: str = DEFAULT_HEAD_SCORE_KIND) -> Path:
    """The packaged `kind` table computed on the model at `model_name_or_path`, known by its content.

    ValueError (naming the script that computes a table) when no packaged table was made for it, and one
    asking for an explicit table when its folder is named like a packaged model whose content it does not have.
    """
    if kind not in HEAD_SCORE_KINDS:
        raise ValueError(f"unknown head-score kind {kind!r}; choose one of {', '.join(HEAD_SCORE_KINDS)}")
    suffix = f"_{kind}.json"
    tables = {p.name[: -len(suffix)]: p for p in sorted(PACKAGED_TABLES_DIR.glob(f"*{suffix}"))}
    return packaged_table(model_name_or_path, tables, PACKAGED_MODELS,
                          made_on="its packaged head-score table was computed on", missing=f"no {kind} head-score table",
                          make=f"compute one with `python scripts/head_scores.py --model_path {model_name_or_path} "
                               f"--kind {kind} --out FILE` and pass it as `--head_path FILE` (head_scores=FILE in "
                               f"Python)")
