"""The attention function registered in transformers 5.x's `AttentionInterface`: the whole model seam of the 5.x
line (no forward is replaced).

A 5.x attention module projects q, k, v, applies its RoPE (and its q/k norms: Qwen3, Gemma3), calls
`cache.update(k, v, layer)` (models/tf5/cache.py hands the new tokens back untouched), then calls the function its
config's `_attn_implementation` names with (module, q, k, v, mask, scaling=..., dropout=..., **kwargs), the kwargs
holding `sliding_window` / `softcap` where the family has them. Registered as `pyramidkv_sdpa` and
`pyramidkv_eager` (each with the mask function of the implementation it extends), it does:

  no compressed cache         the implementation's own function, unchanged (a forward with no cache);
  a repeat pass (KVzip)       attention over the prompt's waiting K/V and the repeat's own (nothing stored);
  a layer's first call        the prompt's attention by the implementation's own function over the full q, k, v
                              and mask (so the prompt's logits are the unpatched model's), or with its column
                              sums / a sparse pattern where the method asks; then the engine keeps what the
                              method selects (`CompressedCache.prefill`);
  later calls                 the new tokens appended to the layer's store and attended over what it holds;
                              in a chunked prefill (core/chunked.py) the layer is then cut back to its budget,
                              scored by the chunk's queries, as on the pinned line.

The attention form (scale, soft-cap, window) the engine uses was read from the modules when the model was patched
(models/tf5/form.py); each call checks that the module still asks for that form.
"""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from pyramidkv.core.scoring import attention_with_column_sums, real_positions
from pyramidkv.models.tf5.cache import InterfaceCache
from pyramidkv.models.tf5.form import call_window
from pyramidkv.sparse_prefill.attention import sparse_prefill_attention

BASES = ("sdpa", "eager", "flash_attention_2")   # the implementations a patched model extends
FLASH = "flash_attention_2"   # CUDA only, with the flash-attn package (models/loading.py refuses it otherwise)
CACHE_KEY, HIDDEN_KEY = "pyramidkv_cache", "pyramidkv_hidden"   # what the modules' pre-hooks add to the kwargs


def registered_name(base: str) -> str:
    return f"pyramidkv_{base}"


def base_function(module, base: str):
    """The implementation's own attention function: sdpa's from the interface, eager's from the module's modeling
    file (each family has its own `eager_attention_forward`), flash-attn's through `flash_attention`."""
    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    if base == FLASH:
        return flash_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def flash_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    sliding_window=None, softcap=None, **kwargs):
    """5.x's flash-attn path (`_flash_attention_forward`, as its `flash_attention_forward` calls it) with the
    implementation named as "flash_attention_2": the 5.x function reads the kernel to load from the module's config,
    which names pyramidkv's function while the model is patched. query [B, Hq, n, D], key and value [B, Hkv, n, D]
    -> (output [B, n, Hq, D], None)."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward, flash_attn_supports_top_left_mask

    out = _flash_attention_forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask,
                                   query_length=query.shape[2], is_causal=True, dropout=dropout, softmax_scale=scaling,
                                   sliding_window=sliding_window, softcap=softcap,
                                   use_top_left_mask=flash_attn_supports_top_left_mask(),
                                   target_dtype=get_target_dtype(query, module), attn_implementation=FLASH,
                                   layer_idx=module.layer_idx, **kwargs)
    return out, None


def check_form(cache: InterfaceCache, layer: int, scaling: Optional[float], head_dim: int, kwargs: dict) -> None:
    """The module asks for the form the engine was built with: its scale, soft-cap and window."""
    form = cache.form
    expected = head_dim ** -0.5 if form.scale is None else form.scale
    window = call_window(kwargs.get("sliding_window"), cache.model_shape.context_window)
    if scaling is not None and abs(scaling - expected) > 1e-9 * expected:
        raise ValueError(f"layer {layer} asks for scale {scaling}, the engine was built for {expected}")
    if kwargs.get("softcap") != form.softcap or window != form.window(layer):
        raise ValueError(f"layer {layer} asks for softcap {kwargs.get('softcap')} and window {window}, the engine "
                         f"was built for {form.softcap} and {form.window(layer)}: the family needs a glue row")


def pyramidkv_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                        dropout: float = 0.0, scaling: Optional[float] = None, *, base: str, **kwargs):
    """query [B, Hq, q, D], key and value [B, Hkv, q, D] (the new tokens only, RoPE applied) -> (output [B, q, Hq, D],
    weights or None), as every 5.x attention function returns them."""
    cache = kwargs.pop(CACHE_KEY, None)
    hidden = kwargs.pop(HIDDEN_KEY, None)
    own = base_function(module, base)
    if not isinstance(cache, InterfaceCache):
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer = module.layer_idx
    cache.attended(layer)
    check_form(cache, layer, scaling, query.shape[-1], kwargs)
    form = cache.form
    factor = 1.0 if form.scale is None else form.scale * query.shape[-1] ** 0.5
    scaled = query if factor == 1.0 else query * factor   # q . k / sqrt(D) = the model's logit
    position_ids = kwargs.get("position_ids")
    if cache.reconstruction is not None and cache.reconstruction.current is not None:   # a repeat pass (KVzip)
        return cache.repeat_attend(layer, scaled, key, value).transpose(1, 2), None
    if cache.is_prefilled(layer):
        out = cache.decode_step(layer, scaled, key, value, position_ids, hidden)
        if cache.chunked is not None:   # a later chunk: the layer keeps its budget again (core/chunked.py)
            cache.chunked.reselect(cache, layer, scaled)
        return out.transpose(1, 2), None
    bsz, _, n, _ = query.shape
    pads = cache.pad_lens or [0] * bsz
    sparse = cache.method.prefill_attention
    pattern = None if sparse is None else sparse.pattern(layer, scaled, key, pads, cache.model_shape.name)
    column_sums = weights = None
    window = form.window(layer)
    if pattern is not None:
        out, weights, density = sparse_prefill_attention(scaled, key, value, pattern, False)
        cache.prefill_density[layer] = density   # out: [B, n, Hq, D] already
    elif (window is None or window >= n) and cache.needs_column_sums(bsz, n):
        out, column_sums = attention_with_column_sums(scaled, key, value, real_positions(pads, n, key.device),
                                                      form=form)
        out = out.transpose(1, 2)
    else:
        out, weights = own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if cache.chunked is not None:   # the first chunk's K/V, held whole while the layer computes
        cache.chunked.note(cache.kv_bytes() + sum(t.numel() * t.element_size() for t in (key, value)))
    cache.prefill(layer, scaled, key, value, position_ids, pattern, column_sums, hidden)
    return out, weights


def register() -> None:
    """Register `pyramidkv_<base>` for each base implementation, with that implementation's mask function."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for base in BASES:
        AttentionInterface.register(registered_name(base), functools.partial(pyramidkv_attention, base=base))
        AttentionMaskInterface.register(registered_name(base), ALL_MASK_ATTENTION_FUNCTIONS[base])
