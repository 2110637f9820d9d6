"""The registry matrix: every method x head allocation x layer allocation x merge rule x quantizer x decode
budget either is refused when it is built, with a ValueError of one line, or generates on a tiny random
Llama holding exactly the tokens its budget gives, after the prefill and after every decode step.

"Built" is make_method plus the two checks the runners make before any weight is used: check_model (the
model's shape) and check_prompt (the prompt's length). A combination that passes them must run: any
exception from generate() fails, and so does a refusal of another type or over several lines.

The registries drive the axes (METHODS, HEAD_ALLOCATIONS, LAYER_ALLOCATIONS, MERGE_RULES, QUANTIZERS). Building a
combination takes a millisecond, running one a tenth of a second: every combination is built (the `product`
fixture: each refusal must be one line), and the ones that build run pairwise: every pair of values of two axes
that some valid combination has appears in at least one case of CASES (126 cases today). REFUSED holds, for each
refusal (its message less the units it names, `refusal_group`), the first combination refused with it (48). A
decode_budget case also runs the same combination without it, whose counts decode_problems compares with. Both
tables are written out, so that collecting this file costs nothing; a new method or unit, or a changed rule, fails
test_the_cases_cover_every_pair or test_every_refusal_is_one_line_and_some_case_meets_it until
`python -m tests.methods.test_matrix` prints new ones.
test_full_product_runs_within_its_budget_or_is_refused_in_one_line runs every combination (15,600, 3,175 of them
valid: minutes).

What a layer and head must hold is written below from the documented rules (Method's docstring,
docs/decoding.md), not read from the code under test:

* a method that keeps every prompt token holds the prompt length n in every head;
* otherwise every head holds at least the window and sinks and at most n; a layer kept whole (l2norm's
  skip_layers) holds n; with uniform heads the heads of a layer hold the same count; the compressed layers
  hold L x H x budget tokens together (with HeadKV's split over all layers at once, only when no layer is
  kept whole); each layer holds H x its layer budget, and H x budget with uniform layers (HeadKV aside);
* without decode_budget a head holds its prefill count plus one token per decode step, exactly;
* with decode_budget D and decode_interval I, whenever a head of a layer would hold D + I tokens or more,
  each head of that layer keeps min(held, D) (right after the prefill too), else it keeps everything: so
  no head ever holds more than D + I - 1 after a step, nor more than its prefill count plus the steps;
* a method whose defaults bound decoding (tova: decode_budget = budget, decode_interval 1) follows that rule
  with its own D and I when no decode_budget is given.

`python -m tests.methods.test_matrix` prints how many combinations run, the refusals grouped by message, and the
tables CASES and REFUSED.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re
import typing
from pathlib import Path

import pytest
import torch

from pyramidkv.allocation import HEAD_ALLOCATIONS, LAYER_ALLOCATIONS
from pyramidkv.components import setting_help
from pyramidkv.generation import generate
from pyramidkv.merging import MERGE_RULES
from pyramidkv.methods import METHODS, budget_flag_applies, make_method
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.models.patch import model_shape
from pyramidkv.quantization import QUANTIZERS
from pyramidkv.sparse_prefill import SPARSE_PREFILLS
from tests.conftest import tiny_llama
from tests.helpers import cached_type_hints, kvzap_artifact, write_calibrations

LAYERS, QUERY_HEADS, KV_HEADS = 3, 4, 2     # 3 layers: Quest attends densely in its first 2
PROMPT_LEN = 64
BUDGET = 40                                 # more than the largest default window + sinks (32 + 4)
DECODE_BUDGET, DECODE_INTERVAL = 36, 2      # re-selects right after the prefill and twice while decoding
NEW_TOKENS = 5                              # the prefill forward and 4 decode steps
THRESHOLD = 0.0                             # threshold eviction: some scorers pass it, some do not
                                            # (one with score_bounds: their middle)
# Small groups and windows so that the prompt is quantized (head_dim 16); residual_length 32 holds ThinK's
# full-width recent keys (key_recent_size 32).
QUANTIZER_SETTINGS = {
    "kivi": dict(nbits=2, group_size=8, residual_length=32),
    "kvquant": dict(group_size=8),
    "gear": dict(group_size=8, residual_length=32, rank=2, decode_rank=1),
}
# Quest evicts nothing: its budget is the tokens of the pages each decode step reads (tests/methods/test_quest.py).
CALIBRATED = ("qfilter_path", "kvzip_head_path", "triattention_path")   # calibrated methods' files written for the tiny model

AXES = {
    "method": list(METHODS),
    "head": [*HEAD_ALLOCATIONS, "threshold"],   # threshold: the threshold sizing (a uniform head allocation)
    "layer": list(LAYER_ALLOCATIONS),
    "merge": [None, *MERGE_RULES],
    "quant": [None, *QUANTIZERS],
    "decode": [None, DECODE_BUDGET],   # last: in the product a combination comes just before its decode twin
}


class TokenIds:
    """The tokenizer generate() needs for prompts given as token ids: a pad id and decode(); and for KVzip's repeat
    instructions an encoder (a byte per character) and no chat template."""

    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False):
        return type("Encoding", (), {"input_ids": list(text.encode())})()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(i) for i in ids)


def tiny_model():
    """The tiny random Llama (GQA 4 / 2, head_dim 16, 256 tokens), shared (tests/conftest.py): never changed."""
    return tiny_llama(layers=LAYERS, heads=QUERY_HEADS, kv_heads=KV_HEADS, vocab=256)


def write_tables(folder: Path) -> dict:
    """The settings of the units that need a table for this model: a HeadKV head-score table, an
    MInference pattern table (each pattern kind on some head), a KVzap predictor made on the model and the
    other calibrated methods' files (random, of the model's shape)."""
    generator = torch.Generator().manual_seed(2)
    head_scores = folder / "head_scores.json"
    head_scores.write_text(json.dumps({f"{layer}-{head}": [float(torch.rand(1, generator=generator))]
                                       for layer in range(LAYERS) for head in range(QUERY_HEADS)}))
    patterns = folder / "patterns.json"
    kinds = [["vertical_and_slash", 8, 16, 0.9], ["stream_llm", 4, 16, 0.9], ["block_sparse", 0, 0, 1.0]]
    patterns.write_text(json.dumps([{str(head): kinds[(layer + head) % 3] for head in range(QUERY_HEADS)}
                                    for layer in range(LAYERS)]))
    kvzap = kvzap_artifact(tiny_model(), folder / "kvzap-linear.safetensors")
    duo = folder / "full_attention_heads.tsv"   # DuoAttention's gates, 3 layers x 2 KV heads: 3 heads stream
    duo.write_text("0.9\t0.1\n0.2\t0.8\n0.6\t0.3\n")
    return {"head_scores": str(head_scores), "pattern_table": str(patterns), "kvzap_path": kvzap,
            "duo_attention": dict(duo_pattern=str(duo), threshold=0.5, window_size=8, num_sinks=2),
            **write_calibrations(folder, tiny_model().config)}


@functools.cache
def shape():
    return model_shape(tiny_model().config, dtype_bytes=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, prompt, tables), torch on one thread: on these sizes more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    prompt = torch.randint(3, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    yield tiny_model(), prompt, write_tables(tmp_path_factory.mktemp("matrix"))
    torch.set_num_threads(threads)


def every_combination(**fixed) -> list[dict]:
    """The product of AXES in their order (the axes in `fixed` at the value given)."""
    values = [[fixed[axis]] if axis in fixed else AXES[axis] for axis in AXES]
    return [dict(zip(AXES, row)) for row in itertools.product(*values)]


def settings(cls, case: dict, tables: dict) -> dict:
    head, layer, merge, quant, decode = (case[axis] for axis in ("head", "layer", "merge", "quant", "decode"))
    chosen = {"head_allocation": head, "layer_allocation": layer}
    if head == "threshold":   # no budget: each head keeps what passes; decided while decoding where it can be
        chosen.update(threshold=THRESHOLD if cls.score_bounds is None else sum(cls.score_bounds) / 2,
                      threshold_decoding=cls.token_scores)
    elif cls.sizing.evicts or budget_flag_applies(cls):   # Quest's reads whole pages, at least 3 of 16: 48
        chosen["budget"] = BUDGET if cls.sizing.evicts else 48
    if head == "threshold":   # a method's own threshold settings (duo_attention: its pattern)
        chosen.update(tables.get(cls.name, {}))
    if head == "headkv":
        chosen["head_scores"] = tables["head_scores"]
    if {f.name: f.default for f in dataclasses.fields(cls)}["window_size"] >= BUDGET:   # KVzap's DMS window (128)
        chosen["window_size"] = 16
    if "kvzap_path" in {f.name for f in dataclasses.fields(cls)}:
        chosen["kvzap_path"] = tables["kvzap_path"]
    chosen.update({name: tables[name] for name in CALIBRATED if name in {f.name for f in dataclasses.fields(cls)}})
    if merge is not None:
        chosen["merge"] = merge
    if quant is not None:
        chosen.update(quant_method=quant, **QUANTIZER_SETTINGS.get(quant, {}))
    if decode is not None:
        chosen.update(decode_budget=decode, decode_interval=DECODE_INTERVAL)
    if {f.name: f.default for f in dataclasses.fields(cls)}["prefill_attention"] is not None:
        chosen["pattern_table"] = tables["pattern_table"]   # the method's own sparse prefill (MInference)
    return chosen


def build(case: dict, tables: dict):
    """The method, through make_method and the checks the runners make before the weights are used."""
    method = make_method(case["method"], **settings(METHODS[case["method"]], case, tables))
    method.check_model(shape())
    method.check_prompt(PROMPT_LEN)
    return method


def refusal_group(message: str) -> str:
    """A refusal's rule: its message, the units and values it quotes written <unit>."""
    return re.sub(r"'[^'\s]*'|\b[A-Z][A-Za-z]+\(.*?\)", "<unit>", message)


