"""Chunked prefill (core/chunked.py) on the 5.x line, through the registered attention function: the same checks
as tests/core/test_chunked_prefill.py, and the same kept sets as the pinned line.

- Under 5.x, tests/core/test_chunked_prefill.py's checks run again here (imported below: each chunk's kept set
  against a float64 SnapKV / H2O recomputation from what the layer held, the peak prefill bytes = the layer budgets
  + one chunk, a budget over the prompt giving the unpatched model's logits, a batch = its prompts alone, the
  refusals); on the pinned line tests/core runs them itself.
- On both lines: the kept sets after every chunk, for SnapKV and H2O on the same tiny Llama (its weights are the
  same on both lines) and the same tokens, equal the record the pinned line made (tests/data/chunked_prefill_kept.json;
  `python -m tests.tf5.test_chunked_prefill` under the pinned line rewrites it). Equal integers, not floats: the
  configurations are those whose every cut the float64 reference above checks has a gap over 1e-9 (no near tie).
- Under 5.x, the families whose attention differs (Qwen3's q/k norms, Phi-3's fused projection, Qwen2's biases):
  a budget over the prompt, fed in chunks, gives the unpatched model's next-token logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.core.chunked import ChunkedPrefill
from pyramidkv.generation.chunked import prefill_in_chunks
from pyramidkv.models.line import INTERFACE_LINE, PINNED, VERSION
from tests.conftest import tiny_llama
from tests.core import test_chunked_prefill as pinned
from tests.tf5.families import CACHE_ARGUMENT, tiny

RECORD = Path(__file__).parents[1] / "data" / "chunked_prefill_kept.json"
# name -> (method settings, prompt length, prompt seed, chunk size): tests/core's SnapKV and H2O configurations
CONFIGURATIONS = {
    "snapkv": (dict(name="snapkv", budget=20, window_size=6, kernel_size=1), 90, 1, 16),
    "h2o": (dict(name="h2o", budget=20, window_size=4), 65, 5, 32),
}
only_5x = pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION} is the pinned line: "
                                                        f"tests/core/test_chunked_prefill.py runs these there")

# tests/core/test_chunked_prefill.py's checks, collected again here under 5.x (not imported on the pinned line,
# where tests/core runs them)
for _name in () if not INTERFACE_LINE else ("test_nothing_evicted_gives_the_models_own_logits",
              "test_each_chunk_keeps_what_a_float64_snapkv_keeps_of_the_layer_it_held",
              "test_h2o_chunks_add_their_column_sums_to_what_the_kept_tokens_gathered",
              "test_peak_prefill_bytes_are_the_layer_budgets_plus_one_chunk",
              "test_a_batch_is_chunked_prompt_by_prompt",
              "test_the_rows_say_when_a_chunk_size_left_the_prompt_whole",
              "test_questions_and_sliding_windows_are_refused"):
    globals()[_name] = getattr(pinned, _name)


def kept_after_each_chunk(name: str) -> list[list[list[int]]]:
    """Per reselection (layer by layer, chunk by chunk, from the second chunk on) the positions each KV head keeps."""
    spec, length, seed, size = CONFIGURATIONS[name]
    model, ids = tiny_llama(layers=2, std=0.2), pinned.prompt(length, seed=seed)
    seen, original = [], ChunkedPrefill.reselect

    def recording(self, cache, layer_idx, queries):
        original(self, cache, layer_idx, queries)
        seen.append([sorted(p.tolist()) for p in cache.layers[layer_idx].kept_positions(0)])

    ChunkedPrefill.reselect = recording
    try:
        with compress(model, make_method(**spec)) as patch:
            prefill_in_chunks(model, patch.new_cache(), ids, size)
    finally:
        ChunkedPrefill.reselect = original
    return seen


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_every_chunk_keeps_what_the_pinned_line_kept(name):
    record = json.loads(RECORD.read_text())
    got = kept_after_each_chunk(name)
    assert len(got) == len(record[name])
    for step, (kept, expected) in enumerate(zip(got, record[name])):
        assert kept == expected, f"{name}: reselection {step} (layer {step % 2}) differs from the pinned line's"


@only_5x
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "phi3"])
def test_a_budget_over_the_prompt_in_chunks_gives_the_unpatched_logits(model_type):
    """70 tokens in chunks of 13 (the first 4 long), budget 500: nothing is evicted, so the last token's logits over
    the chunked cache are the unpatched model's over the whole prompt (float rounding of another sum order)."""
    model, ids = tiny(model_type), pinned.prompt(70)
    with torch.no_grad():
        reference = model(ids).logits[0, -1].double()
        with compress(model, make_method("snapkv", budget=500, window_size=8)) as patch:
            cache = patch.new_cache()
            prefill_in_chunks(model, cache, ids, 13)
            out = model(input_ids=ids[:, -1:], **{CACHE_ARGUMENT: cache}, use_cache=True,
                        position_ids=torch.tensor([[69]])).logits[0, -1].double()
    assert cache.kept_counts(0) == [[69] * model.config.num_key_value_heads]
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-4)


@only_5x
def test_gemma3s_sliding_layers_are_refused_in_one_line():
    """Gemma3's three sliding layers keep their own window (tests/core refuses Mistral's the same way)."""
    from pyramidkv.generation import generate
    from tests.helpers import TokenIds

    with pytest.raises(ValueError, match="not defined for snapkv: a sliding-window layer keeps its own") as refused:
        generate(tiny("gemma3_text"), TokenIds(), [[5] * 30], make_method("snapkv", budget=16, window_size=4), 2,
                 stop_token_ids=[], prefill_chunk_size=8)
    assert "\n" not in str(refused.value)


if __name__ == "__main__":   # the record, made on the pinned line
    if INTERFACE_LINE:
        sys.exit(f"the record is the pinned line's: run this under transformers {PINNED}")
    RECORD.write_text(json.dumps({name: kept_after_each_chunk(name) for name in CONFIGURATIONS}) + "\n")
    print(f"wrote {RECORD}")
