"""MInference pattern tables, in the official JSON layout (`minference/configs/*.json`): a list with one
object per layer, {"head": [pattern, vertical_size, slash_size, score]} for each query head ("0", "1", ...),
pattern one of "vertical_and_slash", "stream_llm" (A-shape: vertical_size initial tokens + a local band of
slash_size) or "block_sparse" (the sizes unused). scripts/minference_patterns.py writes one for any model.

Packaged tables live in pyramidkv/sparse_prefill/data/patterns/, named {model}.json: `model` is the model
the table was made for, known by its content (components.model_digest, listed in data/models.json), never by
its folder's name.
"""

from __future__ import annotations

import json
from pathlib import Path

from pyramidkv.components import packaged_table

PATTERNS = ("vertical_and_slash", "stream_llm", "block_sparse")
PACKAGED_PATTERNS_DIR = Path(__file__).resolve().parent / "data" / "patterns"
# {model: content digest} of the models the packaged tables were made for.
PACKAGED_MODELS = Path(__file__).resolve().parent / "data" / "models.json"

# One head's entry: (pattern, vertical_size, slash_size).
HeadPattern = tuple[str, int, int]


def load_pattern_table(path) -> list[list[HeadPattern]]:
    """[layer][query head] -> (pattern, vertical_size, slash_size); ValueError naming the file and the first
    entry that is not of the official layout."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"pattern table {path}: cannot be read ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"pattern table {path}: not JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(raw, list) or not raw or not all(isinstance(layer, dict) for layer in raw):
        raise ValueError(f"pattern table {path}: expected a list of one {{\"head\": [pattern, vertical, slash, "
                         f"score]}} object per layer (MInference's layout)")
    table = []
    for layer, heads in enumerate(raw):
        if sorted(heads, key=lambda k: (len(k), k)) != [str(h) for h in range(len(heads))]:
            raise ValueError(f"pattern table {path}: layer {layer} must have the heads \"0\"..\"{len(heads) - 1}\" "
                             f"once each, got {sorted(heads)[:6]}")
        row = []
        for head in range(len(heads)):
            entry = heads[str(head)]
            ok = (isinstance(entry, list) and len(entry) >= 3 and entry[0] in PATTERNS
                  and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry[1:3]))
            if not ok:
                raise ValueError(f"pattern table {path}: layer {layer} head {head}: expected [pattern, vertical_size, "
                                 f"slash_size, score] with pattern one of {', '.join(PATTERNS)} and sizes integers "
                                 f">= 0, got {entry!r}")
            if entry[0] != "block_sparse" and entry[1] + entry[2] == 0:
                raise ValueError(f"pattern table {path}: layer {layer} head {head}: {entry[0]} with vertical_size 0 and "
                                 f"slash_size 0 computes no attention entry; give at least one column or diagonal")
            row.append((entry[0], entry[1], entry[2]))
        table.append(row)
    return table


def check_table_shape(table: list[list[HeadPattern]], num_layers: int, num_query_heads: int, source) -> None:
    shape = (len(table), len(table[0]) if table else 0)
    if shape != (num_layers, num_query_heads) or any(len(row) != num_query_heads for row in table):
        raise ValueError(f"pattern table {source} has {shape[0]} layers x {shape[1]} query heads, but the model "
                         f"has {num_layers} x {num_query_heads}; write one for this model with "
                         f"`python scripts/minference_patterns.py --model_path M --out FILE`")


def default_pattern_table(model_name_or_path: str) -> Path:
    """The packaged table made for the model at `model_name_or_path`, known by its content; ValueError
    otherwise (asking for an explicit table where its folder is named like a packaged model it is not)."""
    tables = {p.stem: p for p in sorted(PACKAGED_PATTERNS_DIR.glob("*.json"))}
    return packaged_table(model_name_or_path, tables, PACKAGED_MODELS,
                          made_on="its packaged MInference pattern table was made for",
                          missing="no packaged MInference pattern table",
                          make=f"write one with `python scripts/minference_patterns.py --model_path {model_name_or_path} "
                               f"--out FILE` and pass it as pattern_table=FILE")
