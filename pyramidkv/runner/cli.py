"""The command line every runner shares, generated from the settings dataclasses (as HfArgumentParser does).

Every setting of every registered method, allocator, merge rule and quantizer gets a flag: its name (see
pyramidkv/methods/settings.py: a unit setting by its field when that is unambiguous, and always by its
axis-qualified name, `--quant_rank`, `--merge_seed`), its help from the field's documentation, its
default from the dataclass (shown in the help, never restated here: a flag left out is not passed). The
public harness's names stay as aliases (`--max_capacity_prompts`, `--window_sizes`, `--floor`, ...).
`--method` takes a method name or a whole spec (`snapkv:window_size=8,merge=cam`); flags add to it. An
error names the flag (or spec item) the user typed, the value and what is allowed (docs/method_spec.md).

One name, one meaning. A setting is given once: by the spec or by one of its flags (a repeated flag, a flag
and its alias, `--max_capacity_prompts 128 --budget 64`, are refused by runner/arguments.py's parser, which
also refuses shortened flags and numbers not in ASCII). A benchmark's own flag keeps its name and meaning
(RULER's `--seed` seeds its generator); where it has a setting's bare name it also has a name of its own
(`--generator_seed`), and typed under the shared name while the method has that setting (`--merge cam`,
whose seed is `--merge_seed`) it is refused (runner/method_args.py's `check_shared_names`, beside
`method_from_args`, which builds the method from the flags given). kvpress's `compression_ratio`, the
fraction removed, is `1 - budget_ratio` (methods/settings.py). `--method NAME --help` shows NAME's settings only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing

from pyramidkv.components import flat_settings, parse_setting, setting_help
from pyramidkv.core.chunked import PrefillChunks
from pyramidkv.methods import METHODS, get_method_class
from pyramidkv.methods.settings import (AXES, AXIS_BY_FIELD, COMPRESSION_RATIO, LEGACY_THRESHOLD, SWITCHES,
                                        bare_unit_names, default_units, split_spec)
from pyramidkv.models.default_model import DEFAULT_MODEL_NAME
from pyramidkv.models.patch import ATTENTION_IMPLEMENTATIONS, MODEL_GLUE
from pyramidkv.models.loading import supported_models

# The public PyramidKV harness's flag names (and earlier ones of ours), by the setting they set; each means
# exactly what the setting means (the harness's ThinK --pruning_ratio is lambda, the share of key channels
# pruned, as key_channel_ratio; its --kv_cache_granularity and --gqa_score_agg take the values of gqa_layout
# and gqa_reduce). kvpress's compression_ratio, the fraction removed, is no alias: see COMPRESSION_RATIO.
FLAG_ALIASES = {
    "budget": ("--max_capacity_prompts",),
    "budget_ratio": ("--max_capacity_prompts_ratio",),
    "window_size": ("--window_sizes",),
    "kernel_size": ("--kernel_sizes",),
    "head_floor_ratio": ("--floor",),
    "head_scores": ("--head_path",),
    "quant_group_size": ("--q_group_size",),
    "key_channel_ratio": ("--pruning_ratio",),
    "key_recent_size": ("--recent_size",),
    "gqa_layout": ("--kv_cache_granularity",),
    "gqa_reduce": ("--gqa_score_agg",),
}
# The method flags of the command line before the method spec was recorded (bbca7cf): a run_meta.json written then
# lists them among its fingerprint's arguments, and run_folder.fingerprint_differences compares them through the
# method section, which holds what they set. A record of that command line, not a list to extend: a setting added
# since never reaches the arguments (run_fingerprint leaves every setting flag out).
FLAGS_BEFORE_THE_SPEC = frozenset({
    "method", "max_capacity_prompts", "max_capacity_prompts_ratio", "window_sizes", "kernel_sizes", "pooling", "beta",
    "num_sinks", "gqa_layout", "gqa_reduce", "gqa_pooling", "skip_layers", "head_allocation", "layer_allocation",
    "floor", "normalize", "head_path", "head_beta", "attention_threshold", "b_bound_ratio", "merge",
    "similarity_threshold", "merge_fraction", "merge_budget", "start_budget_ratio", "merge_sampling", "merge_seed",
    "quant_method", "nbits", "q_group_size", "quant_residual_length", "quant_outlier_fraction", "quant_sink_tokens",
    "quant_datatype", "quant_rank", "quant_decode_rank", "decode_budget", "decode_interval",
})
# What --help adds after a setting's own text when it has a public-harness alias.
ALIAS_HELP = {
    "key_channel_ratio": "--pruning_ratio: the public ThinK harness's lambda, the same share pruned",
    "key_recent_size": "--recent_size: the public ThinK harness's name",
    "gqa_layout": "--kv_cache_granularity: the public harness's name, same values (its default: query_head)",
    "gqa_reduce": "--gqa_score_agg: the public harness's name, same values",
}
COMPRESSION_HELP = (f"kvpress's compression ratio: the fraction of each prompt's cache REMOVED, in [0, 1); it sets "
                    f"budget_ratio = 1 - it (--max_capacity_prompts_ratio is the fraction KEPT); not with a budget "
                    f"or budget_ratio")


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict:
    """A class's resolved annotations (a parser is built per run: the leaderboard builds hundreds)."""
    return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class SettingFlag:
    key: str                      # the setting's name in a spec (the flag's dest)
    flags: tuple[str, ...]        # option strings, the first shown first
    annotation: object
    help: str
    choices: tuple[str, ...] = ()
    shown: bool = True            # False: parsed, but left out of a method's --help


