"""Every prompt of a batch is computed alone: a left-padded batch of 3 prompts of different lengths
gives each prompt the greedy tokens, kept positions (every layer and head), held positions and stored
bytes it gets when run by itself. The model is a 4-layer random Llama with SmolLM2's tokenizer
(conftest.py's random_llama): the property holds whatever the weights, and a case takes a fraction of a
second instead of seven on SmolLM2.

The matrix is scorer x head allocation x layer allocation x merge rule x quantizer x decode budget x key
channels (ThinK) x sinks and random share (NACL) x Quest pages x cross-layer merging (MiniCache) x sparse
prefill (MInference). Its combinations are covered pairwise: every pair of values of two axes that some
valid combination has appears in at least one case of CASES (83 cases; combinations refused at build time,
such as headkv with a pyramid, are not cases). CASES is a table, so that collecting this file costs
nothing; test_the_cases_cover_every_pair checks that each pair no case holds is refused in ~250 completions
(`witness`), and `python -m tests.core.test_batch_independence` builds all 336,000 combinations and prints a new
table when the refusals change. Logits may
differ in the last bits (the model's own batched matmuls round differently), so tokens, not logits, are
compared.
"""

from __future__ import annotations

import itertools
import random
import typing

import pytest

from pyramidkv import make_method
from tests.engine_snapshot import assert_batch_equals_alone
from tests.helpers import cached_type_hints

AXES = {
    "scorer": ["streamingllm", "h2o", "snapkv", "l2norm", "nacl", "scissorhands", "expected_attention", "keydiff",
               "tova", "kvzip", "kvzap", "duo_attention", "qfilter",
               "kvzip_head"],
    "head_allocation": ["uniform", "adakv", "headkv", "global", "threshold"],
    "layer_allocation": ["uniform", "pyramid", "zigzag"],
    "merge": [None, "pivot", "weighted", "mergingpress", "cam"],
    "quant": [None, "kivi", "kvquant", "kvquant-nuq", "gear"],
    "decode": [None, 40],
    "key_channels": [0.0, 0.4],
    "sinks_and_random": [False, True],
    "pages": [None, 32],
    "cross_layer": [False, True],
    "prefill": [None, "minference"],
}
# Small groups so that quantization happens at prefill and while decoding on these short prompts.
QUANTIZERS = {
    "kivi": dict(quant_method="kivi", nbits=2, group_size=8, residual_length=8),
    "kvquant": dict(quant_method="kvquant", group_size=8),
    "kvquant-nuq": dict(quant_method="kvquant", group_size=8, datatype="nuq"),
    "gear": dict(quant_method="gear", group_size=8, residual_length=8, rank=2, decode_rank=1),
}
NEW_TOKENS = 10
# head_allocation threshold: per scorer a threshold inside its scores' range on the random Llama's prompts
THRESHOLDS = {"streamingllm": 100.0, "h2o": 1.0, "snapkv": 0.2, "l2norm": -0.5, "expected_attention": 0.003,
              "keydiff": 0.0, "kvzip": 0.01, "kvzap": -8.0, "kvzip_head": 0.5}


def build(case: dict, tables: dict):
    """The case's method; `tables`: the random Llama's HeadKV and MInference tables (conftest.py)."""
    settings = {"budget": 64, "head_allocation": case["head_allocation"], "layer_allocation": case["layer_allocation"]}
    if case["head_allocation"] == "threshold":   # no budget; a threshold that evicts some of each scorer's tokens
        del settings["budget"]
        settings.update(threshold=THRESHOLDS.get(case["scorer"], 0.0), threshold_decoding=False)
    if case["head_allocation"] == "headkv":
        settings["head_scores"] = tables["head_scores"]
    if case["scorer"] == "kvzap":
        settings["kvzap_path"] = tables["kvzap_path"]
    if case["scorer"] == "duo_attention" and case["head_allocation"] == "threshold":   # its own rule, decoding too
        settings.update(threshold=0.5, threshold_decoding=True, duo_pattern=tables["duo_pattern"], window_size=8,
                        num_sinks=2)
    if case["scorer"] in ("h2o", "snapkv", "nacl", "scissorhands", "kvzap", "qfilter"):
        settings["window_size"] = 16
    if case["scorer"] in ("qfilter", "kvzip_head"):
        settings[f"{case['scorer']}_path"] = tables[f"{case['scorer']}_path"]
    if case["key_channels"]:
        settings.update(key_channel_ratio=case["key_channels"], key_recent_size=8)
    if case["sinks_and_random"]:
        settings.update(num_sinks=2, random_fraction=0.3, random_seed=5)
    if case["merge"] is not None:
        settings["merge"] = case["merge"]
    if case["quant"] is not None:
        settings.update(QUANTIZERS[case["quant"]])
    if case["decode"] is not None:
        settings.update(decode_budget=case["decode"], decode_interval=8)
    if case["pages"] is not None:
        settings.update(page_budget=case["pages"], page_size=8)
    if case["cross_layer"]:
        settings.update(cross_layer_merge=True, cross_layer_start=2)
    if case["prefill"] is not None:
        settings.update(prefill_attention=case["prefill"], pattern_table=tables["pattern_table"])
    return make_method(case["scorer"], **settings)


