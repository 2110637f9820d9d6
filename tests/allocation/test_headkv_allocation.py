"""HeadKV allocation: hand-worked shares, the packaged SmolLM2 table end to end (reference from the
JSON file read here with the json module and numpy), and its errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pyramidkv import compress, load_model, make_method
from pyramidkv.allocation import ModelShape
from tests import reference as ref
from tests.allocation.test_allocation import largest_remainder
from tests.helpers import ROOT, prefill

PACKAGED = ROOT / "pyramidkv/allocation/data/head_scores/smollm2-135m_reasoning.json"


def write_table(path: Path, scores: dict) -> str:
    path.write_text(json.dumps(scores) + "\n")
    return str(path)


def test_hand_worked_shares_and_cap(tmp_path):
    # 2 layers x 2 heads, means 1, 0, 0, 3 -> shares 0.25, 0, 0, 0.75; s = 10, head_beta 2: min 5, pool 20
    table = write_table(tmp_path / "t.json", {"0-0": [1, 1], "0-1": [0, 0], "1-0": [0], "1-1": [2, 4]})
    shape = ModelShape(2, 2, 2, "hand")
    alloc = make_method("headkv", budget=14, window_size=4, head_scores=table, head_beta=2.0).head_allocation
    many = torch.zeros(2, 30)
    assert [alloc.selected_per_head(many, 10, layer, shape) for layer in (0, 1)] == [[10, 5], [5, 20]]
    # capped at 15 candidates: the 5 above the cap go to the others in proportion (10 : 5 : 5)
    # -> 12.5, 6.25, 6.25, 15 -> largest remainder: 13, 6, 6, 15
    few = torch.zeros(2, 15)
    assert [alloc.selected_per_head(few, 10, layer, shape) for layer in (0, 1)] == [[13, 6], [6, 15]]


def test_kv_head_layout_averages_the_query_group(tmp_path):
    # 1 layer, 4 query heads in 2 KV groups: group means (1+3)/2 = 2 and (0+2)/2 = 1 -> shares 2/3, 1/3
    table = write_table(tmp_path / "t.json", {"0-0": [1], "0-1": [3], "0-2": [0], "0-3": [2]})
    shape = ModelShape(1, 4, 2, "hand")
    alloc = make_method("headkv", budget=13, window_size=1, head_scores=table, head_beta=1.0).head_allocation
    assert alloc.selected_per_head(torch.zeros(2, 100), 12, 0, shape) == [16, 8]           # kv_head
    assert alloc.selected_per_head(torch.zeros(4, 100), 12, 0, shape) == [8, 24, 0, 16]    # query_head


def packaged_reference(num_layers, num_q, num_kv, selected, candidates, head_beta=1.01):
    raw = json.loads(PACKAGED.read_text().splitlines()[0])
    table = np.zeros((num_layers, num_q))
    for key, scores in raw.items():
        layer, head = map(int, key.split("-"))
        table[layer, head] = np.mean(scores)
    table = table.reshape(num_layers, num_kv, num_q // num_kv).mean(-1)
    shares = (table / table.sum()).reshape(-1)
    minimum = selected - math.floor(selected / head_beta)
    pool = shares.size * (selected - minimum)
    counts = largest_remainder(minimum + shares * pool, shares.size * selected, [minimum] * shares.size,
                               [candidates] * shares.size)
    return np.array(counts).reshape(num_layers, num_kv)


def test_headkv_on_smollm2_matches_the_packaged_table(eager_setup):
    model, ids, attentions, keys = eager_setup
    budget, window, kernel = 64, 16, 5
    n, num_layers, num_kv, num_q = ids.shape[1], len(attentions), keys[0].shape[0], attentions[0].shape[0]
    method = make_method("headkv", budget=budget, window_size=window, kernel_size=kernel)
    cache = prefill(model, ids, method)
    counts = packaged_reference(num_layers, num_q, num_kv, budget - window, n - window)
    assert counts.sum() == num_layers * num_kv * (budget - window)
    assert len(set(counts.reshape(-1).tolist())) > 5                  # really ragged
    total = 0
    for layer in range(num_layers):
        scores = ref.snapkv_scores_reduce_then_pool(attentions[layer], num_kv, "mean", window, kernel, "max")
        kept = cache.kept_positions(layer)
        assert [len(p) for p in kept] == [window + int(c) for c in counts[layer]], layer
        for head, positions in enumerate(kept):
            chosen = set(positions.tolist()) - set(range(n - window, n))
            ref.assert_same_selection(chosen, scores[head], int(counts[layer, head]))
        total += sum(len(p) for p in kept)
    assert total == num_layers * num_kv * budget                       # exactly the uniform total


def test_table_of_another_shape_fails_before_any_prompt(smollm2, tmp_path):
    model, _ = smollm2
    table = write_table(tmp_path / "small.json", {f"{l}-{h}": [1.0] for l in range(2) for h in range(3)})
    with pytest.raises(ValueError, match=r"small\.json have shape \(2, 3\) \(layers, query heads\), but the model has \(30, 9\)"):
        compress(model, make_method("headkv", budget=64, head_scores=table))


def test_model_without_a_table_names_the_script(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, device="cpu")
    with pytest.raises(ValueError, match=r"scripts/head_scores\.py"):
        compress(model, make_method("headkv", budget=64))
    assert getattr(model, "_pyramidkv_patch", None) is None          # nothing left patched


def test_a_head_table_edited_in_place_changes_the_run_fingerprint(tmp_path, smollm2_path):
    """Resuming a HeadKV run after its table changed under the same path must be refused."""
    import argparse

    from pyramidkv.runner.run_folder import fingerprint_differences, run_fingerprint

    table = write_table(tmp_path / "t.json", {f"{l}-{h}": [1.0 + h] for l in range(30) for h in range(9)})
    method = make_method("headkv", budget=64, head_scores=table)
    args = argparse.Namespace(method="headkv", head_path=table)
    before = run_fingerprint(args, method, (smollm2_path, None, "cpu", "float32"))
    write_table(tmp_path / "t.json", {f"{l}-{h}": [9.0 - h] for l in range(30) for h in range(9)})
    after = run_fingerprint(args, method, (smollm2_path, None, "cpu", "float32"))
    assert any(line.startswith(f"input file head_scores={table}:") for line in fingerprint_differences(before, after))
