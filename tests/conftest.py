"""Shared fixtures: the real default model (converted once per machine) and a tiny random Llama."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

from pyramidkv.models.default_model import default_model_path


def pytest_configure(config):
    """Under pytest-xdist (`make test`: -n auto) each worker computes on one thread, and so do the runners it
    starts: one thread per core, where torch's default (every core, in every worker) makes them wait."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    # The C kernels are built (a compiler process, once per machine) before any test runs: the tier guard below
    # refuses processes inside a fast test.
    from pyramidkv.native import library
    library()


# ---------------------------------------------------------------------------------------------------- tiers
# The one place where tests get their tier (pyproject.toml registers the markers, --strict-markers refuses any
# other; tests/test_structure.py checks that no test file marks a tier itself and that every entry here names a
# test that exists). A test in no tier is in the fast one.
#   integration  starts processes (scripts, pip install, the SLURM cluster, notebooks), or runs a runner or the
#                leaderboard end to end several times over
#   real_model   computes with SmolLM2's weights (its tokenizer alone does not count)
#   exhaustive   a full product where a pairwise cover runs in the other tiers
# make test-fast: none of the three (the edit loop); make test (README, CI): all but exhaustive; make test-all.
TIERS: dict[str, tuple[str, ...]] = {
    "integration": (
        "tests/quantization/test_native_read.py::test_without_a_compiler_the_torch_ops_read_and_say_why",
        "tests/quantization/test_native_read.py::test_a_build_is_kept_and_reused",
        "tests/quantization/test_native_read.py::test_a_cache_folder_that_cannot_be_made_falls_back_to_the_temporary_directory",
        "tests/allocation/test_head_scores.py::test_script_both_kinds_naming",
        "tests/allocation/test_head_scores.py::test_script_on_default_model_reduced",
        "tests/sizing/test_threshold.py::test_a_runner_records_what_was_achieved",
        "tests/runner/test_declared_flags.py::test_a_selection_flag_only_chooses_which_samples_run",
        "tests/benchmarks/test_longbench_runner.py::test_end_to_end_run_then_eval",
        "tests/benchmarks/test_longbench_runner.py::test_eval_cli_refuses_a_repeated_id",
        "tests/benchmarks/test_longbench_runner.py::test_longbench_eval_sh_joins_source_path_and_uses_public_harness_settings",
        "tests/benchmarks/test_longbench_runner.py::test_resume_after_a_torn_write_has_no_duplicates",
        "tests/benchmarks/test_longbench_runner.py::test_ruler_and_needle_eval_sh_use_public_harness_settings",
        "tests/benchmarks/test_needle_runner.py::test_eval_sh",
        "tests/benchmarks/test_needle_runner.py::test_visualize_script_is_a_shim_of_the_module",
        "tests/benchmarks/test_ruler_run.py::test_eval_sh",
        "tests/benchmarks/test_ruler_run.py::test_resume_after_kill_9",
        "tests/benchmarks/test_reasoning_run.py::test_resume_after_kill_9_gives_the_same_rows",
        "tests/benchmarks/test_stop_tokens.py::test_the_run_passes_the_families_stops_to_generate_and_records_them",
        "tests/core/test_quantized_cache.py::test_benchmark_reports_bytes_by_part_and_the_fp16_ratio",
        "tests/core/test_quantized_cache.py::test_sweep_runs_quantized_variants_and_the_quantized_full_cache",
        "tests/leaderboard/test_leaderboard.py::test_a_failed_cell_is_recorded_not_dropped",
        "tests/leaderboard/test_reasoning_board.py::test_board_runs_every_cell_then_resumes_and_rerenders",
        "tests/leaderboard/test_reasoning_board.py::test_a_failed_unit_is_a_row_with_its_error_and_the_others_still_run",
        "tests/runner/test_run_integrity.py::test_a_second_run_into_a_locked_folder_fails_naming_the_holder",
        "tests/runner/test_run_integrity.py::test_disk_full_mid_run_keeps_completed_rows_and_says_so",
        "tests/runner/test_run_integrity.py::test_duplicate_prediction_rows_are_refused_not_scored_twice",
        "tests/runner/test_run_integrity.py::test_model_and_device_errors_are_one_line_before_loading",
        "tests/runner/test_run_integrity.py::test_ruler_rerun_with_other_settings_is_refused_or_gets_its_own_folder",
        "tests/scripts/test_benchmark_cli.py::test_every_measuring_script_runs_from_measure",
        "tests/scripts/test_benchmark_cli.py::test_merge_overhead_script_times_every_rule",
        "tests/scripts/test_script_checks.py::test_slurm_count_checks_every_run_of_the_grid",
        "tests/scripts/test_script_checks.py::test_sweep_reads_a_relative_save_dir_from_the_callers_folder",
        "tests/scripts/test_slurm_cluster.py",
        "tests/scripts/test_sweep_summary.py::test_slurm_array_index_runs_its_own_task",
        "tests/scripts/test_sweep_summary.py::test_summary_table_and_plot",
        "tests/scripts/test_sweep_summary.py::test_sweep_grid_has_fullkv_once_plus_methods_times_budgets",
        "tests/scripts/test_sweep_summary.py::test_sweep_lists_its_runs_once_for_the_summary",
        "tests/scripts/test_sweep_summary.py::test_sweep_runs_a_method_without_a_budget_once",
        "tests/scripts/test_sweep_summary.py::test_sweep_variants_run_each_method_and_budget_with_each_flag_set",
        "tests/test_install.py",
        "tests/tf5/test_runners.py",
        "tests/test_issue16_defects.py::test_a_sweep_with_one_invalid_variant_runs_nothing",
        "tests/test_issue16_defects.py::test_examples_refuse_a_bad_method_or_budget_in_one_line",
        "tests/test_issue16_defects.py::test_head_scores_checks_before_loading",
        "tests/test_issue16_defects.py::test_latency_benchmark_refuses_zero_counts",
        "tests/test_issue16_defects.py::test_teacher_forced_nll_needs_its_data_file",
        "tests/viz/test_viz.py::test_batch_generate_example",
        "tests/viz/test_viz.py::test_custom_method_example_matches_numpy_reference",
        "tests/viz/test_viz.py::test_notebook_runs_top_to_bottom_with_checked_figures",
        "tests/viz/test_viz.py::test_notebook_with_a_wrong_method_name_fails_with_the_notebooks_error",
        "tests/viz/test_viz.py::test_see_what_it_keeps_example_writes_the_readme_figures",
        "tests/viz/test_viz.py::test_sweep_and_plot_example",
        # no process, but a runner or the leaderboard end to end, several runs each (seconds, not milliseconds)
        "tests/benchmarks/test_needle_runner.py::test_resume_skips_finished_cells",
        "tests/benchmarks/test_reasoning_run.py::test_fullkv_then_a_decode_time_method",
        "tests/benchmarks/test_ruler_run.py::test_end_to_end_outputs_and_rescore",
        "tests/leaderboard/test_leaderboard.py::test_a_run_writes_every_cell_the_figure_and_the_page",
        "tests/leaderboard/test_leaderboard.py::test_two_shards_merged_equal_one_run",
        "tests/leaderboard/test_leaderboard.py::test_a_killed_unit_resumes_to_the_same_csv",
        "tests/leaderboard/test_leaderboard.py::test_a_folder_holding_another_grid_is_refused",
        "tests/leaderboard/test_leaderboard.py::test_a_cell_whose_budget_is_below_the_window_is_n_a_never_run",
        "tests/leaderboard/test_leaderboard.py::test_a_published_page_merged_with_a_new_ratio_keeps_its_cells",
        "tests/leaderboard/test_leaderboard.py::test_merge_published_refuses_another_grid_and_goes_with_publish",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[mistral-kvzip]",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[mistral-kvzip-uniform]",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[qwen2-kvzip]",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[qwen2-kvzip-uniform]",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[phi3-kvzip]",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[phi3-kvzip-uniform]",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[gemma2-kvzip]",
        "tests/methods/test_kvzip_layer_major.py::test_layer_major_keeps_what_two_forwards_keep[gemma2-kvzip-uniform]",
        "tests/runner/test_question_as_decode.py::test_fullkv_longbench_and_needle_predictions_do_not_change",
        "tests/runner/test_question_as_decode.py::test_fullkv_ruler_predictions_do_not_change",
        "tests/runner/test_shared_context_runner.py::test_a_later_run_answers_from_the_saved_compressed_contexts",
        "tests/runner/test_shared_context_runner.py::test_one_question_per_context_equals_question_as_decode",
        "tests/runner/test_shared_context_runner.py::test_saved_caches_are_kept_per_configuration_and_checked_against_their_context",
        "tests/runner/test_shared_context_runner.py::test_three_questions_resume_per_question_after_a_kill",
        # no process, but every combination of the matrices built (15,600 methods) to check that the pairwise cases
        # still cover every valid pair: tens of seconds, and they fail only when an axis gains a value
        "tests/core/test_batch_independence.py::test_the_cases_cover_every_pair",
        "tests/methods/test_matrix.py::test_the_cases_cover_every_pair",
        "tests/methods/test_matrix.py::test_every_method_and_unit_runs_in_some_combination",
        "tests/methods/test_matrix.py::test_every_refusal_is_one_line_and_some_case_meets_it",
        # 300 decode steps of three methods (the bound's short-run twins stay in the fast tier)
        "tests/core/test_decode_compression.py::test_300_new_tokens_never_hold_more_than_budget_plus_interval",
    ),
    "real_model": (
        "tests/benchmarks/test_reasoning_run.py::test_fullkv_and_a_decode_time_method_on_the_default_model",
        "tests/generation/test_generation.py::test_use_cache_false_runs_the_unpatched_attention",
        "tests/models/test_equivalence.py::test_fullkv_logits_equal_unpatched",
        "tests/models/test_equivalence.py::test_every_class_keeps_and_generates_what_llama_does",
        "tests/models/test_equivalence.py::test_no_state_leaks_between_generate_calls",
        "tests/models/test_equivalence.py::test_unpatch_restores_the_model",
        "tests/models/test_equivalence.py::test_decode_after_compression_equals_attention_over_the_kept_tokens",
        "tests/runner/test_run_integrity.py::test_a_second_run_into_a_locked_folder_fails_naming_the_holder",
        "tests/runner/test_run_integrity.py::test_disk_full_mid_run_keeps_completed_rows_and_says_so",
        "tests/runner/test_run_integrity.py::test_duplicate_prediction_rows_are_refused_not_scored_twice",
        "tests/runner/test_run_integrity.py::test_ruler_rerun_with_other_settings_is_refused_or_gets_its_own_folder",
        "tests/test_docs.py::test_readme_python_api_block_runs_as_written",
        "tests/viz/test_viz.py::test_batch_generate_example",
        "tests/viz/test_viz.py::test_see_what_it_keeps_example_writes_the_readme_figures",
        "tests/viz/test_viz.py::test_sweep_and_plot_example",
    ),
    "exhaustive": (
        "tests/methods/test_matrix.py::test_full_product_runs_within_its_budget_or_is_refused_in_one_line",
        # the engine snapshot's configurations beyond its cover, under the 5.x line (minutes on SmolLM2)
        "tests/tf5/test_engine_snapshot.py::test_every_other_configuration_too",
    ),
}
# Fixtures that load SmolLM2's weights: a test using one (directly or through another fixture) is real_model.
REAL_MODEL_FIXTURES = {"smollm2", "eager_setup"}
# The commands a test outside `integration` may start: the runners record the git commit, and the platform
# (platform.platform() asks `uname -p` for the processor once per process, so whichever test records first starts it).
ALLOWED_COMMANDS = {"git", "uname"}