def outcomes(tables: dict) -> dict[tuple, Exception | None]:
    """Every combination's values (in the order of AXES) -> None when it builds, else what building it raised."""
    result = {}
    for case in every_combination():
        try:
            build(case, tables)
            result[tuple(case.values())] = None
        except Exception as error:  # noqa: BLE001 - a refusal, or the failure test_every_refusal_... reports
            result[tuple(case.values())] = error
    return result


def label(case: dict) -> str:
    return (f"{case['method']} head={case['head']} layer={case['layer']} merge={case['merge']} quant={case['quant']} "
            f"decode_budget={case['decode']}")


def held_after_each_forward(model, prompt, method) -> tuple[list, list[int]]:
    """([forward][layer][stored head] tokens held after the prefill forward and after each decode step, the
    layer budgets the cache reports for the prompt)."""
    states, budgets = [], []

    def record(module, args, kwargs, output):
        cache = kwargs[CACHE_ARGUMENT]   # the line's name for the cache argument
        states.append([cache.held_counts(layer)[0] for layer in range(LAYERS)])
        if len(states) == 1:
            budgets.extend(cache.layer_budgets_used(0))

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        generate(model, TokenIds(), [prompt], method, NEW_TOKENS, stop_token_ids=[])
    finally:
        hook.remove()
    return states, budgets


