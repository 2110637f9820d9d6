"""A left-padded batch of three = each prompt alone, on the 5.x line: tests/core/test_batch_independence.py's 83
pairwise cases (every value of every axis, every valid pair of values in some case) through the registered attention
function and the interface cache, checked by the same rule (`assert_batch_equals_alone`: tokens, kept and held
positions per layer and head, bytes; near-ties by tests/near_ties.py). On the pinned line tests/core runs them."""

from __future__ import annotations

import pytest

from pyramidkv.models.line import INTERFACE_LINE, VERSION
from tests.core import test_batch_independence as pinned
from tests.core.test_batch_independence import three_prompts  # noqa: F401  (the fixture, shared)

pytestmark = pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION} is the pinned line: "
                                                           f"tests/core/test_batch_independence.py runs these there")


@pytest.mark.parametrize("case", pinned.CASES, ids=[pinned.label(c) for c in pinned.CASES])
def test_batch_of_three_equals_each_prompt_alone(random_llama, three_prompts, case, request):  # noqa: F811
    pinned.test_batch_of_three_equals_each_prompt_alone(random_llama, three_prompts, case, request)
