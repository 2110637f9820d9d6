"""generate(): stops at the model's end of sequence by default, reports per-prompt bytes that do not
depend on the batch, and a patched model without a cache behaves exactly as unpatched."""

from __future__ import annotations

import pytest
import torch

from pyramidkv import compress, load_model, make_method
from pyramidkv.generation import generate
from pyramidkv.models.patch import UncompressedWarning
from tests.models.families import SMOLLM2_AS
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
    """Prompts that stop at different steps: the batch keeps decoding the stopped ones, which must not count.
    (SmolLM2 stops after 7 and 6 tokens and runs STORY to the cap: 16 new tokens decode 9 steps past a stop.)"""
    model, tokenizer = smollm2
    prompts = [CAPITAL, passkey_prompt(41872, 20), STORY]
    method = make_method("snapkv", budget=64, window_size=16)
    single = [generate(model, tokenizer, [p], method, 16)[0] for p in prompts]
    assert len({s.new_tokens for s in single}) > 1   # they really stop at different steps
    batch = generate(model, tokenizer, prompts, method, 16)
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 4
    for s, b, p in zip(single, batch, prompts):
        assert (b.text, b.new_tokens) == (s.text, s.new_tokens)
        assert b.kv_bytes_per_prompt == s.kv_bytes_per_prompt
        # Hand count: min(budget, prompt) kept + the tokens fed back (all generated, stop included, but the last).
        fed_back = s.new_tokens if s.new_tokens < 16 else 15
        assert b.kv_bytes_per_prompt == per_token * (min(64, s.prompt_tokens) + fed_back)


@pytest.mark.parametrize("model_class", SMOLLM2_AS)
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


def _split_passkey(tokenizer, key: int, fillers: int):
    from pyramidkv.generation import split_prompt

    prompt = passkey_prompt(key, fillers)
    return prompt, split_prompt(tokenizer, prompt, prompt.index("\nWhat is the pass key?"))


def test_split_prompt_cuts_the_whole_prompt_tokens(tokenizer):
    prompt, (context, question) = _split_passkey(tokenizer, 31415, 6)
    assert context + question == tokenizer(prompt, add_special_tokens=False).input_ids
    assert tokenizer.decode(question).startswith("\nWhat is the pass key?")


def test_question_fed_as_decode_steps_equals_the_whole_prompt_under_fullkv(smollm2):
    """Without compression, feeding the question token by token attends over exactly what prefilling it
    does: the same answer, prompt length and bytes (the question's tokens held either way)."""
    model, tokenizer = smollm2
    prompt, (context, question) = _split_passkey(tokenizer, 31415, 12)
    whole = generate(model, tokenizer, [prompt], make_method("fullkv"), 12)[0]
    fed = generate(model, tokenizer, [context], make_method("fullkv"), 12, questions=[question])[0]
    assert (fed.text, fed.new_tokens, fed.prompt_tokens) == (whole.text, whole.new_tokens, whole.prompt_tokens)
    assert fed.kv_bytes_per_prompt == whole.kv_bytes_per_prompt
    assert "31415" in fed.text


def test_questions_of_different_lengths_in_a_batch_equal_single_runs(smollm2):
    """Each row is forced through its own question (its own length) and then answers; rows that finish
    early keep decoding for the batch without it counting."""
    model, tokenizer = smollm2
    (_, first), (_, second) = _split_passkey(tokenizer, 27182, 20), _split_passkey(tokenizer, 16180, 8)
    contexts = [first[0], second[0]]
    questions = [first[1], second[1] + tokenizer(" Answer with the number only.", add_special_tokens=False).input_ids]
    method = make_method("quest", budget=48, page_size=8)
    single = [generate(model, tokenizer, [c], method, 16, questions=[q])[0] for c, q in zip(contexts, questions)]
    batch = generate(model, tokenizer, contexts, method, 16, questions=questions)
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2 * 4
    for s, b, c, q in zip(single, batch, contexts, questions):
        assert (b.text, b.new_tokens, b.kv_bytes_per_prompt) == (s.text, s.new_tokens, s.kv_bytes_per_prompt)
        fed_back = s.new_tokens if s.new_tokens < 16 else 15
        held = len(c) + len(q) + fed_back
        pages = -(-held // 8)
        metadata = (cfg.num_hidden_layers - 2) * cfg.num_key_value_heads * pages * 2 * 64 * 4
        assert b.kv_bytes_per_prompt == per_token * held + metadata


@pytest.mark.parametrize("prompts, questions, message", [
    ("hello there", None, r"prompts is one string \('hello there'\), not a list of prompts: pass \[text\]"),
    (None, None, r"prompts must be a list of strings or of token-id lists, got None"),
    ([None], None, r"prompt 0 is neither text nor a list of token ids: None"),
    ([[5, 6], [5, None, 7]], None, r"prompt 1 holds None at position 1, not a token id \(an integer in \[0, 49152\)\)"),
    ([[5, 6], [5, 49152]], None, r"prompt 1 holds token id 49152 at position 1, outside the model's vocabulary "
                                 r"\[0, 49152\)"),
    ([[-1, 6]], None, r"prompt 0 holds token id -1 at position 0, outside the model's vocabulary \[0, 49152\)"),
    ([[5, 6]], [[7, 10 ** 9]], r"question 0 holds token id 1000000000 at position 1, outside"),
    ([[5, 6]], "why", r"questions is one string \('why'\), not a list of questions"),
])
def test_bad_prompts_are_refused_at_the_entry(random_llama, prompts, questions, message):
    """SmolLM2's tokenizer and embedding have 49,152 rows (ids 0..49151): one ValueError naming the prompt
    and the value, before any forward (which would fail deep in torch, or, for a bare string, run one prompt
    per character)."""
    model, tokenizer, _ = random_llama
    assert model.get_input_embeddings().num_embeddings == 49152
    with pytest.raises(ValueError, match=message):
        generate(model, tokenizer, prompts, make_method("fullkv"), max_new_tokens=1, questions=questions)


def test_token_ids_as_tensors_and_the_last_vocabulary_id_run(random_llama):
    model, tokenizer, _ = random_llama
    ids = torch.tensor([[5, 6, 49151], [7, 8, 9]])
    got = generate(model, tokenizer, ids, make_method("fullkv"), max_new_tokens=1, stop_token_ids=[])
    assert [g.prompt_tokens for g in got] == [3, 3]
