"""What each benchmark adapter declares of its own flags (runner/protocol.py's Benchmark): `selection_args`, the
flags that only choose which samples run, and `scoring_args`, left out of the run's fingerprint beside the runner's
own (run_folder.NON_GENERATING_ARGS); run_folder.py names no benchmark flag. And --questions_per_context, checked
once by the adapter and once where the samples are built."""

from __future__ import annotations

import json

import pytest

from pyramidkv.benchmarks.longbench.run import LongBench
from pyramidkv.benchmarks.needle.run import Needle
from pyramidkv.benchmarks.reasoning.run import Reasoning
from pyramidkv.benchmarks.ruler.run import Ruler
from pyramidkv.runner.method_args import method_from_args
from pyramidkv.runner.protocol import build_parser, not_generating_args
from pyramidkv.runner.run_folder import (
    NON_GENERATING_ARGS, RUN_META, RunFolderError, fingerprint_differences, open_run_folder, run_fingerprint,
)
from tests.helpers import longbench_data_dir

# run_folder.NON_GENERATING_ARGS as it was before the adapters declared their own (issue 41): one table naming
# every benchmark's flags. Each runner's fingerprint must leave out exactly what it left out then, so that a run
# folder made then resumes.
NON_GENERATING_BEFORE = {
    "save_dir", "overwrite", "num_threads", "decode_threads", "eval", "print_run_dir", "prepare_only",
    "eval_batch_size", "num_samples", "max_num_examples", "tasks", "context_lengths", "datasets", "s_len", "e_len",
    "step", "num_depths", "questions_per_context", "save_compressed", "load_compressed",
}
ADAPTERS = {"ruler": Ruler, "longbench": LongBench, "needle": Needle, "reasoning": Reasoning}


def _dests(benchmark) -> set[str]:
    return {action.dest for action in build_parser(benchmark, [])._actions}


@pytest.mark.parametrize("name", ADAPTERS)
def test_each_runner_leaves_out_what_it_left_out_before(name):
    benchmark = ADAPTERS[name]()
    declared = not_generating_args(benchmark)
    assert set(declared) <= _dests(benchmark), "a declaration names a flag the benchmark does not have"
    assert all(isinstance(why, str) and why for why in declared.values())
    assert (set(NON_GENERATING_ARGS) | set(declared)) & _dests(benchmark) == NON_GENERATING_BEFORE & _dests(benchmark)
    assert not set(declared) & set(NON_GENERATING_ARGS), "the runner's own flags are declared once, in run_folder"


def _prepared(benchmark, argv, tokenizer, config, tmp_path) -> dict:
    """{(predictions file, sample key): (prompt, question token ids)} of what `argv` runs."""
    parser = build_parser(benchmark, [])
    args = parser.parse_args(["--method", "fullkv", "--save_dir", str(tmp_path / "out"), *argv])
    benchmark.given = parser.given
    benchmark.check_arguments(args)
    files = benchmark.prepare(args, tokenizer, config, tmp_path / "out")
    return {(f.file_name, s.key): (list(s.prompt), [list(q.ids) for q in s.questions or []])
            for f in files for s in f.samples}


# Per adapter: the flags every case starts from, then per selection flag the value it has there and another.
SELECTIONS = {
    "ruler": (["--tasks", "niah_multikey_1", "--context_lengths", "320", "--num_samples", "1"], {
        "tasks": (["niah_multikey_1"], ["niah_multikey_1", "niah_single_1"]),
        "context_lengths": (["320"], ["320", "360"]),
        "num_samples": (["1"], ["2"]),
        "questions_per_context": (["1"], ["2"]),
    }),
    "longbench": (["--datasets", "multifieldqa_zh", "--max_num_examples", "1", "--max_length", "200"], {
        "datasets": (["multifieldqa_zh"], ["multifieldqa_zh", "passage_retrieval_zh"]),
        "max_num_examples": (["1"], ["2"]),
    }),
    "needle": (["--s_len", "300", "--e_len", "500", "--step", "200", "--num_depths", "2"], {
        "s_len": (["300"], ["500"]),
        "e_len": (["500"], ["700"]),
        "step": (["200"], ["100"]),
        "num_depths": (["2"], ["3"]),
        "questions_per_context": (["1"], ["2"]),
    }),
    "reasoning": (["--tasks", "chain", "--num_samples", "1"], {
        "tasks": (["chain"], ["chain", "gsm8k"]),
        "num_samples": (["1"], ["2"]),
    }),
}


def _with(base: list[str], flag: str, values: list[str]) -> list[str]:
    argv = list(base)
    if f"--{flag}" in argv:
        i = argv.index(f"--{flag}")
        end = i + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
        del argv[i:end]
    return [*argv, f"--{flag}", *values]


