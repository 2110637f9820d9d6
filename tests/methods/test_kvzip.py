"""KVzip: the repeat inputs against the authors' prompt wording, the scores against the model's own eager attention
over [prompt, repeat input] (the authors' restricted softmax and maxima taken in float64), the kept sets against one
threshold over every layer, head and context position, the bytes, that the repeat passes leave no trace, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.generation import generate
from tests.prompts import STORY

CHUNK = 64


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def test_repeat_inputs_are_the_authors_prompts_chunk_by_chunk(smollm2):
    """Chunk 0: the repeat instruction, the assistant header, the chunk; chunk c: the continuation instruction
    quoting the last 8 tokens of chunk c - 1, the header, the chunk. The template's system prefix and the closing
    header are protected, the context between them is cut into chunks of chunk_size."""
    _, tokenizer = smollm2
    text = STORY[:600]
    tokens = chat_prompt(tokenizer, text)
    plan = make_method("kvzip", budget_ratio=0.5, chunk_size=CHUNK).reconstruction([tokens], tokenizer).plans[0]
    header = "<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokens[:plan.prefix]).endswith("<|im_start|>user\n")
    assert tokenizer.decode(tokens[len(tokens) - plan.suffix:]) == header
    context = tokens[plan.prefix:len(tokens) - plan.suffix]
    assert tokenizer.decode(context) == text
    assert [(c.start - plan.prefix, c.stop - plan.prefix) for c in plan.chunks] == \
        [(s, min(s + CHUNK, len(context))) for s in range(0, len(context), CHUNK)]
    assert len(plan.chunks) >= 3
    first = plan.chunks[0]
    assert tokenizer.decode(first.ids) == "\n\nRepeat the previous context exactly." + header + \
        tokenizer.decode(context[:CHUNK])
    for c, chunk in enumerate(plan.chunks[1:], start=1):
        quoted = tokenizer.decode(context[c * CHUNK - 8:c * CHUNK])
        assert tokenizer.decode(chunk.ids) == "\n\nRepeat the part of the previous context exactly, starting with " + \
            quoted + header + tokenizer.decode(context[c * CHUNK:(c + 1) * CHUNK])


def reference_scores(model, tokens: list[int], plan) -> np.ndarray:
    """[L, Hq, n] from the model's own eager attention weights over the authors' text per chunk, [prefix, context,
    repeat input] (the suffix is not in their cache when it is scored): each chunk column's weight renormalised over
    K' = prefix + chunk + repeat (float64), maximised over the repeat's queries; 0 outside the context."""
    n, stop = len(tokens), len(tokens) - plan.suffix
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    scores = np.zeros((layers, heads, n))
    for chunk in plan.chunks:
        ids = torch.tensor([list(tokens[:stop]) + chunk.ids])
        with torch.no_grad():
            weights = model(ids, output_attentions=True, use_cache=False).attentions
        extent = np.zeros(ids.shape[1], dtype=bool)
        extent[:plan.prefix] = True
        extent[chunk.start:chunk.stop] = True
        extent[stop:] = True
        for layer, w in enumerate(weights):
            rows = w[0, :, stop:].double().numpy()                                # [Hq, m, stop + m]
            restricted = rows[..., extent] / rows[..., extent].sum(-1, keepdims=True)
            columns = np.flatnonzero(extent)
            inside = (columns >= chunk.start) & (columns < chunk.stop)
            scores[layer, :, chunk.start:chunk.stop] = restricted[..., inside].max(1)
    return scores


@pytest.fixture(scope="module")
def reconstructed(smollm2):
    """One prompt's scores by the engine and by the reference, and its kept sets in both GQA layouts."""
    model, tokenizer = smollm2
    tokens = chat_prompt(tokenizer, STORY[:900])
    out = {}
    for layout in ("kv_head", "query_head"):
        method = make_method("kvzip", budget_ratio=0.3, chunk_size=CHUNK, gqa_layout=layout)
        with torch.no_grad(), compress(model, method) as patch:
            cache = patch.new_cache([tokens], tokenizer)
            model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
        out[layout] = cache
    plan = out["kv_head"].reconstruction.plans[0]
    return tokens, plan, reference_scores(model, tokens, plan), out


def test_scores_equal_the_eager_reference(reconstructed):
    tokens, plan, expected, caches = reconstructed
    got = np.stack([caches["kv_head"].reconstruction.scores[layer][0].numpy() for layer in range(expected.shape[0])])
    context = slice(plan.prefix, len(tokens) - plan.suffix)
    np.testing.assert_allclose(got[..., context], expected[..., context], rtol=2e-4, atol=1e-6)
    assert np.all(got[..., :plan.prefix] == 0) and expected[..., context].max() > 0.1


@pytest.mark.parametrize("layout", ["kv_head", "query_head"])
def test_kept_sets_are_one_threshold_over_every_layer_head_and_position(smollm2, reconstructed, layout):
    """kv_head: a KV head's score is the maximum over its query group (the authors'); query_head: each query head
    its own. The best round(0.3 x context) x L x H context entries are kept, the prefix and suffix in every head,
    and the total is exact. Bytes: every kept token's key and value, float32."""
    model, _ = smollm2
    tokens, plan, expected, caches = reconstructed
    cache = caches[layout]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    scores = expected.reshape(expected.shape[0], -1, group, expected.shape[2]).max(2) if layout == "kv_head" \
        else expected
    layers, heads, n = scores.shape
    start, stop = plan.prefix, n - plan.suffix
    total = layers * heads * round(0.3 * (stop - start))
    flat = scores[..., start:stop].reshape(-1)
    threshold = np.sort(flat)[::-1][total - 1]
    protected = set(range(start)) | set(range(stop, n))
    kept_total = 0
    for layer in range(layers):
        for h, positions in enumerate(cache.kept_positions(layer)):
            kept = set(positions.tolist())
            assert protected <= kept
            context = kept - protected
            kept_total += len(context)
            for j in context ^ {j for j in range(start, stop) if scores[layer, h, j] > threshold}:
                assert scores[layer, h, j] == pytest.approx(threshold, rel=1e-4), (layer, h, j)
    assert kept_total == total
    counts = [len(p) for layer in range(layers) for p in cache.kept_positions(layer)]
    assert len(set(counts)) > 1      # ragged: layers and heads keep what their scores earn
    assert cache.kv_bytes() == sum(counts) * 2 * model.config.hidden_size // model.config.num_attention_heads * 4


