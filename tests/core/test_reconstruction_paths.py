"""core/reconstruction.py's two computations of the repeat's attention (the segmented fused kernel on CPU, the
blocked explicit path for other devices and soft-capped models) against a float64 reference on random tensors:
the output over [prompt without its suffix, repeat (causal)], the score a softmax over [prefix, chunk, repeat]
maximised over the queries, per query head; both GQA layouts of the stored prompt."""

from __future__ import annotations

import pytest
import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core import reconstruction
from pyramidkv.core.reconstruction import Reconstruction, ReconstructionPlan, RepeatChunk, RepeatDone

HQ, HKV, D, PAD, N, PREFIX, SUFFIX = 9, 3, 16, 5, 300, 12, 6


def reference(q, k, v, pk, pv, start, stop, softcap):
    read = N - SUFFIX
    group_p = HQ // pk.shape[0]
    keys = torch.cat([pk[:, PAD:PAD + read].repeat_interleave(group_p, 0), k[0].repeat_interleave(HQ // HKV, 0)], 1)
    values = torch.cat([pv[:, PAD:PAD + read].repeat_interleave(group_p, 0), v[0].repeat_interleave(HQ // HKV, 0)], 1)
    m = q.shape[2]
    logits = q[0].double() @ keys.double().transpose(1, 2) / D ** 0.5
    if softcap is not None:
        logits = (logits / softcap).tanh() * softcap
    later = torch.arange(read + m)[None, :] > read + torch.arange(m)[:, None]
    logits = logits.masked_fill(later, float("-inf"))
    out = torch.softmax(logits, -1) @ values.double()
    extent = torch.cat([torch.arange(PREFIX), torch.arange(start, stop), torch.arange(read, read + m)])
    probs = torch.softmax(logits[..., extent], -1)
    return out, probs[..., PREFIX:PREFIX + stop - start].amax(1)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("stored", [HKV, HQ])
@pytest.mark.parametrize("m, start, stop", [(40, PREFIX, N - SUFFIX), (300, 100, 200), (70, 200, N - SUFFIX)])
def test_output_and_scores_equal_the_float64_reference(monkeypatch, fused, softcap, stored, m, start, stop):
    if not fused:
        monkeypatch.setattr(reconstruction, "_FLASH_CPU", None)
    torch.manual_seed(m + stop)
    q, k, v = torch.randn(1, HQ, m, D) * 2, torch.randn(1, HKV, m, D), torch.randn(1, HKV, m, D)
    pk, pv = torch.randn(stored, PAD + N, D), torch.randn(stored, PAD + N, D)
    chunk = RepeatChunk(ids=[0] * m, start=start, stop=stop)
    recon = Reconstruction([ReconstructionPlan(prefix=PREFIX, suffix=SUFFIX, chunks=[chunk])])
    recon.current = (0, chunk)
    out = recon.attend(0, q, k, v, pk, pv, PAD, AttentionForm(softcap=softcap))
    want_out, want_scores = reference(q, k, v, pk, pv, start, stop, softcap)
    torch.testing.assert_close(out[0].double(), want_out, rtol=1e-5, atol=1e-5)
    scores = recon.scores[0][0]
    torch.testing.assert_close(scores[:, PAD + start:PAD + stop].double(), want_scores, rtol=1e-5, atol=1e-7)
    assert torch.all(scores[:, :PAD + start] == 0) and torch.all(scores[:, PAD + stop:] == 0)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("m, start, stop", [(300, 100, 200), (70, PREFIX, 150)])
def test_the_last_layer_records_its_scores_and_ends_the_repeat(monkeypatch, fused, softcap, m, start, stop):
    """At the model's last layer the output is read by nothing: the scores equal the float64 reference's all the
    same (the other chunks, left out of its attention, are in no score's softmax) and RepeatDone stops the forward."""
    if not fused:
        monkeypatch.setattr(reconstruction, "_FLASH_CPU", None)
    torch.manual_seed(m + stop + 1)
    q, k, v = torch.randn(1, HQ, m, D) * 2, torch.randn(1, HKV, m, D), torch.randn(1, HKV, m, D)
    pk, pv = torch.randn(HKV, PAD + N, D), torch.randn(HKV, PAD + N, D)
    chunk = RepeatChunk(ids=[0] * m, start=start, stop=stop)
    recon = Reconstruction([ReconstructionPlan(prefix=PREFIX, suffix=SUFFIX, chunks=[chunk])], last_layer=3)
    recon.current = (0, chunk)
    with pytest.raises(RepeatDone):
        recon.attend(3, q, k, v, pk, pv, PAD, AttentionForm(softcap=softcap))
    _, want_scores = reference(q, k, v, pk, pv, start, stop, softcap)
    scores = recon.scores[3][0]
    torch.testing.assert_close(scores[:, PAD + start:PAD + stop].double(), want_scores, rtol=1e-5, atol=1e-7)
    assert torch.all(scores[:, :PAD + start] == 0) and torch.all(scores[:, PAD + stop:] == 0)
