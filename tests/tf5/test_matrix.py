"""The registry matrix (tests/methods/test_matrix.py) under the 5.x line: every method and axis (head, layer, global
and threshold allocation, merge rules, quantized storage, decode budgets, and through the methods sparse prefill
(MInference), thin keys (ThinK), pages (Quest) and paired layers (MiniCache)), on the same tiny random Llama, the
same pairwise cases and the same refusals, checked by the same rules written from the documented budgets: exact
kept counts after the prefill and after every decode step, generation to the end, each refusal one line.

On top, the bytes each case holds at the end, against hand counts: a full-precision store holds ROW bytes per
token and KV head (keys and values, head_dim 16, float32), so fullkv after the prompt and four decode steps holds
FULL; an evicting case holds ROW per token it keeps; a quantized store fewer than that; ThinK's thinned keys fewer
than that but more than its values alone; MiniCache's merged layer pairs fewer; Quest every token plus each page's
key bounds (more than FULL: it saves reads, not memory). And fullkv's greedy tokens are the unpatched model's, and chunked prefill keeps its
budget with the peak bytes of the layer budgets and one chunk.

Skipped on the pinned line, where tests/methods/test_matrix.py runs these cases itself.
"""

from __future__ import annotations

import pytest
import torch

from pyramidkv.generation import generate
from pyramidkv.models.line import CACHE_ARGUMENT, INTERFACE_LINE, VERSION
from tests.methods import test_matrix as matrix
from tests.methods.test_matrix import CASES, REFUSED, tiny  # noqa: F401 - tiny: the module fixture it defines

pytestmark = pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION} is the pinned line: "
                                                           f"tests/methods/test_matrix.py runs these cases there")

HEAD_DIM = 16
ROW = 2 * HEAD_DIM * 4                       # a token's key and value in one KV head, float32
HELD_AT_END = matrix.PROMPT_LEN + matrix.NEW_TOKENS - 1   # the prompt and 4 decode steps' tokens
FULL = matrix.LAYERS * matrix.KV_HEADS * HELD_AT_END * ROW


def check_and_keep_cache(tiny, case: dict, prefill):   # noqa: F811 - the fixture's value
    """check() of the matrix, and the cache of the run it made (None when the case was refused)."""
    caches = []
    hook = tiny[0].register_forward_hook(lambda module, args, kwargs, output: caches.append(kwargs[CACHE_ARGUMENT]),
                                         with_kwargs=True)
    try:
        problems, held = matrix.check(tiny, case, prefill)
    finally:
        hook.remove()
    return problems, held, caches[-1] if caches else None


def bytes_problems(case: dict, cache) -> list[str]:
    """What is wrong with the bytes the case holds at the end, by the hand counts of the docstring."""
    held = sum(sum(cache.held_counts(layer)[0]) for layer in range(matrix.LAYERS))
    size, rows = cache.kv_bytes(), held * ROW
    name = case["method"]
    if case["quant"] is not None:
        fits, rule = size < rows, f"quantized: fewer than {held} tokens x {ROW}"
    elif name == "think":
        fits, rule = rows // 2 < size < rows, f"thinned keys: between the values ({rows // 2}) and {rows}"
    elif name == "minicache":
        fits, rule = size < rows, f"merged layer pairs: fewer than {held} tokens x {ROW}"
    elif name == "quest":
        fits, rule = size > rows == FULL, f"every token ({FULL}) and the pages' key bounds"
    else:
        fits, rule = size == rows, f"{held} tokens x {ROW}"
    problems = [] if fits else [f"holds {size} bytes, expected {rule}"]
    smaller = held < HELD_AT_END * matrix.LAYERS * matrix.KV_HEADS or case["quant"] or name in ("think", "minicache")
    if name != "quest" and not (size < FULL if smaller else size == FULL):
        problems.append(f"holds {size} bytes against fullkv's {FULL}")
    return [f"{matrix.label(case)}: {p}" for p in problems]


@pytest.mark.parametrize("case", CASES + REFUSED, ids=["-".join(str(v) for v in c.values()) for c in CASES + REFUSED])
def test_every_case_runs_within_its_budget_and_bytes_or_is_refused_in_one_line(tiny, case):   # noqa: F811
    failures, prefill = [], None
    if case["decode"] is not None:
        try:
            matrix.build(case, tiny[2])
        except ValueError as refusal:
            assert matrix.one_line_refusal(refusal), f"{matrix.label(case)}: refused in several lines: {refusal}"
            return
        failures, prefill, _ = check_and_keep_cache(tiny, {**case, "decode": None}, None)
    problems, _, cache = check_and_keep_cache(tiny, case, prefill)
    failures += problems
    if cache is not None and not problems:
        failures += bytes_problems(case, cache)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)


def test_fullkv_generates_the_unpatched_models_tokens(tiny):   # noqa: F811
    model, prompt, _ = tiny
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=matrix.NEW_TOKENS, min_new_tokens=matrix.NEW_TOKENS,
                             pad_token_id=0)
    got = generate(model, matrix.TokenIds(), [prompt], matrix.make_method("fullkv"), matrix.NEW_TOKENS,
                   stop_token_ids=[])[0]
    assert got.text == matrix.TokenIds().decode(out[0, len(prompt):].tolist())
    assert got.kv_bytes_per_prompt == FULL


def test_chunked_prefill_keeps_the_budget_and_holds_at_most_the_budgets_and_one_chunk(tiny):   # noqa: F811
    """Chunked prefill under 5.x (tests/tf5/test_chunked_prefill.py checks its kept sets): 63 tokens in chunks of
    32 (31, then 32), snapkv at BUDGET: the peak during the prefill is the last layer computing the second chunk
    (the two before it back at BUDGET, it holding both chunks: under the bound of every budget plus one chunk), and
    after 2 new tokens each layer holds BUDGET + 2 per KV head."""
    model, prompt, _ = tiny
    got, = generate(model, matrix.TokenIds(), [prompt], matrix.make_method("snapkv", budget=matrix.BUDGET), 2,
                    stop_token_ids=[], prefill_chunk_size=32)
    assert got.prefill_chunks == 2
    assert got.peak_prefill_kv_bytes == (2 * matrix.BUDGET + 31 + 32) * matrix.KV_HEADS * ROW
    assert got.peak_prefill_kv_bytes <= (matrix.LAYERS * matrix.BUDGET + 32) * matrix.KV_HEADS * ROW
    assert got.kv_bytes_per_prompt == matrix.LAYERS * matrix.KV_HEADS * (matrix.BUDGET + 2) * ROW