@pytest.mark.parametrize("answer_prefix", ["", " The hives:"])
def test_the_default_protocol_keeps_the_context_entries_of_the_question_as_decode_protocol(smollm2, answer_prefix):
    """The same context with the template's suffix in the prompt (the default protocol; with an answer prefix after
    the assistant header, as RULER's prompts end) and fed after compression (--question_as_decode: the prompt ends
    with the context): the repeat passes read the same keys at the same
    positions, so the context scores agree to float32 rounding (1e-4) and the kept context entries are the same (a
    difference only at a score tied with the cut to 1e-4); the suffix is kept in every head."""
    model, tokenizer = smollm2
    text = STORY.split("\n", 1)[1].split("<|im_end|>")[0]              # the story's user text, no template
    tokens = chat_prompt(tokenizer, text) + tokenizer(answer_prefix, add_special_tokens=False).input_ids
    caches = {}
    for protocol, prompt in (("default", tokens), ("question_as_decode", None)):
        method = make_method("kvzip", budget_ratio=0.3, chunk_size=CHUNK)
        with torch.no_grad(), compress(model, method) as patch:
            if prompt is None:
                plan = caches["default"].reconstruction.plans[0]
                stop = len(tokens) - plan.suffix
                prompt = tokens[:stop]
            cache = patch.new_cache([prompt], tokenizer)
            model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        caches[protocol] = cache
    tail = len(tokenizer(answer_prefix, add_special_tokens=False).input_ids)
    assert plan.suffix == 6 + tail and caches["question_as_decode"].reconstruction.plans[0].suffix == 0
    default, later = caches["default"], caches["question_as_decode"]
    layers = model.config.num_hidden_layers
    got = np.stack([default.reconstruction.scores[layer][0, :, plan.prefix:stop].numpy() for layer in range(layers)])
    want = np.stack([later.reconstruction.scores[layer][0, :, plan.prefix:stop].numpy() for layer in range(layers)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)   # seen 1.4e-5: 30 layers, two prefill shapes
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    heads = want.reshape(layers, -1, group, want.shape[-1]).max(2)                      # [L, Hkv, context]
    threshold = np.sort(heads.reshape(-1))[::-1][layers * heads.shape[1] * round(0.3 * (stop - plan.prefix)) - 1]
    for layer in range(layers):
        for h, (mine, theirs) in enumerate(zip(default.kept_positions(layer), later.kept_positions(layer))):
            mine = set(mine.tolist())
            assert set(range(stop, len(tokens))) <= mine
            for j in (mine - set(range(stop, len(tokens)))) ^ set(theirs.tolist()):
                assert heads[layer, h, j - plan.prefix] == pytest.approx(threshold, rel=1e-4), (layer, h, j)


def test_repeat_passes_leave_no_trace(reconstructed):
    """After the repeat passes the cache holds prompt positions only, reports the prompt's length, and the
    tokens the passes ran are the repeat inputs'."""
    tokens, plan, _, caches = reconstructed
    cache = caches["kv_head"]
    assert cache.get_seq_length() == len(tokens)
    assert all(int(p.max()) < len(tokens) for layer in range(len(cache.layers)) for p in cache.held_positions(layer))
    assert cache.reconstruction.repeat_tokens == sum(len(c.ids) for c in plan.chunks)


def test_generation_decodes_from_the_compressed_context(smollm2):
    """A budget of the whole prompt keeps every context token: kvzip then generates what fullkv does (the repeat
    passes changed nothing the model reads)."""
    model, tokenizer = smollm2
    prompt = chat_prompt(tokenizer, STORY[:500] + "\n\nWho is the story about?")
    full = generate(model, tokenizer, [prompt], make_method("fullkv"), max_new_tokens=8)[0]
    kept = generate(model, tokenizer, [prompt], make_method("kvzip", budget=len(prompt), chunk_size=CHUNK),
                    max_new_tokens=8)[0]
    assert kept.text == full.text


@pytest.mark.parametrize("settings, message", [
    (dict(budget_ratio=0.5, chunk_size=0), "chunk_size must be an integer >= 1"),
    (dict(budget_ratio=0.5, window_size=8), "window_size must be 0"),
    (dict(budget_ratio=0.5, decode_budget=64), "kvzip does not combine with decode_budget"),
    (dict(budget_ratio=0.5, head_allocation="global", layer_allocation="pyramid"), "cannot be combined with"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message) as error:
        make_method("kvzip", **settings)
    assert "\n" not in str(error.value)


def test_a_prompt_with_no_context_is_refused(smollm2):
    model, tokenizer = smollm2
    template_only = chat_prompt(tokenizer, "")
    with pytest.raises(ValueError, match="prompt 0 .* has no context to reconstruct"):
        generate(model, tokenizer, [template_only], make_method("kvzip", budget_ratio=0.5), max_new_tokens=2)