def prefill_problems(name: str, method, layer: str, held: list[list[int]], budgets: list[int]) -> list[str]:
    """What is wrong with the counts [layer][head] held after the prefill, without decode_budget."""
    n = PROMPT_LEN
    if not method.sizing.evicts:
        return [] if all(c == n for row in held for c in row) else [f"keeps every token, holds {held}"]
    problems = []
    if method.sizing.outcome:   # threshold: between the protected tokens and the prompt, per head
        protected = min(n, method.window_size + method.num_sinks)
        return [] if all(protected <= c <= n for row in held for c in row) else \
            [f"threshold: every head holds between the {protected} protected tokens and the prompt ({n}): {held}"]
    whole = list(range(getattr(method, "skip_layers", 0)))
    compressed = [l for l in range(LAYERS) if l not in whole]
    uniform_heads = method.head_allocation.name == "uniform"
    per_layer = not method.head_allocation.global_over_layers
    if any(c != n for l in whole for c in held[l]):
        problems.append(f"layers {whole} keep the whole prompt ({n}): {held}")
    protected = method.window_size + method.num_sinks
    if any(not protected <= c <= n for l in compressed for c in held[l]):
        problems.append(f"every head holds between the {protected} protected tokens and the prompt ({n}): {held}")
    if uniform_heads and any(len(set(held[l])) != 1 for l in compressed):
        problems.append(f"uniform heads: the heads of a layer hold the same count: {held}")
    total = sum(sum(held[l]) for l in compressed)
    # A split over all layers at once (HeadKV) gives a layer kept whole a share it does not use.
    if (per_layer or not whole) and total != len(compressed) * KV_HEADS * BUDGET:
        problems.append(f"the compressed layers hold {total} tokens, not {len(compressed)} x {KV_HEADS} x {BUDGET}")
    if layer == "uniform" and per_layer and any(sum(held[l]) != KV_HEADS * BUDGET for l in compressed):
        problems.append(f"uniform layers: each layer holds {KV_HEADS} x {BUDGET}: {held}")
    if per_layer:
        if sum(budgets[l] for l in compressed) != len(compressed) * BUDGET or any(budgets[l] != n for l in whole):
            problems.append(f"layer budgets {budgets}: the compressed layers' sum to {len(compressed)} x {BUDGET}, "
                            f"a whole layer's is {n}")
        if any(sum(held[l]) != KV_HEADS * budgets[l] for l in compressed):
            problems.append(f"each layer holds {KV_HEADS} x its layer budget {budgets}: {held}")
    return problems


def decode_problems(held_states: list, prefill: list[list[int]] | None, D: int = DECODE_BUDGET,
                    I: int = DECODE_INTERVAL) -> list[str]:  # noqa: E741
    """What is wrong with the counts after each forward with decode_budget D and decode_interval I, given the
    prefill counts of the same method without it (None when that one was refused: then only the bounds of the
    prefill state)."""
    problems = []

    def reselect(row: list[int]) -> list[int]:
        return [min(c, D) for c in row] if max(row) >= D + I else row

    if prefill is not None:
        expected = [reselect(row) for row in prefill]
        if held_states[0] != expected:
            problems.append(f"after the prefill: holds {held_states[0]}, expected {expected} (prefill {prefill})")
    for step, state in enumerate(held_states):
        if any(c > D + I - 1 for row in state for c in row):
            problems.append(f"step {step}: a head holds more than decode_budget + decode_interval - 1: {state}")
        if prefill is not None and any(c > p + step for row, first in zip(state, prefill) for c, p in zip(row, first)):
            problems.append(f"step {step}: a head holds more than its prefill count + {step}: {state}")
    for step in range(1, len(held_states)):
        expected = [reselect([c + 1 for c in row]) for row in held_states[step - 1]]
        if held_states[step] != expected:
            problems.append(f"step {step}: holds {held_states[step]}, expected {expected}")
    return problems


