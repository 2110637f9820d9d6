"""What a model's attention layers compute, read on either transformers line (models/line.py) for the calibration
scripts: each layer's queries after RoPE as its attention receives them, and the model's key rotation (RoPE at
given positions, and undone).

On the pinned line the glue row projects the attention module's own inputs (`project_qkv`); on the 5.x line the
attention function the model calls is wrapped for one forward (a capturing function registered in
`AttentionInterface` beside the implementation's own, or beside pyramidkv's while the model is patched), so the
queries are the model's own, after its q norms. `capturing_qkv` gives q, k and v of chosen layers the same way
(viz/data.py reads them during a compressed prefill)."""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from pyramidkv.core.rotary import layer_rotation
from pyramidkv.models.glue import decoder
from pyramidkv.models.line import INTERFACE_LINE

CAPTURE = "pyramidkv_capture"


def key_rotation(model, purpose: str):
    """The model's key rotation (rotate(x, positions, inverse=...)); ValueError naming `purpose` where the family
    has none (5.x: models/tf5/families.py)."""
    if INTERFACE_LINE:
        from pyramidkv.models.tf5.families import key_rotation as tf5_key_rotation

        return tf5_key_rotation(model, purpose)
    from pyramidkv.models.patch import MODEL_GLUE

    return MODEL_GLUE[model.config.model_type].key_rotation(model)


@torch.no_grad()
def post_rope_queries(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer the queries [B, Hq, n, D] after RoPE of one forward of input_ids (float32), as the layer's attention
    receives them. The model must not be patched by pyramidkv.compress."""
    if getattr(model, "_pyramidkv_patch", None) is not None:
        raise RuntimeError("the model is patched by pyramidkv.compress: read its queries outside the `with` block")
    layers = range(len(decoder(model).layers))
    captured: dict = {}
    with capturing_qkv(model, layers, captured):
        model(input_ids=input_ids, use_cache=False)
    missing = [i for i in layers if i not in captured]
    if missing:
        raise RuntimeError(f"no queries were captured for layers {missing}")
    return [captured[i][0].float() for i in layers]


@contextlib.contextmanager
def capturing_qkv(model, layers: Iterable[int], out: dict):
    """While open, every forward puts out[layer] = (q [B, Hq, n, D], k and v [B, Hkv, n, D]) for the given layers:
    the new tokens' projections after RoPE (and q/k norms), as the layer's attention receives them, unscaled.
    Works inside `pyramidkv.compress` too (the compressed prefill's own q, k, v); open it inside that block."""
    layers = set(layers)
    if INTERFACE_LINE:
        with _wrapped_attention(model, layers, out):
            yield
        return
    from pyramidkv.models.patch import MODEL_GLUE

    glue = MODEL_GLUE[model.config.model_type]

    def capture(index):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            out[index] = tuple(t.detach() for t in glue.project_qkv(module, hidden, kwargs.get("position_ids"),
                                                                    kwargs.get("position_embeddings")))
        return hook

    hooks = [layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
             for i, layer in enumerate(decoder(model).layers) if i in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def _wrapped_attention(model, layers: set, out: dict):
    """5.x: the model's attention function (its own, or pyramidkv's while patched) wrapped by one that records what
    it receives, registered beside it for as long as the block runs."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    from pyramidkv.models.tf5.attention import BASES, base_function
    from pyramidkv.models.tf5.hooks import switch_implementation

    current = model.config._attn_implementation
    index = {id(layer.self_attn): i for i, layer in enumerate(decoder(model).layers)}

    def capturing(module, query, key, value, attention_mask, **kwargs):
        layer = index[id(module)]
        if layer in layers:
            out[layer] = (query.detach(), key.detach(), value.detach())
        own = base_function(module, current) if current in BASES else ALL_ATTENTION_FUNCTIONS[current]
        return own(module, query, key, value, attention_mask, **kwargs)

    name = f"{CAPTURE}_{current}"
    AttentionInterface.register(name, capturing)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    switch_implementation(model, name)
    try:
        yield
    finally:
        switch_implementation(model, current)


def pre_rope_queries(model, input_ids: torch.Tensor, purpose: str) -> list[torch.Tensor]:
    """Per layer the queries [B, Hq, n, D] before RoPE (float32): post_rope_queries with the model's rotation undone
    at positions 0 .. n - 1 (ValueError naming `purpose` for a family without one)."""
    rotation = key_rotation(model, purpose)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return [layer_rotation(rotation, layer).rotate(q, positions, inverse=True)   # per layer type (Gemma3)
            for layer, q in enumerate(post_rope_queries(model, input_ids))]
