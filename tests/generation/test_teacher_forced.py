"""Teacher-forced reference scoring (generation/teacher_forced.py): the KL against hand-worked cases, fullkv's
distributions against one plain forward of the unpatched model, and the greedy answer from the shared prefill
against `generate`."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pyramidkv import make_method
from pyramidkv.generation import generate
from pyramidkv.generation.teacher_forced import kl_divergence, score_reference


def test_kl_of_a_hand_worked_three_token_case():
    p = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]], dtype=torch.float64).log()
    q = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]], dtype=torch.float64).log()
    got = kl_divergence(p, q)
    # row 0: 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2; row 1: 1 * ln(1 / 0.5), the zero-probability terms count 0
    assert got.tolist() == pytest.approx([0.25 * math.log(2), math.log(2)], abs=1e-12)
    assert kl_divergence(p, p).tolist() == [0.0, 0.0]
    assert math.isinf(kl_divergence(q, p)[1])          # Q puts mass where P has none
    with pytest.raises(ValueError, match="shapes"):
        kl_divergence(p, q[:1])


def test_kl_of_near_equal_float32_rows_is_never_below_zero():
    """Float32 log-softmax rows of logits a float32 rounding apart: each sums to 1 only within float32 rounding, and
    the plain sum came out below 0 on most such rows (a run's `KL -0.0`). Renormalized in float64, every row is
    >= 0, and near the KL of the same logits taken in float64 throughout (~1e-13)."""
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(0)) * 3
    moved = logits + torch.randn(32, 49152, generator=torch.Generator().manual_seed(1)) * 1e-6
    got = kl_divergence(torch.log_softmax(logits, -1), torch.log_softmax(moved, -1))
    p, q = torch.log_softmax(logits.double(), -1), torch.log_softmax(moved.double(), -1)
    exact = (p.exp() * (p - q)).sum(-1)
    assert (got >= 0).all() and torch.allclose(got, exact, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    return model, tokenizer


@pytest.mark.parametrize("spec", [
    ("fullkv", {}), ("snapkv", dict(budget=64)), ("streamingllm", dict(budget_ratio=0.5)),
    ("h2o", dict(budget=64, decode_budget=70, decode_interval=2)), ("quest", dict(page_budget=64, page_dense_layers=1)),
])
def test_greedy_answer_from_the_shared_prefill_equals_generate(tiny, spec):
    model, tokenizer = tiny
    torch.manual_seed(1)
    prompt = torch.randint(100, 40000, (300,)).tolist()
    reference = torch.randint(100, 40000, (6,)).tolist()
    method = make_method(spec[0], **spec[1])
    plain = generate(model, tokenizer, [prompt], method, max_new_tokens=8, stop_token_ids=[])[0]
    # a stop token the answer meets at its third token (fullkv's), and min_new_tokens that bars it at the first
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)[0, -3:]
    for stops, least in (([], 0), ([int(greedy[2])], 0), ([int(greedy[0])], 1)):
        expected = generate(model, tokenizer, [prompt], method, max_new_tokens=8, stop_token_ids=stops,
                            min_new_tokens=least)[0] if stops else plain
        got = score_reference(model, tokenizer, prompt, reference, method, max_new_tokens=8, stop_token_ids=stops,
                              min_new_tokens=least)
        assert got.generation == expected, (stops, least)
        assert got.logprobs.shape == (len(reference), model.config.vocab_size)


def test_fullkv_distributions_equal_one_plain_forward_and_a_method_keeping_all_has_kl_zero(tiny):
    model, tokenizer = tiny
    torch.manual_seed(2)
    prompt = torch.randint(100, 40000, (200,)).tolist()
    reference = torch.randint(100, 40000, (5,)).tolist()
    with torch.no_grad():
        plain = model(torch.tensor([prompt + reference[:-1]]), use_cache=False).logits[0, len(prompt) - 1:]
    expected = torch.log_softmax(plain.float(), -1)
    full = score_reference(model, tokenizer, prompt, reference, make_method("fullkv")).logprobs
    assert torch.allclose(full, expected, atol=1e-4)
    kept_all = score_reference(model, tokenizer, prompt, reference, make_method("snapkv", budget=200)).logprobs   # the whole prompt
    assert kl_divergence(full, kept_all).max() < 1e-6
    kept_quarter = score_reference(model, tokenizer, prompt, reference,
                                   make_method("snapkv", budget_ratio=0.25)).logprobs
    assert kl_divergence(full, kept_quarter).mean() > 1e-5      # eviction shows