@dataclasses.dataclass(frozen=True)
class HelpScope:
    """The settings `--method NAME --help` shows: the method's own, those of the unit it has on each axis
    (its defaults, or the spec's choice), its capabilities' (only the switch of one that is off)."""

    cls: type
    units: dict                   # axis field -> the unit class chosen (None: none)

    @classmethod
    def of(cls, spec: str) -> "HelpScope":
        """The scope of a --method value; ValueError (one line) when it names no method."""
        name, items = split_spec(spec)
        method = get_method_class(name)
        given = dict(items)
        units = {}
        for axis in AXES:
            value = given.get(axis.field, {f.name: f.default for f in dataclasses.fields(method)}[axis.field])
            if isinstance(value, str):
                value = None if value.lower() == "none" else axis.registry.get(value.lower())
            units[axis.field] = value if value is None or isinstance(value, type) else type(value)
        return cls(method, units)


def _defaults_text(owners: dict[str, object]) -> str:
    """'7' when every owner has that default, else '7; cam: 1' (the most common first, the others by owner)."""
    texts = {owner: ("none" if v is None else getattr(v, "name", None) or str(v)) for owner, v in owners.items()}
    counts: dict[str, int] = {}
    for text in texts.values():
        counts[text] = counts.get(text, 0) + 1
    common = max(counts, key=counts.get)
    others = [f"{owner}: {text}" for owner, text in texts.items() if text != common]
    if len(owners) > 1 and len(texts) > 1 and not others and len(counts) == 1:
        return common
    return "; ".join([common] + others) if others else common


