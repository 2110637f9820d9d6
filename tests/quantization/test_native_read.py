"""The C reads of quantized KV (pyramidkv.quantization.native over pyramidkv/native): built on this machine, used
for plain blocks, and right for every row count a panel can hold (1-4 query rows a stored head, and more, split
in panels) against the float64 dequantize-then-matmul reference; without a compiler, or turned off, the torch
ops read instead and `status()` says why. The reads themselves are also run by the `reader`-parametrized tests
beside this file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyramidkv.native as built
from pyramidkv.quantization import GEARQuantizer, KIVIQuantizer, kernels, native
from tests.quantization.test_folded_attention import dequantized_f64, random_block


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """A fresh look for the library (cleared again after the test, so later tests find the real one)."""
    monkeypatch.setenv("PYRAMIDKV_NATIVE_CACHE", str(tmp_path))
    built.reset()
    yield
    built.reset()


def test_this_machine_builds_and_uses_the_c_reads():
    assert built.status() == "on"
    assert native.reads(random_block(KIVIQuantizer(), "channel", 2, 64, 0))
    gear = random_block(GEARQuantizer(group_size=16), "channel", 2, 64, 0)
    assert not native.reads(gear)                         # outliers and a low-rank term: the torch ops fold them


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 9])
@pytest.mark.parametrize("nbits,group", [(2, 32), (4, 8), (8, 16)])
def test_every_row_count_equals_float64(rows, nbits, group):
    quantizer = KIVIQuantizer(nbits=nbits, group_size=group, residual_length=0)
    keys, values = (random_block(quantizer, layout, 3, 96, 5) for layout in ("channel", "token"))
    assert native.reads(keys) and native.reads(values)
    generator = torch.Generator().manual_seed(rows)
    queries = torch.randn(3, rows, 64, generator=generator)
    probs = torch.softmax(torch.randn(3, rows, 96, generator=generator), -1)
    got = kernels.key_scores(keys, queries, 0, 96)
    want = queries.double().numpy() @ dequantized_f64(keys).transpose(0, 2, 1)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-4)
    got = kernels.weighted_values(values, probs, 0, 96, torch.float32)
    np.testing.assert_allclose(got.double().numpy(), probs.double().numpy() @ dequantized_f64(values),
                               rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_torch_ops_read_and_say_why(rebuilt, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert built.library() is None
    assert built.status().startswith("unavailable (/nonexistent/cc")
    block = random_block(KIVIQuantizer(), "channel", 2, 64, 1)
    assert not native.reads(block)
    queries = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    want = queries.double().numpy() @ dequantized_f64(block).transpose(0, 2, 1)
    np.testing.assert_allclose(kernels.key_scores(block, queries, 0, 64).double().numpy(), want, rtol=1e-5, atol=1e-4)


def test_turned_off_by_the_environment(rebuilt, monkeypatch):
    monkeypatch.setenv("PYRAMIDKV_NATIVE", "0")
    assert built.library() is None and built.status() == "off (PYRAMIDKV_NATIVE=0)"
    assert not native.reads(random_block(KIVIQuantizer(), "channel", 2, 64, 1))


@pytest.mark.parametrize("value", ["false", "", "off", "2"])
def test_another_setting_of_the_switch_is_refused_naming_the_allowed_ones(rebuilt, monkeypatch, value):
    monkeypatch.setenv("PYRAMIDKV_NATIVE", value)
    with pytest.raises(ValueError, match=f"PYRAMIDKV_NATIVE must be 1 .* or 0 .*, got {value!r}"):
        built.library()


def test_a_build_is_kept_and_reused(rebuilt, tmp_path):
    assert built.library() is not None
    files = sorted(tmp_path.glob("native-*.so"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    built.reset()
    assert built.library() is not None
    assert sorted(tmp_path.glob("*")) == files and files[0].stat().st_mtime_ns == stamp   # no rebuild, no leftovers


def test_a_cache_folder_that_cannot_be_made_falls_back_to_the_temporary_directory(rebuilt, monkeypatch, tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("PYRAMIDKV_NATIVE_CACHE", str(blocked / "cache"))
    monkeypatch.setattr(built.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert built.library() is not None and built.status() == "on"
    assert len(list((tmp_path / "tmp").glob("pyramidkv-native-*/native-*.so"))) == 1
