"""Every run is filed under what it really does (issue 25): a setting whose effective value makes its capability a
no-op, or makes it store more than the method without it, is refused with its reason, against the model's config
before any weight loads; a setting of a capability that is off is refused; and two command lines that run one
computation resolve to one folder. Expected values are worked by hand from the rules in docs/methods.md on
SmolLM2-135M (30 layers, 9 query / 3 KV heads, head_dim 64, float32 on CPU)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from pyramidkv.benchmarks.ruler import run as RU
from pyramidkv.methods import make_method
from pyramidkv.models.patch import model_shape

R = ["--context_lengths", "1024", "--num_samples", "1", "--tasks", "niah_single_1", "--device", "cpu"]


@pytest.fixture(scope="module")
def shape(smollm2_path):
    return model_shape(AutoConfig.from_pretrained(smollm2_path), 4)     # float32


def folder(smollm2_path, tmp_path, capsys, *argv) -> str:
    assert RU.main(["--model_path", smollm2_path, "--save_dir", str(tmp_path), *R, *argv, "--print_run_dir"]) == 0
    out = capsys.readouterr().out.split()[-1]
    return out[len(str(tmp_path)) + 1:]


def refused(smollm2_path, tmp_path, capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        RU.main(["--model_path", smollm2_path, "--save_dir", str(tmp_path), *R, *argv, "--print_run_dir"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


# --- item 3: settings that defeat the method --------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    # ThinK prunes floor(0.01 x 64) = 0 channels and would store its channel index on top.
    (["--method", "think", "--max_capacity_prompts", "128", "--key_channel_ratio", "0.01"],
     "prunes floor(0.01 x 64) = 0 of the model's 64 key channels"),
    (["--method", "think", "--max_capacity_prompts", "128", "--key_recent_size", "100000"],
     "key_recent_size 100000 keeps all 128 tokens"),
    # 1 channel of 64 on the 128 - 32 = 96 thin keys saves 96 x 4 = 384 bytes, its 63 int64 indices cost 504.
    (["--method", "think", "--max_capacity_prompts", "128", "--key_channel_ratio", "0.02"],
     "saves 384 bytes per head, no more than its 63-channel index costs (504 bytes)"),
    # Merged: 2D + 4 + r (4D + 16 / 4) values per token pair against 4D: r >= 124 / 260 = 0.4769 stores more.
    (["--method", "minicache", "--cross_layer_retain", "1.0"], "cross_layer_retain < 0.4769"),
    (["--method", "minicache", "--cross_layer_retain", "0.48"], "cross_layer_retain < 0.4769"),
    (["--method", "minference", "--start_layer", "30"], "start_layer 30 leaves none of the model's 30 layers"),
    (["--method", "quest", "--max_capacity_prompts", "16"], "page_budget 16 is below page_min_count 3 pages"),
    (["--method", "quest", "--max_capacity_prompts", "32"], "page_budget 32 is below page_min_count 3 pages"),
    (["--method", "quest", "--max_capacity_prompts", "50"], "reads floor(50 / 16) = 3 pages (48 tokens)"),
    # 0.01 of the 128 - 32 - 4 = 92 selected tokens is 0.92: none drawn.
    (["--method", "nacl", "--max_capacity_prompts", "128", "--random_fraction", "0.01"],
     "random_fraction 0.01 of the 92 tokens each head selects"),
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--page_budget", "992"],
     "page_budget 992 reads every page of the 128 tokens"),
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--page_budget", "1000"], "not a whole number of pages"),
])
def test_a_setting_that_defeats_its_capability_is_refused_before_loading(smollm2_path, tmp_path, capsys, argv,
                                                                         message):
    assert message in refused(smollm2_path, tmp_path, capsys, *argv)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv,expected", [
    # floor(0.05 x 64) = 3 channels on 96 thin keys: 96 x 3 x 4 = 1152 bytes saved > 61 x 8 = 488 of index.
    (["--method", "think", "--max_capacity_prompts", "128", "--key_channel_ratio", "0.05"],
     "_128/think_key_channel_ratio=0.05"),
    (["--method", "minicache", "--cross_layer_retain", "0.47"], "_full/minicache_cross_layer_retain=0.47"),
    (["--method", "quest", "--max_capacity_prompts", "48"], "_48/quest"),
    (["--method", "nacl", "--max_capacity_prompts", "128", "--random_fraction", "0.011"],
     "_128/nacl_random_fraction=0.011"),
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--page_budget", "96"], "_128/snapkv_page_budget=96"),
    (["--method", "minference", "--start_layer", "29"], "_full/minference_start_layer=29"),
])
def test_the_nearest_settings_that_do_something_run(smollm2_path, tmp_path, capsys, argv, expected):
    assert folder(smollm2_path, tmp_path, capsys, *argv).endswith(expected)


def test_prompt_dependent_no_ops_are_refused_on_the_prompt():
    """Checks that need the prompt's length (the runners make them on every sample before the weights load)."""
    with pytest.raises(ValueError, match="round\\(0.001 x 1024\\) = 1 tokens .* below page_min_count 3 pages"):
        make_method("quest", budget_ratio=0.001).check_prompt(1024)
    make_method("quest", budget_ratio=0.05).check_prompt(1024)       # 51 tokens: 3 pages
    with pytest.raises(ValueError, match="key_query_window 2000 is longer than the 1024-token prompt"):
        make_method("think", budget=128, key_query_window=2000).check_prompt(1024)
    make_method("think", budget=128, key_query_window=1024).check_prompt(1024)
    with pytest.raises(ValueError, match="proxy_size 2000 is longer than the 1024-token prompt"):
        make_method("nacl", budget=128, proxy_size=2000).check_prompt(1024)
    with pytest.raises(ValueError, match="last_q 2000 is longer than the 1024-token prompt"):
        make_method("minference", last_q=2000).check_prompt(1024)
    # A ratio budget: 0.1 of 1024 = 102 kept, 102 - 32 - 4 = 66 selected; 0.01 x 66 = 0.66 draws none.
    with pytest.raises(ValueError, match="random_fraction 0.01 of the 66 tokens"):
        make_method("nacl", budget_ratio=0.1, random_fraction=0.01).check_prompt(1024)
    with pytest.raises(ValueError, match="key_recent_size 200 keeps all 102 tokens"):
        make_method("think", budget_ratio=0.1, key_recent_size=200).check_prompt(1024)