def setting_flags(taken: set[str] = frozenset(), scope: HelpScope | None = None) -> list[SettingFlag]:
    """One flag per setting of every registered method and unit (read from the registries at call time, so a
    new field or unit gets its flag with no edit here). Option strings in `taken` (a benchmark's own flags)
    are left to the benchmark. With a scope the flags are the same, their help only the scope's (the others
    `shown=False`)."""
    method_fields: dict[str, dict[str, object]] = {}
    docs: dict[str, str] = {}
    annotations: dict[str, object] = {}
    for name, cls in METHODS.items():
        if scope is not None and cls is not scope.cls:   # its fields get their flags below, hidden
            for f in dataclasses.fields(cls):
                method_fields.setdefault(f.name, {})
                annotations.setdefault(f.name, _type_hints(cls)[f.name])
            continue
        hints = _type_hints(cls)
        helps = setting_help(cls)
        for f in dataclasses.fields(cls):
            method_fields.setdefault(f.name, {})[name] = f.default
            docs.setdefault(f.name, helps.get(f.name, ""))
            annotations.setdefault(f.name, hints[f.name])
    out = []
    for key, owners in method_fields.items():
        if key == "method" or (key in AXIS_BY_FIELD and AXIS_BY_FIELD[key].flat):  # a capability: by its settings
            continue
        axis = AXIS_BY_FIELD.get(key)
        choices = tuple(axis.registry) + ("none",) if axis is not None else ()
        if key == LEGACY_THRESHOLD[0]:   # --head_allocation threshold, from before threshold eviction was a sizing
            choices += (LEGACY_THRESHOLD[1],)
        flags = [f for f in (*FLAG_ALIASES.get(key, ()), f"--{key}") if f not in taken]
        if not owners:
            out.append(SettingFlag(key, tuple(flags), annotations[key], "", choices, shown=False))
            continue
        which = "" if len(owners) == len(METHODS) or scope is not None else f"{', '.join(owners)}: "
        text = f"{which}{docs[key]}" + (f" ({ALIAS_HELP[key]})" if key in ALIAS_HELP else "")
        if axis is not None:   # the choices from the registry, never a hand-written list
            text = f"{text.rstrip('.')}; one of: {', '.join(axis.registry)} (or none)"
        shown = scope is None or key not in scope.cls.refuses
        out.append(SettingFlag(key, tuple(flags), annotations[key], f"{text} [{_defaults_text(owners)}]", choices,
                               shown=shown))
    if "--compression_ratio" not in taken:
        budgeted = scope is None or scope.cls.sizing.evicts
        out.append(SettingFlag(COMPRESSION_RATIO, ("--compression_ratio",), float, COMPRESSION_HELP, shown=budgeted))
    bare = bare_unit_names(method_fields)
    for axis in AXES:
        if axis.flat and len(axis.registry) > 1:   # the sizing: a kind per setting given
            out.extend(_kind_flags(axis, taken, scope))
            continue
        if axis.flat:
            out.extend(_capability_flags(axis, taken, scope))
            continue
        for setting, units in axis.fields().items():
            chosen = scope.units[axis.field] if scope is not None else None
            shown = scope is None or (chosen is not None and setting in {f.name for f in dataclasses.fields(chosen)})
            if scope is not None and shown:
                units = [chosen.name]
            key = axis.qualified(setting)
            names = [*FLAG_ALIASES.get(key, ())]
            if bare.get(setting) is axis:
                names.append(f"--{setting}")
            names.append(f"--{key}")
            flags = tuple(f for f in dict.fromkeys(names) if f not in taken)
            helps = {unit: setting_help(axis.registry[unit]).get(setting, "") for unit in units}
            if len(set(helps.values())) == 1:
                text = f"{' / '.join(units)}: {next(iter(helps.values()))}"
            else:
                text = "; ".join(f"{unit}: {h}" for unit, h in helps.items())
            unit_defaults = {unit: {f.name: f.default for f in dataclasses.fields(axis.registry[unit])}[setting]
                        for unit in units}
            hints = _type_hints(axis.registry[units[0]])
            out.append(SettingFlag(key, flags, hints[setting], f"{text} [{_defaults_text(unit_defaults)}]",
                                   shown=shown))
    return out


