"""The runners' command line (issue 25): every flag read once, by its full name, numbers in ASCII; one name, one
meaning; the public harnesses' names; `--method NAME --help`. Parse-only (`--print_run_dir`): no model loads."""

from __future__ import annotations

import ast
import contextlib
import io
import re

import pytest

from pyramidkv.benchmarks.longbench.run import LongBench
from pyramidkv.benchmarks.longbench.run import main as longbench_main
from pyramidkv.benchmarks.needle.run import Needle
from pyramidkv.benchmarks.needle.run import main as needle_main
from pyramidkv.benchmarks.ruler.run import Ruler
from pyramidkv.benchmarks.ruler.run import main as ruler_main
from pyramidkv.methods import parse_method_spec
from pyramidkv.methods.settings import AXES
from pyramidkv.runner.cli import method_from_args
from pyramidkv.runner.protocol import build_parser
from tests.helpers import ROOT

MAINS = {"ruler": ruler_main, "longbench": longbench_main, "needle": needle_main}


def run(argv, benchmark="ruler") -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a runner given argv plus --print_run_dir."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = MAINS[benchmark](list(argv) + ["--print_run_dir"])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def refused(argv, benchmark="ruler") -> str:
    code, _, err = run(argv, benchmark)
    prog = {"ruler": "run_ruler.py", "longbench": "run_longbench.py", "needle": "run_needle_in_haystack.py"}
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"{prog[benchmark]}: error: "), err
    return err


def method(argv):
    parser = build_parser(Ruler())
    return method_from_args(parser.parse_args(argv), parser)


# --- item 1: a flag given twice, abbreviated, or a number that is not ASCII ---------------------------------

@pytest.mark.parametrize("benchmark, argv, named", [
    ("ruler", ["--method", "snapkv", "--max_capacity_prompts", "128", "--max_capacity_prompts", "64"],
     ["--max_capacity_prompts 128", "--max_capacity_prompts 64"]),
    ("ruler", ["--method", "snapkv", "--max_capacity_prompts", "128", "--budget", "64"],
     ["--max_capacity_prompts 128", "--budget 64"]),
    ("ruler", ["--method", "snapkv", "--budget", "128", "--window_sizes=8", "--window_size", "16"],
     ["--window_sizes 8", "--window_size 16"]),
    ("ruler", ["--method", "think", "--budget", "128", "--pruning_ratio", "0.5", "--key_channel_ratio", "0.4"],
     ["--pruning_ratio 0.5", "--key_channel_ratio 0.4"]),
    ("ruler", ["--method", "snapkv", "--budget", "128", "--context_lengths", "1024", "--context_lengths", "2048"],
     ["--context_lengths 1024", "--context_lengths 2048"]),
    ("ruler", ["--method", "snapkv", "--budget", "128", "--num_samples", "5", "--num_samples=3"],
     ["--num_samples 5", "--num_samples 3"]),
    ("ruler", ["--method", "snapkv", "--method", "h2o", "--budget", "128"], ["--method snapkv", "--method h2o"]),
    ("longbench", ["--method", "snapkv", "--budget", "128", "--datasets", "qasper", "--datasets", "hotpotqa"],
     ["--datasets qasper", "--datasets hotpotqa"]),
    ("needle", ["--method", "snapkv", "--budget", "128", "--s_len", "1000", "--s_len", "2000"],
     ["--s_len 1000", "--s_len 2000"]),
])
def test_a_setting_given_twice_is_refused_naming_both(benchmark, argv, named):
    err = refused(argv, benchmark)
    assert all(n in err for n in named), err


@pytest.mark.parametrize("argv, flag", [
    (["--method", "think", "--budget", "128", "--key_channel", "0.5"], "--key_channel"),
    (["--method", "nacl", "--budget", "128", "--proxy", "8"], "--proxy"),
    (["--method", "snapkv", "--budget", "128", "--num_sample", "3"], "--num_sample"),
    (["--method", "snapkv", "--max_capacity", "128"], "--max_capacity"),
])
def test_an_abbreviated_flag_is_refused(argv, flag):
    assert f"unrecognized arguments: {flag}" in refused(argv)