def test_clamped_values_are_refused_against_the_model(shape):
    with pytest.raises(ValueError, match="key_query_window 100000 is longer than any prompt of this model"):
        make_method("think", budget=128, key_query_window=100000).check_model(shape)
    with pytest.raises(ValueError, match="last_q 100000 is longer than any prompt of this model"):
        make_method("minference", last_q=100000).check_model(shape)


def test_an_a_shape_entry_that_computes_nothing_is_refused(smollm2_path, tmp_path, shape):
    layers = [{str(h): ["stream_llm", 64, 64, 0.5] for h in range(shape.num_query_heads)}
              for _ in range(shape.num_layers)]
    layers[3]["2"] = ["stream_llm", 0, 0, 0.5]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(layers))
    with pytest.raises(ValueError, match="layer 3 head 2: stream_llm with vertical_size 0 and slash_size 0 computes "
                                         "no attention entry"):
        make_method("minference", pattern_table=str(path)).check_model(shape)


# --- item 4: settings of a capability that is off ---------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--key_recent_size", "16"],
     "has no effect without key_channel_ratio"),
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--key_query_window", "8"],
     "has no effect without key_channel_ratio"),
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--random_seed", "5"],
     "random_seed=5 has no effect without random_fraction"),
    (["--method", "quest", "--max_capacity_prompts", "128", "--window_sizes", "8"],
     "quest keeps every prompt token, so window_size has no effect"),
    (["--method", "fullkv", "--gqa_reduce", "max"], "fullkv keeps every prompt token, so gqa_reduce has no effect"),
    (["--method", "fullkv", "--page_budget", "128"], "fullkv with a page budget is quest"),
])
def test_a_setting_that_does_nothing_is_refused(smollm2_path, tmp_path, capsys, argv, message):
    assert message in refused(smollm2_path, tmp_path, capsys, *argv)


