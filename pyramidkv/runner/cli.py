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
whose seed is `--merge_seed`) it is refused (`check_shared_names`). kvpress's `compression_ratio`, the
fraction removed, is `1 - budget_ratio` (methods/settings.py). `--method NAME --help` shows NAME's settings only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from typing import Optional
from pathlib import Path

from pyramidkv.components import parse_setting, setting_help
from pyramidkv.methods import METHODS, Method, canonical, get_method_class
from pyramidkv.components import flat_settings
from pyramidkv.methods.settings import (AXES, AXIS_BY_FIELD, COMPRESSION_RATIO, SWITCHES, bare_unit_names,
                                        LEGACY_THRESHOLD, build_method, default_units, read_settings, split_spec)
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
    r.add_argument("--overwrite", action="store_true",
                   help="delete the run folder's earlier results first (needed to rerun a folder with other "
                        "settings: a resume must match the stored configuration)")
    parser.set_defaults(_setting_dests=dests)
    return dests


# Errors a runner reports as one line and exit status 2 (bad input, found before anything is written).
INPUT_ERRORS = (ValueError, TypeError, ImportError, OSError, RuntimeError)


def fail(parser: argparse.ArgumentParser, error: BaseException) -> None:
    """Print `error` as one line and exit 2."""
    message = " ".join(str(error).split("\n")).strip() or type(error).__name__
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("num_threads", "decode_threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")


def apply_num_threads(args: argparse.Namespace) -> None:
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)


def method_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> Method:
    """The method of --method (a name or a spec) and the setting flags given. On a bad setting: ValueError
    naming the flags (or spec items) that cause it, as the user typed them."""
    name, items = split_spec(args.method)
    cls = get_method_class(name)
    typed = getattr(parser, "typed_flags", {}) if parser is not None else {}
    labels = {key: key for key, _ in items}                         # how messages name each given setting
    shown = {key: f"{key}={raw} (in --method {args.method})" for key, raw in items}   # ... with its value
    settings = read_settings(cls, items, lambda key: labels.get(key, key))
    for key in getattr(args, "_setting_dests", []):
        value = getattr(args, key, None)
        if value is None:
            continue
        flag = typed.get(key, f"--{key}")
        if key in settings:
            raise ValueError(f"{shown[key]} and {flag} {value} set the same setting; give it once")
        settings[key] = None if value == "none" else value
        labels[key], shown[key] = flag, f"{flag} {value}"
    label = lambda key: labels.get(key, key)  # noqa: E731
    try:
        method = build_method(cls, settings, label)
    except ValueError as error:
        # The settings the error is about: those whose removal makes it go away, else those whose removal changes it.
        without = {key: _error_without(cls, settings, key) for key in settings}
        culprits = [key for key, other in without.items() if other == ""] or [
            key for key, other in without.items() if other != str(error)]
        named = [shown[key] for key in culprits if f"{labels[key]} " not in f"{error} "]
        raise ValueError(f"{', '.join(named)}: {error}" if named else str(error)) from None
    return canonical(method)


def _error_without(cls, settings: dict, key: str) -> str:
    """The error building the method gives without one setting ('' if none): a setting whose removal changes
    the error is one the error is about."""
    try:
        build_method(cls, {k: v for k, v in settings.items() if k != key})
    except ValueError as e:
        return str(e)
    return ""


def recorded_method_label(meta: dict, folder: Path) -> str:
    """The method label (as results.json and the folder name give it: snapkv_merge=pivot) of a run from its
    run_meta.json's method_spec; the method folder's name where the record has none."""
    from pyramidkv.methods import parse_method_spec

    spec = meta.get("method_spec") if isinstance(meta, dict) else None
    if isinstance(spec, str):
        try:
            return parse_method_spec(spec).label()
        except (ValueError, TypeError):
            pass
    return Path(folder).name


def recorded_budget(meta: dict):
    """The budget (as results.json records it: 128, "r0.25", "threshold", None) of a run from its run_meta.json:
    its method_spec's sizing; where the record has no readable spec, its description's budget or budget_ratio."""
    from pyramidkv.methods import parse_method_spec

    spec = meta.get("method_spec") if isinstance(meta, dict) else None
    if isinstance(spec, str):
        try:
            method = parse_method_spec(spec)
            return method.sizing.recorded(method)
        except (ValueError, TypeError):
            pass
    described = (meta.get("method") if isinstance(meta, dict) else None) or {}
    ratio = described.get("budget_ratio")
    return described.get("budget") if ratio is None else f"r{ratio:g}"


def model_label(model_path: str) -> str:
    return Path(model_path.rstrip("/")).name


# The method folder's suffix of a run with the question fed as decode steps (--question_as_decode).
QUESTION_AS_DECODE_SUFFIX = "_question_as_decode"