def tier_markers(nodeid: str, fixturenames) -> set[str]:
    """The tiers of the test `nodeid` (path::name[params]) using these fixtures."""
    tiers = {tier for tier, prefixes in TIERS.items()
             if any(nodeid == p or nodeid.startswith(p + "[") or nodeid.startswith(p + "::") for p in prefixes)}
    if REAL_MODEL_FIXTURES & set(fixturenames):
        tiers.add("real_model")
    return tiers


def pytest_collection_modifyitems(config, items):
    """Marks each test's tiers, then runs the files holding integration tests first and those holding real_model
    tests next (each file kept whole, for its module fixtures): under xdist the long tests then start while other
    work remains to fill the other workers, instead of one of them running on alone at the end."""
    rank: dict[str, int] = {}
    for item in items:
        tiers = tier_markers(item.nodeid, item.fixturenames)
        for tier in tiers:
            item.add_marker(getattr(pytest.mark, tier))
        path = item.nodeid.split("::")[0]
        rank[path] = min(rank.get(path, 2), 0 if "integration" in tiers else 1 if "real_model" in tiers else 2)
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


@pytest.fixture(autouse=True)
def _tier_guard(request, monkeypatch):
    """A test outside `integration` that starts a process, or outside `real_model` that loads SmolLM2's weights,
    fails with a line saying where to list it (so the fast tier stays fast and its tests stay in it)."""
    marks = {m.name for m in request.node.iter_markers()}

    def where(tier: str) -> str:
        return f"{request.node.nodeid}: list it under {tier!r} in tests/conftest.py's TIERS"
    if "integration" not in marks:
        import subprocess

        popen_init = subprocess.Popen.__init__

        def refuse_processes(self, args, *rest, **kwargs):
            command = args if isinstance(args, str) else args[0]
            if os.path.basename(str(command).split()[0]) not in ALLOWED_COMMANDS:
                raise AssertionError(f"started {command!r}: " + where("integration"))
            popen_init(self, args, *rest, **kwargs)

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse_processes)
    if "real_model" not in marks:
        from transformers import PreTrainedModel

        from pyramidkv.models.default_model import default_model_cache_dir

        from_pretrained = PreTrainedModel.from_pretrained.__func__
        real = default_model_cache_dir().resolve()

        def refuse_real_weights(cls, path, *args, **kwargs):
            if os.path.isdir(str(path)) and os.path.realpath(path) == str(real):
                raise AssertionError("loaded SmolLM2's weights: " + where("real_model"))
            return from_pretrained(cls, path, *args, **kwargs)

        monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse_real_weights))


