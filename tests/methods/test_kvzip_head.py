"""KVzip's head-level variant: the head-score table against kvzip's own pair scores (computed here through kvzip's
public path and reduced here: max over the query group and the positions, max over samples), and what a head keeps
with head scores written by hand: under a threshold all or none of its tokens, under the global budget the best
heads whole and one boundary head its most recent tokens; refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from pyramidkv.methods.calibrated import model_record, save_artifact
from pyramidkv.models.patch import model_shape
from tests.helpers import ROOT, load_script, prefill
from tests.prompts import STORY

SCRIPT = load_script("kvzip_head_scores", ROOT / "scripts" / "kvzip_head_scores.py")
CHUNK = 32


def chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def test_head_scores_are_the_maxima_of_kvzips_pair_scores(sharp_llama):
    """[L, Hkv] = max over samples of (max over the group and the context positions of kvzip's scores); each sample
    is the larger somewhere, so the maximum over samples is exercised."""
    model, tokenizer, _ = sharp_llama
    samples = [chat(tokenizer, STORY[:250]), chat(tokenizer, STORY[250:500])]
    got = SCRIPT.head_scores(model, tokenizer, samples, CHUNK).numpy()
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    per_sample = []
    for tokens in samples:
        cache = prefill(model, torch.tensor([tokens]), make_method("kvzip", budget_ratio=0.3, chunk_size=CHUNK),
                        tokenizer=tokenizer)
        scores = np.stack([cache.reconstruction.scores[layer][0].numpy() for layer in range(layers)])   # [L, Hq, n]
        plan = cache.reconstruction.plans[0]
        context = scores[..., plan.prefix:len(tokens) - plan.suffix]
        per_sample.append(context.reshape(layers, kv_heads, -1).max(-1))
    np.testing.assert_allclose(got, np.maximum(*per_sample), rtol=1e-6)
    assert (per_sample[0] > per_sample[1]).any() and (per_sample[1] > per_sample[0]).any()


@pytest.fixture(scope="module")
def hand_table(tmp_path_factory, random_llama):
    """(file, table): head scores [4 layers, 2 KV heads] chosen by hand (all distinct) for random_llama."""
    model = random_llama[0]
    table = torch.tensor([[0.9, 0.1], [0.3, 0.8], [0.5, 0.2], [0.05, 0.7]])
    folder = tmp_path_factory.mktemp("kvzip-head")
    record = {"kind": "kvzip-head", "model": model_record(str(folder / "none"), model.config)}
    return str(save_artifact(folder / "heads.safetensors", {"head_scores": table}, record)), table


def kept(model, method, tokens) -> list[list[set[int]]]:
    method.check_model(model_shape(model.config))
    cache = prefill(model, torch.tensor([tokens]), method)
    return [[set(p.tolist()) for p in cache.kept_positions(layer)] for layer in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("threshold", [0.25, 0.6])
def test_under_a_threshold_a_head_keeps_all_or_none_of_its_tokens(random_llama, hand_table, threshold):
    """Outside the window a head scored >= threshold keeps every token, one below none; the window stays. While
    decoding (threshold decoding) each generated token is decided the same way when it leaves the window."""
    model, tokenizer, _ = random_llama
    path, table = hand_table
    tokens = chat(tokenizer, STORY[:200])
    n, window, steps = len(tokens), 4, 6
    method = make_method("kvzip_head", head_allocation="threshold", threshold=threshold, window_size=window,
                         kvzip_head_path=path)
    with torch.no_grad(), compress(model, method) as patch:
        cache = patch.new_cache()
        out = model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
        after_prefill = [[set(p.tolist()) for p in cache.held_positions(layer)] for layer in range(len(table))]
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    for layer in range(len(table)):
        for head, held in enumerate(cache.held_positions(layer)):
            passes = bool(table[layer, head] >= threshold)
            assert after_prefill[layer][head] == set(range(0 if passes else n - window, n)), (layer, head)
            assert set(held.tolist()) == set(range(0 if passes else n + steps - window, n + steps)), (layer, head)


def test_the_global_budget_keeps_the_best_heads_whole(random_llama, hand_table):
    """L x H x budget selected tokens over all heads: the heads in score order keep all n tokens while the total
    allows, the next head its most recent remaining share, the others nothing (window 0: no token is protected)."""
    model, tokenizer, _ = random_llama
    path, table = hand_table
    tokens = chat(tokenizer, STORY[:200])
    n = len(tokens)
    budget = n // 2 - 3                                   # 8 heads x budget: 3 whole heads and part of a 4th
    total = table.numel() * budget
    method = make_method("kvzip_head", budget=budget, kvzip_head_path=path)
    held = kept(model, method, tokens)
    order = sorted(((float(table[l, h]), l, h) for l in range(table.shape[0]) for h in range(table.shape[1])),
                   reverse=True)
    left = total
    for _, layer, head in order:
        share = min(left, n)
        assert held[layer][head] == set(range(n - share, n)), (layer, head, share)
        left -= share
    assert 0 < total - 3 * n < n


@pytest.mark.parametrize("settings, message", [
    (dict(budget=64, merge="pivot"), "may keep none of a head's tokens"),
    (dict(budget=64, kvzip_head_path="/nonexistent.safetensors"), "no such file"),
])
def test_bad_settings_are_refused_in_one_line(random_llama, settings, message):
    with pytest.raises(ValueError) as refused:
        make_method("kvzip_head", **settings).check_model(model_shape(random_llama[0].config))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("argv, message", [
    (["--chunk_size", "0"], "--chunk_size must be >= 1, got 0"),
    (["--num_samples", "400", "--haystack_dir", str(ROOT / "docs")], "fewer than --num_samples 400 x --length 2000"),
    (["--length", "9000"], "beyond the model's 8192"),
])
def test_the_script_refuses_bad_input_in_one_line(argv, message, capsys, smollm2_path):
    """Before the weights load: `kvzip_head_scores.py: error: ...`, exit status 2."""
    with pytest.raises(SystemExit) as exited:
        SCRIPT.main(["--model_path", smollm2_path, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and "kvzip_head_scores.py: error: " in err[-1] and message in err[-1]


def test_a_calibration_sample_holds_exactly_length_essay_tokens_in_one_repeat_chunk(sharp_llama, tmp_path):
    """The sample is the template's prefix, the essays' first `length` token ids as they are, the template's
    suffix: kvzip reads a context of exactly `length` tokens, one repeat chunk at chunk_size = length (a decoded and
    re-encoded slice gets another count: the shipped file's 2,000-token sample had become 2,001, two chunks)."""
    from pyramidkv.methods.kvzip import template_edges

    tokenizer = sharp_llama[1]
    texts = ["Bees kept on the hill; the hives counted each spring, 41 of them in a blue notebook. " * 6,
             "Osei's shelf of notebooks: rainfall, lambs, the day the river froze. " * 6]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    essay = [t for text in texts for t in tokenizer(text + "\n\n", add_special_tokens=False).input_ids]
    samples, sources = SCRIPT.calibration_samples(tokenizer, tmp_path, 2, 77)
    prefix, suffix = template_edges(tokenizer)
    assert prefix and suffix and [s["file"] for s in sources] == ["0.txt", "1.txt"]
    for i, sample in enumerate(samples):
        assert sample == prefix + essay[i * 77:(i + 1) * 77] + suffix
        plan = make_method("kvzip", budget_ratio=0.5, chunk_size=77).reconstruction([sample], tokenizer).plans[0]
        assert (plan.prefix, plan.suffix, len(plan.chunks)) == (len(prefix), len(suffix), 1)
