"""Method settings: checked by type and range at construction, immutable afterwards; a spec giving one setting
twice refused; PyramidKV's budgets on short prompts; the CLI flags for the new settings."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from pyramidkv import compress, make_method
from tests.prompts import STORY


@pytest.mark.parametrize("name,settings,message", [
    ("snapkv", dict(budget_ratio="0.5"), r"budget_ratio \(max_capacity_prompts_ratio\) must be a finite number, got '0.5'"),
    ("snapkv", dict(budget=128, kernel_size=True), r"kernel_size must be an integer, got True \(bool\)"),
    ("snapkv", dict(budget=128, window_size=8.0), r"window_size must be an integer, got 8.0"),
    ("snapkv", dict(budget=128, pooling=1), r"pooling must be a string, got 1"),
    ("pyramidkv", dict(budget=128, beta="x"), r"beta must be a finite number, got 'x'"),
    ("pyramidkv", dict(budget=128, beta=float("nan")), r"beta must be a finite number, got nan"),
    ("pyramidkv", dict(budget=128, beta=float("inf")), r"beta must be a finite number, got inf"),
    ("streamingllm", dict(budget=128, num_sinks="4"), r"num_sinks must be an integer, got '4'"),
    ("l2norm", dict(budget=128, skip_layers=False), r"skip_layers must be an integer, got False"),
])
def test_wrong_types_are_refused_at_construction(name, settings, message):
    with pytest.raises(TypeError, match=message):
        make_method(name, **settings)


def test_range_errors_for_new_settings():
    with pytest.raises(ValueError, match="gqa_pooling must be one of after_reduce|before_reduce, got 'first'"):
        make_method("snapkv", budget=128, gqa_pooling="first")
    with pytest.raises(ValueError, match="skip_layers must be an integer >= 0"):
        make_method("l2norm", budget=128, skip_layers=-1)


@pytest.mark.parametrize("spec, named", [
    ("snapkv:budget=64,budget=32", "budget"),                                                 # two values
    ("snapkv:budget=64,window_size=8,window_size=8", "window_size"),                          # the same value
    ("snapkv:budget=64,head_allocation=global,score_scale=raw,score_scale=zscore", "score_scale"),   # a unit's
])
def test_a_spec_giving_one_setting_twice_is_refused(spec, named):
    """A spec is one value per setting: one written twice is refused in one line naming it, not read as the last."""
    from pyramidkv.methods import parse_method_spec

    with pytest.raises(ValueError, match=re.escape(f"method spec '{spec}': {named} is given twice")) as error:
        parse_method_spec(spec)
    assert "\n" not in str(error.value)


def test_methods_are_immutable_and_replace_revalidates():
    method = make_method("snapkv", budget=128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        method.kernel_size = 4
    variant = dataclasses.replace(method, kernel_size=5, pooling="avg")
    assert (variant.kernel_size, variant.pooling, method.kernel_size) == (5, "avg", 7)
    with pytest.raises(ValueError, match="kernel_size must be a positive odd integer, got 4"):
        dataclasses.replace(method, kernel_size=4)
    assert hash(method) == hash(make_method("snapkv", budget=128))  # usable as a key (e.g. a cache of runs)


def test_ints_are_accepted_where_floats_are_expected():
    assert make_method("pyramidkv", budget=128, beta=10).layer_allocation.beta == 10
    assert make_method("snapkv", budget_ratio=1, decode_budget=64).prompt_budget(100) == 100   # 1: with a decode budget


# --- PyramidKV on short prompts ---------------------------------------------------------------

def pyramid_reference(budget: int, window: int, beta: float, num_layers: int, n: int) -> list[int]:
    """The public code's rule, with exact largest-remainder apportionment: uniform below 2 s;
    otherwise max = min(2 s - s / beta, n - window), min = 2 s - max, linear over the layers."""
    s = budget - window
    if n < 2 * s:
        return [budget] * num_layers
    high = min(2 * s - s / beta, n - window)
    low = 2 * s - high
    exact = np.linspace(high, low, num_layers)
    counts = np.floor(exact + 1e-9).astype(int)
    missing = num_layers * s - counts.sum()
    order = np.lexsort((np.arange(num_layers), -np.round(exact - counts, 9)))
    counts[order[:missing]] += 1
    return [window + int(c) for c in counts]


@pytest.mark.parametrize("n", [129, 191, 192, 193, 200, 219, 220, 1000])
def test_pyramid_budgets_on_short_prompts(n):
    method = make_method("pyramidkv", budget=128)  # window 32, s = 96: 2 s = 192
    budgets = method.layer_budgets(128, 30, n)
    assert sum(budgets) == 30 * 128                # exact in every regime
    assert max(budgets) <= n                       # no layer asks for more than the prompt
    assert budgets == pyramid_reference(128, 32, 20.0, 30, n)
    if n < 192:
        assert budgets == [128] * 30               # the public fallback: uniform
    else:
        assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]


def test_pyramid_short_prompt_keeps_the_exact_total_in_the_cache(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    n = ids.shape[1]
    budget = 100                                   # s = 68: 2 s = 136 <= n < 200 -> capped pyramid
    assert 2 * (budget - 32) <= n
    with compress(model, make_method("pyramidkv", budget=budget)) as patch:
        cache = patch.new_cache()
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
    counts = [cache.kept_counts(layer)[0] for layer in range(model.config.num_hidden_layers)]
    per_layer = [c[0] for c in counts]
    assert all(len(set(c)) == 1 for c in counts)
    assert sum(per_layer) == model.config.num_hidden_layers * budget   # 3000, not less
    assert per_layer == pyramid_reference(budget, 32, 20.0, model.config.num_hidden_layers, n)


def test_cli_accepts_the_new_settings():
    from pyramidkv.runner.cli import add_model_and_method_args
    from pyramidkv.runner.method_args import method_from_args
    import argparse

    parser = argparse.ArgumentParser()
    add_model_and_method_args(parser)
    args = parser.parse_args(["--method", "snapkv", "--max_capacity_prompts", "64", "--gqa_pooling", "before_reduce"])
    assert method_from_args(args).gqa_pooling == "before_reduce"
    args = parser.parse_args(["--method", "l2norm", "--max_capacity_prompts", "64", "--skip_layers", "0"])
    assert method_from_args(args).skip_layers == 0