def pytest_terminal_summary(terminalreporter):
    """Near-ties (tests/near_ties.py): selections that rounding decided, counted, not failed."""
    ties = [(report.nodeid, text) for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "call" for name, text in getattr(report, "user_properties", [])
            if name == "near_tie"]
    if ties:
        terminalreporter.section(f"near-ties: {len(ties)} selections decided by float rounding (not disagreements)")
        for nodeid, text in ties:
            terminalreporter.line(f"{nodeid}: {text}")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The converted SmolLM2-135M-Instruct checkpoint (first use converts the GGUF, ~30 s)."""
    return str(default_model_path())


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer): SmolLM2 as LlamaForCausalLM, sdpa, float32, CPU."""
    from pyramidkv import load_model

    return load_model(smollm2_path, attn_implementation="sdpa", device="cpu")


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """SmolLM2's tokenizer alone (no weights loaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def formatter(tokenizer):
    """The RULER prompt formatter for SmolLM2 (chat template, no system turn)."""
    from pyramidkv.benchmarks.ruler.generate import PromptFormatter

    return PromptFormatter(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_path) -> str:
    """A 2-layer random Llama (GQA 4 query / 2 KV heads) with SmolLM2's tokenizer, saved as an HF directory.

    For end-to-end runner tests that must take seconds: the outputs are
    meaningless but every code path (tokenizer, template, cache, patch) is real.
    """
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    save_copy(tiny_llama(vocab=len(tokenizer), **FOR_SMOLLM2_TOKENIZER), out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def eager_setup(smollm2_path):
    """(eager model, ids, attentions, keys) of a ~400-token prompt: the material of the reference tests.

    attentions: per layer the [Hq, n, n] attention probabilities transformers returns; keys: per layer
    the [Hkv, n, D] post-RoPE keys of an ordinary DynamicCache (both float64 numpy)."""
    from pyramidkv import load_model
    from tests.prompts import STORY

    model, tokenizer = load_model(smollm2_path, attn_implementation="eager", device="cpu")
    ids = tokenizer(STORY * 2, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model(ids, output_attentions=True, use_cache=True)
    attentions = [a[0].double().numpy() for a in out.attentions]
    keys = [out.past_key_values[l][0][0].double().numpy() for l in range(len(attentions))]
    return model, ids, attentions, keys


@pytest.fixture(scope="session")
def random_llama(tokenizer, tmp_path_factory):
    """(model, tokenizer, tables): a 4-layer random Llama in memory (GQA 4 query / 2 KV heads, head_dim 16) with
    SmolLM2's tokenizer, and for it the tables the units that need one read: `head_scores` (HeadKV),
    `pattern_table` (MInference, every pattern kind on some head), `kvzap_path` (KVzap's predictor, made on it),
    `duo_pattern` (DuoAttention's gates), `qfilter_path` and `kvzip_head_path` (random calibration files).

    For properties that hold whatever the weights (a batch computes each prompt alone): a generate() takes
    milliseconds where SmolLM2's takes a second, and every code path is the same.
    """
    import json

    layers, heads = 4, 4
    model = tiny_llama(layers=layers, heads=heads, vocab=len(tokenizer), **FOR_SMOLLM2_TOKENIZER)
    config = model.config
    folder = tmp_path_factory.mktemp("random-llama-tables")
    generator = torch.Generator().manual_seed(1)
    head_scores = folder / "head_scores.json"
    head_scores.write_text(json.dumps({f"{layer}-{head}": [float(torch.rand(1, generator=generator))]
                                       for layer in range(layers) for head in range(heads)}))
    kinds = [["vertical_and_slash", 8, 16, 0.9], ["stream_llm", 4, 16, 0.9], ["block_sparse", 0, 0, 1.0]]
    patterns = folder / "patterns.json"
    patterns.write_text(json.dumps([{str(head): kinds[(layer + head) % 3] for head in range(heads)}
                                    for layer in range(layers)]))
    from tests.helpers import kvzap_artifact, write_calibrations

    kvzap = kvzap_artifact(model, folder / "kvzap-linear.safetensors")
    duo = folder / "full_attention_heads.tsv"   # DuoAttention's gates, 4 layers x 2 KV heads: 4 stream at share 0.5
    duo.write_text("0.9\t0.1\n0.2\t0.8\n0.7\t0.3\n0.1\t0.6\n")
    return model, tokenizer, {"head_scores": str(head_scores), "pattern_table": str(patterns), "kvzap_path": kvzap,
                              "duo_pattern": str(duo), **write_calibrations(folder, config)}


SHARP_STD = 0.2   # at transformers' default 0.02 attention is nearly flat: a dropped token moves no logit beyond 1e-2


@pytest.fixture(scope="session")
def sharp_llama(random_llama):
    """(model, tokenizer, tables): random_llama re-drawn with weights of std SHARP_STD, for properties checked by
    comparing outputs (the same logits, the same text) that must not hold vacuously: here a budget one token
    short of the prompt moves a decode step's logits by 0.2 or more, and greedy text depends on the prompt."""
    model, tokenizer, tables = random_llama
    config = model.config
    return tiny_llama(layers=config.num_hidden_layers, heads=config.num_attention_heads, vocab=config.vocab_size,
                      std=SHARP_STD, **FOR_SMOLLM2_TOKENIZER), tokenizer, tables


@pytest.fixture(scope="session")
def sharp_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """tiny_model_dir's Llama re-drawn with weights of std SHARP_STD, saved as an HF directory: for runner tests
    that compare predictions, which then depend on the prompt."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("sharp-llama")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    save_copy(tiny_llama(vocab=len(tokenizer), std=SHARP_STD, **FOR_SMOLLM2_TOKENIZER), out)
    tokenizer.save_pretrained(out)
    return str(out)


# ---- tiny random models: one cached factory ---------------------------------------------------------------------
# Not a fixture, so that module-level code and helpers reach it too: `from tests.conftest import tiny_llama`.

@functools.lru_cache(maxsize=None)
def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 96, std: float = 0.02,
               attn: str | None = "sdpa", seed: int = 0, family: str = "llama", **config):
    """A random eval model, hidden 64 (head_dim 16 with 4 heads), MLP 128, 512 positions: `layers` layers of
    `heads` query and `kv_heads` KV heads, `vocab` tokens, weights of std `std` drawn after torch.manual_seed(seed)
    (torch's global generator is left as it was), attention `attn` (None: transformers' choice). `family`: a
    model_type of MODEL_GLUE, built in its config class; `config`: any other config setting, over these.

    Cached by its settings (they must be hashable) and shared by every test that asks for the same: never change
    its weights or its config; copy it first (copy.deepcopy; save_copy to save it, as save_pretrained writes into
    the config). `tiny_llama.__wrapped__(...)` builds a fresh one."""
    from pyramidkv.models.patch import MODEL_GLUE

    glue = MODEL_GLUE[family]
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                    initializer_range=std)
    model_config = glue.config_class(**{**settings, **config}, attn_implementation=attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return glue.causal_lm(model_config).eval()


def save_copy(model, folder) -> None:
    """Save a copy of `model` as an HF directory (save_pretrained sets config.architectures and torch_dtype:
    a cached tiny_llama stays as it was)."""
    copy.deepcopy(model).save_pretrained(folder, safe_serialization=True)


# The tiny Llamas that run with SmolLM2's tokenizer (random_llama, tiny_model_dir): its special token ids, its
# rope_theta, tied embeddings (vocab=len(tokenizer) is given with them).
FOR_SMOLLM2_TOKENIZER = dict(max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=2, pad_token_id=2)
