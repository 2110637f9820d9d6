"""The engine snapshot across the lines: the 39 configurations of tests/engine_snapshot.py run on the default model
(SmolLM2, a Llama, loaded by load_model() on either line) under the 5.x line and compared with the record the
pinned line made (tests/data/engine_snapshot.json) by the same rules (tests/test_engine_snapshot.py): kept counts,
bytes and tokens exactly, kept positions up to near-ties that float rounding decides, stored K/V sums and top
logits within the tolerances measured across CPU kernels. The two lines' Llamas compute the same (the prompt's
attention is each line's own sdpa, the decode steps the engine's), so any other difference is a bug.

Real-model tier (SmolLM2's weights); skipped on the pinned line, where tests/test_engine_snapshot.py is this test.
"""

from __future__ import annotations

import pytest

from pyramidkv.models.line import INTERFACE_LINE, VERSION
from tests.engine_snapshot import CONFIGS
from tests.test_engine_snapshot import compare_with_the_record, one_thread, reference  # noqa: F401 - fixtures

pytestmark = pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION} is the pinned line, whose record "
                                                           f"tests/test_engine_snapshot.py compares with")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_5x_line_does_what_the_pinned_lines_record_says(smollm2, reference, name, request):  # noqa: F811
    compare_with_the_record(*smollm2, reference, name, request)