def _capability_flags(axis, taken: set[str], scope: HelpScope | None = None) -> list[SettingFlag]:
    """A capability's settings as the method's own flags, each default read from every method's own unit (the
    unit's when the method has it on, its off value when off): `[0; streamingllm: 4, nacl: 4]`. With a scope:
    its method's values, every setting when the method has the capability on, else only the switch."""
    unit = axis.unit
    helps = setting_help(unit)
    hints = _type_hints(unit)
    methods = {scope.cls.name: scope.cls} if scope is not None else METHODS
    per_method = {name: flat_settings(unit, {f.name: f.default for f in dataclasses.fields(cls)}[axis.field])
                  for name, cls in methods.items()}
    is_on = scope is None or scope.units[axis.field] is not None
    refused = scope is not None and unit.switch in scope.cls.refuses
    names = list(next(iter(per_method.values())))
    out = []
    for setting in names:
        flags = tuple(f for f in (*FLAG_ALIASES.get(setting, ()), f"--{setting}") if f not in taken)
        defaults = {name: values[setting] for name, values in per_method.items()}
        if setting in SWITCHES:
            text = f"{unit.title}: turns it on (true) or off (false)"
            annotation = bool
        else:
            text, annotation = helps.get(setting, ""), hints[setting]
        text += f" ({ALIAS_HELP[setting]})" if setting in ALIAS_HELP else ""
        out.append(SettingFlag(setting, flags, annotation, f"{text} [{_defaults_text(defaults)}]",
                               shown=not refused and (is_on or setting == unit.switch)))
    return out


def _kind_flags(axis, taken: set[str], scope: HelpScope | None = None) -> list[SettingFlag]:
    """The settings of a flat axis whose kind is chosen by the setting given (the sizing: budget, budget_ratio,
    threshold, threshold_decoding), each default read from every method's own unit (none where its kind lacks
    it). With a scope: shown when the method's default sizing evicts (or lends the budget to a unit: quest)."""
    methods = {scope.cls.name: scope.cls} if scope is not None else METHODS
    per_method = {name: {f.name: f.default for f in dataclasses.fields(cls)}[axis.field] for name, cls in methods.items()}
    out = []
    for kind in axis.registry.values():
        helps, hints = setting_help(kind), _type_hints(kind)
        for f in dataclasses.fields(kind):
            flags = tuple(x for x in (*FLAG_ALIASES.get(f.name, ()), f"--{f.name}") if x not in taken)
            defaults = {name: unit.settings().get(f.name) for name, unit in per_method.items()}
            lends = scope is not None and kind.budget_kind and \
                bool(per_method[scope.cls.name].budget_names(default_units(scope.cls)))
            shown = scope is None or ((per_method[scope.cls.name].evicts or lends) and f.name not in scope.cls.refuses)
            out.append(SettingFlag(f.name, flags, hints[f.name], f"{helps.get(f.name, '')} [{_defaults_text(defaults)}]",
                                   shown=shown))
    return out


def _reader(annotation, flag: str):
    def read(text: str):
        try:
            return parse_setting(text, annotation)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    read.__name__ = flag
    return read


def _is_bool(annotation) -> bool:
    if typing.get_origin(annotation) is typing.Union:
        annotation = [a for a in typing.get_args(annotation) if a is not type(None)][0]
    return annotation is bool


