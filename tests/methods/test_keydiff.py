"""KeyDiff: minus the cosine of each post-RoPE key to the mean of its head's normalised keys, against a float64
reference from the keys of a plain forward of the default model, in both GQA layouts; padding never in the
anchor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import make_method
from pyramidkv.core.context import ScoreContext
from tests.helpers import prefill
from tests.reference import assert_same_selection

BUDGET = 64


def reference_scores(keys: np.ndarray) -> np.ndarray:
    """keys [H, n, D] float64 -> [H, n]: -cos(k_i, mean_j k_j / |k_j|)."""
    unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    anchor = unit.mean(axis=1, keepdims=True)                                     # [H, 1, D]
    return -(keys * anchor).sum(-1) / (np.linalg.norm(keys, axis=-1) * np.linalg.norm(anchor, axis=-1))


@pytest.mark.parametrize("layout", ["kv_head", "query_head"])
def test_scores_and_kept_sets_equal_the_float64_reference(eager_setup, layout):
    model, ids, _, keys = eager_setup
    method = make_method("keydiff", budget=BUDGET, gqa_layout=layout)
    cache = prefill(model, ids, method)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    n = ids.shape[1]
    for layer in range(model.config.num_hidden_layers):
        expected = reference_scores(keys[layer])                                  # [Hkv, n]
        k = torch.from_numpy(keys[layer]).float()[None]
        ctx = ScoreContext(layer, model.config.num_hidden_layers, k.new_zeros(1, 9, 1, k.shape[-1]), k, k,
                           torch.ones(1, n, dtype=torch.bool))
        np.testing.assert_allclose(method.score(ctx)[0].double().numpy(), expected, rtol=1e-5, atol=1e-6)
        kept = cache.kept_positions(layer, 0)
        assert len(kept) == (model.config.num_attention_heads if layout == "query_head" else len(expected))
        for head, positions in enumerate(kept):
            kv_head = head // group if layout == "query_head" else head
            assert len(positions) == BUDGET
            assert_same_selection(set(positions.tolist()), expected[kv_head], BUDGET, rel_tol=1e-5)


def test_padding_never_enters_the_anchor():
    """A left-padded row scores its real keys as the row alone does (padding keys are large, so a pad in the
    anchor would move every score)."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 12, 8, generator=generator, dtype=torch.float64)
    padded = torch.cat([torch.full((1, 2, 5, 8), 50.0, dtype=torch.float64), keys], dim=2)
    real = torch.arange(17)[None] >= 5
    method = make_method("keydiff", budget=4)
    ctx = lambda k, r: ScoreContext(0, 1, k[:, :, -1:], k, k, r)  # noqa: E731
    alone = method.score(ctx(keys, torch.ones(1, 12, dtype=torch.bool)))
    in_batch = method.score(ctx(padded, real))
    np.testing.assert_allclose(in_batch[..., 5:].numpy(), alone.numpy(), rtol=1e-6)
    np.testing.assert_allclose(alone[0].double().numpy(), reference_scores(keys[0].numpy()), rtol=1e-6, atol=1e-7)
