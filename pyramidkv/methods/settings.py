"""Every setting of a method and of its units under one name, and the method spec that writes a whole
configuration as one line: `snapkv:budget=128,window_size=8,merge=cam,merge_sampling=true,merge_seed=3`.

Names. A method's own settings keep their field names, and so do a capability's (pyramidkv/capabilities: the
selection knobs, decode budget, page selection, key channels, layer sharing: `page_size`, `decode_interval`):
its switch (`page_budget`, `decode_budget`, `key_channel_ratio`, `cross_layer_merge=true`) turns it on, and its
other settings only apply with it. A unit's setting (an allocator's, a merge rule's, a quantizer's) is named
by its field when no other axis and no method has a field of that name
(`nbits`, `merge_fraction`), and always also by its axis-qualified name: `head_` / `layer_` / `merge_` /
`quant_` + field (`quant_rank`, `merge_seed`); a field that starts with its axis prefix is its own
qualified name (`head_beta`). A bare name that units on two axes share (`seed`: CaM and GEAR) must be
qualified when both are chosen; otherwise it goes to the one chosen unit that has it.

The sizing (pyramidkv/sizing) is flat too, and its kind is chosen by the setting given: `budget` (tokens),
`budget_ratio` (ratio), `threshold` / `threshold_decoding` (threshold); two kinds at once are refused. On a method
that keeps every token a unit reading a budget per step takes the budget names (Quest: `budget` is its
`page_budget`); the legacy `head_allocation=threshold` of older specs chooses the threshold kind.

Aliases: kvpress's `compression_ratio`, the fraction of the cache removed, read as `budget_ratio = 1 -
compression_ratio` (refused with a budget or budget_ratio). A name is given once (an alias and its setting
together are refused).

The spec `NAME[:setting=value,...]` uses these names; values are read by each field's type (integers in ASCII
digits, finite numbers in ASCII, booleans true/false, none for None; a string holding `,` `=` `:` or `"` is
written in double quotes). docs/method_spec.md shows each rule with examples (tested). `method_spec`
prints a method back in canonical form: the settings that differ from the method's defaults, in field order,
each unit's changed settings right after it, so a spec that spells out default values names the same
configuration as one that leaves them out, and `parse(print(m)) == m`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Iterable, Optional

from pyramidkv.allocation import HEAD_ALLOCATIONS, LAYER_ALLOCATIONS, make_head_allocation, make_layer_allocation
from pyramidkv.capabilities import CAPABILITIES, make_capability
from pyramidkv.components import flat_settings, parse_setting, setting_text
from pyramidkv.merging import MERGE_RULES, make_merge_rule
from pyramidkv.methods.base import CAPABILITY_AXES, Method
from pyramidkv.quantization import QUANTIZERS, make_quantizer
from pyramidkv.sparse_prefill import SPARSE_PREFILLS, make_sparse_prefill
from pyramidkv.sizing import SIZING_SETTINGS, SIZINGS, Sizing, choose_sizing, make_sizing


@dataclass(frozen=True)
class Axis:
    """A method field that holds a unit: its registry, its name prefix, and how errors call its units."""

    field: str
    registry: dict
    prefix: str
    kind: str
    make: typing.Callable
    flat: bool = False    # a capability: its settings are named as the method's own, no prefix

    def qualified(self, setting: str) -> str:
        return setting if self.flat or setting.startswith(self.prefix) else self.prefix + setting

    @property
    def unit(self) -> type:
        """The axis's first unit (a capability axis's settings name it when the axis is off)."""
        return next(iter(self.registry.values()))

    def fields(self) -> dict[str, list[str]]:
        """{setting: [units that have it]} over the registry, in registration order (computed once per state of
        the registry: every setting name a method is built from is resolved through it)."""
        key = (self.field, tuple((name, id(cls)) for name, cls in self.registry.items()))
        if key not in _AXIS_FIELDS:
            found: dict[str, list[str]] = {}
            for unit_name, cls in self.registry.items():
                for f in dataclasses.fields(cls):
                    found.setdefault(f.name, []).append(unit_name)
            _AXIS_FIELDS[key] = found
        return _AXIS_FIELDS[key]


_AXIS_FIELDS: dict[tuple, dict[str, list[str]]] = {}


AXES = (
    Axis("sizing", SIZINGS, "", "sizing", make_sizing, flat=True),
    Axis("head_allocation", HEAD_ALLOCATIONS, "head_", "head allocation", make_head_allocation),
    Axis("layer_allocation", LAYER_ALLOCATIONS, "layer_", "layer allocation", make_layer_allocation),
    Axis("merge", MERGE_RULES, "merge_", "merge rule", make_merge_rule),
    Axis("quant_method", QUANTIZERS, "quant_", "quantizer", make_quantizer),
    Axis("prefill_attention", SPARSE_PREFILLS, "prefill_", "prefill attention", make_sparse_prefill),
    *(Axis(axis, table, "", next(iter(table.values())).title, lambda name, axis=axis: make_capability(axis, name),
           flat=True) for axis, table in CAPABILITIES.items()),
)
AXIS_BY_FIELD = {axis.field: axis for axis in AXES}
# Switches that are no field of their unit (cross_layer_merge=true): {switch: its axis}.
SWITCHES = {axis.unit.switch: axis for axis in AXES if axis.flat and axis.unit.switch
            and axis.unit.switch not in {f.name for f in dataclasses.fields(axis.unit)}}
# Switches that are a field of their unit (page_budget, decode_budget, key_channel_ratio): at their off value they
# turn the capability off.
FIELD_SWITCHES = {axis.unit.switch: axis for axis in AXES if axis.flat and axis.unit.switch
                  and axis.unit.switch not in SWITCHES}


def _method_fields(cls: type[Method]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def bare_unit_names(method_fields: Iterable[str]) -> dict[str, Axis]:
    """Unit settings whose bare field name is unambiguous over every registry: {name: its axis}."""
    taken = set(method_fields)
    owners: dict[str, list[Axis]] = {}
    for axis in AXES:
        for setting in axis.fields():
            owners.setdefault(setting, []).append(axis)
    return {name: axes[0] for name, axes in owners.items() if len(axes) == 1 and name not in taken}


def unit_key(axis: Axis, setting: str, method_fields: Iterable[str]) -> str:
    """The shortest name of a unit setting: its field when unambiguous, else its qualified name."""
    return setting if bare_unit_names(method_fields).get(setting) is axis else axis.qualified(setting)


class SpecError(ValueError):
    """A setting name or value that cannot be read."""


# --- building a method from named settings -------------------------------------------------------

def _chosen_unit(axis: Axis, value):
    """The unit class an axis value stands for (a name, an object, or None)."""
    if value is None:
        return None
    if isinstance(value, str):
        key = value.lower()
        if key not in axis.registry:
            raise ValueError(f"unknown {axis.kind} {value!r}; choose one of: {', '.join(axis.registry)}")
        return axis.registry[key]
    return type(value)


def _qualified_names() -> dict[str, tuple[Axis, str]]:
    """{name: (axis, field)} of every unit setting written qualified (head_floor_ratio) or flat (a capability's
    page_size), the first axis in AXES order where two give one name; per state of the registries."""
    key = tuple(id(axis.fields()) for axis in AXES)
    if key not in _QUALIFIED:
        names: dict[str, tuple[Axis, str]] = {}
        for axis in AXES:
            for setting in axis.fields():
                if axis.flat or setting.startswith(axis.prefix) or axis.qualified(setting) != setting:
                    names.setdefault(axis.qualified(setting), (axis, setting))
        _QUALIFIED.clear()
        _QUALIFIED[key] = names
    return _QUALIFIED[key]


_QUALIFIED: dict[tuple, dict[str, tuple[Axis, str]]] = {}


def resolve(cls: type[Method], key: str, chosen: dict[str, Optional[type]]) -> tuple[Optional[Axis], str]:
    """(axis or None for the method itself, field) that the setting name `key` denotes, given the unit class
    chosen on each axis. ValueError naming the unit to choose, or the qualified names to write."""
    own = _method_fields(cls)
    if key in own:
        return None, key
    qualified = _qualified_names()
    if key in qualified:
        return qualified[key]
    having = [axis for axis in AXES if key in axis.fields()]
    if not having:
        names = [*SIZING_SETTINGS, *(name for name in own if name != "sizing")]
        raise ValueError(f"{cls.name} has no setting {key!r}; its settings are: {', '.join(names)}, plus those of "
                         f"its units ({_unit_settings_hint(own)})")
    picked = [axis for axis in having if chosen[axis.field] is not None
              and key in {f.name for f in dataclasses.fields(chosen[axis.field])}]
    if len(picked) > 1:
        raise ValueError(f"{key!r} is a setting of the {' and of the '.join(a.kind for a in picked)} chosen here; "
                         f"write {' or '.join(a.qualified(key) for a in picked)}")
    if picked:
        return picked[0], key
    if len(having) > 1:
        owners = " and the ".join(f"{a.kind} {' / '.join(a.fields()[key])}" for a in having)
        raise ValueError(f"{key!r} is a setting of the {owners}, and {cls.name} has none of them chosen; choose one "
                         f"and write {' or '.join(a.qualified(key) for a in having)}")
    return having[0], key


def _unit_settings_hint(method_fields) -> str:
    parts = []
    for axis in AXES:
        for unit_name, unit in axis.registry.items():
            names = [unit_key(axis, f.name, method_fields) for f in dataclasses.fields(unit)]
            if names:
                parts.append(f"{unit_name}: {', '.join(names)}")
    return "; ".join(parts)


def build_method(cls: type[Method], settings: dict, label=None) -> Method:
    """The method `cls` with `settings` ({name: value}, names as in the module docstring). A setting the
    method and its chosen units do not have is an error, and so is one that has no effect (`only_with`),
    even at its default value. label(name) is how errors name a setting (the command line passes its flags)."""
    label = label or (lambda name: name)
    own_fields = _method_fields(cls)
    settings = _resolve_aliases(cls, settings, label)
    sizing = {k: settings.pop(k) for k in list(settings) if k in SIZING_SETTINGS}
    own = {k: v for k, v in settings.items() if k in own_fields}
    if sizing or isinstance(own.get("sizing"), str):
        own["sizing"] = choose_sizing(own.get("sizing", own_fields["sizing"].default), sizing, label, cls.name)
        if own["sizing"].outcome:   # the threshold decides the heads' shares
            own.setdefault("head_allocation", "uniform")
    chosen = {axis.field: _chosen_unit(axis, own.get(axis.field, own_fields[axis.field].default)) for axis in AXES}
    per_axis: dict[str, dict] = {axis.field: {} for axis in AXES}
    names: dict[tuple[str, str], str] = {}
    for key, value in settings.items():
        if key in own_fields:
            continue
        axis, setting = resolve(cls, key, chosen)
        unit = chosen[axis.field]
        if unit is None and axis.flat:
            unit = _switch_on(axis, key, setting, value, chosen, own, label)
            if unit is None:
                continue
        if unit is None:
            owners = axis.fields()[setting]
            raise ValueError(f"{label(key)} is a setting of the {axis.kind} {' / '.join(owners)}, but {cls.name} has "
                             f"no {axis.field}; choose one with {axis.field}={owners[0]!r} "
                             f"(--{axis.field} {owners[0]})")
        if setting not in {f.name for f in dataclasses.fields(unit)}:
            owners = axis.fields()[setting]
            raise ValueError(f"{label(key)} is a setting of the {axis.kind} {' / '.join(owners)}, not of "
                             f"{unit.name}; choose {axis.field}={owners[0]!r}, or leave {label(key)} out")
        if setting in per_axis[axis.field]:
            raise ValueError(f"{label(key)} and {label(names[(axis.field, setting)])} name the same setting "
                             f"({axis.kind} {unit.name}: {setting}); give it once")
        per_axis[axis.field][setting] = value
        names[(axis.field, setting)] = key
    for axis in AXES:
        if not per_axis[axis.field]:
            continue
        current = own.get(axis.field, own_fields[axis.field].default)
        if isinstance(current, type):   # a capability its switch turned on: built with its settings
            own[axis.field] = current(**per_axis[axis.field])
            continue
        base = axis.make(current) if isinstance(current, str) else current
        own[axis.field] = dataclasses.replace(base, **per_axis[axis.field])
    method = cls(**own)
    method.check_given([k for k in own if k in own_fields], label)
    for axis in AXES:
        unit = getattr(method, axis.field)
        if unit is not None and per_axis[axis.field]:
            unit.check_given(per_axis[axis.field], lambda s, a=axis: label(names.get((a.field, s), unit_key(
                a, s, own_fields))))
    return method


def _resolve_aliases(cls: type[Method], settings: dict, label) -> dict:
    """Settings under the names they stand for: a method's budget aliases (quest: budget -> page_budget) and
    the switches that are no field (cross_layer_merge=true -> layer_sharing='minicache', false -> None)."""
    out, given = {}, {}
    if COMPRESSION_RATIO in settings:
        budgets = [f"{label(k)}={settings[k]!r}" for k in ("budget", "budget_ratio", *budget_names(cls).values())
                   if k in settings]
        if budgets:
            raise ValueError(f"{label(COMPRESSION_RATIO)}={settings[COMPRESSION_RATIO]!r} and {' and '.join(budgets)} "
                             f"both give the budget "
                             f"({COMPRESSION_RATIO} is kvpress's fraction removed, 1 - budget_ratio); give one")
    names = budget_names(cls)
    for key, value in settings.items():
        if key == COMPRESSION_RATIO:
            key, value = "budget_ratio", _complement(value, label(key))
        if (key, str(value).lower()) == LEGACY_THRESHOLD:
            key = "sizing"
        target = names.get(key, key)
        axis = SWITCHES.get(key) or FIELD_SWITCHES.get(target)
        if axis is not None and (key in SWITCHES or value == axis.unit.switch_off):  # on / off by its switch
            target = axis.field
            if key in SWITCHES and isinstance(value, bool):
                value = axis.unit.name if value else None
            elif key not in SWITCHES:
                value = None
        if target in out:
            raise ValueError(f"{label(key)} and {label(given[target])} name the same setting ({target}); give it once")
        out[target], given[target] = value, key
    return out


# Specs before threshold eviction became a sizing chose it as head_allocation=threshold: read as sizing=threshold.
LEGACY_THRESHOLD = ("head_allocation", "threshold")

# kvpress's compression ratio, the fraction of the cache removed: an alias of budget_ratio = 1 - it.
COMPRESSION_RATIO = "compression_ratio"


def _complement(ratio, name: str) -> float:
    """budget_ratio of a compression ratio, exact in decimal (1 - 0.9 is 0.1, not 0.09999999999999998)."""
    import decimal

    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ValueError(f"{name} (kvpress's fraction of the cache removed, 1 - budget_ratio) must be a number in "
                         f"(0, 1), got {ratio!r}")
    kept = float(1 - decimal.Decimal(repr(float(ratio))))
    if kept >= 1:   # 0, or so small that 1 - it rounds to 1: nothing removed
        raise ValueError(f"{name} {ratio!r} removes nothing: budget_ratio = 1 - {ratio!r} "
                         f"{'is' if ratio == 0 else 'rounds to'} 1, every prompt token kept (that is fullkv); allowed: "
                         f"0 < {name} < 1, large enough that 1 - it is below 1 (>= 1e-16)")
    return kept


def _switch_on(axis: Axis, key: str, setting: str, value, chosen: dict, own: dict, label):
    """A capability setting given while its axis is off: its switch turns the unit on (None when the value is the
    switch's off value); any other setting is refused, naming the switch."""
    unit = axis.unit
    if setting == unit.switch:
        if value == unit.switch_off:
            return None
        chosen[axis.field] = own[axis.field] = unit
        return unit
    raise ValueError(f"{label(key)}={value!r} has no effect without {unit.switch} ({unit.title}): {label(key)}="
                     f"{value!r} only applies with {unit.switch}; set {unit.switch} too, or leave {label(key)} out")


# --- the spec: one line for a whole configuration -----------------------------------------------

def split_spec(text: str) -> tuple[str, list[tuple[str, str]]]:
    """NAME[:key=value,...] -> (name, [(key, raw value)]); a value in double quotes is a JSON string."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"method spec {text!r}: expected NAME[:setting=value,...]")
    name, _, rest = text.strip().partition(":")
    items: list[tuple[str, str]] = []
    position = 0
    while rest and position < len(rest):
        key, sep, _ = rest[position:].partition("=")
        if not sep or not key or "," in key:
            raise SpecError(f"method spec {text!r}: expected NAME:setting=value[,setting=value...], got "
                            f"{rest[position:].split(',')[0]!r}")
        position += len(key) + 1
        if rest[position:position + 1] == '"':
            try:
                value, length = json.JSONDecoder().raw_decode(rest[position:])
            except json.JSONDecodeError:
                raise SpecError(f"method spec {text!r}: unterminated quoted value for {key}") from None
            position += length
        else:
            end = rest.find(",", position)
            end = len(rest) if end < 0 else end
            value, position = rest[position:end], end
        items.append((key.strip(), value))
        if position < len(rest):
            if rest[position] != ",":
                raise SpecError(f"method spec {text!r}: expected ',' after the value of {key}")
            position += 1
    return name.strip().lower(), items


def annotation_of(cls: type[Method], key: str, chosen: dict[str, Optional[type]]):
    """The type annotation of the field that setting `key` names (for reading its value from text)."""
    if key in SWITCHES:
        return bool
    if key == COMPRESSION_RATIO:
        return float
    key = key if key in _method_fields(cls) else budget_names(cls).get(key, key)
    axis, setting = resolve(cls, key, chosen)
    owner = cls if axis is None else chosen[axis.field]
    if owner is None or setting not in {f.name for f in dataclasses.fields(owner)}:
        owner = axis.registry[axis.fields()[setting][0]]   # not the chosen unit's: build_method names the problem
    return typing.get_type_hints(owner)[setting]


def read_settings(cls: type[Method], items: list[tuple[str, str]], label=None) -> dict:
    """Text values of a spec (or command line) read by their fields' types: {name: value}."""
    label = label or (lambda name: name)
    own_fields = _method_fields(cls)
    items = [("sizing", raw) if (key, str(raw).strip().lower()) == LEGACY_THRESHOLD else (key, raw)
             for key, raw in items]
    seen: set = set()
    for key, _ in items:
        if key in seen:
            raise SpecError(f"{label(key)} is given twice")
        seen.add(key)
    given = {k: (None if v.strip().lower() == "none" else v) for k, v in items if k in AXIS_BY_FIELD}
    chosen = {axis.field: _chosen_unit(axis, given.get(axis.field, own_fields[axis.field].default)) for axis in AXES}
    settings = {}
    for key, raw in items:
        if key in AXIS_BY_FIELD:
            settings[key] = given[key]
            continue
        annotation = annotation_of(cls, key, chosen)
        try:
            settings[key] = parse_setting(raw, annotation) if isinstance(raw, str) else raw
        except ValueError as e:
            raise SpecError(f"{label(key)}: {e}") from None
    return settings


def method_spec(method: Method) -> str:
    """The canonical spec of a method: NAME:changed settings (see the module docstring)."""
    own_fields = _method_fields(type(method))
    parts = []
    for name, f in own_fields.items():
        value, default = getattr(method, name), f.default
        axis = AXIS_BY_FIELD.get(name)
        if axis is None:
            if value != default:
                parts.append((name, value))
            continue
        if isinstance(value, Sizing):
            parts.extend(value.changes(default))
            continue
        if axis.flat:
            unit = type(value) if value is not None else type(default) if default is not None else axis.unit
            before, after = flat_settings(unit, default), flat_settings(unit, value)
            aliases = {v: k for k, v in budget_names(type(method)).items()}
            parts.extend((aliases.get(k, k), v) for k, v in after.items() if v != before.get(k))
            continue
        if value is None:
            if default is not None:
                parts.append((name, None))
            continue
        if default is None or type(value) is not type(default):
            parts.append((name, value))
            reference = type(value)()
        else:
            reference = default
        for unit_field in dataclasses.fields(value):
            setting = getattr(value, unit_field.name)
            if setting != getattr(reference, unit_field.name):
                parts.append((unit_key(axis, unit_field.name, own_fields), setting))
    return method.name + ("" if not parts else ":" + ",".join(f"{k}={_quote(setting_text(v))}" for k, v in parts))


def _quote(text: str) -> str:
    return json.dumps(text) if (not text or any(c in text for c in ',=:"') or text != text.strip()) else text


def default_units(cls: type[Method]) -> list:
    """The capability units a method class has on by default."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return [defaults[axis] for axis in CAPABILITY_AXES if defaults[axis] is not None]


def budget_names(cls: type[Method]) -> dict[str, str]:
    """{budget name: the unit setting it stands for} on a method whose default sizing lends the budget to a unit
    (quest: budget -> page_budget); {} otherwise."""
    default = {f.name: f.default for f in dataclasses.fields(cls)}["sizing"]
    return default.budget_names(default_units(cls))


def sizing_of(cls: type[Method], settings: Optional[dict] = None) -> Sizing:
    """The sizing `cls` gets from `settings` (read_settings' {name: value}) without a budget given by a runner:
    the kind they name over the class default (the legacy head_allocation=threshold included)."""
    settings = settings or {}
    default = {f.name: f.default for f in dataclasses.fields(cls)}["sizing"]
    if isinstance(settings.get("head_allocation"), str) and settings["head_allocation"].lower() == "threshold":
        default = make_sizing("threshold")
    given = {k: v for k, v in settings.items() if k in SIZING_SETTINGS and k not in budget_names(cls)}
    if COMPRESSION_RATIO in settings:
        given.setdefault("budget_ratio", None)   # kvpress's fraction removed names a ratio
    try:
        return choose_sizing(settings.get("sizing", default), given)
    except (TypeError, ValueError):
        return default


def budget_flag_applies(cls: type[Method], settings: Optional[dict] = None) -> bool:
    """Whether the runners' budget flag (--max_capacity_prompts) sets a budget of `cls` given `settings`: its sizing
    (or a unit reading a budget, quest's pages) takes one, and the settings give none."""
    settings = settings or {}
    if {"budget", "budget_ratio", COMPRESSION_RATIO} & set(settings):
        return False
    return sizing_of(cls, settings).reads_budget_flag(default_units(cls))


def method_from_spec(cls: type[Method], items: list[tuple[str, str]], budget: Optional[int] = None,
                     **defaults) -> Method:
    """The method of a split spec; `budget` applies when the method takes one and the spec gives neither budget
    nor budget_ratio, each of `defaults` when the method has that setting and the spec does not give it."""
    settings = read_settings(cls, items)
    own = _method_fields(cls)
    if budget is not None and budget_flag_applies(cls, settings):
        settings["budget"] = budget
    for key, value in defaults.items():
        if key in own and key not in settings:
            settings[key] = value
    return build_method(cls, settings)
