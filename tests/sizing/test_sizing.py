"""The sizing unit: each kind's per-prompt count, folder part and recorded value against hand-worked cases; the
kind chosen by the setting given; specs round-trip; records made while threshold eviction was a head allocation
still match (a killed kvzap run resumes); 16:1 and 32:1 are ratios like any other."""

from __future__ import annotations

import json

import pytest

from pyramidkv.methods import budget_flag_applies, get_method_class, make_method, method_spec, parse_method_spec
from pyramidkv.runner.cli import recorded_budget, run_dir
from pyramidkv.runner.run_folder import fingerprint_differences
from pyramidkv.sizing import KeepAll, Ratio, Threshold, Tokens


@pytest.mark.parametrize("spec, kind, counts, folder, recorded", [
    # counts: {prompt length: tokens per head}, worked out by hand from the rule of each kind
    ("snapkv:budget=128", Tokens, {100: 128, 4096: 128}, "m_128", 128),
    ("snapkv:budget_ratio=0.25", Ratio, {4096: 1024, 1000: 250, 130: 32}, "m_r0.25", "r0.25"),   # 32.5 -> 32
    ("snapkv:budget_ratio=0.0625", Ratio, {4096: 256, 1024: 64}, "m_r0.0625", "r0.0625"),        # 16:1
    ("snapkv:compression_ratio=0.96875,window_size=8", Ratio, {4096: 128, 1024: 32}, "m_r0.03125", "r0.03125"),  # 32:1
    ("fullkv", KeepAll, {100: 100, 4096: 4096}, "m_full", None),
    ("quest:budget=64", KeepAll, {100: 100}, "m_64", 64),             # the page unit reads the budget per step
    ("quest:budget_ratio=0.25", KeepAll, {100: 100}, "m_r0.25", "r0.25"),
    ("kvzap", Threshold, {4096: 0}, "m_threshold", "threshold"),     # no sinks: every token may go
    ("duo_attention", Threshold, {4096: 64}, "m_threshold", "threshold"),   # its 64 sinks stay
])
def test_each_kind_counts_names_and_records_its_budget(spec, kind, counts, folder, recorded):
    method = parse_method_spec(spec)
    assert type(method.sizing) is kind
    assert {n: method.prompt_budget(n) for n in counts} == counts
    assert run_dir("s", "m", method).parent.name == folder
    assert method.sizing.recorded(method) == recorded
    assert recorded_budget({"method_spec": method_spec(method)}) == recorded
    assert parse_method_spec(method_spec(method)) == method


@pytest.mark.parametrize("settings, kind", [
    (dict(budget=256), Tokens), (dict(budget_ratio=0.5), Ratio), (dict(threshold=-4.0), Threshold),
    (dict(threshold_decoding=False), Threshold),
])
def test_the_setting_given_chooses_the_kind_over_the_default(settings, kind):
    """kvzap's default is a threshold; a budget makes it kvzap at that budget, a threshold keeps the kind."""
    method = make_method("kvzap", **settings)
    assert type(method.sizing) is kind
    assert method.sizing.settings().items() >= settings.items()
    assert method.head_allocation.name == "uniform"


def test_two_kinds_at_once_are_refused_in_one_line():
    for settings, fragment in ((dict(budget=64, budget_ratio=0.5), "snapkv needs exactly one of budget"),
                               (dict(budget=64, threshold=0.1), "budget is an outcome")):
        with pytest.raises(ValueError, match=fragment) as error:
            make_method("snapkv", **settings)
        assert "\n" not in str(error.value)


def test_the_budget_flag_applies_where_the_sizing_takes_it():
    """--max_capacity_prompts sets snapkv's budget and quest's page budget, not fullkv's or kvzap's (a threshold)."""
    takes = {name: budget_flag_applies(get_method_class(name)) for name in ("snapkv", "quest", "fullkv", "kvzap",
                                                                          "duo_attention", "minicache")}
    assert takes == {"snapkv": True, "quest": True, "fullkv": False, "kvzap": False, "duo_attention": False,
                     "minicache": False}
    assert budget_flag_applies(get_method_class("kvzap"), {"head_allocation": "uniform"}) is False
    assert budget_flag_applies(get_method_class("snapkv"), {"threshold": 0.1}) is False


# run_meta.json's method section of kvzap and of a snapkv threshold run, as recorded before this change.
OLD_KVZAP = {"method": "kvzap", "budget": None, "budget_ratio": None, "window_size": 128, "gqa_layout": "kv_head",
             "gqa_reduce": "mean", "head_allocation": {"name": "threshold", "threshold": -4.0,
                                                       "threshold_decoding": True}}
OLD_SNAPKV = {"method": "snapkv", "budget": None, "budget_ratio": None, "window_size": 8, "gqa_layout": "kv_head",
              "gqa_reduce": "mean", "head_allocation": {"name": "threshold", "threshold": 0.3,
                                                        "threshold_decoding": False}}


@pytest.mark.parametrize("old, spec", [(OLD_KVZAP, "kvzap:threshold=-4"),
                                       (OLD_SNAPKV, "snapkv:head_allocation=threshold,threshold=0.3,"
                                                    "threshold_decoding=false,window_size=8")])
def test_a_record_from_when_threshold_was_a_head_allocation_still_matches(old, spec):
    method = parse_method_spec(spec)
    now = json.loads(json.dumps(method.describe(), default=str))
    shared = {k: now[k] for k in now if k not in old and k not in ("head_allocation", "threshold",
                                                                    "threshold_decoding")}
    assert fingerprint_differences({"method": {**old, **shared}}, {"method": now}) == []
    other = {**old, "head_allocation": {**old["head_allocation"], "threshold": 0.25}}
    assert fingerprint_differences({"method": {**other, **shared}}, {"method": now}) == \
        [f"method.threshold: 0.25 -> {method.sizing.threshold!r}"]
