"""Configurations keep their names across the capability refactor: for 332 configurations recorded with the
code before it (commit 67e8965: every method, alone and with each capability setting and pair of them), the
folder name, the label, the old canonical spec (it still parses to the same method) and the recorded
run_meta description (a results folder made then resumes now) are what they were.

Except the configurations issue 25 changed on purpose, each listed in tests/data/labels_issue25.json: one that
states another registered method's computation is named as that method (fullkv with cross_layer_merge=true is
minicache, snapkv with key channels is think), and one whose setting did nothing is refused (random_seed without
random_fraction, window_size on a method that keeps every token, a Quest budget below its page_min_count pages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyramidkv.methods import make_method, parse_method_spec
from pyramidkv.runner.labels import run_dir
from pyramidkv.runner.run_folder import fingerprint_differences

RECORD = json.loads((Path(__file__).parents[1] / "data" / "labels_67e8965.json").read_text(encoding="utf-8"))
CHANGED = json.loads((Path(__file__).parents[1] / "data" / "labels_issue25.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("entry", RECORD, ids=[f"{e['method']}-{i}" for i, e in enumerate(RECORD)])
def test_a_configuration_keeps_its_folder_label_spec_and_description(entry):
    changed = CHANGED.get(str(RECORD.index(entry)))
    if changed is not None and "refused" in changed:
        with pytest.raises(ValueError, match=changed["refused"]):
            make_method(entry["method"], **entry["settings"])
        return
    method = make_method(entry["method"], **entry["settings"])
    if changed is not None:   # named as the registered method it is: its label, folder and spec say so
        assert method.label() == changed["label"] != entry["label"]
        assert str(run_dir("s", "m", method)).endswith("/" + changed["label"])
        assert parse_method_spec(entry["spec"]) == method
        return
    assert method.label() == entry["label"]
    assert str(run_dir("s", "m", method)) == entry["folder"]
    assert parse_method_spec(entry["spec"]) == method
    stored = {"method": entry["describe"]}
    now = json.loads(json.dumps({"method": method.describe()}, default=str))
    added = ["page_budget_ratio", "decode_query_window", "proxy_causal", "head_allocation.safeguard"]   # since
    assert fingerprint_differences(stored, now, {}, [a for a in added if a in method.settings_at_default()]) == []


def test_the_record_covers_every_capability_setting():
    given = {name for entry in RECORD for name in entry["settings"]}
    assert {"num_sinks", "random_fraction", "random_seed", "decode_budget", "decode_interval", "key_channel_ratio",
            "key_recent_size", "key_query_window", "page_budget", "page_size", "page_min_count", "page_keep_last",
            "page_dense_layers", "page_selection", "cross_layer_merge", "cross_layer_start", "cross_layer_t",
            "cross_layer_retain"} <= given
    assert {"quest", "think", "minicache", "nacl", "streamingllm"} <= {entry["method"] for entry in RECORD}
