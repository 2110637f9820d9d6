"""A left-padded batch's prompt forward under sdpa: each prompt's own tokens, causal, no padding mask.

References: a float64 softmax over each query's real keys at or before it, entry by entry; the unpatched
model's masked-sdpa batch; each prompt alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyramidkv import compress, make_method
from pyramidkv.models import attention as patched_attention
from pyramidkv.models.attention import causal_per_prompt
from tests.prompts import STORY


def reference_attention(q, k, v, pads):
    """float64, per prompt, query and head: softmax over the keys j with pad <= j <= i. q, k, v: [B, H, n, D]."""
    q, k, v = q.double(), k.double(), v.double()
    bsz, heads, n, dim = q.shape
    out = torch.zeros_like(q)
    for b, pad in enumerate(pads):
        for h in range(heads):
            for i in range(pad, n):
                scores = torch.stack([q[b, h, i] @ k[b, h, j] for j in range(pad, i + 1)]) / dim**0.5
                out[b, h, i] = torch.softmax(scores, 0) @ v[b, h, pad:i + 1]
    return out


def test_each_prompt_attends_its_own_earlier_tokens_only():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 13, 8) for _ in range(3))
    pads = [0, 4, 12]
    got = causal_per_prompt(q, k, v, pads)
    torch.testing.assert_close(got.double(), reference_attention(q, k, v, pads), rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(got[1, :, :4]) == 0 and torch.count_nonzero(got[2, :, :12]) == 0


@pytest.fixture()
def sdpa_masks(monkeypatch):
    """The attn_mask of every sdpa call (torch.nn.functional's, so the unpatched model's too)."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(patched_attention.F, "scaled_dot_product_attention", spy)
    return seen


def _padded_batch(tokenizer, texts):
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_padded_batch_logits_equal_the_masked_batch_and_each_prompt_alone(smollm2, sdpa_masks):
    model, tokenizer = smollm2
    texts = [STORY, STORY[: len(STORY) // 2], STORY[: len(STORY) // 5]]
    batch = _padded_batch(tokenizer, texts)
    pads = (batch.attention_mask == 0).sum(1).tolist()
    assert pads[0] == 0 and pads[1] > 0 and pads[2] > pads[1]
    with torch.no_grad():
        unpatched = model(**batch, use_cache=False).logits           # transformers' sdpa under the padding mask
        sdpa_masks.clear()
        with compress(model, make_method("fullkv")):
            got = model(**batch, use_cache=True).logits
            assert sdpa_masks and all(mask is None for mask in sdpa_masks)   # the causal kernel, no padding mask
            alone = [model(torch.tensor([tokenizer(t, add_special_tokens=False).input_ids]), use_cache=True).logits
                     for t in texts]
    for b, pad in enumerate(pads):
        torch.testing.assert_close(got[b, pad:], unpatched[b, pad:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[b, pad:], alone[b][0], rtol=1e-4, atol=1e-4)


def test_padded_batch_generates_what_each_prompt_generates_alone(smollm2):
    from pyramidkv.generation import generate

    model, tokenizer = smollm2
    texts = [STORY, STORY.replace("Marta", "Ines")[: len(STORY) // 2] + "\nWho kept bees?<|im_end|>\n"]
    method = make_method("snapkv", budget=64, window_size=16)
    together = generate(model, tokenizer, texts, method, 12, min_new_tokens=12)
    for text, row in zip(texts, together):
        assert row.text == generate(model, tokenizer, [text], method, 12, min_new_tokens=12)[0].text