@pytest.mark.parametrize("argv, value", [
    (["--method", "snapkv", "--max_capacity_prompts", "٨"], "'٨'"),             # Arabic-Indic eight
    (["--method", "snapkv", "--max_capacity_prompts", "1_0"], "'1_0'"),
    (["--method", "snapkv", "--max_capacity_prompts", "1e23"], "'1e23'"),
    (["--method", "snapkv", "--max_capacity_prompts", "64.0"], "'64.0'"),
    (["--method", "snapkv", "--max_capacity_prompts_ratio", "nan"], "'nan'"),
    (["--method", "snapkv", "--max_capacity_prompts_ratio", "inf"], "'inf'"),
    (["--method", "snapkv", "--max_capacity_prompts_ratio", "0.٥"], "'0.٥'"),
    (["--method", "snapkv", "--budget", "128", "--num_samples", "٣"], "'٣'"),
    (["--method", "snapkv", "--budget", "128", "--context_lengths", "1_024"], "'1_024'"),
    (["--method", "snapkv:budget=٨"], "'٨'"),
])
def test_a_number_not_in_ascii_or_not_finite_is_refused(argv, value):
    err = refused(argv)
    assert value in err and ("integer" in err or "finite number" in err), err


@pytest.mark.parametrize("argv, budget, ratio", [
    (["--method", "snapkv", "--budget", "+64"], 64, None),
    (["--method", "snapkv", "--budget_ratio", ".5"], None, 0.5),
    (["--method", "snapkv", "--budget_ratio", "1e-1"], None, 0.1),
])
def test_plain_ascii_numbers_still_read(argv, budget, ratio):
    m = method(argv)
    assert (m.budget, m.budget_ratio) == (budget, ratio)


def test_every_parser_is_the_strict_one():
    """No command line of the repository builds argparse's own parser (it would take `--key_channel` and a
    repeated flag)."""
    sources = [p for p in (*ROOT.glob("*.py"), *ROOT.glob("pyramidkv/**/*.py"), *ROOT.glob("scripts/**/*.py"),
                           *ROOT.glob("measure/*.py"), *ROOT.glob("examples/*.py"))
               if p.name != "arguments.py"]
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Attribute) and call.attr == "ArgumentParser" and \
                    getattr(call.value, "id", None) == "argparse":
                found.append(str(path.relative_to(ROOT)))
    assert not found


# --- item 2: one name, one meaning -------------------------------------------------------------------------

@pytest.mark.parametrize("units, qualified", [
    (["--merge", "cam", "--merge_sampling"], "--merge_seed"),
    (["--quant_method", "gear"], "--quant_seed"),
    (["--method=snapkv:merge=cam"], "--merge_seed"),
])
def test_ruler_seed_with_a_unit_that_has_a_seed_is_refused_naming_both(units, qualified):
    argv = ([] if units[0].startswith("--method=") else ["--method", "snapkv"]) + units + ["--budget", "128",
                                                                                           "--seed", "3"]
    err = refused(argv)
    assert "--seed" in err and "--generator_seed" in err and qualified in err, err


def test_the_qualified_names_say_which_seed():
    code, out, err = run(["--method", "snapkv", "--budget", "128", "--merge", "cam", "--merge_sampling",
                          "--generator_seed", "3", "--merge_seed", "5"])
    assert code == 0 and out.strip().endswith("snapkv_merge=cam-sampling=True-seed=5"), err
    parser = build_parser(Ruler())
    args = parser.parse_args(["--method", "snapkv", "--budget", "128", "--generator_seed", "3"])
    assert args.seed == 3                       # the same setting as --seed: the run folder's fingerprint has it
    # Without a unit that has a seed, --seed is RULER's only meaning.
    assert run(["--method", "snapkv", "--budget", "128", "--seed", "3"])[0] == 0


def test_a_benchmark_flag_named_like_a_setting_has_an_unambiguous_name_too():
    """Where a benchmark's flag has a setting's bare name (seed), the benchmark gives it a second name that no
    setting has, so the refusal above always has a name to offer."""
    setting_names = {f for axis in AXES for f in axis.fields()}
    for benchmark in (Ruler(), LongBench(), Needle()):
        parser = build_parser(benchmark)
        for option in parser.benchmark_flags:
            if option.lstrip("-") in setting_names:
                others = [o for o in parser._option_string_actions[option].option_strings if o != option]
                assert any(o.lstrip("-") not in setting_names for o in others), (benchmark.name, option)


@pytest.mark.parametrize("argv, message", [
    (["--seed", "3"], "--seed 3 has no effect"),
    (["--sample_method", "topk", "--max_num_examples", "2", "--sample_seed", "3"], "--sample_seed 3 has no effect"),
    (["--sample_method", "random"], "--sample_method random has no effect without --max_num_examples"),
])
def test_longbench_seed_is_refused_where_it_cannot_act(argv, message):
    err = refused(["--method", "snapkv", "--budget", "128", *argv], "longbench")
    assert message in err, err


