"""The attention forward every patched model uses; the model's glue (models/glue.py) only says how to get q, k, v.

Prefill (the first forward of a `generate()`): attention over the whole prompt
is computed exactly as the model's own implementation does it (eager, sdpa or
flash_attention_2), so the prompt's logits are unchanged, unless the method has a
sparse prefill attention (MInference), which computes only its pattern's entries
(pyramidkv/sparse_prefill/), or scores by the attention's column sums (H2O), which
come out of one chunked pass with the output (equal to the model's kernel to float
rounding); under sdpa a left-padded batch runs each prompt's own tokens causally
(causal_per_prompt: equal to the masked kernel to float rounding, and to the prompt
alone); then the cache keeps the tokens the method selects.
Later forwards append their K/V to the cache and attend over what it stores.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pyramidkv.components import AttentionForm
from pyramidkv.core.cache import CompressedCache
from pyramidkv.core.fused_column_sums import column_sums_attention
from pyramidkv.core.scoring import PLAIN, probabilities, real_positions
from pyramidkv.sparse_prefill.attention import sparse_prefill_attention

# (module, hidden_states, position_ids, position_embeddings) -> (q, k, v), RoPE applied: the glue's project_qkv
ProjectFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def repeat_kv(states: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv, n, D] -> [B, Hkv * group, n, D] (as transformers' repeat_kv)."""
    if group == 1:
        return states
    bsz, heads, n, dim = states.shape
    return states[:, :, None].expand(bsz, heads, group, n, dim).reshape(bsz, heads * group, n, dim)


def full_attention(module, implementation: str, queries, keys, values, attention_mask, position_ids, output_attentions,
                   pad_lens: Optional[list[int]] = None, form: AttentionForm = PLAIN):
    """Attention over the full prompt, the same computation as transformers 4.44.2 does it, except that a
    left-padded batch under sdpa runs each prompt's own tokens with `is_causal` (see causal_per_prompt).
    form: the model's attention form (the glue's `attention_form`): its scale and soft-cap, and the layer's
    sliding window for flash-attn (eager and sdpa receive it in the mask).

    Returns (output [B, n, Hq, D], weights or None).
    """
    group = module.num_key_value_groups
    q_len = queries.shape[2]
    scale, sliding_window = form.scale, form.window(module.layer_idx)
    if implementation == "flash_attention_2":
        from transformers.modeling_flash_attention_utils import _flash_attention_forward

        out = _flash_attention_forward(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attention_mask, q_len,
            position_ids=position_ids, dropout=0.0, softmax_scale=scale,
            sliding_window=None if sliding_window is None else sliding_window - 1,   # window_size (W - 1, W - 1)
            use_top_left_mask=module._flash_attn_uses_top_left_mask, is_causal=True,
            **({"softcap": form.softcap} if form.capped else {}),
        )
        return out, None
    keys, values = repeat_kv(keys, group), repeat_kv(values, group)
    causal_ok = sliding_window is None or sliding_window >= q_len   # is_causal cannot express a window
    if implementation == "sdpa" and not output_attentions and pad_lens and any(pad_lens) and keys.shape[-2] == q_len \
            and causal_ok:
        return causal_per_prompt(queries, keys, values, pad_lens, scale).transpose(1, 2), None
    mask = None if attention_mask is None else attention_mask[:, :, :, : keys.shape[-2]]
    if implementation == "sdpa" and not output_attentions:
        if queries.device.type == "cuda" and mask is not None:
            queries, keys, values = queries.contiguous(), keys.contiguous(), values.contiguous()
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                             is_causal=mask is None and q_len > 1, scale=scale)
        return out.transpose(1, 2), None
    products = torch.matmul(queries, keys.transpose(2, 3))
    weights = form.cap(products / module.head_dim**0.5 if scale is None else products * scale)
    if mask is not None:
        weights = weights + mask
    weights = probabilities(weights, dtype=queries.dtype)
    out = torch.matmul(weights, values)
    return out.transpose(1, 2), (weights if output_attentions else None)