def one_line_refusal(error: Exception) -> bool:
    return isinstance(error, ValueError) and bool(str(error).strip()) and "\n" not in str(error)


def check(tiny, case: dict, prefill: list[list[int]] | None) -> tuple[list[str], list[list[int]] | None]:
    """(what is wrong with the combination, the counts [layer][head] it holds after the prefill when it runs without
    decode_budget). `prefill`: with decode_budget, the counts of the same combination without it (None when that
    one is refused)."""
    model, prompt, tables = tiny
    name, layer = case["method"], case["layer"]
    try:
        method = build(case, tables)
    except ValueError as refusal:
        return ([] if one_line_refusal(refusal) else [f"{label(case)}: refused, but not in one line: {str(refusal)!r}"],
                None)
    except Exception as error:  # noqa: BLE001 - any other exception is the failure reported
        return [f"{label(case)}: {type(error).__name__} while building: {error}"], None
    try:
        states, budgets = held_after_each_forward(model, prompt, method)
    except Exception as error:  # noqa: BLE001
        return [f"{label(case)}: passed the checks, then {type(error).__name__} while generating: {error}"], None
    if len(states) != NEW_TOKENS:
        return [f"{label(case)}: {len(states)} forwards, expected {NEW_TOKENS}"], None
    if case["decode"] is None:
        problems = prefill_problems(name, method, layer, states[0], budgets)
        if method.decode is not None:   # its defaults bound decoding
            problems += decode_problems(states, None, method.decode.decode_budget, method.decode.decode_interval)
        elif getattr(method.sizing, "threshold_decoding", False):   # evicts as tokens leave the window
            problems += [f"step {t}: holds {state} after {states[t - 1]}: a head gains the new token and loses at "
                         f"most the one leaving the window" for t, state in enumerate(states)
                         if t and any(not 0 <= c - p <= 1 for row, prev in zip(state, states[t - 1])
                                      for c, p in zip(row, prev))]
        else:
            problems += [f"step {t}: holds {state}, expected the prefill counts + {t}"
                         for t, state in enumerate(states) if state != [[c + t for c in row] for row in states[0]]]
        return [f"{label(case)}: {problem}" for problem in problems], states[0]
    return [f"{label(case)}: {problem}" for problem in decode_problems(states, prefill)], None


# ---- the cases: pairwise over the combinations that run, and one per refusal ---------------------------------
def pairs(case: dict) -> set:
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(AXES, 2)}


def twin(values: tuple) -> tuple:
    """The same combination without decode_budget."""
    return values[:-1] + (None,)


def witness(pair: tuple, product: dict) -> dict | None:
    """The first combination of the product holding `pair` that builds, or None."""
    return next((dict(zip(AXES, values)) for values, error in product.items()
                 if error is None and all(dict(zip(AXES, values))[axis] == value for axis, value in pair)), None)


def pairwise_cases(product: dict) -> list[dict]:
    """A small set of combinations that build, covering every pair of axis values that such a combination has
    (greedy: each step takes the combination covering the most pairs not yet covered, one whose no-decode twin
    builds when it can, so that decode_problems has its counts)."""
    combos = [dict(zip(AXES, values)) for values, error in product.items() if error is None]
    twin_builds = {tuple(c.values()): product[twin(tuple(c.values()))] is None for c in combos}
    uncovered = set().union(*(pairs(c) for c in combos))
    chosen = []
    while uncovered:
        best = max(combos, key=lambda c: (len(pairs(c) & uncovered), twin_builds[tuple(c.values())]))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def outcome(product: dict, case: dict) -> Exception | None:
    """The case's outcome in the product (a case of a unit no registry holds any more: a KeyError)."""
    return product.get(tuple(case.values()), KeyError(f"{label(case)} is not a combination of AXES"))


def refused_cases(product: dict) -> list[dict]:
    """For each refusal group, the first combination of the product refused with it."""
    first = {}
    for values, error in product.items():
        if isinstance(error, ValueError):
            first.setdefault(refusal_group(str(error)), dict(zip(AXES, values)))
    return list(first.values())