def test_longbench_seed_draws_the_rows_with_sample_method_random():
    code, _, err = run(["--method", "snapkv", "--budget", "128", "--sample_method", "random", "--max_num_examples",
                        "2", "--seed", "3"], "longbench")
    assert code == 0, err


# --- item 3: the public harnesses' names -------------------------------------------------------------------

@pytest.mark.parametrize("argv, field, value", [
    (["--method", "think", "--budget", "128", "--pruning_ratio", "0.3"], ("channels", "key_channel_ratio"), 0.3),
    (["--method", "think", "--budget", "128", "--recent_size", "16"], ("channels", "key_recent_size"), 16),
    (["--method", "snapkv", "--budget", "128", "--kv_cache_granularity", "query_head"], ("gqa_layout",), "query_head"),
    (["--method", "snapkv", "--budget", "128", "--gqa_score_agg", "max"], ("gqa_reduce",), "max"),
    (["--method", "snapkv", "--compression_ratio", "0.75"], ("budget_ratio",), 0.25),
    (["--method", "snapkv", "--compression_ratio", "0.9"], ("budget_ratio",), 0.1),   # not 0.09999999999999998
    (["--method", "snapkv:compression_ratio=0.6"], ("budget_ratio",), 0.4),
])
def test_public_harness_names_set_our_settings(argv, field, value):
    got = method(argv)
    for name in field:
        got = getattr(got, name)
    assert got == value


@pytest.mark.parametrize("argv, named", [
    (["--method", "snapkv", "--compression_ratio", "0.75", "--budget", "64"],
     ["--compression_ratio=0.75", "--budget=64", "both give the budget"]),
    (["--method", "snapkv", "--compression_ratio", "0.75", "--budget_ratio", "0.25"],
     ["--compression_ratio=0.75", "--budget_ratio=0.25", "both give the budget"]),
    (["--method", "snapkv:compression_ratio=0.5,budget=64"], ["compression_ratio=0.5", "budget=64", "both give"]),
    (["--method", "snapkv", "--compression_ratio", "1"], ["--compression_ratio", "(0, 1)"]),
    (["--method", "snapkv", "--compression_ratio", "0"], ["--compression_ratio 0.0 removes nothing", "fullkv"]),
    (["--method", "snapkv", "--budget", "128", "--kv_cache_granularity", "head"], ["--kv_cache_granularity head"]),
    (["--method", "snapkv", "--budget", "128", "--gqa_score_agg", "median"], ["--gqa_score_agg median"]),
])
def test_aliases_with_their_setting_or_without_an_equivalent_are_refused(argv, named):
    err = refused(argv)
    assert all(n in err for n in named), err


def test_compression_ratio_in_a_spec_is_one_minus_budget_ratio():
    assert parse_method_spec("snapkv:compression_ratio=0.75") == parse_method_spec("snapkv:budget_ratio=0.25")
    assert parse_method_spec("quest:compression_ratio=0.5") == parse_method_spec("quest:budget_ratio=0.5")


# --- item 4: --help, complete or for one method, with each default where it comes from ---------------------

