"""The method and model a command line asks for: the method built from --method and the setting flags (errors
name the flags as typed), a benchmark flag that shares a name with one of its settings refused, the model's
config checked without loading weights, and the method as it runs on that model."""

from __future__ import annotations

import argparse
import dataclasses

from pyramidkv.methods import Method, canonical, get_method_class
from pyramidkv.methods.settings import AXES, build_method, read_settings, split_spec


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