# pairwise_cases(product) and refused_cases(product) as printed by `python -m tests.methods.test_matrix`, in the
# order of AXES.
CASES = [dict(zip(AXES, row)) for row in [
    ('fullkv', 'uniform', 'uniform', None, None, None),
    ('streamingllm', 'adakv', 'pyramid', 'pivot', None, 36),
    ('h2o', 'adakv', 'zigzag', 'weighted', 'kivi', None),
    ('streamingllm', 'headkv', 'uniform', 'mergingpress', 'kvquant', None),
    ('snapkv', 'uniform', 'pyramid', 'cam', 'gear', None),
    ('h2o', 'global', 'uniform', 'cam', None, 36),
    ('pyramidkv', 'uniform', 'zigzag', 'mergingpress', None, 36),
    ('pyramidkv', 'global', 'uniform', 'pivot', 'kivi', None),
    ('snapkv', 'headkv', 'uniform', 'weighted', None, 36),
    ('l2norm', 'threshold', 'uniform', None, 'gear', None),
    ('adakv', 'uniform', 'pyramid', 'weighted', 'kvquant', None),
    ('ada_pyramidkv', 'adakv', 'zigzag', None, 'kvquant', None),
    ('headkv', 'uniform', 'pyramid', None, 'kivi', None),
    ('zigzagkv', 'uniform', 'zigzag', 'pivot', 'gear', None),
    ('think', 'adakv', 'uniform', 'mergingpress', 'gear', None),
    ('adakv', 'threshold', 'uniform', None, None, 36),
    ('cam', 'adakv', 'zigzag', 'cam', 'kivi', None),
    ('nacl', 'global', 'uniform', 'weighted', 'gear', None),
    ('kvzip', 'headkv', 'uniform', None, 'kivi', None),
    ('expected_attention', 'uniform', 'pyramid', 'mergingpress', 'kivi', None),
    ('ada_expected_attention', 'headkv', 'uniform', 'pivot', 'kvquant', None),
    ('keydiff', 'global', 'uniform', None, 'kvquant', None),
    ('kvzap', 'headkv', 'uniform', 'cam', 'kvquant', None),
    ('ada_pyramidkv', 'global', 'uniform', 'mergingpress', None, 36),
    ('qfilter', 'headkv', 'uniform', None, 'gear', None),
    ('l2norm', 'uniform', 'pyramid', 'pivot', None, 36),
    ('headkv', 'adakv', 'uniform', 'pivot', None, 36),
    ('zigzagkv', 'adakv', 'uniform', None, None, 36),
    ('cam', 'uniform', 'uniform', None, None, 36),
    ('nacl', 'uniform', 'pyramid', None, None, 36),
    ('quest', 'uniform', 'uniform', None, None, None),
    ('minicache', 'uniform', 'uniform', None, None, None),
    ('minference', 'uniform', 'uniform', None, None, None),
    ('expected_attention', 'adakv', 'uniform', None, None, 36),
    ('ada_expected_attention', 'uniform', 'pyramid', None, None, 36),
    ('keydiff', 'uniform', 'pyramid', 'pivot', None, 36),
    ('tova', 'uniform', 'uniform', None, None, None),
    ('duo_attention', 'threshold', 'uniform', None, None, None),
    ('qfilter', 'uniform', 'pyramid', 'pivot', None, 36),
    ('kvzip_head', 'uniform', 'uniform', None, None, None),
    ('scissorhands', 'uniform', 'uniform', None, None, 36),
    ('rkv', 'uniform', 'uniform', None, None, None),
    ('streamingllm', 'uniform', 'zigzag', None, 'kivi', None),
    ('h2o', 'uniform', 'pyramid', None, 'kvquant', None),
    ('snapkv', 'adakv', 'zigzag', None, 'kivi', None),
    ('pyramidkv', 'adakv', 'pyramid', None, 'kvquant', None),
    ('l2norm', 'adakv', 'zigzag', 'weighted', 'kivi', None),
    ('adakv', 'adakv', 'zigzag', 'pivot', 'kivi', None),
    ('ada_pyramidkv', 'uniform', 'pyramid', 'pivot', 'kivi', None),
    ('think', 'uniform', 'pyramid', None, None, None),
    ('nacl', 'adakv', 'zigzag', 'pivot', 'kivi', None),
    ('ada_expected_attention', 'adakv', 'zigzag', 'weighted', 'kivi', None),
    ('keydiff', 'adakv', 'zigzag', 'weighted', 'kivi', None),
    ('kvzap', 'uniform', 'pyramid', None, None, None),
    ('kvzap', 'adakv', 'zigzag', 'pivot', 'kivi', None),
    ('qfilter', 'adakv', 'zigzag', 'weighted', 'kivi', None),
    ('streamingllm', 'global', 'uniform', 'weighted', 'gear', None),
    ('h2o', 'headkv', 'uniform', 'pivot', 'gear', None),
    ('snapkv', 'global', 'uniform', 'pivot', 'kvquant', None),
    ('pyramidkv', 'headkv', 'uniform', 'weighted', 'gear', None),
    ('l2norm', 'headkv', 'uniform', 'mergingpress', 'kvquant', None),
    ('adakv', 'headkv', 'uniform', 'mergingpress', 'gear', None),
    ('ada_pyramidkv', 'headkv', 'uniform', 'weighted', 'gear', None),
    ('headkv', 'uniform', 'zigzag', 'weighted', 'kvquant', None),
    ('headkv', 'headkv', 'uniform', 'mergingpress', 'gear', None),
    ('zigzagkv', 'uniform', 'pyramid', 'weighted', 'kivi', None),
    ('zigzagkv', 'headkv', 'uniform', 'mergingpress', 'kvquant', None),
    ('think', 'uniform', 'zigzag', 'pivot', 'kivi', None),
    ('nacl', 'headkv', 'uniform', 'mergingpress', 'kvquant', None),
    ('kvzip', 'uniform', 'pyramid', None, None, None),
    ('kvzip', 'adakv', 'zigzag', None, 'kvquant', None),
    ('expected_attention', 'uniform', 'zigzag', 'pivot', 'kvquant', None),
    ('expected_attention', 'headkv', 'uniform', 'weighted', 'gear', None),
    ('ada_expected_attention', 'global', 'uniform', 'mergingpress', 'gear', None),
    ('keydiff', 'headkv', 'uniform', 'mergingpress', 'gear', None),
    ('tova', 'uniform', 'pyramid', 'pivot', None, 36),
    ('kvzap', 'global', 'uniform', 'weighted', 'gear', None),
    ('qfilter', 'global', 'uniform', 'mergingpress', 'kvquant', None),
    ('kvzip_head', 'adakv', 'pyramid', None, None, 36),
    ('scissorhands', 'adakv', 'pyramid', 'pivot', None, 36),
    ('rkv', 'adakv', 'pyramid', 'pivot', None, 36),
    ('streamingllm', 'threshold', 'uniform', None, 'kivi', None),
    ('h2o', 'threshold', 'uniform', None, 'kvquant', None),
    ('adakv', 'global', 'uniform', 'cam', None, None),
    ('headkv', 'global', 'uniform', 'cam', None, None),
    ('zigzagkv', 'global', 'uniform', 'cam', None, None),
    ('cam', 'uniform', 'pyramid', None, 'kvquant', None),
    ('cam', 'headkv', 'uniform', None, 'gear', None),
    ('think', 'headkv', 'uniform', 'weighted', None, None),
    ('think', 'global', 'uniform', 'cam', None, None),
    ('kvzip', 'global', 'uniform', None, 'gear', None),
    ('tova', 'uniform', 'zigzag', 'weighted', None, None),
    ('kvzip_head', 'uniform', 'zigzag', None, 'kivi', None),
    ('kvzip_head', 'headkv', 'uniform', None, 'kvquant', None),
    ('kvzip_head', 'global', 'uniform', None, 'gear', None),
    ('scissorhands', 'uniform', 'zigzag', 'weighted', None, 36),
    ('scissorhands', 'headkv', 'uniform', 'mergingpress', None, 36),
    ('scissorhands', 'global', 'uniform', 'cam', None, 36),
    ('rkv', 'uniform', 'zigzag', 'weighted', None, None),
    ('rkv', 'headkv', 'uniform', 'mergingpress', None, None),
    ('rkv', 'global', 'uniform', 'cam', None, None),
    ('fullkv', 'uniform', 'uniform', None, 'kivi', None),
    ('fullkv', 'uniform', 'uniform', None, 'kvquant', None),
    ('fullkv', 'uniform', 'uniform', None, 'gear', None),
    ('h2o', 'uniform', 'uniform', 'mergingpress', None, None),
    ('snapkv', 'uniform', 'uniform', 'mergingpress', None, None),
    ('snapkv', 'threshold', 'uniform', None, None, None),
    ('pyramidkv', 'uniform', 'uniform', 'cam', None, None),
    ('pyramidkv', 'threshold', 'uniform', None, None, None),
    ('l2norm', 'global', 'uniform', None, None, None),
    ('ada_pyramidkv', 'uniform', 'uniform', 'cam', None, None),
    ('ada_pyramidkv', 'threshold', 'uniform', None, None, None),
    ('headkv', 'threshold', 'uniform', None, None, None),
    ('zigzagkv', 'threshold', 'uniform', None, None, None),
    ('cam', 'global', 'uniform', None, None, None),
    ('nacl', 'uniform', 'uniform', 'cam', None, None),
    ('minference', 'uniform', 'uniform', None, 'kivi', None),
    ('minference', 'uniform', 'uniform', None, 'kvquant', None),
    ('minference', 'uniform', 'uniform', None, 'gear', None),
    ('kvzip', 'threshold', 'uniform', None, None, None),
    ('expected_attention', 'global', 'uniform', None, None, None),
    ('expected_attention', 'threshold', 'uniform', None, None, None),
    ('ada_expected_attention', 'threshold', 'uniform', None, None, None),
    ('keydiff', 'threshold', 'uniform', None, None, None),
    ('tova', 'uniform', 'uniform', 'mergingpress', None, None),
    ('kvzap', 'uniform', 'uniform', 'mergingpress', None, None),
    ('kvzap', 'threshold', 'uniform', None, None, None),
    ('qfilter', 'uniform', 'uniform', 'cam', None, None),
    ('qfilter', 'threshold', 'uniform', None, None, None),
    ('kvzip_head', 'threshold', 'uniform', None, None, None),
    ('scissorhands', 'threshold', 'uniform', None, None, 36),
    ('triattention', 'uniform', 'uniform', None, None, None),
    ('triattention', 'adakv', 'pyramid', 'pivot', None, 36),
    ('triattention', 'uniform', 'zigzag', 'weighted', None, None),
    ('triattention', 'headkv', 'uniform', 'mergingpress', None, None),
    ('triattention', 'global', 'uniform', None, None, None),
]]