@pytest.mark.parametrize("name", SELECTIONS)
def test_a_selection_flag_only_chooses_which_samples_run(name, tokenizer, smollm2_path, tmp_path):
    """Each declared selection flag, at two values: the samples both run are the same prompts (so their rows, keyed,
    may come from either run), and the flag does select. The cases cover every declared flag."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_path)
    extra = ["--data_dir", str(longbench_data_dir())] if name == "longbench" else []
    base, cases = SELECTIONS[name]
    assert set(cases) == set(ADAPTERS[name].selection_args)
    for flag, (one, other) in cases.items():
        a = _prepared(ADAPTERS[name](), [*extra, *_with(base, flag, one)], tokenizer, config, tmp_path)
        b = _prepared(ADAPTERS[name](), [*extra, *_with(base, flag, other)], tokenizer, config, tmp_path)
        assert set(a) != set(b), f"--{flag} chose the same samples"
        assert all(a[key] == b[key] for key in set(a) & set(b)), f"--{flag} changed a sample both run"


# Per adapter: a selection flag changed (resumes) and a flag that changes the prompts (refused).
RESUMES = {
    "ruler": (["--tasks", "niah_single_1"], ["--num_samples", "7"], ["--seed", "7"]),
    "longbench": (["--datasets", "multi_news"], ["--max_num_examples", "7"], ["--max_length", "700"]),
    "needle": ([], ["--e_len", "7000"], ["--answer_prefix", "Sure:"]),
    "reasoning": (["--tasks", "chain"], ["--num_samples", "7"], ["--chain_steps", "7"]),
}


@pytest.mark.parametrize("name", RESUMES)
def test_a_run_folder_resumes_with_other_selection_flags_and_refuses_other_prompts(name, tmp_path):
    """Through the fingerprint a run folder records: another choice of samples resumes; a flag that changes a
    prompt is refused, named."""
    base, selection, prompts = RESUMES[name]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def fingerprint(*argv):
        benchmark = ADAPTERS[name]()
        parser = build_parser(benchmark, [])
        args = parser.parse_args(["--method", "snapkv:budget=64", "--save_dir", str(tmp_path / "out"), *base, *argv])
        method = method_from_args(args, parser)
        defaults = {action.dest: action.default for action in parser._actions}
        ignored = not_generating_args(benchmark)
        return run_fingerprint(args, method, (str(model), None, "cpu", "float32"), None, {}, ignored), \
            defaults, ignored

    stored, defaults, ignored = fingerprint()
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "rows.jsonl").write_text("{}\n")
    (folder / RUN_META).write_text(json.dumps({"fingerprint": stored}))
    now, _, _ = fingerprint(*selection)
    assert now == stored
    open_run_folder(folder, now, argument_defaults=defaults, not_generating=ignored).release()
    changed, _, _ = fingerprint(*prompts)
    flag = prompts[0].lstrip("-")
    with pytest.raises(RunFolderError, match=f"arguments.{flag}: "):
        open_run_folder(folder, changed, argument_defaults=defaults, not_generating=ignored)
    # A fingerprint recorded when a selection flag was still fingerprinted resumes.
    older = json.loads(json.dumps(stored))
    older["arguments"][selection[0].lstrip("-")] = 3
    assert fingerprint_differences(older, now, defaults, (), ignored) == []
    assert fingerprint_differences(older, now, defaults) != []   # without the adapter's declaration


def test_fingerprints_from_before_the_method_spec_resume():
    """A fingerprint that listed the method flags among its arguments (before the method spec was recorded:
    cli.FLAGS_BEFORE_THE_SPEC) is compared through its method section: every one of them, at any value, resumes;
    an argument that is no method flag of then, given, does not."""
    from pyramidkv.runner.cli import FLAGS_BEFORE_THE_SPEC

    assert len(FLAGS_BEFORE_THE_SPEC) == 38
    new = {"method": {"method": "snapkv", "budget": 64}, "arguments": {"seed": 42}}
    stored = {"method": {"method": "snapkv", "budget": 64},
              "arguments": {"seed": 42, **{name: 1 for name in FLAGS_BEFORE_THE_SPEC}}}
    assert fingerprint_differences(stored, new) == []
    stored["arguments"]["page_size"] = 16   # a method setting added since: never among the arguments
    assert fingerprint_differences(stored, new) == ["arguments.page_size: 16 -> '<unset>'"]


# --- --questions_per_context: once in the adapter, once where the samples are built -------------------------------

@pytest.mark.parametrize("k,message", [
    ("0", "--questions_per_context must be >= 1, got 0"),
    ("2", "task cwe cannot pose 2 questions per context (at most 1)"),
])
def test_ruler_refuses_questions_per_context_in_its_checks(k, message):
    """Refused by the adapter's checks, before any tokenizer loads or sample is built."""
    benchmark = Ruler()
    parser = build_parser(benchmark, [])
    args = parser.parse_args(["--method", "fullkv", "--tasks", "cwe", "--questions_per_context", k])
    benchmark.given = parser.given
    with pytest.raises(ValueError) as e:
        benchmark.check_arguments(args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_generation_checks_questions_per_context_once_per_sample(formatter, tmp_path, monkeypatch):
    """On the runner's road (load_or_generate -> generate_rows -> generate_sample -> fit_sample -> make_builder) the
    count is checked where each sample is built, once; a bad count is refused there, before anything is written."""
    from pyramidkv.benchmarks.ruler import generate as gen
    from pyramidkv.benchmarks.ruler import tasks

    calls = []
    real = tasks.check_questions_per_context

    def counted(task, k):
        calls.append((task, k))
        return real(task, k)

    monkeypatch.setattr(gen, "check_questions_per_context", counted)
    monkeypatch.setattr(tasks, "check_questions_per_context", counted)
    rows = gen.load_or_generate("niah_multikey_1", 512, 2, formatter, tmp_path, "m", questions_per_context=2)
    assert len(rows) == 2 and calls == [("niah_multikey_1", 2)] * 2
    with pytest.raises(ValueError, match=r"^task niah_multikey_1 cannot pose 5 questions per context \(at most 4\)"):
        gen.load_or_generate("niah_multikey_1", 512, 1, formatter, tmp_path / "other", "m", questions_per_context=5)
    assert not (tmp_path / "other").exists()