def run_dir(save_dir: str, model_path: str, method: Method, question_as_decode: bool = False,
            shared_context: Optional[str] = None) -> Path:
    """{save_dir}/{model}_{budget}/{method.label()}: the public harness's layout for a method at its
    defaults; settings other than the defaults are appended to the method folder (Component.label:
    snapkv_window_size=8_pooling=avg, adakv_floor_ratio=0.5, snapkv_head_allocation=adakv-floor_ratio=0.3),
    and QUESTION_AS_DECODE_SUFFIX when the question is fed as decode steps, `_{mode}` under --shared_context."""
    folder = method.label() + (QUESTION_AS_DECODE_SUFFIX if question_as_decode else "")
    folder += f"_{shared_context}" if shared_context else ""
    return Path(save_dir) / f"{model_label(model_path)}_{method.sizing.folder_part(method)}" / folder


def check_model_args(args: argparse.Namespace, method: Method | None = None):
    """load_model's checks without loading weights: (resolved path, config, device, dtype). With the method:
    also what the method needs from the model (Method.check_model: head tables, quantizer settings, layers)."""
    from pyramidkv.models.loading import DTYPES, check_model, resolve_device_map
    from pyramidkv.models.patch import model_shape

    if getattr(args, "device_map", None) is not None:   # a JSON file is recorded and fingerprinted by its map
        args.device_map = resolve_device_map(args.device_map)
    checked = check_model(args.model_path, args.attn_implementation, args.device, args.dtype, args.model_class,
                          getattr(args, "device_map", None))
    config, dtype = checked[1], checked[3]
    if method is not None and config is not None:
        method.check_model(model_shape(config, DTYPES[dtype].itemsize, args.attn_implementation))
    return checked


def effective_method(method: Method, model_check) -> Method:
    """The method as it runs on the checked model: a setting given at what its default resolves to there written
    as the default (Method.normalized: cross_layer_start=15 of a 30-layer model is minicache's default)."""
    from pyramidkv.models.loading import DTYPES
    from pyramidkv.models.patch import model_shape

    config, dtype = model_check[1], model_check[3]
    return method if config is None else method.normalized(model_shape(config, DTYPES[dtype].itemsize))


def method_inputs(method: Method, config) -> dict[str, str]:
    """{name: path} of the files the method reads for the model of `config` (None: those it names)."""
    from pyramidkv.models.patch import model_shape

    return method.files_read(model_shape(config) if config is not None else None)


def run_fingerprint(args: argparse.Namespace, method: Method, model_check, extra: dict | None = None,
                    inputs: dict[str, str] | None = None) -> dict:
    """The generation fingerprint of this invocation (see pyramidkv/runner/run_folder.py); `inputs`: the files
    it reads (run_folder.input_files), by default the method's."""
    from pyramidkv.runner.run_folder import generation_fingerprint, input_digests, input_files, model_fingerprint

    path, config, device, dtype = model_check
    if inputs is None:
        inputs = input_files(method_inputs(method, config))
    # The method's settings are in the fingerprint's method section (its full description), whichever flags or
    # spec gave them: spelling out a default value is the same configuration as leaving it out.
    setting_args = {"method", *getattr(args, "_setting_dests", ())}
    arguments = {k: v for k, v in vars(args).items() if k not in setting_args and not k.startswith("_")}
    return generation_fingerprint(arguments, method, model_fingerprint(path),
                                  {"device": device.split(":")[0], "dtype": dtype}, extra, input_digests(inputs))


def check_shared_names(parser: argparse.ArgumentParser, method: Method) -> None:
    """One name, one meaning: a benchmark flag the user typed under a name that is also a setting of the
    method as chosen (RULER's --seed with the merge rule cam, whose seed is --merge_seed) is refused, naming
    the benchmark's other name for it and the setting's qualified name. ValueError."""
    benchmark_flags = getattr(parser, "benchmark_flags", set())
    for dest, option in getattr(parser, "given", {}).items():
        if option not in benchmark_flags:
            continue
        name = option.lstrip("-")
        owners = [f"{method.name}'s {name}" for f in dataclasses.fields(method) if f.name == name]
        for axis in AXES:
            unit = getattr(method, axis.field)
            if unit is not None and name in {f.name for f in dataclasses.fields(unit)}:
                qualified = axis.qualified(name)
                owners.append(f"the {axis.kind} {unit.name}'s {name}" + (f" (write --{qualified})"
                                                                         if qualified != name else ""))
        if owners:
            action = parser._option_string_actions[option]
            other = next((o for o in action.option_strings if o != option), None)
            benchmark = getattr(parser, "benchmark_name", "the benchmark")
            raise ValueError(f"{option} names two settings here: {benchmark}'s {dest}"
                             f"{f' (write {other})' if other else ''} and {' and '.join(owners)}; write the one you "
                             f"mean")