def valid(case: dict, tables: dict) -> bool:
    try:
        build(case, tables)
    except ValueError:
        return False
    return True


def every_combination() -> list[dict]:
    return [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]


def pairs(case: dict) -> set:
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(AXES, 2)}


def every_pair() -> list[tuple]:
    return [((a, x), (b, y)) for a, b in itertools.combinations(AXES, 2) for x in AXES[a] for y in AXES[b]]


def witness(pair: tuple, tables: dict, tries: int = 200):
    """A valid combination holding `pair`, or None: the pair with every other axis at its first value, then each
    other axis changed alone, then `tries` seeded random completions. A pair no case covers is one that some rule
    refuses (tova with adakv, a threshold with a budget-only unit); a rule change that lets it run shows in one of
    these completions. Searching all completions of every uncovered pair costs the whole product (336,000 builds,
    ~4 minutes): `python -m tests.core.test_batch_independence` does that when it prints a new table."""
    fixed = dict(pair)
    base = {axis: fixed.get(axis, values[0]) for axis, values in AXES.items()}
    candidates = [base] + [{**base, axis: value} for axis, values in AXES.items() if axis not in fixed
                           for value in values[1:]]
    rng = random.Random(str(pair))
    candidates += [{axis: fixed.get(axis, rng.choice(values)) for axis, values in AXES.items()} for _ in range(tries)]
    return next((c for c in candidates if valid(c, tables)), None)