# --- items 4 and 5: one computation, one folder --------------------------------------------------------

@pytest.mark.parametrize("first,second", [
    (["--method", "minicache", "--cross_layer_merge", "false"], ["--method", "fullkv"]),
    (["--method", "minference", "--prefill_attention", "none"], ["--method", "fullkv"]),
    (["--method", "fullkv", "--cross_layer_merge"], ["--method", "minicache"]),
    (["--method", "minicache", "--cross_layer_start", "15"], ["--method", "minicache"]),   # 30 // 2: the default
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--key_channel_ratio", "0.4"],
     ["--method", "think", "--max_capacity_prompts", "128"]),
    (["--method", "snapkv:key_channel_ratio=0.5", "--max_capacity_prompts", "128"],
     ["--method", "think", "--max_capacity_prompts", "128", "--key_channel_ratio", "0.5"]),
    (["--method", "think", "--max_capacity_prompts", "128", "--key_channel_ratio", "0"],
     ["--method", "snapkv", "--max_capacity_prompts", "128"]),
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--layer_allocation", "pyramid"],
     ["--method", "pyramidkv", "--max_capacity_prompts", "128"]),
    (["--method", "snapkv", "--max_capacity_prompts", "128", "--kernel_sizes", "1", "--merge", "cam"],
     ["--method", "cam", "--max_capacity_prompts", "128"]),
    (["--method", "minference", "--cross_layer_merge"], ["--method", "minicache:prefill_attention=minference"]),
])
def test_two_command_lines_of_one_computation_share_one_folder(smollm2_path, tmp_path, capsys, first, second):
    assert folder(smollm2_path, tmp_path, capsys, *first) == folder(smollm2_path, tmp_path, capsys, *second)


def packaged(name: str) -> str:
    from pyramidkv.methods.calibrated import PACKAGED_DIR

    return str(PACKAGED_DIR / name)


@pytest.mark.parametrize("first,second", [
    (["--method", "kvzap", "--kvzap_path", packaged("smollm2-135m_kvzap-linear.safetensors")], ["--method", "kvzap"]),
    (["--method", "qfilter", "--max_capacity_prompts", "128", "--qfilter_path",
      packaged("smollm2-135m_qfilter.safetensors")], ["--method", "qfilter", "--max_capacity_prompts", "128"]),
    (["--method", "kvzip_head", "--max_capacity_prompts", "128", "--kvzip_head_path",
      packaged("smollm2-135m_kvzip-head.safetensors")], ["--method", "kvzip_head", "--max_capacity_prompts", "128"]),
    (["--method", "duo_attention", "--duo_pattern", packaged("smollm2-135m_duo")], ["--method", "duo_attention"]),
    (["--method", "duo_attention", "--duo_pattern", packaged("smollm2-135m_duo/full_attention_heads.tsv")],
     ["--method", "duo_attention"]),
])
def test_the_packaged_file_given_by_its_path_is_the_default(smollm2_path, tmp_path, capsys, first, second):
    """Issue 40, item 6: the packaged calibration file (or DuoAttention's folder, or its .tsv) named by its path is
    the file the method reads when none is given: one computation, the default's folder."""
    assert folder(smollm2_path, tmp_path, capsys, *first) == folder(smollm2_path, tmp_path, capsys, *second)


