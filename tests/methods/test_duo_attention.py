"""DuoAttention: the official pattern format, the two head selections, the removed share, calibration
(scripts/calibrate_duo.py), the refusals, and on a tiny random Llama the stored heads and the decode output."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.methods.duo_attention import (NOISE_SEED, model_pattern, read_pattern, removed_share,
                                             streaming_heads)
from tests.helpers import ROOT, load_script

CALIBRATE = load_script("calibrate_duo", ROOT / "scripts/calibrate_duo.py")


def write_tsv(path, rows) -> None:
    path.write_text("".join("\t".join(str(x) for x in row) + "\n" for row in rows))


def test_reads_the_official_format_clipped(tmp_path):
    """An official folder (no pyramidkv record): L rows of tab-separated floats, read with clip(0, 1)."""
    folder = tmp_path / "lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10"
    folder.mkdir()
    write_tsv(folder / "full_attention_heads.tsv", [[-0.0213, 1.0], [0.4998, 1.27], [1e-05, -3e-06]])
    (folder / "config.json").write_text(json.dumps({"sink_size": 128, "recent_size": 256, "lr": 0.02}))
    expected = np.array([[0.0, 1.0], [0.4998, 1.0], [1e-05, 0.0]])
    for path in (folder, folder / "full_attention_heads.tsv"):
        gates, record, tsv = read_pattern(path)
        np.testing.assert_array_equal(gates, expected)
        assert record is None and tsv == folder / "full_attention_heads.tsv"
    gates, _ = model_pattern(str(folder), ModelShape(3, 4, 2, name="any"))   # shape check only
    np.testing.assert_array_equal(gates, expected)


@pytest.mark.parametrize("case", ["missing", "shape", "text"])
def test_pattern_refusals_are_one_line(tmp_path, case):
    tsv = tmp_path / "full_attention_heads.tsv"
    if case == "text":
        tsv.write_text("0.1\tx\n")
    elif case == "shape":
        write_tsv(tsv, [[0.1, 0.2, 0.3]] * 3)
    says = {"missing": "no such file", "shape": "3 rows x 3 gates; this model has 3 layers x 2 KV heads",
            "text": "tab-separated numbers"}[case]
    with pytest.raises(ValueError, match=says) as e:
        model_pattern(str(tsv if case != "missing" else tmp_path / "nope"), ModelShape(3, 4, 2))
    assert "\n" not in str(e.value)


# 2 layers x 3 KV heads, three ties at 0 and two at 1 (flat indices 0..5).
TIES = np.array([[0.0, 1.0, 0.0], [0.3, 0.0, 1.0]])


@pytest.mark.parametrize("share, streams", [(1 / 3, 2), (0.5, 3), (0.6, 3), (0.75, 4), (0.0, 0), (1.0, 6)])
def test_quantile_and_argsort_selections(share, streams):
    """argsort (kvpress): round(6 x share) lowest stream, ties in index order; quantile (official): noise
    U(0, 1e-6) seeded, heads below np.quantile(noisy, share) stream, ties broken by the noise."""
    argsort = streaming_heads(TIES, share, "argsort").reshape(-1)
    order = [0, 2, 4, 3, 1, 5]                      # values 0, 0, 0, 0.3, 1, 1 with ties by index
    assert set(np.flatnonzero(argsort)) == set(order[:round(6 * share)])
    noise = np.random.default_rng(NOISE_SEED).uniform(0, 1e-6, 6)
    by_noise = sorted(range(6), key=lambda i: (TIES.reshape(-1)[i], noise[i]))
    quantile = streaming_heads(TIES, share, "quantile").reshape(-1)
    # np.quantile at share over 6 values: position 5 x share; heads strictly below stream
    assert set(np.flatnonzero(quantile)) == set(by_noise[:streams])
    assert (streaming_heads(TIES, share, "quantile") == quantile.reshape(2, 3)).all()   # seeded: the same again


def test_quantile_ties_follow_the_noise_not_the_index():
    """Among the three zeros at share 1/3 (two stream) the noise picks, so the rule can differ from argsort."""
    noise = np.random.default_rng(NOISE_SEED).uniform(0, 1e-6, 6)
    zeros = sorted([0, 2, 4], key=lambda i: noise[i])
    assert set(np.flatnonzero(streaming_heads(TIES, 1 / 3, "quantile"))) == set(zeros[:2])


@pytest.mark.parametrize("n", [200, 320, 1000, 4096])
def test_removed_share_against_a_hand_count(n):
    streaming = streaming_heads(TIES, 0.5, "argsort")
    sinks, recent = 64, 256
    kept = sum(min(n, sinks + recent) if s else n for s in streaming.reshape(-1))
    assert removed_share(streaming.mean(), sinks, recent, n) == pytest.approx(1 - kept / (streaming.size * n))
    if n == 4096:   # kvpress #228's figure: 0.875 of the heads streaming at 4,096 tokens with 128 + 256
        assert removed_share(0.875, 128, 256, 4096) == pytest.approx(0.793, abs=1e-3)


# --- calibration ----------------------------------------------------------------------------------------------

TINY_GATE = ["--num_steps", "3", "--context_length_min", "96", "--context_length_max", "128", "--num_passkeys", "2",
             "--passkey_words", "3", "--sink_size", "4", "--recent_size", "16", "--lr", "0.05"]
TINY_FLY = ["--on_the_fly", "--num_samples", "2", "--sample_tokens", "64", "--positions", "50"]


@pytest.mark.parametrize("recipe", ["gate", "on_the_fly"])
def test_calibration_is_deterministic_and_records_its_making(recipe, tiny_model_dir, sharp_model_dir, tmp_path,
                                                             monkeypatch):
    monkeypatch.setattr(sys, "argv", ["calibrate_duo.py"])
    argv = TINY_GATE if recipe == "gate" else TINY_FLY
    outs = [CALIBRATE.main(["--model_path", tiny_model_dir, "--out", str(tmp_path / str(i)), *argv])
            for i in range(2)]
    texts = [(out / "full_attention_heads.tsv").read_text() for out in outs]
    assert texts[0] == texts[1]
    gates, record, _ = read_pattern(outs[0])
    assert gates.shape == (2, 2) and len(texts[0].splitlines()) == 2
    config = json.loads((outs[0] / "config.json").read_text())
    assert config["sink_size"] == (4 if recipe == "gate" else 8) and "recent_size" in config
    assert record["kind"] == "duo" and record["model"]["num_kv_heads"] == 2 and record["cpu_seconds"] >= 0
    assert record["data"]["files"] and all(len(f["sha256"]) == 16 for f in record["data"]["files"])
    raw = np.loadtxt(outs[0] / "full_attention_heads.tsv", ndmin=2)
    if recipe == "gate":   # the gates moved from 1.0 (the L1 term alone pulls every gate down)
        assert (raw < 1.0).all() and config["num_steps"] == 3
    else:                  # cumulative attention, mean over 50 positions: within (0, 1]
        assert ((raw > 0) & (raw <= 1)).all()
    model_pattern(str(outs[0]), ModelShape(2, 4, 2, name=tiny_model_dir))
    with pytest.raises(ValueError, match="another checkpoint or a fine-tune") as e:   # same shape, other weights
        model_pattern(str(outs[0]), ModelShape(2, 4, 2, name=sharp_model_dir))
    assert "\n" not in str(e.value)


def test_lr_factor_is_the_official_schedule():
    steps = 100
    factors = [CALIBRATE.lr_factor(s, steps) for s in range(steps)]
    assert factors[0] == pytest.approx(0.1) and factors[1] == pytest.approx(0.1)   # floored: (s+1)/20 < 0.1
    assert factors[9] == pytest.approx(0.5) and factors[19] == 1.0 and factors[50] == 1.0
    assert factors[90] == pytest.approx(0.5) and factors[99] == pytest.approx(0.1)


@pytest.mark.parametrize("argv, says", [
    (["--num_passkeys", "11"], "--num_passkeys must be in 1..10"),
    (["--context_length_min", "600", "--context_length_max", "500"], "--context_length_max 500"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--haystack_dir", "{tmp}"], "no .txt files"),
])
def test_calibration_refuses_bad_values_before_loading(argv, says, tiny_model_dir, tmp_path, capsys, monkeypatch):
    import pyramidkv.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    monkeypatch.setattr(sys, "argv", ["calibrate_duo.py"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        CALIBRATE.main(["--model_path", tiny_model_dir, "--out", str(tmp_path / "o"),
                        *[a.replace("{tmp}", str(tmp_path)) for a in argv]])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("calibrate_duo.py: error: "), err
    assert says in err