def pairwise_cases(tables: dict) -> list[dict]:
    """A small set of valid combinations covering every pair of axis values that a valid combination has
    (greedy: each step takes the combination covering the most pairs not yet covered)."""
    combos = [c for c in every_combination() if valid(c, tables)]
    uncovered = set().union(*(pairs(c) for c in combos))
    chosen = []
    while uncovered:
        best = max(combos, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


# pairwise_cases() over every axis at once (82 cases; the table appended issue by issue had grown to 107), in the
# order of AXES; then the case where the suite first met a near-tie (tests/near_ties.py, docs/testing.md): on
# AVX-512 kernels, prompt 2 at layer 0 keeps one of two occurrences of a token whose key norms are equal but for
# rounding.
CASES = [dict(zip(AXES, row)) for row in [
    ('streamingllm', 'uniform', 'uniform', None, None, None, 0.0, False, None, False, None),
    ('h2o', 'adakv', 'pyramid', 'pivot', 'kivi', None, 0.4, True, None, False, 'minference'),
    ('snapkv', 'uniform', 'zigzag', 'weighted', None, 40, 0.0, True, 32, False, 'minference'),
    ('l2norm', 'headkv', 'uniform', 'mergingpress', 'gear', None, 0.4, False, None, False, 'minference'),
    ('nacl', 'global', 'uniform', 'cam', 'kvquant', None, 0.0, True, None, False, None),
    ('expected_attention', 'adakv', 'pyramid', 'mergingpress', None, 40, 0.0, False, 32, False, None),
    ('keydiff', 'adakv', 'zigzag', 'weighted', 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('kvzip', 'threshold', 'uniform', None, 'kivi', None, 0.4, False, None, False, None),
    ('kvzap', 'uniform', 'uniform', 'pivot', None, None, 0.0, False, None, True, None),
    ('qfilter', 'headkv', 'uniform', None, None, 40, 0.0, True, 32, False, None),
    ('qfilter', 'uniform', 'pyramid', 'cam', 'gear', None, 0.4, False, None, False, 'minference'),
    ('kvzip_head', 'adakv', 'pyramid', None, 'kvquant', None, 0.0, False, None, False, 'minference'),
    ('expected_attention', 'global', 'uniform', 'weighted', 'gear', None, 0.4, True, None, False, 'minference'),
    ('scissorhands', 'global', 'uniform', 'pivot', None, 40, 0.0, False, None, False, None),
    ('snapkv', 'adakv', 'zigzag', None, 'gear', None, 0.4, False, None, False, None),
    ('tova', 'uniform', 'zigzag', 'mergingpress', None, None, 0.0, True, 32, False, None),
    ('duo_attention', 'threshold', 'uniform', None, None, None, 0.0, False, None, False, 'minference'),
    ('h2o', 'adakv', 'uniform', 'cam', None, None, 0.0, False, None, True, None),
    ('kvzap', 'headkv', 'uniform', 'cam', 'kvquant-nuq', None, 0.0, True, None, False, 'minference'),
    ('l2norm', 'uniform', 'pyramid', 'weighted', 'kivi', None, 0.0, True, None, False, None),
    ('nacl', 'uniform', 'zigzag', 'pivot', None, 40, 0.0, False, 32, False, 'minference'),
    ('keydiff', 'uniform', 'uniform', None, None, None, 0.0, True, None, True, 'minference'),
    ('kvzip_head', 'global', 'uniform', 'mergingpress', None, 40, 0.0, True, 32, False, None),
    ('streamingllm', 'adakv', 'zigzag', 'mergingpress', 'kivi', None, 0.4, True, None, False, 'minference'),
    ('h2o', 'uniform', 'zigzag', 'weighted', 'kvquant', None, 0.0, False, None, False, None),
    ('snapkv', 'headkv', 'uniform', 'pivot', 'kvquant', None, 0.0, False, None, False, None),
    ('l2norm', 'threshold', 'uniform', None, None, 40, 0.0, False, 32, False, None),
    ('kvzip', 'uniform', 'pyramid', None, 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('nacl', 'headkv', 'uniform', 'weighted', 'kivi', None, 0.4, False, None, False, None),
    ('scissorhands', 'uniform', 'zigzag', 'cam', None, 40, 0.0, True, None, False, None),
    ('tova', 'uniform', 'uniform', None, None, 40, 0.0, False, None, False, 'minference'),
    ('kvzap', 'global', 'uniform', None, 'kivi', None, 0.4, False, None, False, None),
    ('kvzip_head', 'uniform', 'zigzag', 'pivot', 'gear', None, 0.0, True, None, False, None),
    ('streamingllm', 'global', 'uniform', 'pivot', 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('nacl', 'adakv', 'pyramid', 'mergingpress', 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('kvzap', 'adakv', 'pyramid', 'mergingpress', 'kvquant', None, 0.0, False, None, False, None),
    ('streamingllm', 'uniform', 'pyramid', 'weighted', None, 40, 0.0, False, 32, False, None),
    ('h2o', 'threshold', 'uniform', None, 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('snapkv', 'uniform', 'pyramid', 'cam', 'kivi', None, 0.0, False, None, False, None),
    ('l2norm', 'adakv', 'zigzag', 'pivot', None, None, 0.4, False, None, False, None),
    ('expected_attention', 'uniform', 'zigzag', None, 'kivi', None, 0.0, False, None, False, None),
    ('keydiff', 'uniform', 'pyramid', 'pivot', None, 40, 0.0, False, 32, False, None),
    ('keydiff', 'headkv', 'uniform', 'mergingpress', 'kivi', None, 0.4, False, None, False, None),
    ('qfilter', 'adakv', 'uniform', 'weighted', None, None, 0.0, False, None, True, None),
    ('kvzip_head', 'headkv', 'uniform', 'weighted', 'kivi', None, 0.4, True, None, False, None),
    ('streamingllm', 'threshold', 'uniform', None, 'kvquant', None, 0.0, False, None, False, None),
    ('h2o', 'headkv', 'uniform', 'mergingpress', None, None, 0.0, False, 32, False, None),
    ('snapkv', 'uniform', 'uniform', 'mergingpress', None, None, 0.0, False, None, True, None),
    ('scissorhands', 'adakv', 'pyramid', None, None, 40, 0.0, False, None, False, None),
    ('expected_attention', 'headkv', 'uniform', 'pivot', 'kvquant', None, 0.0, False, None, False, None),
    ('keydiff', 'threshold', 'uniform', None, 'gear', None, 0.0, False, None, False, None),
    ('kvzip', 'adakv', 'zigzag', None, None, None, 0.0, False, None, False, None),
    ('kvzap', 'uniform', 'zigzag', 'weighted', None, None, 0.0, False, 32, False, None),
    ('qfilter', 'uniform', 'zigzag', 'pivot', 'kivi', None, 0.0, False, None, False, None),
    ('qfilter', 'global', 'uniform', 'mergingpress', 'kvquant', None, 0.0, False, None, False, None),
    ('streamingllm', 'headkv', 'uniform', None, 'gear', None, 0.0, False, None, False, None),
    ('h2o', 'global', 'uniform', None, None, 40, 0.0, False, None, False, None),
    ('snapkv', 'global', 'uniform', None, 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('l2norm', 'global', 'uniform', None, 'kvquant', None, 0.0, False, None, False, None),
    ('nacl', 'uniform', 'uniform', None, None, None, 0.0, False, None, True, None),
    ('scissorhands', 'headkv', 'uniform', 'weighted', None, 40, 0.0, False, None, False, None),
    ('expected_attention', 'threshold', 'uniform', None, 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('keydiff', 'global', 'uniform', None, 'kvquant', None, 0.0, False, None, False, None),
    ('tova', 'uniform', 'pyramid', 'pivot', None, None, 0.0, False, None, False, None),
    ('kvzip', 'headkv', 'uniform', None, 'kvquant', None, 0.0, False, None, False, None),
    ('kvzip', 'global', 'uniform', None, 'gear', None, 0.0, False, None, False, None),
    ('kvzap', 'threshold', 'uniform', None, 'gear', None, 0.0, False, None, False, None),
    ('qfilter', 'threshold', 'uniform', None, 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('kvzip_head', 'threshold', 'uniform', None, 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('streamingllm', 'uniform', 'uniform', None, None, None, 0.0, False, None, True, None),
    ('h2o', 'uniform', 'uniform', None, 'gear', None, 0.0, False, None, False, None),
    ('h2o', 'uniform', 'uniform', 'cam', None, None, 0.0, False, 32, False, None),
    ('snapkv', 'threshold', 'uniform', None, None, None, 0.0, False, None, False, None),
    ('l2norm', 'uniform', 'uniform', None, None, None, 0.0, False, None, True, None),
    ('l2norm', 'uniform', 'uniform', None, 'kvquant-nuq', None, 0.0, False, None, False, None),
    ('nacl', 'uniform', 'uniform', None, 'gear', None, 0.0, False, None, False, None),
    ('scissorhands', 'uniform', 'uniform', 'mergingpress', None, 40, 0.0, False, None, False, None),
    ('scissorhands', 'threshold', 'uniform', None, None, 40, 0.0, False, None, False, None),
    ('expected_attention', 'uniform', 'uniform', None, None, None, 0.0, False, None, True, None),
    ('tova', 'uniform', 'uniform', 'weighted', None, None, 0.0, False, None, False, None),
    ('duo_attention', 'threshold', 'uniform', None, None, None, 0.0, False, None, False, None),
    ('kvzip_head', 'uniform', 'uniform', None, None, None, 0.0, False, None, True, None),
    ('l2norm', 'uniform', 'zigzag', 'pivot', None, 40, 0.0, False, 32, False, None),
]]


def label(case: dict) -> str:
    return "-".join(f"{v}" for v in case.values())


@pytest.fixture(scope="module")
def three_prompts(random_llama):
    """Three chat prompts of about 200, 130 and 60 tokens (the last one shorter than the budget)."""
    _, tokenizer, _ = random_llama
    text = ("A lighthouse keeper logged every passing ship in a ledger with a green cover. The ledger noted the "
            "weather, the ship's flag and the hour. ")

    def chat(body: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False).input_ids

    return [chat(text * 5 + "The secret harbour is Vardo. " + text * 2 + "Which harbour is secret?"),
            chat(text * 3 + "The secret harbour is Tromso. Which harbour is secret?"),
            chat("The secret harbour is Bodo. Which harbour is secret?")]


def test_the_cases_cover_every_pair(random_llama, monkeypatch):
    tables = random_llama[2]
    monkeypatch.setattr(typing, "get_type_hints", cached_type_hints())
    for case in CASES:
        build(case, tables)
    covered = set().union(*(pairs(c) for c in CASES))
    missing = [pair for pair in every_pair() if pair not in covered and witness(pair, tables) is not None]
    assert not missing, (f"{len(missing)} pairs of a valid combination are in no case, e.g. "
                         f"{[witness(p, tables) for p in missing[:2]]}; print a new table: "
                         f"python -m tests.core.test_batch_independence")
    for axis, values in AXES.items():
        assert {c[axis] for c in CASES} == set(values), axis


@pytest.mark.parametrize("case", CASES, ids=[label(c) for c in CASES])
def test_batch_of_three_equals_each_prompt_alone(random_llama, three_prompts, case, request):
    model, tokenizer, tables = random_llama
    method = build(case, tables)
    assert_batch_equals_alone(model, tokenizer, method, three_prompts, NEW_TOKENS, request)


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    typing.get_type_hints = cached_type_hints()
    with tempfile.TemporaryDirectory() as folder:  # building only checks that the tables are files
        tables = {"head_scores": str(Path(folder) / "head_scores.json"), "pattern_table": str(Path(folder) / "p.json"),
                  "kvzap_path": str(Path(folder) / "kvzap.safetensors"), "duo_pattern": str(Path(folder) / "duo.tsv"),
                  "qfilter_path": str(Path(folder) / "qfilter.safetensors"),
                  "kvzip_head_path": str(Path(folder) / "kvzip-head.safetensors")}
        for path in tables.values():
            Path(path).write_text("{}")
        for case in pairwise_cases(tables):
            print(f"    {tuple(case.values())!r},")
