"""The engine snapshot across the lines: the 39 configurations of tests/engine_snapshot.py run on the default model
(SmolLM2, a Llama, loaded by load_model() on either line) under the 5.x line and compared with the record the
pinned line made (tests/data/engine_snapshot.json) by the same rules (tests/test_engine_snapshot.py): kept counts,
bytes and tokens exactly, kept positions up to near-ties that float rounding decides, stored K/V sums and top
logits within the tolerances measured across CPU kernels. The two lines' Llamas compute the same (the prompt's
attention is each line's own sdpa, the decode steps the engine's), so any other difference is a bug.

COVER (one configuration per axis: scorers with and without column sums, head allocations, a merge rule, a
quantizer before and one after RoPE, a decode budget, the query-head layout, a batch) runs in `make test-tf5`
(real_model tier: SmolLM2's weights); the other 28 are in the exhaustive tier (tests/conftest.py TIERS). All 39
passed on 2026-11-29 (docs/transformers5.md). Skipped on the pinned line, where tests/test_engine_snapshot.py is
this test.
"""

from __future__ import annotations

import pytest

from pyramidkv.models.line import INTERFACE_LINE, VERSION
from tests.engine_snapshot import CONFIGS
from tests.test_engine_snapshot import compare_with_the_record, one_thread, reference  # noqa: F401 - fixtures

pytestmark = pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION} is the pinned line, whose record "
                                                           f"tests/test_engine_snapshot.py compares with")

COVER = ["fullkv", "snapkv", "h2o", "adakv", "headkv", "snapkv+merge=mergingpress", "snapkv+kivi-small",
         "snapkv+kvquant", "snapkv+decode", "h2o+query_head", "batch:snapkv"]


@pytest.mark.parametrize("name", COVER)
def test_the_5x_line_does_what_the_pinned_lines_record_says(smollm2, reference, name, request):  # noqa: F811
    compare_with_the_record(*smollm2, reference, name, request)


@pytest.mark.parametrize("name", [name for name in CONFIGS if name not in COVER])
def test_every_other_configuration_too(smollm2, reference, name, request):  # noqa: F811
    compare_with_the_record(*smollm2, reference, name, request)
