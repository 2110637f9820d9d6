"""The families of the 5.x line on tiny random instances (tests/tf5/families.py), against the unpatched model and
hand counts; run by `make test-tf5` under .venv-tf5, and under the pinned line for the families it has.

References: the unpatched model's greedy tokens and logits; a budget of 16 keeps 16 tokens per layer and KV head
(on a sliding layer of window W, min(16, W - 1): the prompt tokens the next token's window covers, less itself);
each prompt of a left-padded batch alone; the fullkv cache's bytes.
"""

from __future__ import annotations

import pytest
import torch

from pyramidkv import compress, make_method
from tests.tf5.families import CACHE_ARGUMENT, FAMILIES, tiny, windows

PROMPT, NEW, BUDGET = 40, 6, 16
DECODE_LOGITS_ATOL = 1e-5   # decode steps attend over the engine's stores: float rounding of another sum order


def ids(length: int = PROMPT, seed: int = 5, vocab: int = 96) -> torch.Tensor:
    return torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt, mask=None, cache=None, new=NEW):
    """(tokens [B, new], logits of each step [new, B, V]) of greedy generate, a compressed cache passed as given."""
    extra = {} if cache is None else {CACHE_ARGUMENT: cache}
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt) if mask is None else mask, do_sample=False,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, **extra)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits)


def run(model, spec: dict, prompt, mask=None, tokenizer=None, new=NEW):
    """(tokens, logits, cache) of greedy generate under the method."""
    with compress(model, make_method(**spec)) as patch, torch.no_grad():
        token_lists = [row[row != 0].tolist() for row in prompt] if tokenizer is not None else None
        cache = patch.new_cache(token_lists, tokenizer)
        tokens, logits = greedy(model, prompt, mask, cache, new)
    return tokens, logits, cache


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fullkv_is_the_unpatched_model(model_type):
    """Greedy tokens equal; the prompt's logits bit-identical (the implementation's own function over the same q,
    k, v and mask), each decode step's to DECODE_LOGITS_ATOL."""
    model, prompt = tiny(model_type), ids()
    with torch.no_grad():
        tokens, logits = greedy(model, prompt)
    got, got_logits, cache = run(model, dict(name="fullkv"), prompt)
    assert torch.equal(got, tokens)
    assert torch.equal(got_logits[0], logits[0])
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=DECODE_LOGITS_ATOL)
    for layer, window in enumerate(windows(model)):   # a sliding layer holds what its window covers
        expected = PROMPT if window is None else min(PROMPT, window - 1)
        assert cache.kept_counts(layer) == [[expected] * model.config.num_key_value_heads], layer


@pytest.mark.parametrize("model_type", FAMILIES)
def test_snapkv_holds_exactly_its_budget_per_layer_and_head(model_type):
    model = tiny(model_type)
    _, _, cache = run(model, dict(name="snapkv", budget=BUDGET, window_size=4), ids(), new=1)
    heads = model.config.num_key_value_heads
    for layer, window in enumerate(windows(model)):
        expected = BUDGET if window is None else min(BUDGET, window - 1)
        assert cache.kept_counts(layer) == [[expected] * heads], (layer, window)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_left_padded_batch_of_three_is_each_prompt_alone(model_type):
    """Tokens, kept positions per layer and head, and bytes of each prompt: as in a batch of one."""
    model, spec = tiny(model_type), dict(name="snapkv", budget=BUDGET, window_size=4)
    prompts = [ids(n, seed=n)[0] for n in (PROMPT, 31, 23)]
    batch = torch.zeros(3, PROMPT, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, prompt in enumerate(prompts):
        batch[row, PROMPT - len(prompt):], mask[row, PROMPT - len(prompt):] = prompt, 1
    tokens, _, cache = run(model, spec, batch, mask)
    for row, prompt in enumerate(prompts):
        alone, _, own = run(model, spec, prompt[None])
        assert torch.equal(tokens[row], alone[0]), row
        for layer in range(model.config.num_hidden_layers):
            assert [p.tolist() for p in cache.kept_positions(layer, row)] == \
                   [p.tolist() for p in own.kept_positions(layer, 0)], (row, layer)
        assert cache.final_kv_bytes(row) == own.final_kv_bytes(0), row


KIVI2 = dict(quant_method="kivi", nbits=2, group_size=8, residual_length=8)
FEWER_BYTES = {
    "kvzip": dict(name="kvzip", budget=BUDGET),
    "adakv": dict(name="adakv", budget=BUDGET, window_size=4),
    "kivi2": dict(name="fullkv", **KIVI2),
    "decode_budget": dict(name="snapkv", budget=BUDGET, window_size=4, decode_budget=BUDGET, decode_interval=2),
    # keys before RoPE: the family's key rotation (Gemma3: one per layer type)
    "kvquant": dict(name="fullkv", quant_method="kvquant", group_size=8),
    "expected_attention": dict(name="expected_attention", budget=BUDGET, window_size=4),
}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_kvzip_adakv_kivi2_and_a_decode_budget_store_fewer_bytes_than_fullkv(model_type, tokenizer):
    """Each (and KVQuant and Expected Attention, which rotate keys outside the model) runs a greedy generate to the
    end and holds fewer bytes than fullkv after the same tokens (kvzip's
    repeat passes need the tokenizer's ids: the model's vocabulary is the tokenizer's). Mistral as v0.2 and later
    (no window); Gemma3's sliding layers refuse kvzip, whose repeats attend the whole prompt (on both lines)."""
    model = tiny(model_type, vocab_size=len(tokenizer), **({"sliding_window": None} if model_type == "mistral" else {}))
    prompt = ids(vocab=len(tokenizer))
    full = run(model, dict(name="fullkv"), prompt)[2].kv_bytes()
    for name, spec in FEWER_BYTES.items():
        if name == "kvzip" and any(windows(model)):
            with pytest.raises(ValueError, match="kvzip does not support sliding-window layers"):
                run(model, spec, prompt, tokenizer=tokenizer)
            continue
        cache = run(model, spec, prompt, tokenizer=tokenizer if name == "kvzip" else None)[2]
        assert cache.kv_bytes() < full, name