def test_another_file_than_the_packaged_one_keeps_its_own_folder(smollm2_path, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy.safetensors"
    shutil.copy(packaged("smollm2-135m_kvzap-linear.safetensors"), copy)
    assert "kvzap_kvzap_path=" in folder(smollm2_path, tmp_path, capsys, "--method", "kvzap", "--kvzap_path", str(copy))


def test_a_start_layer_other_than_the_default_keeps_its_own_folder(smollm2_path, tmp_path, capsys):
    assert folder(smollm2_path, tmp_path, capsys, "--method", "minicache", "--cross_layer_start", "14").endswith(
        "_full/minicache_cross_layer_start=14")


def test_the_canonical_method_is_the_same_computation():
    """The renamed method is built from the same settings: every field equal, only the class (its name) differs,
    and the class computes the same (same scorer and budget rules)."""
    import dataclasses

    given = make_method("snapkv", budget=128, layer_allocation="pyramid")
    assert type(given).__name__ == "PyramidKV"
    reference = make_method("pyramidkv", budget=128)
    assert {f.name: getattr(given, f.name) for f in dataclasses.fields(given)} == {
        f.name: getattr(reference, f.name) for f in dataclasses.fields(reference)}
    # A subclass with its own rules is never a rename: quest keeps its own name even at fullkv-like settings.
    assert make_method("quest", budget=64).name == "quest"


def test_a_budget_no_prompt_can_reach_is_refused(shape):
    """SmolLM2's window is 8192 tokens: a budget of 8192 or more never compresses a prompt (it is fullkv), and a
    decode budget whose bound no head can reach never re-selects."""
    with pytest.raises(ValueError, match="budget \\(max_capacity_prompts\\) 8192 is at least the model's context window"):
        make_method("snapkv", budget=8192).check_model(shape)
    make_method("snapkv", budget=8191).check_model(shape)
    with pytest.raises(ValueError, match="decode_budget 8180 \\+ decode_interval 32 = 8212 is more than a head can hold"):
        make_method("snapkv", budget=128, decode_budget=8180).check_model(shape)
    make_method("snapkv", budget=128, decode_budget=8160).check_model(shape)


def test_an_error_names_the_setting_it_is_about(smollm2_path, tmp_path, capsys):
    """The flags an error is prefixed with are those whose removal makes it go away: a budget given next to a
    wrong merge setting is not blamed."""
    err = refused(smollm2_path, tmp_path, capsys, "--method", "snapkv", "--max_capacity_prompts", "128", "--page_budget",
                  "992")
    assert "--page_budget 992: page_budget 992 reads every page" in err and "--max_capacity_prompts 128," not in err


# --- issue 40, item 4: settings that compress nothing, refused before the weights load -----------------------

@pytest.mark.parametrize("argv,message", [
    (["--method", "snapkv", "--compression_ratio", "0"], "--compression_ratio 0.0 removes nothing"),
    (["--method", "snapkv", "--compression_ratio", "5e-324"], "budget_ratio = 1 - 5e-324 rounds to 1"),
    *[(["--method", name, "--max_capacity_prompts_ratio", "1.0"],
       "budget_ratio (max_capacity_prompts_ratio) 1 keeps every prompt token") for name in
      ("snapkv", "keydiff", "kvzip", "kvzip_head")],
    (["--method", "quest", "--max_capacity_prompts_ratio", "1.0"], "page_budget_ratio must be in (0, 1)"),
    # round(0.99995 x 8192) = 8192: even a prompt as long as the window keeps every token
    (["--method", "snapkv", "--max_capacity_prompts_ratio", "0.99995"], "keeps round(0.99995 x 8192) = 8192 tokens"),
    (["--method", "duo_attention", "--streaming_share", "0"], "streaming_share 0: no head streams"),
    # SmolLM2's window is 8192 tokens: a streaming head holding 8192 keeps every token of any prompt.
    (["--method", "duo_attention", "--window_size", "8128"], "window_size 8128 + num_sinks 64 = 8192 tokens"),
    (["--method", "duo_attention", "--num_sinks", "9000"], "window_size 256 + num_sinks 9000 = 9256 tokens"),
    (["--method", "streamingllm", "--max_capacity_prompts_ratio", "0.5", "--window_size", "8188"],
     "window_size 8188 + num_sinks 4 = 8192 tokens"),
    # snapkv's default 0.0 kept every token ("kept 1.000"): no threshold fits every scorer.
    (["--method", "snapkv", "--head_allocation", "threshold", "--threshold_decoding", "false"],
     "threshold eviction on snapkv needs a threshold"),
    (["--method", "qfilter", "--head_allocation", "threshold"], "threshold eviction on qfilter needs a threshold"),
    (["--method", "qfilter", "--threshold_decoding", "true"], "threshold eviction on qfilter needs a threshold"),
    (["--method", "kvzap", "--threshold", "-1e308"], "threshold -1e+308 is at or below every score a scorer can give"),
    (["--method", "snapkv", "--threshold_decoding", "false", "--threshold",
      "-3.5e38"], "threshold -3.5e+38 is at or below every score"),
    (["--method", "kvzip_head", "--head_allocation", "threshold", "--threshold", "-1"],
     "every score of kvzip_head lies in [0, 1], so it would keep every token"),
    (["--method", "kvzip_head", "--head_allocation", "threshold", "--threshold", "0"],
     "every score of kvzip_head lies in [0, 1], so it would keep every token"),
    (["--method", "kvzip_head", "--head_allocation", "threshold", "--threshold", "1.5"],
     "so it would keep no token outside the window"),
])
def test_a_setting_that_compresses_nothing_is_refused_before_loading(smollm2_path, tmp_path, capsys, argv, message):
    assert message in refused(smollm2_path, tmp_path, capsys, *argv)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv,expected", [
    (["--method", "snapkv", "--compression_ratio", "0.01"], "/snapkv"),
    (["--method", "snapkv", "--max_capacity_prompts_ratio", "0.99"], "/snapkv"),
    (["--method", "snapkv", "--max_capacity_prompts_ratio", "1.0", "--decode_budget", "256"], "/snapkv_decode_budget=256"),
    (["--method", "duo_attention", "--streaming_share", "0.01"], "/duo_attention_streaming_share=0.01"),
    (["--method", "duo_attention", "--window_size", "8127"], "/duo_attention_window_size=8127"),
    (["--method", "kvzap"], "/kvzap"),                                             # its calibrated default, -3
    (["--method", "kvzap", "--threshold", "-8e37"], "/kvzap_threshold=-8e+37"),
    (["--method", "kvzip_head", "--head_allocation", "threshold", "--threshold", "1"],
     "/kvzip_head_threshold=1_head_allocation=uniform"),
    (["--method", "kvzip_head", "--head_allocation", "uniform", "--threshold", "1"],
     "/kvzip_head_threshold=1_head_allocation=uniform"),
    (["--method", "snapkv", "--threshold_decoding", "false", "--threshold", "0"],
     "/snapkv_threshold=0_threshold_decoding=False"),
])
def test_the_nearest_settings_that_compress_run(smollm2_path, tmp_path, capsys, argv, expected):
    assert expected in folder(smollm2_path, tmp_path, capsys, *argv)


def test_a_streaming_share_that_makes_no_head_stream_is_refused_on_the_model(shape):
    """argsort streams the round(L x Hkv x share) lowest gates: on SmolLM2's 30 x 3 = 90 heads a share of 0.005
    rounds to none."""
    with pytest.raises(ValueError, match="streaming_share 0.005 makes no head of the model's 90 KV heads stream"):
        make_method("duo_attention", streaming_share=0.005, duo_selection="argsort").check_model(shape)
    make_method("duo_attention", streaming_share=0.006, duo_selection="argsort").check_model(shape)