REFUSED = [dict(zip(AXES, row)) for row in [
    ('fullkv', 'uniform', 'uniform', None, None, 36),
    ('fullkv', 'uniform', 'uniform', 'pivot', None, None),
    ('fullkv', 'uniform', 'pyramid', None, None, None),
    ('fullkv', 'headkv', 'pyramid', None, None, None),
    ('fullkv', 'threshold', 'uniform', None, None, None),
    ('snapkv', 'threshold', 'pyramid', None, None, None),   # the threshold sizing's own layer-allocation refusal
    ('streamingllm', 'uniform', 'uniform', None, 'kivi', 36),
    ('streamingllm', 'uniform', 'uniform', 'cam', None, None),
    ('streamingllm', 'threshold', 'uniform', 'pivot', None, None),
    ('l2norm', 'uniform', 'uniform', 'cam', None, None),
    ('cam', 'uniform', 'uniform', 'pivot', None, None),
    ('think', 'uniform', 'uniform', None, None, 36),
    ('think', 'uniform', 'uniform', None, 'kvquant', None),
    ('think', 'threshold', 'uniform', None, None, None),
    ('nacl', 'threshold', 'uniform', None, None, None),
    ('scissorhands', 'uniform', 'uniform', None, None, None),
    ('rkv', 'threshold', 'uniform', None, None, None),
    ('quest', 'uniform', 'uniform', None, None, 36),
    ('quest', 'uniform', 'uniform', None, 'kivi', None),
    ('quest', 'uniform', 'uniform', 'pivot', None, None),
    ('quest', 'uniform', 'uniform', 'cam', None, None),
    ('quest', 'uniform', 'pyramid', None, None, None),
    ('quest', 'adakv', 'uniform', None, None, None),
    ('quest', 'threshold', 'uniform', None, None, None),
    ('minicache', 'uniform', 'uniform', None, None, 36),
    ('minicache', 'uniform', 'uniform', None, 'kivi', None),
    ('minicache', 'uniform', 'uniform', 'pivot', None, None),
    ('minicache', 'uniform', 'pyramid', None, None, None),
    ('minicache', 'adakv', 'uniform', None, None, None),
    ('minicache', 'headkv', 'uniform', None, None, None),
    ('minicache', 'threshold', 'uniform', None, None, None),
    ('minference', 'uniform', 'uniform', None, None, 36),
    ('minference', 'uniform', 'uniform', 'pivot', None, None),
    ('minference', 'uniform', 'pyramid', None, None, None),
    ('minference', 'threshold', 'uniform', None, None, None),
    ('kvzip', 'uniform', 'uniform', None, None, 36),
    ('kvzip', 'uniform', 'uniform', 'pivot', None, None),
    ('kvzip', 'uniform', 'uniform', 'cam', None, None),
    ('expected_attention', 'uniform', 'uniform', 'cam', None, None),
    ('ada_expected_attention', 'uniform', 'uniform', 'cam', None, None),
    ('keydiff', 'uniform', 'uniform', 'cam', None, None),
    ('tova', 'uniform', 'uniform', 'cam', None, None),
    ('tova', 'adakv', 'uniform', None, None, None),
    ('tova', 'threshold', 'uniform', None, None, None),
    ('kvzap', 'uniform', 'uniform', None, None, 36),
    ('kvzap', 'threshold', 'uniform', None, 'kivi', None),
    ('duo_attention', 'uniform', 'uniform', None, None, None),
    ('duo_attention', 'threshold', 'uniform', None, None, 36),
    ('kvzip_head', 'uniform', 'uniform', 'pivot', None, None),
    ('kvzip_head', 'uniform', 'uniform', 'cam', None, None),
    ('triattention', 'uniform', 'uniform', 'cam', None, None),
    ('triattention', 'threshold', 'uniform', None, None, None),
]]


