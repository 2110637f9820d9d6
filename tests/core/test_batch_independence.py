"""Every prompt of a batch is computed alone: a left-padded batch of 3 prompts of different lengths
gives each prompt the greedy tokens, kept positions (every layer and head), held positions and stored
bytes it gets when run by itself.

The matrix is scorer x head allocation x layer allocation x merge rule x quantizer x decode budget x key
channels (ThinK) x sinks and random share (NACL) x Quest pages x cross-layer merging (MiniCache) x sparse
prefill (MInference). Its combinations are covered pairwise: every pair of values of two axes that some valid combination
has appears in at least one case below (about 30 cases; combinations refused at build time, such as
headkv with a pyramid, are not cases). Logits may differ in the last bits (the model's own batched
matmuls round differently), so tokens, not logits, are compared.
"""

from __future__ import annotations

import itertools

import pytest

from pyramidkv import make_method
from tests.engine_snapshot import record

AXES = {
    "scorer": ["streamingllm", "h2o", "snapkv", "l2norm", "nacl", "scissorhands"],
    "head_allocation": ["uniform", "adakv", "headkv"],
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


def build(case: dict):
    settings = {"budget": 64, "head_allocation": case["head_allocation"], "layer_allocation": case["layer_allocation"]}
    if case["scorer"] in ("h2o", "snapkv", "nacl", "scissorhands"):
        settings["window_size"] = 16
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
        settings.update(cross_layer_merge=True, cross_layer_start=20)
    if case["prefill"] is not None:
        settings.update(prefill_attention=case["prefill"])
    return make_method(case["scorer"], **settings)


def valid(case: dict) -> bool:
    try:
        build(case)
    except ValueError:
        return False
    return True


def pairwise_cases() -> list[dict]:
    """A small set of valid combinations covering every pair of axis values that a valid combination has
    (greedy: each step takes the combination covering the most pairs not yet covered)."""
    names = list(AXES)
    combos = [dict(zip(names, values)) for values in itertools.product(*AXES.values())]
    combos = [c for c in combos if valid(c)]

    def pairs(case):
        return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs(c) for c in combos))
    chosen = []
    while uncovered:
        best = max(combos, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


CASES = pairwise_cases()


def label(case: dict) -> str:
    return "-".join(f"{v}" for v in case.values())


@pytest.fixture(scope="module")
def three_prompts(smollm2):
    """Three chat prompts of about 200, 130 and 60 tokens (the last one shorter than the budget)."""
    _, tokenizer = smollm2
    text = ("A lighthouse keeper logged every passing ship in a ledger with a green cover. The ledger noted the "
            "weather, the ship's flag and the hour. ")

    def chat(body: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False).input_ids

    return [chat(text * 5 + "The secret harbour is Vardo. " + text * 2 + "Which harbour is secret?"),
            chat(text * 3 + "The secret harbour is Tromso. Which harbour is secret?"),
            chat("The secret harbour is Bodo. Which harbour is secret?")]


def test_the_cases_cover_every_pair():
    assert 25 <= len(CASES) <= 60
    for axis, values in AXES.items():
        assert {c[axis] for c in CASES} == set(values), axis


@pytest.mark.parametrize("case", CASES, ids=[label(c) for c in CASES])
def test_batch_of_three_equals_each_prompt_alone(smollm2, three_prompts, case):
    model, tokenizer = smollm2
    method = build(case)
    batch = record(model, tokenizer, method, three_prompts, NEW_TOKENS)
    for b, prompt in enumerate(three_prompts):
        alone = record(model, tokenizer, method, [prompt], NEW_TOKENS)
        assert batch["tokens"][b] == alone["tokens"][0], f"prompt {b}: predictions differ"
        for layer, (in_batch, by_itself) in enumerate(zip(batch["prefill"]["layers"], alone["prefill"]["layers"])):
            assert in_batch[b]["positions"] == by_itself[0]["positions"], f"prompt {b}, layer {layer}: kept sets"
            assert in_batch[b]["counts"] == by_itself[0]["counts"]
        assert [held[b] for held in batch["held_positions"]] == [held[0] for held in alone["held_positions"]]
        assert batch["prefill"]["kv_bytes"][b] == alone["prefill"]["kv_bytes"][0]
        assert batch["kv_bytes_after"][b] == alone["kv_bytes_after"][0]
        if "kv_bytes_breakdown" in alone:
            assert batch["kv_bytes_breakdown"][b] == alone["kv_bytes_breakdown"][0]
