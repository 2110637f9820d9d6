"""The engine does what the record says it did (tests/engine_snapshot.py), on any CPU.

For 39 configurations on the default model (every named method; snapkv with each allocator, merge rule
and quantizer; decode_budget; both GQA layouts; left-padded batches of 3) a run is compared with the record
(`python -m tests.engine_snapshot --write`), quantity by quantity:

* integers exactly: the tokens, the KV bytes after the prefill and after decoding (and by part where
  quantized), the kept count of every head;
* the selections, in the order they were made (kind, layer, prompt, head, how many kept by rank, the
  candidates): each keeps the recorded positions, or differs only in positions that this run's scores put
  within RESOLUTION_ULPS float32 units of the cut (tests/near_ties.py). Such a near-tie is rounding's
  decision, not the engine's: it is counted and reported, and the prompt's decoding after it (which attends
  over other tokens) is not compared;
* the stored K/V of an unchanged kept set: sum and absolute sum within KV_SUM_RTOL (quantized sets: up to a
  few quantization levels, where a value on a level boundary rounds to the next level);
* the top-3 logits of every step within LOGIT_ATOL, and the greedy token equal unless the top two logits
  are that close (a tie of the logits, reported, the prompt's later steps then not compared).

Bitwise equality of floats is never asked: it holds only on the CPU kernels the record was made with
(AVX-512 and AVX2 kernels, and MKL's reproducibility modes, round differently). The tolerances were measured
as the largest difference between ATEN_CPU_CAPABILITY=default, avx2 and avx512 and MKL_CBWR=COMPATIBLE runs on
one machine, with a margin (docs/reliability.md, "The suite on every CPU").
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.engine_snapshot import CONFIGS, REFERENCE, differs_only_where, snapshot_entry
from tests.near_ties import Decision, Disagreement, near_ties, report

# Measured between the record (AVX-512, one thread) and ATEN_CPU_CAPABILITY=default / avx2 and MKL_CBWR=COMPATIBLE
# runs on one machine, the largest difference over all configurations, then a margin:
KV_SUM_RTOL = 1e-3             # a kept set's stored K/V sum and absolute sum, relative (seen: 6.8e-5)
LOGIT_ATOL = 1e-3              # each top-3 logit of a step, recorded to 4 decimals (seen: 1e-4, the rounding)
# With quantized storage a value on a level boundary rounds to the neighbouring level on another CPU; the sets are
# then compared by _level_steps_close, and a decode step reads values a level apart (seen: 0.24 with KVQuant's
# non-uniform levels, 0.08 with its uniform ones, 0.008 with KIVI):
QUANTIZED_LOGIT_ATOL = 0.75
QUANTIZED_ABS_SUM_RTOL = 2e-3  # a quantized set's absolute sum, relative (seen: 2.1e-4)
QUANTIZED_SUM_SHARE = 2e-3     # its sum's change, as a share of its absolute sum (seen: 1.7e-4)


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text(encoding="utf-8"))


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as the record was made: the run is then the same on a loaded machine as on a quiet one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _close(a: list[float], b: list[float]) -> bool:
    return all(math.isclose(x, y, rel_tol=KV_SUM_RTOL, abs_tol=KV_SUM_RTOL) for x, y in zip(a, b))


def _level_steps_close(a: list[float], b: list[float]) -> bool:
    """[sum, absolute sum] of a quantized set. Where rounding moved values across a level boundary the store holds
    the neighbouring level: the sum moves by a few level steps and the absolute sum hardly moves; another token or
    block moves both."""
    (sum_a, absolute_a), (sum_b, absolute_b) = a, b
    return _close(a, b) or (math.isclose(absolute_a, absolute_b, rel_tol=QUANTIZED_ABS_SUM_RTOL)
                            and abs(sum_a - sum_b) <= QUANTIZED_SUM_SHARE * absolute_b)


def _compare_decoding(got: dict, expected: dict, b: int, tolerance: float) -> str | None:
    """Prompt b's tokens and top logits against the record: None if equal (within `tolerance`), a line naming the
    step where the top two logits tie if the tokens part there, else an AssertionError."""
    for step, (token, recorded) in enumerate(zip(got["tokens"][b], expected["tokens"][b])):
        ours, theirs = got["logits_top"][b][step], expected["logits_top"][b][step]
        if token != recorded:
            assert min(ours[0] - ours[1], theirs[0] - theirs[1]) <= tolerance, \
                f"prompt {b}, step {step}: token {token} instead of {recorded} (top logits {ours} vs {theirs})"
            return f"prompt {b}: the top two logits tie at step {step} ({ours[:2]} vs {theirs[:2]})"
        assert all(abs(x - y) <= tolerance for x, y in zip(ours, theirs)), \
            f"prompt {b}, step {step}: top logits {ours} vs the record's {theirs}"
    assert len(got["tokens"][b]) == len(expected["tokens"][b])
    return None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_matches_the_record(smollm2, reference, name, request):
    compare_with_the_record(*smollm2, reference, name, request)


def compare_with_the_record(model, tokenizer, reference: dict, name: str, request) -> None:
    """A run of configuration `name` against the record, by the rules of the module docstring (also the 5.x line's
    run against the pinned line's record: tests/tf5/test_engine_snapshot.py)."""
    expected = reference["configs"][name]
    got, decisions = snapshot_entry(model, tokenizer, name)
    recorded = [Decision.from_row(row) for row in expected["decisions"]]
    quantized = "quant_method" in CONFIGS[name][1]
    close = _level_steps_close if quantized else _close
    for b in range(len(expected["tokens"])):
        try:
            ties = near_ties([d for d in decisions if d.prompt == b], [d for d in recorded if d.prompt == b])
        except Disagreement as error:
            raise AssertionError(f"{name}, prompt {b}: {error}") from None
        for layer, (ours, theirs) in enumerate(zip(got["prefill"]["layers"], expected["prefill"]["layers"])):
            assert ours[b]["counts"] == theirs[b]["counts"], f"{name}, prompt {b}, layer {layer}: kept counts"
            assert differs_only_where(ours[b]["positions"], theirs[b]["positions"], ties, "prefill", layer), \
                f"{name}, prompt {b}, layer {layer}: kept positions differ from the record, not at a near-tie"
            if ours[b]["positions"] == theirs[b]["positions"]:
                assert close(ours[b]["keys_sum"], theirs[b]["keys_sum"]) and \
                    close(ours[b]["values_sum"], theirs[b]["values_sum"]), \
                    f"{name}, prompt {b}, layer {layer}: stored K/V sums {ours[b]['keys_sum']}, " \
                    f"{ours[b]['values_sum']} vs the record's {theirs[b]['keys_sum']}, {theirs[b]['values_sum']}"
        assert got["prefill"]["kv_bytes"][b] == expected["prefill"]["kv_bytes"][b]
        for tie in ties:
            report(request, f"{name}, prompt {b}: {tie}")
        if ties:
            continue
        logit_tie = _compare_decoding(got, expected, b, QUANTIZED_LOGIT_ATOL if quantized else LOGIT_ATOL)
        if logit_tie is not None:
            report(request, f"{name}, {logit_tie}")
            continue
        for layer, (ours, theirs) in enumerate(zip(got["held_positions"], expected["held_positions"])):
            assert ours[b] == theirs[b], f"{name}, prompt {b}, layer {layer}: held positions after decoding"
        assert got["kv_bytes_after"][b] == expected["kv_bytes_after"][b]
        if "kv_bytes_breakdown" in expected:
            assert got["kv_bytes_breakdown"][b] == expected["kv_bytes_breakdown"][b]