def help_text(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        ruler_main(argv)
    return " ".join(out.getvalue().partition("\noptions:")[2].split())     # the entries, not the usage line


def entry(text: str, flag: str) -> str:
    """The help entry of a flag: from its option strings to the next flag's."""
    match = re.search(rf"(?:^| ){re.escape(flag)} [A-Z_\[]", text)
    assert match, flag
    rest = text[match.start():]
    following = re.search(r"(?<!,) --[a-z_]+ (?:[A-Z_]+|\[|\{)", rest[len(flag) + 1:])   # not an alias of it
    return rest[:len(flag) + 1 + following.start()] if following else rest


def test_plain_help_shows_every_default_read_from_its_own_unit():
    """The defaults are those of each unit's own class (kvquant's nbits is 4, the other quantizers' 2;
    streamingllm, nacl and Expected Attention keep 4 sinks, the others none): reading them from the first unit
    would print [2]."""
    text = help_text(["--help"])
    assert entry(text, "--quant_nbits").endswith("[2; kvquant: 4]")
    assert entry(text, "--num_sinks").endswith("[0; streamingllm: 4; nacl: 4; expected_attention: 4; "
                                              "ada_expected_attention: 4; duo_attention: 64]")
    for flag in ("--merge_fraction", "--page_size", "--pruning_ratio", "--kv_cache_granularity", "--compression_ratio"):
        assert f" {flag} " in text


def test_help_for_one_method_shows_its_settings_and_values():
    text = help_text(["--method", "think", "--help"])
    for flag in ("--window_sizes", "--kernel_sizes", "--pruning_ratio", "--recent_size", "--key_query_window",
                 "--merge", "--quant_method", "--page_budget", "--decode_budget", "--cross_layer_merge"):
        assert f" {flag} " in text, flag
    for flag in ("--merge_fraction", "--nbits", "--page_size", "--decode_interval", "--proxy_fraction",
                 "--cross_layer_start", "--beta"):
        assert f" {flag} " not in text, flag
    assert entry(text, "--pruning_ratio").endswith("[0.4]")
    assert entry(help_text(["--method", "snapkv:quant_method=kvquant", "--help"]), "--quant_nbits").endswith("[4]")
    assert entry(help_text(["--method", "streamingllm", "--help"]), "--num_sinks").endswith("[4]")
    cam = help_text(["--method", "snapkv:merge=cam", "--help"])
    assert " --merge_seed " in cam and " --merge_fraction " not in cam


# --- issue 40, item 8: values that start with "-" -----------------------------------------------------------

@pytest.mark.parametrize("value, threshold", [("-1e3", -1000.0), ("-.5", -0.5), ("-5", -5.0), ("-2.5E1", -25.0)])
def test_a_negative_number_in_any_notation_is_a_value(value, threshold):
    """kvzap's thresholds are log scores, negative by nature: argparse's own matcher took -1e3 for a flag."""
    assert method(["--method", "kvzap", "--threshold", value]).sizing.threshold == threshold


@pytest.mark.parametrize("value, says", [
    ("-inf", "expected a finite number (ASCII, e.g. 0.5), got '-inf'"),
    ("-1e308", "threshold -1e+308 is at or below every score a scorer can give"),
])
def test_a_negative_value_reaches_the_flags_own_check(value, says):
    err = refused(["--method", "kvzap", "--threshold", value])
    assert says in err and "expected one argument" not in err, err


def test_a_flag_like_word_after_a_flag_says_how_to_give_it():
    err = refused(["--method", "snapkv", "--budget", "128", "--save_dir", "-results"])
    assert "--save_dir: expected one value, got the flag-like '-results'" in err and "--save_dir=-results" in err


# --- issue 40, item 9: help shows what the method accepts, choices from the registry, an unknown method refused -

def test_help_for_a_method_leaves_out_the_settings_it_refuses():
    """`--method kvzip --help` offered --merge, --decode_budget, ... which kvzip refuses: each setting in its
    `refuses` table is refused when given and absent from its help; its own settings are there."""
    from pyramidkv.methods import METHODS

    text = help_text(["--method", "kvzip", "--help"])
    refused_flags = {"merge": "--merge", "decode_budget": "--decode_budget", "page_budget": "--page_budget",
                     "cross_layer_merge": "--cross_layer_merge", "prefill_attention": "--prefill_attention"}
    assert set(METHODS["kvzip"].refuses) == set(refused_flags)
    for setting, flag in refused_flags.items():
        assert f" {flag} " not in text, flag
        assert "kvzip does not combine with" in refused(["--method", "kvzip", "--max_capacity_prompts_ratio", "0.5",
                                                         flag, "cam" if setting == "merge" else "minference"
                                                         if setting == "prefill_attention" else "true"
                                                         if setting == "cross_layer_merge" else "64"])
    for flag in ("--chunk_size", "--chunk_overlap", "--head_allocation", "--max_capacity_prompts_ratio"):
        assert f" {flag} " in text, flag
    assert " --merge " in help_text(["--method", "snapkv", "--help"])


@pytest.mark.parametrize("axis", [axis for axis in AXES if not axis.flat])
def test_a_units_flag_lists_every_unit_of_its_registry(axis):
    """--head_allocation's text listed uniform, adakv, headkv and not kvzip's default global: the text names every
    registered unit (the metavar aside), and the field's documentation names none of them by hand."""
    from pyramidkv.components import setting_help
    from pyramidkv.methods.base import Method

    text = re.search(rf" --{axis.field} {{[^}}]*}} (.*?) --[a-z_]+ [A-Z_{{\[]", help_text(["--help"]))[1]
    assert all(re.search(rf"\b{name}\b", text) for name in axis.registry), text
    assert not [name for name in axis.registry if re.search(rf"\b{name}\b", setting_help(Method)[axis.field])]


def test_help_for_an_unknown_method_is_refused():
    code, out, err = run(["--method", "bogus", "--help"])
    assert code == 2 and not out, out[:200]
    assert err.count("\n") == 1 and "unknown method 'bogus'; choose one of: fullkv," in err, err
