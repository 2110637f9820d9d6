"""Compression during decoding (decode_budget, decode_interval): the bound at every step, positions,
per-method decode scoring against hand-made or independent references, batches, bad input, CLI."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from pyramidkv import compress, load_model, make_method
from pyramidkv.generation import generate
from pyramidkv.methods.base import Method, ScoreContext
from pyramidkv.capabilities import DecodeBudget
from tests.prompts import STORY, passkey_prompt
from tests.helpers import ROOT, prefill


class StepObserver:
    """Calls `check(cache, step)` after every forward of the model (step 0 = the prefill)."""

    def __init__(self, model, check):
        self.step = 0
        self.check = check
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        self.check(kwargs["past_key_values"], self.step)
        self.step += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def expected_held(kept: int, steps: int, budget: int, interval: int) -> list[int]:
    """The firing rule written out: one token per step; a head reaching budget + interval goes back to budget."""
    held, out = kept, []
    for _ in range(steps):
        held += 1
        if held >= budget + interval:
            held = budget
        out.append(held)
    return out


BOUND_CASES = {
    # kept prompt 256 > 224: compressed at the first decode step
    "snapkv": (STORY * 2, dict(budget=256, window_size=32)),
    # kept prompt 128 < 192: grows to 224 first
    "h2o": (STORY, dict(budget=128, window_size=32)),
    "streamingllm": (STORY, dict(budget=64)),
}


@pytest.mark.parametrize("name", list(BOUND_CASES))
def test_300_new_tokens_never_hold_more_than_budget_plus_interval(random_llama, name):
    model, tokenizer, _ = random_llama  # the bound holds whatever the weights; 301 steps of SmolLM2 take 15 s
    prompt, settings = BOUND_CASES[name]
    n = len(tokenizer(prompt, add_special_tokens=False).input_ids)
    method = make_method(name, decode_budget=192, decode_interval=32, **settings)
    layers = model.config.num_hidden_layers
    kept = min(n, settings["budget"])
    kept = 192 if kept >= 224 else kept  # a kept prompt reaching the bound is re-selected right after prefill
    expected = [kept] + expected_held(kept, 300, 192, 32)
    window = method.window_size
    seen = []

    def check(cache, step):
        assert cache.get_seq_length() == n + step  # every token ever appended: true RoPE positions
        total = n + step
        for layer in range(layers):
            counts = cache.held_counts(layer)[0]
            assert max(counts) <= 224
            assert counts == [expected[step]] * model.config.num_key_value_heads, (layer, step)
            if layer not in (0, layers // 2, layers - 1):  # positions on three layers (time)
                continue
            for positions in cache.held_positions(layer):
                p = positions.tolist()
                assert p == sorted(set(p)) and p[-1] == total - 1
                assert p[len(p) - window:] == list(range(total - window, total))  # the recent window stays
                if name == "streamingllm":  # sinks + the most recent tokens, nothing else
                    assert p == [0, 1, 2, 3] + list(range(total - (len(p) - 4), total))
        seen.append(step)

    with StepObserver(model, check):
        generate(model, tokenizer, [prompt], method, 301, min_new_tokens=301)
    assert seen == list(range(301))
    assert expected.count(192) >= 3  # it did compress, repeatedly


@pytest.mark.parametrize("name,settings", [("snapkv", dict(budget=64, window_size=16)),
                                           ("h2o", dict(budget=64, window_size=16))])
def test_decode_budget_above_everything_changes_nothing(sharp_llama, name, settings):
    """Every step's logits, the text and the bytes equal the run without decode_budget (whatever the weights:
    sharp_llama, where a changed kept set moves the logits)."""
    model, tokenizer, _ = sharp_llama
    runs = []
    for method in (make_method(name, **settings), make_method(name, decode_budget=4096, **settings)):
        logits = []
        hook = model.register_forward_hook(lambda module, args, output: logits.append(output.logits[0, -1].clone()))
        try:
            out = generate(model, tokenizer, [STORY], method, 40, min_new_tokens=40)[0]
        finally:
            hook.remove()
        runs.append((logits, out))
    (plain_logits, plain), (large_logits, large) = runs
    assert len(large_logits) == len(plain_logits) == 40
    for got, expected in zip(large_logits, plain_logits):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert large.text == plain.text
    assert large.kv_bytes_per_prompt == plain.kv_bytes_per_prompt


@pytest.mark.parametrize("name,settings", [
    ("snapkv", dict(budget=128, window_size=16)),
    ("h2o", dict(budget=128, window_size=16, gqa_layout="query_head")),
    ("adakv", dict(budget=128, window_size=16)),  # ragged heads at prefill
], ids=["snapkv", "h2o-query_head", "adakv"])
def test_left_padded_batch_of_3_equals_single_runs(random_llama, name, settings):
    model, tokenizer, _ = random_llama  # a batch computes each prompt alone whatever the weights
    prompts = [passkey_prompt(41872, 12), STORY, passkey_prompt(90311, 0)]  # 364, 186, 76 tokens
    method = make_method(name, decode_budget=96, decode_interval=8, **settings)
    single = [generate(model, tokenizer, [p], method, 30, min_new_tokens=30)[0] for p in prompts]
    fired = []

    def check(cache, step):
        counts = cache.held_counts(0)
        assert max(max(c) for c in counts) <= 104
        fired.append(counts[2][0])

    with StepObserver(model, check):
        batch = generate(model, tokenizer, prompts, method, 30, min_new_tokens=30)
    assert fired[:3] == [76, 77, 78] and 96 in fired  # the whole-kept 76-token prompt too (at step 28)
    for s, b in zip(single, batch):
        assert b.text == s.text
        assert b.kv_bytes_per_prompt == s.kv_bytes_per_prompt


@dataclass(frozen=True)
class FirstTokensMethod(Method):
    """A user method with no decode_score of its own (keeps the earliest tokens at prefill)."""

    name = "first_tokens_test"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        n = ctx.keys.shape[2]
        return -torch.arange(n, dtype=torch.float32).expand(ctx.keys.shape[0], ctx.keys.shape[1], n)


@pytest.mark.parametrize("method", [
    make_method("pyramidkv", budget=128, window_size=16, decode_budget=64, decode_interval=8),
    make_method("zigzagkv", budget=128, window_size=16, decode_budget=64, decode_interval=8),  # layers deferred
    make_method("l2norm", budget=128, decode_budget=64, decode_interval=8),
    make_method("cam", budget=128, window_size=16, decode_budget=64, decode_interval=8),
    FirstTokensMethod(budget=128, window_size=16, decode=DecodeBudget(64, 8)),  # the default decode_score
], ids=["pyramidkv", "zigzagkv", "l2norm", "cam", "user-method"])
def test_other_methods_stay_within_the_bound(random_llama, method):
    model, tokenizer, _ = random_llama  # the bound and the window hold whatever the weights
    n = len(tokenizer(STORY, add_special_tokens=False).input_ids)
    layers = model.config.num_hidden_layers
    compressed = []

    def check(cache, step):
        assert cache.get_seq_length() == n + step
        for layer in range(layers):
            counts = cache.held_counts(layer)[0]
            assert max(counts) <= 72, (layer, step, counts)
            for positions in cache.held_positions(layer):
                if method.window_size:
                    assert positions[-method.window_size:].tolist() == list(range(n + step - method.window_size,
                                                                                   n + step))
        compressed.append(sum(cache.decoding.compressions))

    with StepObserver(model, check):
        generate(model, tokenizer, [STORY], method, 13, min_new_tokens=13)
    assert compressed[-1] > compressed[0] > 0  # after prefill, and again while decoding


# --- H2O: accumulated attention against eager attention weights ---------------------------------

def top_k_recent_first_reference(scores: np.ndarray, k: int) -> set[int]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], -i))
    return set(order[:k])


def test_h2o_keeps_heaviest_accumulated_attention_plus_recent_window(smollm2, smollm2_path):
    """A 40-token prompt kept whole (budget 128), decode_budget 64, interval 16, window 8: the first
    compression comes at decode step 40 (40 + 40 = 80 held). Until then nothing was evicted, so each
    token's accumulated attention is the column sum of the full causal attention of the 80 tokens,
    which the eager model returns; averaged over each GQA group (gqa_reduce mean)."""
    model, tokenizer = smollm2
    prompt = STORY[:200]
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    n = len(prompt_ids)
    assert n < 64
    method = make_method("h2o", budget=128, window_size=8, decode_budget=64, decode_interval=16)
    first_step = 80 - n
    snapshot = {}

    def check(cache, step):
        if step == first_step:
            assert cache.decoding.compressions == [1] * model.config.num_hidden_layers
            snapshot["held"] = [[p.tolist() for p in cache.held_positions(layer)]
                                for layer in range(model.config.num_hidden_layers)]
        elif step == first_step - 1:
            assert cache.decoding.compressions == [0] * model.config.num_hidden_layers

    with compress(model, method) as patch:
        cache = patch.new_cache()
        ids = torch.tensor([prompt_ids])
        with StepObserver(model, check), torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=first_step + 1, min_new_tokens=first_step + 1, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=tokenizer.eos_token_id)
    sequence = out[:, :80]  # prompt + the 40 tokens fed back by step 40
    eager, _ = load_model(smollm2_path, attn_implementation="eager", device="cpu")
    with torch.no_grad():
        attentions = eager(sequence, output_attentions=True).attentions
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    mismatches = 0
    for layer, attention in enumerate(attentions):
        column_sums = attention[0].double().numpy().sum(axis=1)  # [Hq, 80]
        per_kv_head = column_sums.reshape(cfg.num_key_value_heads, group, 80).mean(axis=1)
        for head in range(cfg.num_key_value_heads):
            scores = per_kv_head[head, :72]
            expected = top_k_recent_first_reference(scores, 56) | set(range(72, 80))
            got = set(snapshot["held"][layer][head])
            if got != expected:  # allowed only between near-equal scores (float noise of another kernel)
                mismatches += 1
                cut = np.sort(scores)[::-1]
                assert abs(cut[55] - cut[56]) < 1e-5, (layer, head, sorted(got ^ expected))
    assert mismatches <= 2


# --- merging evicted decode tokens ---------------------------------------------------------------

def test_merge_rule_folds_evicted_decode_tokens_without_changing_which_are_kept(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    feed = tokenizer(" The swarm went to the oak, and Marta recorded forty-one hives in her blue notebook today.",
                     add_special_tokens=False).input_ids[:12]
    states = {}
    for merge in (None, "pivot"):
        # The prompt (186 tokens) is kept whole at prefill, so nothing is merged before decoding.
        method = make_method("snapkv", budget=256, window_size=8, decode_budget=160, decode_interval=8,
                             **({"merge": merge} if merge else {}))
        with compress(model, method) as patch, torch.no_grad():
            cache = patch.new_cache()
            model(ids, past_key_values=cache, use_cache=True)  # 186 >= 168: re-selected right after prefill
            assert cache.held_counts(0)[0] == [160] * 3
            states[merge] = [(cache.held_positions(layer), cache.layers[layer].kept[0].values.clone())
                             for layer in range(model.config.num_hidden_layers)]
            for token in feed:
                model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                assert max(cache.held_counts(5)[0]) <= 168
    changed = 0
    for (positions, values), (merged_positions, merged_values) in zip(states[None], states["pivot"]):
        assert [p.tolist() for p in positions] == [p.tolist() for p in merged_positions]
        changed += not torch.equal(values, merged_values)
    assert changed == model.config.num_hidden_layers


# --- bad input, CLI, folder names, run_meta ------------------------------------------------------

@pytest.mark.parametrize("name,settings,message", [
    ("snapkv", dict(budget=128, decode_budget=16), r"decode_budget 16 is smaller than window_size 32"),
    ("h2o", dict(budget=128, window_size=8, decode_budget=0), r"decode_budget must be an integer >= 1 .*got 0"),
    ("snapkv", dict(budget=128, decode_budget=64, decode_interval=0), r"decode_interval must be an integer >= 1.*got 0"),
    ("snapkv", dict(budget=128, decode_interval=16), r"decode_interval=16 has no effect without decode_budget"),
    ("streamingllm", dict(budget=64, decode_budget=4), r"decode_budget 4 must exceed num_sinks 4"),
    ("fullkv", dict(decode_budget=256), r"fullkv keeps every token and has no scorer.*no decode_budget"),
])
def test_bad_decode_settings_are_refused(name, settings, message):
    with pytest.raises(ValueError, match=message):
        make_method(name, **settings)


def test_decode_settings_type_checked():
    with pytest.raises(TypeError, match=r"decode_budget must be an integer, got 12.5"):
        make_method("snapkv", budget=128, decode_budget=12.5)


@pytest.fixture
def no_model_load(monkeypatch):
    import pyramidkv
    import pyramidkv.models.loading as loading

    boom = lambda *a, **k: pytest.fail("the model was loaded before the bad input was found")  # noqa: E731
    monkeypatch.setattr(pyramidkv, "load_model", boom)
    monkeypatch.setattr(loading, "load_model", boom)


@pytest.mark.parametrize("flags,message", [
    (["--decode_budget", "16"], r"decode_budget 16 is smaller than window_size 32"),
    (["--decode_budget", "64", "--decode_interval", "0"], r"decode_interval must be an integer >= 1"),
])
def test_bad_decode_flags_fail_before_loading(flags, message, tmp_path, capsys, no_model_load,
                                                          smollm2_path):
    from pyramidkv.benchmarks.ruler.run import main as ruler_main

    data = tmp_path / "niah_single_1_256.jsonl"
    data.write_text(json.dumps({"index": 0, "input": "x", "outputs": ["1"], "length": 4, "max_new_tokens": 2}) + "\n")
    argv = ["--model_path", smollm2_path, "--method", "snapkv", "--max_capacity_prompts", "128", "--data_file",
            str(data), "--save_dir", str(tmp_path / "out"), "--device", "cpu", *flags]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ruler_main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage, then one error line
    import re

    assert "error:" in last and re.search(message, last), last
    assert not (tmp_path / "out").exists()


def test_flags_reach_the_method_folder_name_and_run_meta():
    from pyramidkv.runner.cli import add_model_and_method_args
    from pyramidkv.runner.labels import run_dir
    from pyramidkv.runner.method_args import method_from_args

    parser = argparse.ArgumentParser()
    add_model_and_method_args(parser)
    args = parser.parse_args(["--method", "h2o", "--max_capacity_prompts", "128", "--decode_budget", "256",
                              "--decode_interval", "64"])
    method = method_from_args(args)
    assert (method.decode_budget, method.decode_interval) == (256, 64)
    assert run_dir("s", "m", method) == Path("s/m_128/h2o_decode_budget=256_decode_interval=64")
    assert run_dir("s", "m", make_method("snapkv", budget=128, decode_budget=512)) == \
        Path("s/m_128/snapkv_decode_budget=512")
    described = method.describe()
    assert (described["decode_budget"], described["decode_interval"]) == (256, 64)
    plain = method_from_args(parser.parse_args(["--method", "h2o", "--max_capacity_prompts", "128"]))
    assert plain.decode_budget is None and run_dir("s", "m", plain) == Path("s/m_128/h2o")


@pytest.mark.parametrize("name", ["snapkv", "scissorhands"])
@pytest.mark.parametrize("budget, held_after_prefill", [(48, 40), (47, 47)])
def test_a_kept_prompt_exactly_at_the_bound_is_reselected_right_after_prefill(random_llama, name, budget,
                                                                              held_after_prefill):
    """decode_budget 40 + decode_interval 8: the bound is 48 and the rule fires at >= 48. A prompt kept at
    exactly 48 is re-selected to 40 before the first step (else the step's attention would read 49, over the
    bound); kept at 47 it is left alone (and grows to the bound first)."""
    model, tokenizer, _ = random_llama
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids[:, :120]
    method = make_method(name, budget=budget, window_size=8, decode_budget=40, decode_interval=8)
    cache = prefill(model, ids, method)
    for layer in range(model.config.num_hidden_layers):
        assert cache.held_counts(layer) == [[held_after_prefill] * model.config.num_key_value_heads], layer
