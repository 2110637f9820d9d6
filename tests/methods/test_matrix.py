"""The registry matrix: every method x head allocation x layer allocation x merge rule x quantizer x decode
budget either is refused when it is built, with a ValueError of one line, or generates on a tiny random
Llama holding exactly the tokens its budget gives, after the prefill and after every decode step.

"Built" is make_method plus the two checks the runners make before any weight is used: check_model (the
model's shape) and check_prompt (the prompt's length). A combination that passes them must run: any
exception from generate() fails, and so does a refusal of another type or over several lines.

The registries drive the axes (METHODS, HEAD_ALLOCATIONS, LAYER_ALLOCATIONS, MERGE_RULES, QUANTIZERS), so a
new method or unit is in the matrix with no edit here. What a layer and head must hold is written below from
the documented rules (Method's docstring, docs/decoding.md), not read from the code under test:

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

`python -m tests.methods.test_matrix` prints how many combinations run and the refusals grouped by message.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pyramidkv.allocation import HEAD_ALLOCATIONS, LAYER_ALLOCATIONS
from pyramidkv.components import setting_help
from pyramidkv.generation import generate
from pyramidkv.merging import MERGE_RULES
from pyramidkv.methods import METHODS, make_method
from pyramidkv.models.patch import model_shape
from pyramidkv.quantization import QUANTIZERS
from pyramidkv.sparse_prefill import SPARSE_PREFILLS
from tests.helpers import kvzap_artifact, write_calibrations

LAYERS, QUERY_HEADS, KV_HEADS = 3, 4, 2     # 3 layers: Quest attends densely in its first 2
PROMPT_LEN = 64
BUDGET = 40                                 # more than the largest default window + sinks (32 + 4)
DECODE_BUDGET, DECODE_INTERVAL = 36, 2      # re-selects right after the prefill and twice while decoding
NEW_TOKENS = 5                              # the prefill forward and 4 decode steps
THRESHOLD = 0.0                             # head_allocation threshold: some scorers pass it, some do not
# Small groups and windows so that the prompt is quantized (head_dim 16); residual_length 32 holds ThinK's
# full-width recent keys (key_recent_size 32).
QUANTIZER_SETTINGS = {
    "kivi": dict(nbits=2, group_size=8, residual_length=32),
    "kvquant": dict(group_size=8),
    "gear": dict(group_size=8, residual_length=32, rank=2, decode_rank=1),
}
# Quest evicts nothing: its budget is the tokens of the pages each decode step reads (tests/methods/test_quest.py).
KEEPS_THE_PROMPT = {"quest"}
CALIBRATED = ("qfilter_path", "kvzip_head_path")   # calibrated methods' files written for the tiny model


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


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=QUERY_HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                       attn_implementation="sdpa")


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
    torch.manual_seed(0)
    kvzap = kvzap_artifact(LlamaForCausalLM(tiny_config()).eval(), folder / "kvzap-linear.safetensors")
    duo = folder / "full_attention_heads.tsv"   # DuoAttention's gates, 3 layers x 2 KV heads: 3 heads stream
    duo.write_text("0.9\t0.1\n0.2\t0.8\n0.6\t0.3\n")
    return {"head_scores": str(head_scores), "pattern_table": str(patterns), "kvzap_path": kvzap,
            "duo_attention": dict(duo_pattern=str(duo), threshold=0.5, window_size=8, num_sinks=2),
            **write_calibrations(folder, tiny_config())}


SHAPE = model_shape(tiny_config(), dtype_bytes=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, prompt, tables), torch on one thread: on these sizes more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    prompt = torch.randint(3, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    yield model, prompt, write_tables(tmp_path_factory.mktemp("matrix"))
    torch.set_num_threads(threads)


def combinations(name: str, head: str):
    """(layer, merge, quant, decode) for one method and head allocation, decode None before decode_budget."""
    for layer, merge, quant in itertools.product(LAYER_ALLOCATIONS, [None, *MERGE_RULES], [None, *QUANTIZERS]):
        for decode in (None, DECODE_BUDGET):
            yield layer, merge, quant, decode


def settings(cls, head: str, layer: str, merge, quant, decode, tables: dict) -> dict:
    chosen = {"head_allocation": head, "layer_allocation": layer}
    if head == "threshold":   # no budget: each head keeps what passes; decided while decoding where it can be
        chosen.update(threshold=THRESHOLD, threshold_decoding=cls.token_scores)
    elif cls.needs_budget:   # Quest's reads whole pages, at least 3 of 16: 48
        chosen["budget"] = 48 if cls.name in KEEPS_THE_PROMPT else BUDGET
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


def build(name: str, head: str, layer: str, merge, quant, decode, tables: dict):
    """The method, through make_method and the checks the runners make before the weights are used."""
    method = make_method(name, **settings(METHODS[name], head, layer, merge, quant, decode, tables))
    method.check_model(SHAPE)
    method.check_prompt(PROMPT_LEN)
    return method


def held_after_each_forward(model, prompt, method) -> tuple[list, list[int]]:
    """([forward][layer][stored head] tokens held after the prefill forward and after each decode step, the
    layer budgets the cache reports for the prompt)."""
    states, budgets = [], []

    def record(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
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
    if not type(method).needs_budget or name in KEEPS_THE_PROMPT:
        return [] if all(c == n for row in held for c in row) else [f"keeps every token, holds {held}"]
    problems = []
    if method.head_allocation.sets_budget:   # threshold: between the protected tokens and the prompt, per head
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


@pytest.mark.parametrize("head", list(HEAD_ALLOCATIONS))
@pytest.mark.parametrize("name", list(METHODS))
def test_every_combination_runs_within_its_budget_or_is_refused_in_one_line(tiny, name, head):
    model, prompt, tables = tiny
    failures, prefill = [], {}
    for layer, merge, quant, decode in combinations(name, head):
        label = f"{name} head={head} layer={layer} merge={merge} quant={quant} decode_budget={decode}"
        try:
            method = build(name, head, layer, merge, quant, decode, tables)
        except ValueError as refusal:
            if not str(refusal).strip() or "\n" in str(refusal):
                failures.append(f"{label}: refused, but not in one line: {str(refusal)!r}")
            continue
        except Exception as error:  # noqa: BLE001 - any other exception is the failure reported
            failures.append(f"{label}: {type(error).__name__} while building: {error}")
            continue
        try:
            states, budgets = held_after_each_forward(model, prompt, method)
        except Exception as error:  # noqa: BLE001
            failures.append(f"{label}: passed the checks, then {type(error).__name__} while generating: {error}")
            continue
        if len(states) != NEW_TOKENS:
            failures.append(f"{label}: {len(states)} forwards, expected {NEW_TOKENS}")
            continue
        if decode is None:
            prefill[layer, merge, quant] = states[0]
            problems = prefill_problems(name, method, layer, states[0], budgets)
            if method.decode is not None:   # its defaults bound decoding
                problems += decode_problems(states, None, method.decode.decode_budget, method.decode.decode_interval)
            elif getattr(method.head_allocation, "threshold_decoding", False):   # evicts as tokens leave the window
                problems += [f"step {t}: holds {state} after {states[t - 1]}: a head gains the new token and loses at "
                             f"most the one leaving the window" for t, state in enumerate(states)
                             if t and any(not 0 <= c - p <= 1 for row, prev in zip(state, states[t - 1])
                                          for c, p in zip(row, prev))]
            else:
                problems += [f"step {t}: holds {state}, expected the prefill counts + {t}"
                             for t, state in enumerate(states) if state != [[c + t for c in row] for row in states[0]]]
        else:
            problems = decode_problems(states, prefill.get((layer, merge, quant)))
        failures.extend(f"{label}: {problem}" for problem in problems)
    assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n".join(failures[:12])


def test_every_method_and_unit_runs_in_some_combination(tmp_path):
    """Else the matrix would test nothing of it: a method or unit that every combination refuses."""
    tables = write_tables(tmp_path)
    wanted = {("method", name) for name in METHODS} | {("head", h) for h in HEAD_ALLOCATIONS} | {
        ("layer", l) for l in LAYER_ALLOCATIONS} | {("merge", m) for m in [None, *MERGE_RULES]} | {
        ("quant", q) for q in [None, *QUANTIZERS]} | {("decode", d) for d in (None, DECODE_BUDGET)}
    for name, head in itertools.product(METHODS, HEAD_ALLOCATIONS):
        for layer, merge, quant, decode in combinations(name, head):
            values = {("method", name), ("head", head), ("layer", layer), ("merge", merge), ("quant", quant),
                      ("decode", decode)}
            if not values & wanted:
                continue
            try:
                build(name, head, layer, merge, quant, decode, tables)
            except ValueError:
                continue
            wanted -= values
    assert not wanted, f"refused in every combination: {sorted(wanted, key=str)}"


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
    # How many combinations run and how many are refused, the refusals grouped by message.
    import collections
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tables = write_tables(Path(folder))
        runs, refusals = 0, collections.Counter()
        for name, head in itertools.product(METHODS, HEAD_ALLOCATIONS):
            for layer, merge, quant, decode in combinations(name, head):
                try:
                    build(name, head, layer, merge, quant, decode, tables)
                    runs += 1
                except ValueError as refusal:
                    refusals[re.sub(r"'[a-z_]+'|\b[A-Z][A-Za-z]+\(.*?\)", "<unit>", str(refusal))] += 1
    print(f"{runs} run, {sum(refusals.values())} refused")
    for message, count in refusals.most_common():
        print(f"{count:5d}  {message}")
