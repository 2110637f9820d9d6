"""Decoding over a cache whose heads (and prompts) keep different token counts.

The caches are built by hand from the model's own full K/V (every head keeps its own random set of
prompt positions), so these tests do not depend on any method producing ragged heads.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pyramidkv import compress, make_method, native
from pyramidkv.core import layout
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from tests.prompts import STORY, passkey_prompt


def spy_paths(monkeypatch) -> set[str]:
    """The names of DecodeLayout's ragged paths that attend from now on (filled as they run)."""
    ran = set()
    for name in ("_attend_segments", "_attend_blocks"):
        original = getattr(layout.DecodeLayout, name)

        def recorded(self, *args, name=name, original=original):
            ran.add(name)
            return original(self, *args)

        monkeypatch.setattr(layout.DecodeLayout, name, recorded)
    return ran


def full_prefill(model, ids, attention_mask=None):
    """Unpatched prefill: (last-position logits [B, V], DynamicCache of the full K/V); RoPE positions
    count from each prompt's first real token (as generate() gives them)."""
    position_ids = None if attention_mask is None else (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=DynamicCache(),
                    use_cache=True)
    return out.logits[:, -1], out.past_key_values


def ragged_positions(num_layers: int, num_heads: int, real_len: int, seed: int) -> list[list[torch.Tensor]]:
    """Per layer and KV head, a sorted random subset of [0, real_len) of a different size per head."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        sizes = torch.randperm(real_len - 8, generator=gen)[:num_heads] + 4
        out.append([torch.randperm(real_len, generator=gen)[:int(k)].sort().values for k in sizes])
    return out


def hand_built_cache(patch, full: DynamicCache, kept: list[list[list[torch.Tensor]]], pads: list[int]):
    """A CompressedCache holding, for prompt b, layer l, head h, the full K/V at kept[b][l][h] (real positions)."""
    cache = patch.new_cache()
    cache.pad_lens = list(pads)
    cache.prompt_len = full.key_cache[0].shape[2]
    for layer in range(len(full.key_cache)):
        prompts = []
        for b, pad in enumerate(pads):
            per_head = kept[b][layer]
            keys = torch.cat([full.key_cache[layer][b, h, p + pad] for h, p in enumerate(per_head)])
            values = torch.cat([full.value_cache[layer][b, h, p + pad] for h, p in enumerate(per_head)])
            prompts.append(KeptKV(keys, values, [len(p) for p in per_head], torch.cat(per_head)))
        cache.layers[layer] = FullPrecisionStore(prompts, [cache.prompt_len - pad for pad in pads])
    return cache


# The ragged rows one segment at a time (in C, pyramidkv/native/segment_attend.c, or by torch ops), or in blocks.
@pytest.mark.parametrize("segment_rows,in_c", [(1, True), (1, False), (10**9, False)])
def test_ragged_decode_equals_hf_attention_over_each_heads_kept_tokens(smollm2, monkeypatch, segment_rows, in_c):
    """Each layer's attention output (before o_proj) of the patched model, for 3 decode steps, against
    transformers' own attention module run once per KV head h over a DynamicCache that physically holds
    only head h's kept tokens (plus the appended ones), on the same layer input."""
    monkeypatch.setattr(layout, "SEGMENT_ROWS", segment_rows)
    attended = spy_paths(monkeypatch)
    in_c_calls = []
    in_c_original = layout._segments_in_c
    monkeypatch.setattr(layout, "_segments_in_c", lambda *args: in_c_calls.append(1) or in_c_original(*args))
    if not in_c:
        monkeypatch.setattr(native, "_OFF", [1])
    model, tokenizer = smollm2
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    group, head_dim = cfg.num_attention_heads // kv_heads, cfg.hidden_size // cfg.num_attention_heads
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    n = ids.shape[1]
    logits, full = full_prefill(model, ids)
    kept = ragged_positions(layers, kv_heads, n, seed=0)
    assert all(len({len(p) for p in per_head}) == kv_heads for per_head in kept)  # every head its own count
    # Per KV head h: a dense DynamicCache whose every head holds head h's kept tokens of each layer.
    reference_caches = []
    for h in range(kv_heads):
        cache = DynamicCache()
        for layer in range(layers):
            cache.update(full.key_cache[layer][:, :, kept[layer][h]], full.value_cache[layer][:, :, kept[layer][h]], layer)
        reference_caches.append(cache)

    layer_inputs, attention_outputs, hooks = {}, {}, []
    for layer_idx, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=layer_idx: layer_inputs.__setitem__(i, kwargs), with_kwargs=True))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, args, i=layer_idx: attention_outputs.__setitem__(i, args[0].clone())))
    try:
        with compress(model, make_method("fullkv")) as patch, torch.no_grad():
            cache = hand_built_cache(patch, full, [kept], [0])
            token = logits[:, None].argmax(-1)
            for step in range(3):
                out = model(token, past_key_values=cache, use_cache=True)
                got = dict(attention_outputs)  # [1, 1, Hq * D] per layer
                patch.remove()  # the reference runs transformers' own attention
                for layer_idx, layer in enumerate(model.model.layers):
                    kwargs = layer_inputs[layer_idx]
                    for h in range(kv_heads):
                        type(layer.self_attn).forward(
                            layer.self_attn, kwargs["hidden_states"], attention_mask=None,
                            position_ids=kwargs["position_ids"], past_key_value=reference_caches[h], use_cache=True,
                            cache_position=kwargs["cache_position"], position_embeddings=kwargs["position_embeddings"])
                        cols = slice(h * group * head_dim, (h + 1) * group * head_dim)
                        torch.testing.assert_close(got[layer_idx][..., cols], attention_outputs[layer_idx][..., cols],
                                                   rtol=1e-5, atol=1e-5, msg=f"step {step} layer {layer_idx} head {h}")
                patch.apply()
                assert kwargs["position_ids"].item() == n + step  # true RoPE position of the new token
                token = out.logits[:, -1:].argmax(-1)
    finally:
        for hook in hooks:
            hook.remove()
    torch_path = "_attend_segments" if segment_rows == 1 else "_attend_blocks"
    assert attended == (set() if in_c else {torch_path}), attended
    assert bool(in_c_calls) == in_c


