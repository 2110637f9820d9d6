"""`reader`: a test that takes it runs twice, the plain blocks read by the C kernels (quantization/native.py) and by
the torch ops they replace (kernels.py, cells.py), against the same float64 reference."""

from __future__ import annotations

import pytest

from pyramidkv.native import library, off, status


@pytest.fixture(params=["native", "torch"])
def reader(request):
    if request.param == "torch":
        with off():
            yield request.param
    else:
        assert library() is not None, f"the C kernels are {status()}"
        yield request.param
