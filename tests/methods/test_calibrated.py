"""Calibration artifacts (pyramidkv/methods/calibrated.py): how they are written and what a file must be to be read."""

from __future__ import annotations

import os
import stat

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