@pytest.fixture(scope="module")
def product(tiny):
    """outcomes() of every combination (typing's hints cached while building: 15,600 builds in seconds)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(typing, "get_type_hints", cached_type_hints())
        return outcomes(tiny[2])


@pytest.mark.parametrize("case", CASES + REFUSED, ids=["-".join(str(v) for v in c.values()) for c in CASES + REFUSED])
def test_every_case_runs_within_its_budget_or_is_refused_in_one_line(tiny, case):
    """A case of CASES or REFUSED, checked as in the full product; a decode_budget case after the same combination
    without it (checked too), whose counts decode_problems compares with."""
    failures, prefill = [], None
    if case["decode"] is not None:
        try:
            build(case, tiny[2])
        except ValueError as refusal:
            assert one_line_refusal(refusal), f"{label(case)}: refused, but not in one line: {str(refusal)!r}"
            return
        failures, prefill = check(tiny, {**case, "decode": None}, None)
    failures += check(tiny, case, prefill)[0]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)


def test_the_cases_cover_every_pair(product):
    """Every pair of values of two axes that a combination that builds has is in a case of CASES; each case builds;
    a method with a decode_budget combination whose twin without it builds has such a case in CASES (decode_problems
    compares the two)."""
    stale = [label(c) for c in CASES if outcome(product, c) is not None]
    assert not stale, f"cases that no longer build: {stale[:4]}; print a new table: python -m tests.methods.test_matrix"
    covered = set().union(*(pairs(c) for c in CASES))
    wanted = set().union(*(pairs(dict(zip(AXES, values))) for values, error in product.items() if error is None))
    missing = sorted(wanted - covered, key=str)
    assert not missing, (f"{len(missing)} pairs of a valid combination are in no case, e.g. "
                         f"{[witness(p, product) for p in missing[:2]]}; print a new table: "
                         f"python -m tests.methods.test_matrix")
    comparable = {values[0] for values, error in product.items()
                  if error is None and values[-1] is not None and product[twin(values)] is None}
    compared = {c["method"] for c in CASES
                if c["decode"] is not None and outcome(product, {**c, "decode": None}) is None}
    assert compared == comparable, f"no decode case compared with its twin: {sorted(comparable - compared)}"


def test_every_method_and_unit_runs_in_some_combination(product):
    """Else the matrix would test nothing of it: a method or unit that every combination refuses."""
    runs = [values for values, error in product.items() if error is None]
    refused = [(axis, value) for i, (axis, values) in enumerate(AXES.items()) for value in values
               if not any(row[i] == value for row in runs)]
    assert not refused, f"refused in every combination: {refused}"


def test_every_refusal_is_one_line_and_some_case_meets_it(product):
    """Building every combination: any exception but a ValueError of one line fails; each refusal group
    (refusal_group) of the product is met by a case of REFUSED."""
    failures = [f"{label(dict(zip(AXES, values)))}: {type(error).__name__} while building: {error!r}"
                for values, error in product.items() if error is not None and not one_line_refusal(error)]
    assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n".join(failures[:12])
    groups = {refusal_group(str(error)) for error in product.values() if error is not None}
    met = {refusal_group(str(outcome(product, c))) for c in REFUSED}
    built = [label(c) for c in REFUSED if outcome(product, c) is None]
    assert not built and groups <= met, (f"refused cases that build: {built}; refusals no case meets: "
                                         f"{sorted(groups - met)}; print a new table: "
                                         f"python -m tests.methods.test_matrix")


@pytest.mark.parametrize("head", AXES["head"])
@pytest.mark.parametrize("name", list(METHODS))
def test_full_product_runs_within_its_budget_or_is_refused_in_one_line(tiny, name, head):
    """Every combination of the method and head allocation, as the cases are checked."""
    failures, prefill = [], {}
    for case in every_combination(method=name, head=head):   # decode None just before its decode twin
        problems, held = check(tiny, case, prefill.get(twin(tuple(case.values()))))
        if held is not None:
            prefill[tuple(case.values())] = held
        failures.extend(problems)
    assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n".join(failures[:12])


@pytest.mark.parametrize("registry", ["METHODS", "HEAD_ALLOCATIONS", "LAYER_ALLOCATIONS", "MERGE_RULES", "QUANTIZERS",
                                      "SPARSE_PREFILLS"])
def test_every_setting_has_its_help_entry(registry):
    """--help and the docs tables show a setting's entry in its class docstring (CONTRIBUTING.md)."""
    table = {"METHODS": METHODS, "HEAD_ALLOCATIONS": HEAD_ALLOCATIONS, "LAYER_ALLOCATIONS": LAYER_ALLOCATIONS,
             "MERGE_RULES": MERGE_RULES, "QUANTIZERS": QUANTIZERS, "SPARSE_PREFILLS": SPARSE_PREFILLS}[registry]
    missing = {name: [f.name for f in dataclasses.fields(cls) if not setting_help(cls).get(f.name)]
               for name, cls in table.items()}
    assert not {name: fields for name, fields in missing.items() if fields}


if __name__ == "__main__":
    # How many combinations run and how many are refused, the refusals grouped by message; then CASES and REFUSED.
    import collections
    import tempfile

    typing.get_type_hints = cached_type_hints()
    with tempfile.TemporaryDirectory() as folder:
        product = outcomes(write_tables(Path(folder)))
    refusals = collections.Counter(refusal_group(str(e)) for e in product.values() if e is not None)
    print(f"{sum(e is None for e in product.values())} run, {sum(refusals.values())} refused")
    for message, count in refusals.most_common():
        print(f"{count:5d}  {message}")
    for name, cases in (("CASES", pairwise_cases(product)), ("REFUSED", refused_cases(product))):
        print(f"\n{name} = [dict(zip(AXES, row)) for row in [")
        for case in cases:
            print(f"    {tuple(case.values())!r},")
        print("]]")
