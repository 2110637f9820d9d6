"""models/capture.py, the calibration scripts' queries, on either line: each layer's queries before RoPE equal a
projection computed here from the layer's own input and weights (q_proj, or the query part of Phi-3's fused
qkv_proj, then Qwen3's / Gemma3's q norm), so the model's RoPE was applied and undone exactly per layer type."""

from __future__ import annotations

import pytest
import torch

from pyramidkv.models.capture import post_rope_queries, pre_rope_queries
from pyramidkv.models.glue import decoder
from tests.tf5.families import tiny


def projected_queries(attention, hidden: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[B, Hq, n, D] before RoPE, from the module's weights."""
    if hasattr(attention, "q_proj"):
        q = attention.q_proj(hidden)
    else:   # Phi-3: the queries are the first Hq x D outputs of the fused projection
        q = attention.qkv_proj(hidden)[..., : heads * head_dim]
    q = q.view(*hidden.shape[:2], heads, head_dim)
    if hasattr(attention, "q_norm"):
        q = attention.q_norm(q)
    return q.transpose(1, 2).float()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "gemma3_text"])
def test_queries_before_rope_are_the_layers_own_projection(model_type):
    model = tiny(model_type)
    config = model.config
    ids = torch.randint(3, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    inputs = {}

    def keep(index):
        def hook(module, args, kwargs):
            inputs[index] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
        return hook

    layers = decoder(model).layers
    hooks = [layer.self_attn.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
        for h in hooks:
            h.remove()
        expected = [projected_queries(layer.self_attn, inputs[i], config.num_attention_heads, config.head_dim)
                    for i, layer in enumerate(layers)]
    got = pre_rope_queries(model, ids, "this test")
    post = post_rope_queries(model, ids)
    assert len(got) == len(layers) == len(post)
    for layer, (q, ref, rotated) in enumerate(zip(got, expected, post)):
        assert q.shape == ref.shape == (2, config.num_attention_heads, 20, config.head_dim)
        torch.testing.assert_close(q, ref, atol=2e-5, rtol=1e-4, msg=f"layer {layer}")
        assert (rotated[:, :, 1:] - ref[:, :, 1:]).abs().max() > 1e-3   # RoPE moved every later position
    assert model.config._attn_implementation in ("sdpa", "eager")   # the capture left the model as it was
