"""`reader`: a test that takes it runs twice, the plain blocks read by the C kernels (quantization/native.py) and by
the torch ops they replace (kernels.py, cells.py), against the same float64 reference."""

from __future__ import annotations

import pytest

from pyramidkv.native import library, status
from pyramidkv.quantization import native


@pytest.fixture(params=["native", "torch"])
def reader(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(native, "reads", lambda block: False)
    else:
        assert library() is not None, f"the C kernels are {status()}"
    return request.param
