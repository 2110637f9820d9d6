"""scripts/gpu_check.py's rules, on hand-made runs (the device run itself needs CUDA): a float32 run on the device
matches the CPU's when its tokens are equal and its logits within the tolerance, or where a token differs only
at a tie of the CPU's top two logits; the bfloat16 run must keep the budget's shape, at the level the head
allocation fixes it."""

from __future__ import annotations

import pytest
import torch

from pyramidkv import make_method
from tests.helpers import ROOT, load_script

CHECK = load_script("gpu_check", ROOT / "scripts" / "gpu_check.py")
TOL = CHECK.LOGIT_TOL


def run(tokens: list[list[int]], logits: list[list[list[float]]]) -> dict:
    """A run as greedy() returns it: tokens [B, steps]; logits [steps][B, V]."""
    return {"tokens": torch.tensor(tokens), "logits": [torch.tensor(step) for step in logits]}


# Two prompts, three steps, vocabulary 3; logits of magnitude <= 1 (the tolerance is then absolute).
CPU = run([[0, 1, 2], [2, 2, 0]], [[[0.9, 0.1, 0.0], [0.0, 0.2, 0.8]],
                                   [[0.1, 0.7, 0.0], [0.0, 0.1, 0.5]],
                                   [[0.0, 0.5, 0.5 + TOL / 2], [0.6, 0.1, 0.0]]])


def shifted(step: int, row: int, token: int, by: float) -> list:
    logits = [[list(r) for r in s.tolist()] for s in CPU["logits"]]
    logits[step][row][token] += by
    return logits


@pytest.mark.parametrize("tokens, logits, problem, note", [
    (CPU["tokens"].tolist(), [s.tolist() for s in CPU["logits"]], None, ""),
    # within the tolerance: the same run
    (CPU["tokens"].tolist(), shifted(1, 1, 0, TOL / 2), None, ""),
    # a logit off by twice the tolerance, the tokens equal
    (CPU["tokens"].tolist(), shifted(1, 0, 0, 2 * TOL), "logits differ", ""),
    # a different token where the CPU's top two are apart (0.7 vs 0.1): a real difference
    ([[0, 0, 2], [2, 2, 0]], shifted(1, 0, 0, 0.7), "token 1 differs", ""),
    # a different token at the CPU's tie (step 2, prompt 0: 0.5 and 0.5 + TOL / 2): compared up to it
    ([[0, 1, 1], [2, 2, 0]], shifted(2, 0, 1, TOL), None, "a tie at step 2"),
])
def test_a_device_run_matches_the_cpu_up_to_ties(tokens, logits, problem, note):
    problems, found_note, _ = CHECK.compare_tokens(CPU, run(tokens, logits))
    assert (problem is None) == (not problems), problems
    if problem:
        assert any(problem in p for p in problems), problems
    assert note in found_note


@pytest.mark.parametrize("method, same, moved", [
    # uniform heads: every head's count is fixed, one token moved between heads is off the shape
    (make_method("snapkv", budget=64), False, False),
    # an adaptive split (AdaKV): a layer's total is fixed, not how its heads share it
    (make_method("adakv", budget=64), True, False),
    # a split over all layers at once (KVzip): only the prompt's total is fixed
    (make_method("kvzip", budget=64), True, True),
])
def test_the_budget_shape_is_fixed_at_the_allocation_s_level(method, same, moved):
    counts = [[[64, 64]], [[64, 64]]]                    # [layer][prompt][head]
    within_layer = [[[60, 68]], [[64, 64]]]               # a token share moved between heads of layer 0
    across_layers = [[[70, 70]], [[58, 58]]]              # moved from layer 1 to layer 0
    assert (CHECK.budget_shape(method, within_layer) == CHECK.budget_shape(method, counts)) is same
    assert (CHECK.budget_shape(method, across_layers) == CHECK.budget_shape(method, counts)) is moved


def test_every_step_has_a_cap_and_a_function_and_the_targets_are_timed_rows():
    """The steps table, the caps and the step functions name the same steps; the prefill targets' rows are rows the
    timings step times, at contexts it runs on the device; both modes size the prefill_ratios step."""
    assert set(CHECK.STEPS) == set(CHECK.CAPS_S) == set(CHECK.STEP_FUNCTIONS)
    contexts = {context for context, _ in CHECK.SIZES["cuda"]["timings"]}
    for row, context in CHECK.PREFILL_TARGETS:
        assert row in CHECK.TIMING_METHODS and context in contexts, (row, context)
    for sizes in CHECK.SIZES.values():
        assert sizes["kvzip_lengths"] and sizes["column_sum_lengths"]
