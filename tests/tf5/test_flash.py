"""flash_attention_2 as a base of the 5.x line (models/tf5/attention.py `flash_attention`, registered as
`pyramidkv_flash_attention_2`), and its refusals on both lines.

flash-attn runs on CUDA only, and this machine has neither, so the plumbing is checked with a stand-in for 5.x's
`_flash_attention_forward` (causal attention in its [B, n, H, D] layout, computed by sdpa): the patched model calls
it once per layer for the prompt, naming flash_attention_2 (not the registered name, which no kernel has), with the
layer's window and no mask for an unpadded prompt, and decodes through the engine; its tokens and kept sets are
those of the same model under sdpa, its logits within 1e-5. What the kernel itself computes is flash-attn's (a GPU
machine's check: docs/transformers5.md).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from pyramidkv import compress, make_method
from pyramidkv.models.line import INTERFACE_LINE, VERSION
from pyramidkv.models.loading import check_model
from tests.tf5.families import CACHE_ARGUMENT, tiny

only_5x = pytest.mark.skipif(not INTERFACE_LINE, reason=f"transformers {VERSION}: the pinned line's flash path is "
                                                        f"its glue's (models/attention.py)")
PROMPT, NEW = 40, 5


def stand_in(calls: list):
    """A CPU stand-in for 5.x's _flash_attention_forward: records its arguments, computes causal (windowed)
    attention of q [B, n, Hq, D], k and v [B, n, Hkv, D] -> [B, n, Hq, D]."""
    def attend(q, k, v, attention_mask, query_length, is_causal, dropout=0.0, softmax_scale=None,
               sliding_window=None, attn_implementation=None, **kwargs):
        calls.append(dict(mask=attention_mask, query_length=query_length, is_causal=is_causal,
                          window=sliding_window, implementation=attn_implementation, scale=softmax_scale))
        group = q.shape[2] // k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, 1), v.transpose(1, 2).repeat_interleave(group, 1)
        n = q.shape[2]
        p = torch.arange(n)
        visible = p[None, :] <= p[:, None]
        if sliding_window is not None:
            visible &= p[None, :] > p[:, None] - sliding_window
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=softmax_scale).transpose(1, 2)
    return attend


def run(model, method, prompt):
    """(tokens, prompt logits, kept positions per layer) of greedy generate under the method."""
    with compress(model, method) as patch, torch.no_grad():
        cache = patch.new_cache()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **{CACHE_ARGUMENT: cache})
    kept = [[p.tolist() for p in cache.kept_positions(layer, 0)] for layer in range(model.config.num_hidden_layers)]
    return out.sequences[:, prompt.shape[1]:], out.logits[0], kept


@only_5x
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_the_prompt_goes_through_5xs_flash_path_and_decoding_through_the_engine(monkeypatch, model_type):
    import transformers.modeling_flash_attention_utils as flash_utils

    calls: list = []
    monkeypatch.setattr(flash_utils, "_flash_attention_forward", stand_in(calls))
    prompt = torch.randint(1, 96, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    method = make_method("snapkv", budget=16, window_size=4)
    want_tokens, want_logits, want_kept = run(tiny(model_type), method, prompt)
    model = tiny(model_type)
    model.config._attn_implementation = "flash_attention_2"   # as loaded with it (from_config checks flash-attn)
    tokens, logits, kept = run(model, method, prompt)
    assert model.config._attn_implementation == "flash_attention_2"   # the patch undone
    layers = model.config.num_hidden_layers
    assert len(calls) == layers   # the prompt, once per layer; the decode steps are the engine's
    window = getattr(model.config, "sliding_window", None)
    assert all(c["implementation"] == "flash_attention_2" and c["query_length"] == PROMPT and c["is_causal"]
               and c["mask"] is None and c["window"] == window for c in calls)
    assert torch.equal(tokens, want_tokens) and kept == want_kept
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)


@only_5x
def test_the_registered_flash_function_is_used_while_patched():
    model = tiny("llama")
    model.config._attn_implementation = "flash_attention_2"
    with compress(model, make_method("fullkv")):
        assert model.config._attn_implementation == "pyramidkv_flash_attention_2"
    assert model.config._attn_implementation == "flash_attention_2"


def test_flash_is_refused_in_one_line_without_the_package_or_off_cuda(monkeypatch, tiny_model_dir):
    """The pinned line's refusals, on both lines: the flash-attn package missing; a device other than CUDA."""
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ImportError, match="needs the optional package flash-attn") as missing:
            check_model(tiny_model_dir, attn_implementation="flash_attention_2", device="cpu")
        assert "\n" not in str(missing.value)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else found(name, *a))
    with pytest.raises(ValueError, match="flash_attention_2 runs on CUDA only, but device is 'cpu'") as off_cuda:
        check_model(tiny_model_dir, attn_implementation="flash_attention_2", device="cpu")
    assert "\n" not in str(off_cuda.value)
