"""A checkpoint of a family the installed line has no row for is refused by load_model's checks in one line naming
the line that runs it (Qwen3 and Gemma3 on the pinned line: the 5.x one; Mixtral and Gemma2 on the 5.x line: the
pinned one), or saying that neither does (GPT-2). Runs under both lines, each asserting its own direction."""

from __future__ import annotations

import json

import pytest

from pyramidkv.models.line import INTERFACE_LINE
from pyramidkv.models.loading import check_model

OTHER_LINES_FAMILY, OTHER_LINE = ("gemma2", "the pinned line") if INTERFACE_LINE else ("qwen3", "the 5.x line")


def checkpoint(folder, model_type: str) -> str:
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(folder)


@pytest.mark.parametrize("model_type,expected", [
    (OTHER_LINES_FAMILY, f"model type '{OTHER_LINES_FAMILY}' .* runs on {OTHER_LINE}"),
    ("gpt2", "unsupported model type 'gpt2' .*: neither transformers line supports it"),
])
def test_a_family_this_line_lacks_is_refused_in_one_line_naming_the_line_that_has_it(tmp_path, model_type, expected):
    with pytest.raises(ValueError, match=expected) as refused:
        check_model(checkpoint(tmp_path, model_type), "sdpa", "cpu")
    assert "\n" not in str(refused.value)


@pytest.mark.skipif(not INTERFACE_LINE, reason="Qwen3 is the 5.x line's")
def test_a_device_map_of_a_family_without_a_glue_row_is_checked_against_its_modules():
    """5.x's Qwen3 has no glue row (models/patch.py's MODEL_GLUE): a device map is checked on its auto class."""
    from pyramidkv.models.loading import check_device_map_modules
    from tests.tf5.families import tiny

    config = tiny("qwen3").config
    check_device_map_modules({"model": "cpu", "lm_head": "cpu"}, config)
    with pytest.raises(ValueError, match="names 'model.nope', which is no module of Qwen3ForCausalLM"):
        check_device_map_modules({"model.nope": "cpu"}, config)
    with pytest.raises(ValueError, match="places no device for 1 weight"):
        check_device_map_modules({"model": "cpu"}, config)
