"""H2O's column sums come out of the prefill attention pass itself (attention_with_column_sums).

References: a float64 causal softmax built entry by entry in numpy (output and column sums), the
two-pass `attention_column_sums` H2O used before (kept sets must not change), and the unpatched model's
own logits (the prefill output differs from its sdpa kernel by rounding only).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.core.scoring import attention_column_sums, attention_with_column_sums
from pyramidkv.methods.h2o import H2O
from tests.prompts import STORY


def reference(queries, keys, values, pads):
    """Per prompt b and query head h, the float64 causal softmax over the real keys of every real query:
    (output [B, Hq, n, D] at real queries, NaN elsewhere; column sums [B, Hq, n])."""
    q, k, v = (t.double().numpy() for t in (queries, keys, values))
    bsz, num_q_heads, n, dim = q.shape
    group = num_q_heads // k.shape[1]
    out = np.full(q.shape, np.nan)
    sums = np.zeros((bsz, num_q_heads, n))
    for b, pad in enumerate(pads):
        for h in range(num_q_heads):
            for i in range(pad, n):
                logits = k[b, h // group, pad:i + 1] @ q[b, h, i] / np.sqrt(dim)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[b, h, i] = p @ v[b, h // group, pad:i + 1]
                sums[b, h, pad:i + 1] += p
    return out, sums


@pytest.mark.parametrize("max_chunk_elements", [1, 6 * 40 * 3 * 7, 1 << 21])  # 1 row, 7 rows, all at once
def test_output_and_column_sums_equal_float64_reference(max_chunk_elements):
    torch.manual_seed(0)
    bsz, num_q_heads, num_kv_heads, n, dim = 3, 6, 2, 40, 16
    pads = [0, 5, 11]
    queries = torch.randn(bsz, num_q_heads, n, dim) * 2
    keys, values = torch.randn(bsz, num_kv_heads, n, dim), torch.randn(bsz, num_kv_heads, n, dim)
    real = torch.arange(n)[None, :] >= torch.tensor(pads)[:, None]
    out, sums = attention_with_column_sums(queries, keys, values, real, max_chunk_elements)
    expected_out, expected_sums = reference(queries, keys, values, pads)
    assert out.shape == queries.shape and sums.shape == (bsz, num_q_heads, n)
    assert torch.isfinite(out).all()  # padding queries too: their rows flow on into padding K/V
    for b, pad in enumerate(pads):
        np.testing.assert_allclose(out[b, :, pad:].numpy(), expected_out[b, :, pad:], rtol=0, atol=2e-6)
        assert torch.all(sums[b, :, :pad] == 0)  # padding is neither counted nor attended
    np.testing.assert_allclose(sums.numpy(), expected_sums, rtol=1e-5, atol=1e-6)
    # Columns of a real query's row sum to 1: the total over keys is the number of real queries.
    np.testing.assert_allclose(sums.sum(-1).numpy(), np.array([[n - p] * num_q_heads for p in pads]), rtol=1e-5)


def test_column_sums_equal_the_two_pass_scores():
    """The sums H2O scored by before (a second, separate pass over the scores) to 1e-5 relative."""
    torch.manual_seed(1)
    queries, keys, values = torch.randn(2, 9, 300, 64), torch.randn(2, 3, 300, 64), torch.randn(2, 3, 300, 64)
    real = torch.arange(300)[None, :] >= torch.tensor([0, 37])[:, None]
    _, sums = attention_with_column_sums(queries, keys, values, real, max_chunk_elements=9 * 300 * 2 * 50)
    before = attention_column_sums(queries, keys, real)
    torch.testing.assert_close(sums, before, rtol=1e-5, atol=1e-7)


def test_h2o_prefill_uses_one_pass_and_keeps_the_same_tokens(smollm2, monkeypatch):
    """On the model, a left-padded batch: the scorer receives the pass's column sums, which equal the
    two-pass sums of the same queries and keys to 1e-5 relative, and the kept sets equal those the
    two-pass sums select (identical, or a swap between exactly tied scores); the prompt's logits equal
    the unpatched model's to rounding."""
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    texts = [STORY, STORY[: len(STORY) // 2], STORY[len(STORY) // 3:]]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    method = make_method("h2o", budget=48, window_size=8)
    seen = []
    original = H2O.score

    def spy(self, ctx):
        assert ctx.column_sums is not None, "the prefill attention pass did not hand over its column sums"
        seen.append((ctx.column_sums.clone(), attention_column_sums(ctx.queries, ctx.keys, ctx.real)))
        return original(self, ctx)

    monkeypatch.setattr(H2O, "score", spy)
    with compress(model, method) as patch:
        cache = patch.new_cache()
        with torch.no_grad():
            got = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                        past_key_values=cache, use_cache=True).logits
    assert len(seen) == model.config.num_hidden_layers
    for layer, (one_pass, two_pass) in enumerate(seen):
        torch.testing.assert_close(one_pass, two_pass, rtol=1e-5, atol=1e-7, msg=f"layer {layer}")
        for b, pad in enumerate(cache.pad_lens):
            scores = two_pass[b].reshape(3, 3, -1).mean(1)  # kv_head layout: mean over the query group
            n = scores.shape[1]
            for head, kept in enumerate(cache.kept_positions(layer, b)):
                chosen = set((kept + pad).tolist()) - set(range(n - 8, n))
                k = 48 - 8
                candidates = scores[head, pad:n - 8]
                threshold = torch.sort(candidates, descending=True).values[k - 1]
                above = {pad + int(i) for i in torch.nonzero(candidates > threshold * (1 + 1e-5))}
                near = {pad + int(i) for i in torch.nonzero(candidates >= threshold * (1 - 1e-5))}
                assert above <= chosen <= near, (layer, b, head)
    with torch.no_grad():
        plain = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids).logits
    for b, pad in enumerate(cache.pad_lens):
        torch.testing.assert_close(got[b, pad:], plain[b, pad:], rtol=0, atol=1e-4)


def test_fullkv_and_kept_whole_prompts_run_the_models_own_kernel(smollm2):
    """No column sums are asked for when nothing is scored by them: fullkv, and h2o with a budget that
    covers the prompt (its logits stay bit-identical to the unpatched model)."""
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        plain = model(ids).logits
    for method in (make_method("fullkv"), make_method("h2o", budget=ids.shape[1] + 1)):
        with compress(model, method) as patch:
            cache = patch.new_cache()
            assert not cache.needs_column_sums(1, ids.shape[1])
            with torch.no_grad():
                got = model(ids, past_key_values=cache, use_cache=True).logits
        assert torch.equal(got, plain), method.name
    compressed = make_method("h2o", budget=64)
    with compress(model, compressed) as patch:
        assert patch.new_cache().needs_column_sums(1, ids.shape[1])
    with compress(model, make_method("h2o", budget=ids.shape[1] + 1, decode_budget=64)) as patch:
        assert patch.new_cache().needs_column_sums(1, ids.shape[1])  # decoding accumulates from them
