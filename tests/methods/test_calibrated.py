"""Calibration artifacts (pyramidkv/methods/calibrated.py): how they are written and what a file must be to be read."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch

from pyramidkv.methods.calibrated import save_artifact


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_artifact_gets_the_permissions_open_gives(tmp_path, umask):
    """Written through a temporary file and safetensors (0600 both), a calibration file gets 0666 less the umask, as
    a file open() makes (issue 40, item 11)."""
    old = os.umask(umask)
    try:
        path = save_artifact(tmp_path / "a.safetensors", {"filters": torch.zeros(2, 3)}, {"kind": "qfilter"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask and os.listdir(tmp_path) == ["a.safetensors"]


# --- item 5: an artifact is trusted by its digests, not its name ------------------------------------------------

PACKAGED = {"kvzap-linear": "smollm2-135m_kvzap-linear.safetensors", "qfilter": "smollm2-135m_qfilter.safetensors",
            "kvzip-head": "smollm2-135m_kvzip-head.safetensors"}


def _flipped(source, out, at=-1):
    """`source` copied to `out` with one byte flipped (by default the last: a tensor's)."""
    data = bytearray(source.read_bytes())
    data[at] ^= 1
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("kind", sorted(PACKAGED))
def test_an_artifact_with_one_flipped_tensor_byte_is_refused_naming_it(tmp_path, kind):
    """The packaged file loads; the same file with one tensor byte flipped is refused in one line naming it, as a
    cache file is (it passed every check before: issue 40, item 5); so is one whose record was edited."""
    from pyramidkv.methods.calibrated import PACKAGED_DIR, load_artifact

    load_artifact(PACKAGED_DIR / PACKAGED[kind], kind)
    edited = _flipped(PACKAGED_DIR / PACKAGED[kind], tmp_path / PACKAGED[kind])
    with pytest.raises(ValueError, match=rf"^calibration file {re.escape(str(edited))} was edited: its tensors do not "
                                         rf"match the sha256 its record holds") as refusal:
        load_artifact(edited, kind)
    assert "\n" not in str(refusal.value)
    data = (PACKAGED_DIR / PACKAGED[kind]).read_bytes()
    record = _flipped(PACKAGED_DIR / PACKAGED[kind], tmp_path / "record.safetensors", data.index(b'seed') + 1)
    with pytest.raises(ValueError, match=r"was edited: its record does not match its sha256"):
        load_artifact(record, kind)


def test_a_method_given_an_edited_artifact_refuses_it_before_any_weights(tmp_path):
    """Through the method's model check (what a runner calls before the weights load): the edited file is refused."""
    from pyramidkv import make_method
    from pyramidkv.models.patch import model_shape
    from tests.conftest import tiny_llama
    from tests.helpers import write_calibrations

    made = write_calibrations(tmp_path, tiny_llama().config)
    shape = model_shape(tiny_llama().config)
    make_method("qfilter", budget=64, qfilter_path=made["qfilter_path"]).check_model(shape)
    edited = _flipped(Path(made["qfilter_path"]), tmp_path / "edited.safetensors")
    with pytest.raises(ValueError, match=f"calibration file {re.escape(str(edited))} was edited"):
        make_method("qfilter", budget=64, qfilter_path=str(edited)).check_model(shape)


def test_a_version_1_artifact_holds_no_digest_and_is_refused_saying_so(tmp_path):
    import json

    from safetensors.torch import save_file

    from pyramidkv.methods.calibrated import RECORD_KEY, load_artifact

    old = tmp_path / "old.safetensors"
    save_file({"filters": torch.zeros(2, 3)}, str(old), {RECORD_KEY: json.dumps(
        {"format": "pyramidkv-calibration", "version": 1, "kind": "qfilter"})})
    with pytest.raises(ValueError, match=r"version 1 \(version 1 records no digest of its tensors: an edited byte "
                                         r"could not be told\); this pyramidkv reads 'pyramidkv-calibration' version "
                                         r"2: re-make it with `python scripts/calibrate_qfilter.py`"):
        load_artifact(old, "qfilter")


def test_a_duo_pattern_edited_in_its_text_is_refused(tmp_path):
    """The packaged pattern folder loads; a copy whose .tsv has one digit changed is refused naming it (its config.json's
    record holds the text's sha256); an official folder (no pyramidkv record) is read as it is."""
    import shutil

    from pyramidkv.methods.calibrated import PACKAGED_DIR
    from pyramidkv.methods.duo_attention import PATTERN_FILE, read_pattern

    packaged = PACKAGED_DIR / "smollm2-135m_duo"
    read_pattern(packaged)
    copy = tmp_path / "duo"
    shutil.copytree(packaged, copy)
    text = (copy / PATTERN_FILE).read_text()
    digit = next(i for i, c in enumerate(text) if c in "123456789")
    (copy / PATTERN_FILE).write_text(text[:digit] + str(int(text[digit]) % 9 + 1) + text[digit + 1:])
    with pytest.raises(ValueError, match=rf"duo_pattern {re.escape(str(copy / PATTERN_FILE))} was edited: it does not "
                                         rf"match the sha256 the record in {re.escape(str(copy / 'config.json'))} holds"):
        read_pattern(copy)
    (copy / "config.json").write_text("{}")   # the official layout: its config.json has no record of ours
    assert read_pattern(copy)[1] is None
