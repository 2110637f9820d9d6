"""generate() around transformers' loop: the prompt's forward computes logits at its last position only, the
decode steps run on `decode_threads` (the thread setting comes back afterwards), and a batch still predicts,
stores and stops for each prompt what it does alone."""

from __future__ import annotations

import pytest
import torch

from pyramidkv import make_method
from pyramidkv.generation import generate
from tests.prompts import STORY, passkey_prompt

CAPITAL = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [passkey_prompt(41872, 6), "The librarian counted the notebooks.", STORY]


@pytest.fixture
def two_threads():
    """Two threads while the test runs (pytest-xdist workers run on one), then the setting it found."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_prompt_forward_computes_logits_at_its_last_position_only(random_llama):
    model, tokenizer, _ = random_llama
    widths = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
    try:
        outputs = generate(model, tokenizer, PROMPTS, make_method("snapkv", budget=16, window_size=4), 5,
                           stop_token_ids=[])
    finally:
        hook.remove()
    assert widths == [1] * 5                      # the prompt's forward and 4 decode steps: one position each
    assert all(o.new_tokens == 5 for o in outputs)
    # The hook is gone afterwards: the model's own forward gives every position's logits again.
    ids = tokenizer(PROMPTS[1], return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        assert model(ids).logits.shape[1] == ids.shape[1]


def test_greedy_tokens_equal_transformers_on_the_unpatched_model(random_llama):
    """fullkv keeps everything: the same greedy tokens as plain transformers, which computes every position's
    logits at the prompt."""
    model, tokenizer, _ = random_llama
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        plain = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=2)
        ours = generate(model, tokenizer, [prompt], make_method("fullkv"), 8, stop_token_ids=[])[0]
        assert ours.text == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("decode_threads", [1, None])
def test_decode_steps_run_on_decode_threads_and_the_setting_comes_back(random_llama, two_threads, decode_threads):
    model, tokenizer, _ = random_llama
    seen = []  # (positions fed, threads) per forward
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"].shape[1], torch.get_num_threads())),
        with_kwargs=True)
    try:
        generate(model, tokenizer, PROMPTS[:2], make_method("snapkv", budget=16, window_size=4), 4,
                 stop_token_ids=[], decode_threads=decode_threads)
        generate(model, tokenizer, PROMPTS[:1], make_method("quest", budget=16, page_size=4), 3,
                 questions=[" What is it?"], decode_threads=decode_threads)
    finally:
        hook.remove()
    decode = 2 if decode_threads is None else decode_threads
    prompt_width = len(tokenizer(PROMPTS[1], add_special_tokens=False).input_ids)
    assert seen[0][1] == 2 and seen[0][0] > 1 and seen[0][0] >= prompt_width
    assert [threads for _, threads in seen[1:4]] == [decode] * 3
    assert seen[4][1] == 2 and seen[4][0] > 1       # the next generate's prompt: the setting restored
    question = len(tokenizer(" What is it?", add_special_tokens=False).input_ids)
    assert seen[5] == (question - 1, 2)   # the question but its last token in one forward, on the prompt's threads
    assert {threads for width, threads in seen[6:]} == {decode} and {width for width, _ in seen[6:]} == {1}
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="decode_threads must be >= 1, got 0"):
        generate(model, tokenizer, PROMPTS[:1], make_method("fullkv"), 2, decode_threads=0)


def test_a_batch_on_one_decode_thread_gives_each_prompt_its_own_output(smollm2, two_threads):
    """Prompts of three lengths that stop at different steps (SmolLM2: the random model repeats one token): in
    one batch, its decode steps on one thread, each gives the text, new tokens and bytes it gives alone."""
    model, tokenizer = smollm2
    prompts = [CAPITAL, passkey_prompt(41872, 4), STORY]
    method = make_method("snapkv", budget=64, window_size=16)
    alone = [generate(model, tokenizer, [p], method, 16, decode_threads=1)[0] for p in prompts]
    assert len({a.new_tokens for a in alone}) > 1      # they really stop at different steps
    batch = generate(model, tokenizer, prompts, method, 16, decode_threads=1)
    for b, a in zip(batch, alone):
        assert (b.text, b.new_tokens, b.prompt_tokens, b.kv_bytes_per_prompt) == \
            (a.text, a.new_tokens, a.prompt_tokens, a.kv_bytes_per_prompt)
