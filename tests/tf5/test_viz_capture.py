"""viz/data.py's q/k/v capture during a compressed prefill (`prefill(..., capture_layers=...)`, through
models/capture.py's `capturing_qkv`) on both lines, on tiny random eager models of each family the line has.

References: the unpatched model's own eager attention weights (`attention_weights`, the model's
`eager_attention_forward` / 4.44.2's eager forward): the attention maps recomputed in float64 from the captured q and
k (the module's scale, causal, the layer's sliding window) equal them to 1e-5 absolute (float32 weights against
float64); and the score curve of SnapKV at a layer against tests/reference.py's numpy SnapKV over those weights, its
kept set the cache's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import make_method
from pyramidkv.viz.data import Prompt, attention_weights, prefill, score_curve
from tests.reference import assert_same_selection, snapkv_scores_reduce_then_pool
from tests.tf5.families import FAMILIES, tiny, windows

N = 48
MAP_ATOL = 1e-5
FAMILIES_HERE = FAMILIES


def prompt(vocab: int = 96) -> Prompt:
    ids = torch.randint(1, vocab, (N,), generator=torch.Generator().manual_seed(3)).tolist()
    return Prompt(" ".join(f"t{i}" for i in ids), ids, [f"t{i}" for i in ids], [(0, 0)] * N)


def maps_from(query: torch.Tensor, key: torch.Tensor, scale: float, window) -> np.ndarray:
    """[Hq, n, n] float64 softmax(q k^T * scale) of one prompt (query [1, Hq, n, D], key [1, Hkv, n, D]), causal,
    a query at p seeing keys p - window + 1 .. p where the layer slides."""
    q, k = query[0].double(), key[0].double()
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    logits = q @ k.transpose(1, 2) * scale
    p = torch.arange(q.shape[1])
    hidden = p[None, :] > p[:, None]
    if window is not None:
        hidden |= p[None, :] <= p[:, None] - window
    return torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1).numpy()


@pytest.mark.parametrize("model_type", FAMILIES_HERE)
def test_captured_qkv_give_the_models_own_attention_maps(model_type):
    model = tiny(model_type, attn="eager")
    text = prompt()
    layers = list(range(model.config.num_hidden_layers))
    run = prefill(model, text, make_method("snapkv", budget=16, window_size=4), capture_layers=layers)
    assert run.counts.min() >= 1 and set(run.qkv) == set(layers)
    for layer, window in zip(layers, windows(model)):
        query, key, value = run.qkv[layer]
        assert key.shape == value.shape and key.shape[1] == model.config.num_key_value_heads
        module = model.model.layers[layer].self_attn   # 4.44.2's modules: no `scaling`, 1 / sqrt(head_dim)
        scale = getattr(module, "scaling", module.head_dim ** -0.5)
        expected = attention_weights(model, text, layer)
        np.testing.assert_allclose(maps_from(query, key, scale, window), expected, rtol=0, atol=MAP_ATOL,
                                   err_msg=f"{model_type} layer {layer}")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_score_curve_is_numpy_snapkv_over_the_eager_weights_and_keeps_the_caches_set(model_type):
    model = tiny(model_type, attn="eager")
    text, method, layer, budget = prompt(), make_method("snapkv", budget=16, window_size=4), 1, 16
    w, heads = method.window_size, model.config.num_key_value_heads
    attention = attention_weights(model, text, layer).astype(np.float64)
    reference = snapkv_scores_reduce_then_pool(attention, heads, "mean", w, method.kernel_size, "max")
    for head in range(heads):
        curve = score_curve(model, text, method, layer, head)
        np.testing.assert_allclose(curve.scores[: N - w], reference[head], rtol=1e-4, atol=1e-6)
        assert_same_selection(set(curve.kept[curve.kept < N - w].tolist()), reference[head], budget - w)