class _Typed(argparse.Action):
    """Stores the value and remembers the option string the user typed (errors name it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        typed = getattr(parser, "typed_flags", None)
        if typed is None:
            typed = parser.typed_flags = {}
        typed[self.dest] = option_string


def add_model_and_method_args(parser: argparse.ArgumentParser, scope: HelpScope | None = None) -> list[str]:
    """The model, method and run flags; returns the dests of the method settings. With a scope, --help shows
    only that method's settings (the flags parsed are the same)."""
    taken = set(parser._option_string_actions)
    g = parser.add_argument_group("model")
    g.add_argument("--model_path", default=DEFAULT_MODEL_NAME,
                   help=f"local HF directory, hub id, or {DEFAULT_MODEL_NAME!r} (embedded default); its config's "
                        f"model_type is one of the supported families: {supported_models()} (docs/models.md)")
    g.add_argument("--model_class", choices=list(MODEL_GLUE), default=None,
                   help="load the weights into this family's transformers class instead of the config's (weights "
                        "of the same layout: SmolLM2's load as mistral)")
    g.add_argument("--attn_implementation", default="sdpa", choices=list(ATTENTION_IMPLEMENTATIONS))
    g.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (with --device_map: leave it out)")
    g.add_argument("--device_map", default=None,
                   help="spread the model over devices with accelerate: auto (also balanced, balanced_low_0, "
                        "sequential), or a JSON file or object mapping module names to devices "
                        "(docs/models.md, \"Larger than one device\"); refused together with --device")
    g.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="when not given: float32 on CPU, bfloat16 on CUDA")
    m = parser.add_argument_group(
        "compression method", "every setting of every method and unit; [..] shows the dataclass defaults, a flag "
        "left out keeps them (`--method NAME --help`: only NAME's settings)" if scope is None else
        f"the settings of {scope.cls.name} and its units; [..] shows their defaults, a flag left out keeps them "
        f"(--help without --method: every method's)")
    m.add_argument("--method", required=True,
                   help=f"a method ({', '.join(METHODS)}) or a whole spec, e.g. snapkv:window_size=8,merge=cam")
    dests = []
    for flag in setting_flags(taken, scope):
        if not flag.flags:
            continue
        kwargs = dict(dest=flag.key, default=None, action=_Typed, help=flag.help if flag.shown else argparse.SUPPRESS)
        if flag.choices:
            kwargs.update(type=str.lower, choices=flag.choices, metavar="{" + ",".join(flag.choices) + "}")
        elif _is_bool(flag.annotation):
            kwargs.update(nargs="?", const=True, type=_reader(flag.annotation, flag.flags[0]), metavar="true|false")
        else:
            kwargs.update(type=_reader(flag.annotation, flag.flags[0]))
        m.add_argument(*flag.flags, **kwargs)
        dests.append(flag.key)
    r = parser.add_argument_group("run")
    r.add_argument("--num_threads", type=int, default=None,
                   help="CPU threads for torch (when not given: torch's choice; 1 is faster on a busy shared CPU)")
    r.add_argument("--decode_threads", type=int, default=None,
                   help="CPU threads for the decode steps, the prompt's forward keeping --num_threads (when not "
                        "given: the same); a decode step's small matmuls lose more to waiting for a thread on a "
                        "busy CPU than a second thread brings, the more so in batches: 1 there")
    r.add_argument("--prefill_chunk_size", type=int, default=PrefillChunks.prefill_chunk_size, metavar="N",
                   help=setting_help(PrefillChunks)["prefill_chunk_size"])
    r.add_argument("--overwrite", action="store_true",
                   help="delete the run folder's earlier results first (needed to rerun a folder with other "
                        "settings: a resume must match the stored configuration)")
    parser.set_defaults(_setting_dests=dests)
    return dests


# Errors a runner reports as one line and exit status 2 (bad input, found before anything is written).
INPUT_ERRORS = (ValueError, TypeError, ImportError, OSError, RuntimeError)
UNFIT_EXIT_STATUS = 3


class UnfitPrompt(ValueError):
    """A prompt on which the method cannot do what its settings say (Method.check_prompt: a ratio budget below the
    window, a recent part as wide as the budget, ...). Reported as one line with exit status 3, not 2, so that a
    sweep (the leaderboard) can tell a cell that does not apply at this length from bad input."""

    exit_status = UNFIT_EXIT_STATUS


def fail(parser: argparse.ArgumentParser, error: BaseException) -> None:
    """Print `error` as one line and exit 2 (3 for an UnfitPrompt)."""
    message = " ".join(str(error).split("\n")).strip() or type(error).__name__
    parser.exit(getattr(error, "exit_status", 2), f"{parser.prog}: error: {message}\n")


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("num_threads", "decode_threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    chunks = getattr(args, "prefill_chunk_size", None)
    if chunks is not None:
        clashing = [flag for flag in ("question_as_decode", "shared_context", "kl_vs_fullkv", "save_compressed",
                                      "load_compressed") if getattr(args, flag, None)]
        if clashing:
            parser.error(f"--prefill_chunk_size {chunks} chunks a whole prompt's prefill; it does not combine with "
                         f"--{clashing[0]}")


def apply_num_threads(args: argparse.Namespace) -> None:
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)


