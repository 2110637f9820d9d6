"""generate(): stops at the model's end of sequence by default, reports per-prompt bytes that do not
depend on the batch, and a patched model without a cache behaves exactly as unpatched."""

from __future__ import annotations

import pytest
import torch

from pyramidkv import compress, load_model, make_method
from pyramidkv.generation import generate
from pyramidkv.models.patch import UncompressedWarning
from tests.prompts import STORY, passkey_prompt

CAPITAL = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_stops_at_end_of_sequence_by_default(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(CAPITAL, return_tensors="pt", add_special_tokens=False).input_ids
    # Reference: plain transformers, unpatched, told the end-of-sequence id (<|im_end|> = 2) explicitly.
    plain = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=2)[0, ids.shape[1]:]
    assert plain[-1].item() == 2 and len(plain) < 40
    out = generate(model, tokenizer, [CAPITAL], make_method("snapkv", budget=64), max_new_tokens=40)[0]
    assert out.new_tokens == len(plain) - 1          # the stop token is not part of the answer
    assert out.text == tokenizer.decode(plain[:-1])
    # An empty stop list decodes every token asked for.
    every = generate(model, tokenizer, [CAPITAL], make_method("fullkv"), max_new_tokens=12, stop_token_ids=[])[0]
    assert every.new_tokens == 12


def test_batch_reports_each_prompt_bytes_as_if_alone(smollm2):
    """Prompts that stop at different steps: the batch keeps decoding the stopped ones, which must not count."""
    model, tokenizer = smollm2
    prompts = [CAPITAL, passkey_prompt(41872, 20), STORY]
    method = make_method("snapkv", budget=64, window_size=16)
    single = [generate(model, tokenizer, [p], method, 48)[0] for p in prompts]
    assert len({s.new_tokens for s in single}) > 1   # they really stop at different steps
    batch = generate(model, tokenizer, prompts, method, 48)
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 4
    for s, b, p in zip(single, batch, prompts):
        assert (b.text, b.new_tokens) == (s.text, s.new_tokens)
        assert b.kv_bytes_per_prompt == s.kv_bytes_per_prompt
        # Hand count: min(budget, prompt) kept + the tokens fed back (all generated, stop included, but the last).
        fed_back = s.new_tokens if s.new_tokens < 48 else 47
        assert b.kv_bytes_per_prompt == per_token * (min(64, s.prompt_tokens) + fed_back)


@pytest.mark.parametrize("model_class", ["llama", "mistral"])
def test_use_cache_false_runs_the_unpatched_attention(smollm2_path, model_class):
    model, tokenizer = load_model(smollm2_path, attn_implementation="sdpa", device="cpu", model_class=model_class)
    ids = tokenizer(CAPITAL, return_tensors="pt", add_special_tokens=False).input_ids
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=2)
    with torch.no_grad():
        expected_logits = model(ids, use_cache=False).logits
    with compress(model, make_method("snapkv", budget=16, window_size=8)):
        with pytest.warns(UncompressedWarning, match="use_cache=False inside compress.*nothing is compressed"):
            got = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=2)
        with torch.no_grad(), pytest.warns(UncompressedWarning):
            got_logits = model(ids, use_cache=False).logits
    assert torch.equal(got, expected)
    assert torch.equal(got_logits, expected_logits)