def test_ragged_left_padded_batch_equals_single_prompts(smollm2):
    """Two prompts of different lengths, left-padded into one batch, every head of every layer keeping its
    own count: the batch's decode logits equal each prompt decoded alone with the same kept tokens."""
    model, tokenizer = smollm2
    cfg = model.config
    prompts = [STORY, passkey_prompt(4711, 2)]
    token_lists = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    real = [len(t) for t in token_lists]
    width = max(real)
    assert real[0] != real[1]
    kept = [ragged_positions(cfg.num_hidden_layers, cfg.num_key_value_heads, r, seed=b) for b, r in enumerate(real)]
    steps = 4

    def decode(ids, attention_mask, kept_per_prompt, pads):
        """Greedy decode logits [steps, B, V] from a hand-built cache; RoPE positions count real tokens only."""
        logits, full = full_prefill(model, ids, attention_mask)
        out_logits = []
        with compress(model, make_method("fullkv")) as patch, torch.no_grad():
            cache = hand_built_cache(patch, full, kept_per_prompt, pads)
            token = logits[:, None].argmax(-1)
            for _ in range(steps):
                attention_mask = torch.cat([attention_mask, torch.ones(len(pads), 1, dtype=attention_mask.dtype)], 1)
                position_ids = attention_mask.sum(1, keepdim=True) - 1  # real tokens before the new one
                out = model(token, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                            use_cache=True)
                out_logits.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
        return torch.stack(out_logits)

    ids = torch.full((2, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, tokens in enumerate(token_lists):
        ids[b, width - len(tokens):] = torch.tensor(tokens)
        mask[b, width - len(tokens):] = 1
    batch = decode(ids, mask, kept, [width - r for r in real])
    for b, tokens in enumerate(token_lists):
        single = decode(torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long), [kept[b]], [0])
        torch.testing.assert_close(batch[:, b], single[:, 0], rtol=1e-4, atol=1e-4)