def causal_per_prompt(queries, keys, values, pad_lens: list[int], scale: Optional[float] = None) -> torch.Tensor:
    """Causal sdpa over each prompt of a left-padded batch alone, its padding cut off: [B, Hq, n, D], 0 at padding.

    The same attention as sdpa under the batch's padding mask (to float rounding), and the same computation as
    the prompt alone in a batch of one; with a mask, sdpa's kernel cannot skip the keys after each query, which
    made a padded batch's prefill ~25% slower per prompt at 2,048 tokens than running the prompts one by one.
    keys, values: [B, Hq, n, D] (repeated to the query heads).
    """
    out = queries.new_zeros(queries.shape)
    for b, pad in enumerate(pad_lens):
        out[b, :, pad:] = F.scaled_dot_product_attention(queries[b:b + 1, :, pad:], keys[b:b + 1, :, pad:],
                                                         values[b:b + 1, :, pad:], is_causal=True, scale=scale)[0]
    return out


def compressed_attention_forward(
    module,
    hidden_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.LongTensor] = None,
    past_key_value=None,
    output_attentions: bool = False,
    use_cache: bool = False,
    cache_position: Optional[torch.LongTensor] = None,
    position_embeddings=None,
    *,
    project_qkv: ProjectFn,
    implementation: str,
    **kwargs,
):
    """Drop-in replacement for the forward of a glued attention module (transformers 4.44.2's Llama signature).
    The model's attention form is the cache's (`cache.form`, built by the glue: scale, soft-cap, windows); the
    cache gets the queries scaled so that q . k / sqrt(D) is the model's logit."""
    cache = past_key_value
    if not isinstance(cache, CompressedCache):
        if cache is not None and use_cache:
            raise TypeError(f"a model patched by pyramidkv needs a CompressedCache, got {type(cache).__name__}")
        # No cache to compress (use_cache=False; generate() still passes a DynamicCache it never reads
        # back): the model's own attention, exactly as unpatched, with the arguments its decoder gave (a
        # module that computes its own RoPE, as Mistral's eager one, takes no position_embeddings).
        if position_embeddings is not None:
            kwargs["position_embeddings"] = position_embeddings
        return type(module).forward(module, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                    past_key_value=past_key_value, output_attentions=output_attentions,
                                    use_cache=use_cache, cache_position=cache_position, **kwargs)
    bsz, q_len, _ = hidden_states.shape
    queries, keys, values = project_qkv(module, hidden_states, position_ids, position_embeddings)
    form = cache.form
    factor = 1.0 if form.scale is None else form.scale * module.head_dim ** 0.5
    scaled = queries if factor == 1.0 else queries * factor   # q . k / sqrt(D) = the model's logit

    weights = None
    layer = module.layer_idx
    hidden = hidden_states if cache.method.needs_hidden else None   # the attention input, for scorers reading it
    if cache.reconstruction is not None and cache.reconstruction.current is not None:   # a repeat pass (KVzip)
        out = cache.repeat_attend(layer, scaled, keys, values).transpose(1, 2)
    elif not cache.is_prefilled(layer):
        sparse = cache.method.prefill_attention
        pads = cache.pad_lens or [0] * bsz
        pattern = None if sparse is None else sparse.pattern(layer, scaled, keys, pads, cache.model_shape.name)
        window = form.window(layer)
        column_sums = None
        if pattern is not None:
            out, weights, density = sparse_prefill_attention(scaled, keys, values, pattern, output_attentions)
            cache.prefill_density[layer] = density
        elif not output_attentions and (window is None or window >= q_len) and cache.needs_column_sums(bsz, q_len):
            out, column_sums = column_sums_attention(scaled, keys, values, real_positions(pads, q_len, keys.device),
                                                     form=form)
            out = out.transpose(1, 2)
        else:
            out, weights = full_attention(module, implementation, queries, keys, values, attention_mask,
                                          position_ids, output_attentions, pads, form)
        if cache.chunked is not None:   # the first chunk's K/V, held whole while the layer computes
            cache.chunked.note(cache.kv_bytes() + sum(t.numel() * t.element_size() for t in (keys, values)))
        cache.prefill(layer, scaled, keys, values, position_ids, pattern, column_sums, hidden)
    else:
        out = cache.decode_step(layer, scaled, keys, values, position_ids, hidden).transpose(1, 2)
        if cache.chunked is not None:   # a later chunk: the layer keeps its budget again (core/chunked.py)
            cache.chunked.reselect(cache, layer, scaled)
    out = out.reshape(bsz, q_len, -1).contiguous()
    return module.o_proj(out), weights, cache
