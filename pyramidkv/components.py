"""The settings base of every unit of pyramidkv: methods, allocators, merge rules and quantizers.

A unit is a frozen dataclass whose fields are its settings, with their defaults there and nowhere
else. When a unit is built its settings are checked by type (the field annotations: `True` is not
an integer, `"0.5"` is not a number) and by range (`validate`, written by the unit). `describe()`
is what run_meta.json records, `label()` what a run-folder name shows, `changed_settings()` the
settings that differ from the defaults; units nested in a unit (a method's allocators) are
described and labelled by their own `describe()` / `label()`.

A setting is documented in its class docstring, one entry per field: a line `name: text`, continued
by lines indented deeper (`setting_help` reads them; the command line's help comes from there). A
setting that only matters when another one is on names it in `only_with` ({"seed": "sampling"}):
giving it without the other is an error, never silently ignored.

A *flat* unit (`flat = True`: a method's selection knobs, decode budget, page selection, key channels,
layer sharing) names its fields as its owner's own settings (`page_size`, `decode_interval`), so its owner
labels and describes them inline, as if they were its own fields: a flat unit that is off (None) reads as
its `switch` at `switch_off` (`key_channel_ratio=0`, `cross_layer_merge=False`) and its other fields at
their defaults.

It also holds the two helpers every floor above uses on files: `model_digest` (a model folder by its content)
and `atomic_write` (a file replaced whole, with the permissions open() gives). This module imports nothing of
pyramidkv (floor 0 of the layering in docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import re
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Optional


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type (a ValueError too, so callers catching bad settings catch it)."""


def _type_error(owner: str, setting: str, value, expected: str) -> SettingTypeError:
    return SettingTypeError(f"{owner}: {setting} must be {expected}, got {value!r} ({type(value).__name__})")


def check_setting_type(owner: str, setting: str, value, annotation) -> None:
    """Check one setting against its annotation: int (not bool), float (finite, int allowed), str,
    bool, a class (an instance of it), or Optional[...] of those. Raises SettingTypeError naming
    the owner, the setting and the value."""
    if typing.get_origin(annotation) is typing.Union:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return
        annotation = options[0]
    if annotation is bool:
        if not isinstance(value, bool):
            raise _type_error(owner, setting, value, "True or False")
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(owner, setting, value, "an integer")
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _type_error(owner, setting, value, "a finite number")
    elif annotation is str:
        if not isinstance(value, str):
            raise _type_error(owner, setting, value, "a string")
    elif isinstance(annotation, type) and not isinstance(value, annotation):
        raise _type_error(owner, setting, value, f"a {annotation.__name__}")


_BOOL_TEXT = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
# What a number may look like as text: ASCII only (Python's int() and float() also take other scripts' digits,
# `1_0`, surrounding blanks, `inf` and `nan`).
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def read_int(text: str) -> int:
    """An integer written in ASCII digits with an optional sign; ValueError saying so for anything else
    (`٨`, `1_0`, `1e3`, `8.0`)."""
    if not _INTEGER.fullmatch(text):
        raise ValueError(f"expected an integer (ASCII digits, e.g. 128), got {text!r}")
    return int(text)


def read_float(text: str) -> float:
    """A finite number written in ASCII (`0.5`, `.5`, `1e-3`, `3`); ValueError for anything else (`nan`, `inf`,
    `1_0`, other scripts' digits) and for a value too large to be finite (`1e400`)."""
    if not _NUMBER.fullmatch(text):
        raise ValueError(f"expected a finite number (ASCII, e.g. 0.5), got {text!r}")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r} (too large)")
    return value


def parse_setting(text: str, annotation):
    """A setting's value from text (a spec item or a command-line word), converted by the field's annotation:
    int (read_int), float (read_float), bool (true/false/yes/no/1/0), str, Optional[...] ("none" is None), or a
    unit class (its name, kept as text: the method builds the unit). ValueError naming what was expected."""
    if typing.get_origin(annotation) is typing.Union:
        if text.strip().lower() == "none":
            return None
        annotation = [a for a in typing.get_args(annotation) if a is not type(None)][0]
    if annotation is bool:
        key = text.strip().lower()
        if key not in _BOOL_TEXT:
            raise ValueError(f"expected true or false, got {text!r}")
        return _BOOL_TEXT[key]
    if annotation is int:
        return read_int(text.strip())
    if annotation is float:
        return read_float(text.strip())
    return text


def setting_text(value) -> str:
    """A setting as a spec writes it, read back to the same value by parse_setting: floats exactly (repr),
    booleans true/false, None as none, a unit by its name."""
    if isinstance(value, Component):
        return value.name
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


@functools.lru_cache(maxsize=None)   # read once per class: every run's parser asks for every method's
def setting_help(cls: type) -> dict[str, str]:
    """Each field's documentation from the class docstrings, the most derived class first: in a docstring a
    line `name: text` (name a field of the class) starts the entry, lines indented deeper continue it."""
    names = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        doc = inspect.cleandoc(vars(klass).get("__doc__") or "")
        entry, indent = None, 0
        for line in doc.splitlines():
            match = re.match(r"^(\s*)([A-Za-z_]\w*): (.*)$", line)
            if match and match.group(2) in names and (entry is None or len(match.group(1)) <= indent):
                entry, indent = match.group(2), len(match.group(1))
                if entry not in found:
                    found[entry] = match.group(3).strip()
                else:
                    entry = "-"          # documented by a more derived class already: skip its lines
                continue
            stripped = line.strip()
            if entry is not None and stripped and len(line) - len(line.lstrip()) > indent:
                if entry != "-":
                    found[entry] += " " + stripped
                continue
            entry = None
    return {name: found[name] for name in (f.name for f in dataclasses.fields(cls)) if name in found}


def _text(value) -> str:
    """A setting as a folder name shows it: floats with :g, no '/' and no spaces."""
    if isinstance(value, Component):
        return value.label()
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text.replace("/", "-").replace(" ", "")


@dataclass(frozen=True)
class AttentionForm:
    """How a model turns its queries and keys into attention, as its modeling file computes it: the logit
    q . k * scale, soft-capped to softcap * tanh(logit / softcap) where the model caps (Gemma2), then a softmax over
    the keys the layer's sliding window covers. The model's glue builds it (models/glue.py `attention_form`); the
    cache gets it once, inside the ModelShape, and every store and scorer reads it from there.

    Inside the engine (pyramidkv/core) queries come scaled so that q . k / sqrt(D) is the model's logit (the
    patched attention folds `scale` into them), so the engine computes its logits as q . k / sqrt(D) and applies
    `cap` (or `logits`) to them; the form's scale is the model-side attention's (eager, sdpa, flash-attn).

    scale: the logit's scale; None: 1 / sqrt(head_dim), computed as the Llama files do (a division).
    softcap: the logit soft-cap; None: none.
    windows: per layer its sliding window W (a query at p attends to p - W + 1 .. p), None: global; (): every
        layer global.
    """

    scale: Optional[float] = None
    softcap: Optional[float] = None
    windows: tuple = ()

    def window(self, layer: int) -> Optional[int]:
        """The layer's sliding window W, None: global."""
        return self.windows[layer] if self.windows else None

    @property
    def sliding(self) -> bool:
        """Some layer has a sliding window."""
        return any(w is not None for w in self.windows)

    @property
    def capped(self) -> bool:
        """The logits are soft-capped."""
        return self.softcap is not None

    def cap(self, logits):
        """Logits (a tensor) soft-capped where the model caps, in the modeling file's order of operations
        (tanh(logit / softcap) * softcap); unchanged where it does not. Applied before any mask."""
        return logits if self.softcap is None else (logits / self.softcap).tanh() * self.softcap

    def logits(self, queries, keys_t):
        """The attention logits of queries [..., r, D] against transposed keys keys_t [..., D, n]: [..., r, n],
        soft-capped where the model caps. The queries come scaled (the logit is their plain product)."""
        return self.cap(queries @ keys_t)


@dataclass(frozen=True)
class Conflict:
    """`setting` (a method setting, flat names included) refused next to a unit when `applies(method)`; `why`
    may name the method's values as `{m.<setting>}` (str.format with m = the method). A capability's refusal
    reads "<unit> does not combine with <setting>=<value> (<why>)"; a sizing's is `why` itself."""

    setting: str
    applies: Callable[[object], bool]
    why: str


@dataclass(frozen=True)
class ModelShape:
    """What a component's checks may need to know about the model being compressed (no weights)."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    name: str = ""            # model path or hub id (HeadKV looks up its packaged head table by it)
    head_dim: int = 0         # 0: unknown (the checks that need it are skipped)
    dtype_bytes: int = 0      # bytes per value of the unquantized cache (the model dtype); 0: unknown
    context_window: int = 0   # max_position_embeddings; 0: unknown
    form: AttentionForm = AttentionForm()   # scale, soft-cap and sliding windows of its attention


@dataclass(frozen=True)
class Component:
    name: ClassVar[str] = ""
    # The key under which describe() records the name ("method" for methods, as run_meta.json has it).
    kind_key: ClassVar[str] = "name"
    # label() joins the name and the changed settings with this ("adakv-floor_ratio=0.5",
    # "snapkv_window_size=8").
    label_separator: ClassVar[str] = "-"
    # Settings label() leaves out (a method's budget is its own part of the folder name).
    unlabelled: ClassVar[tuple[str, ...]] = ()
    # How errors name a setting, where the command line knows it by another name.
    setting_labels: ClassVar[dict[str, str]] = {}
    # setting -> the setting that must be on (not None, not False) for it to have any effect.
    only_with: ClassVar[dict[str, str]] = {}
    # A flat unit's settings read as its owner's (see the module docstring); `switch` is the setting that turns
    # it on (a field of the unit, or a name of its own such as cross_layer_merge) and `switch_off` its value off.
    flat: ClassVar[bool] = False
    switch: ClassVar[str] = ""
    switch_off: ClassVar[object] = None
    # An owner's settings that hold flat units, by the unit class they hold when on ({"pages": QuestPages}).
    flat_units: ClassVar[dict[str, type]] = {}
    # Settings whose value names a file the unit reads (a head table, a pattern table): a run fingerprints them
    # by content (files_read).
    path_settings: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            check_setting_type(self.name or type(self).__name__, self.setting_labels.get(f.name, f.name),
                               getattr(self, f.name), hints[f.name])
        self.validate()
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        self.check_given(name for name in self.only_with if getattr(self, name) != defaults[name])

    def check_given(self, settings, label=None) -> None:
        """Refuse settings (given by the user, even at their default value) that have no effect because the
        setting they need is off (`only_with`). label(setting) names it as the user wrote it."""
        label = label or (lambda setting: setting)
        for setting in settings:
            needed = self.only_with.get(setting)
            if needed is not None and (getattr(self, needed) is None or getattr(self, needed) is False):
                raise ValueError(f"{self.name or type(self).__name__}: {label(setting)}={getattr(self, setting)!r} has no "
                                 f"effect without {label(needed)} (it only applies with {label(needed)}); set "
                                 f"{label(needed)} too, or leave {label(setting)} out")

    def validate(self) -> None:
        """Range checks; raise ValueError naming the setting, the value and what is allowed."""

    def describe(self) -> dict:
        """The full configuration: the name and every setting (nested units as their own describe(), flat
        units inline)."""
        out = {self.kind_key: self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flat = self.flat_units.get(f.name)
            if flat is not None:
                out.update(flat_settings(type(value) if value is not None else flat, value))
            else:
                out[f.name] = value.describe() if isinstance(value, Component) else value
        return out

    def setting(self, name: str):
        """A setting by the name a spec uses: a field, or a flat unit's setting (its off value when off)."""
        if name in self.__dataclass_fields__:
            return getattr(self, name)
        for field, unit_class in self.flat_units.items():
            if field not in vars(self):   # not built yet
                break
            unit = vars(self)[field]
            values = flat_settings(type(unit) if unit is not None else unit_class, unit)
            if name in values:
                return values[name]
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def files_read(self, model: Optional[ModelShape] = None) -> dict[str, str]:
        """{how a message names it ("pattern_table=t.json"): path} of every file this unit and the units in it
        read: the `path_settings` given, and what a unit reads in their place (`packaged_files`)."""
        out = {f"{name}={getattr(self, name)}": str(getattr(self, name)) for name in self.path_settings
               if getattr(self, name) is not None}
        out.update(self.packaged_files(model))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Component):
                out.update(value.files_read(model))
        return out

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        """The packaged files the unit reads for `model` where a path setting is left out (none by default)."""
        return {}

    def file_read(self, name: str) -> Path:
        """The file the path setting `name` makes the unit read (a unit whose setting may name a folder maps it to
        the file read in it)."""
        return Path(str(getattr(self, name))).expanduser()

    def with_packaged_defaults(self, model: Optional[ModelShape]):
        """The same unit with each path setting that names the very file the unit reads for `model` when it is left
        out (the packaged one, the same file on disk) left out, in this unit and the units in it: one computation,
        one name (a run folder, a leaderboard entry)."""
        changes = {}
        for name in self.path_settings:
            if getattr(self, name) is None:
                continue
            try:
                packaged = dataclasses.replace(self, **{name: None}).packaged_files(model)
            except ValueError:   # none for this model: the given file is no default
                continue
            given = self.file_read(name)
            if given.is_file() and any(Path(p).is_file() and os.path.samefile(given, p) for p in packaged.values()):
                changes[name] = None
        for f in dataclasses.fields(self):
            unit = getattr(self, f.name)
            if isinstance(unit, Component) and f.name not in changes:
                resolved = unit.with_packaged_defaults(model)
                if resolved != unit:
                    changes[f.name] = resolved
        return dataclasses.replace(self, **changes) if changes else self

    def settings_at_default(self) -> list[str]:
        """Every setting (flat units' settings by their own names; another unit's as unit.setting, at its class's
        default) left at its default."""
        fields = self.__dataclass_fields__
        names = [name for name, f in fields.items() if getattr(self, name) == f.default]
        for name in fields:
            unit = getattr(self, name)
            if isinstance(unit, Component) and name not in self.flat_units:
                names += [f"{name}.{sub}" for sub, f in unit.__dataclass_fields__.items() if getattr(unit, sub) == f.default]
        for field, unit in self.flat_units.items():
            before, after = flat_settings(unit, fields[field].default), flat_settings(unit, getattr(self, field))
            names += [name for name, value in after.items() if before.get(name) == value]
        return names

    def changed_settings(self) -> list[tuple[str, object]]:
        """(setting, value) for every setting that differs from its default, in field order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]

    def label(self) -> str:
        """The name plus every changed setting, for folder names: adakv-floor_ratio=0.5,
        snapkv_window_size=8_pooling=avg. A nested unit of its default kind shows just its changed
        settings (pyramidkv_beta=10); one of another kind its label (head_allocation=adakv-floor_ratio=0.3)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        parts = [self.name]
        for setting, value in self.changed_settings():
            if setting in self.unlabelled:
                continue
            flat = self.flat_units.get(setting)
            if flat is not None and hasattr(value, "label_parts"):   # a unit whose kinds say what they show
                parts.extend(f"{name}={_text(v)}" for name, v in value.label_parts(defaults[setting], self.unlabelled))
            elif flat is not None:
                flat = type(value) if value is not None else type(defaults[setting]) if defaults[setting] else flat
                before, after = flat_settings(flat, defaults[setting]), flat_settings(flat, value)
                parts.extend(f"{name}={_text(v)}" for name, v in after.items()
                             if v != before.get(name) and name not in self.unlabelled)
            elif isinstance(value, Component) and type(value) is type(defaults[setting]):
                parts.extend(f"{name}={_text(v)}" for name, v in value.changed_settings())
            else:
                parts.append(f"{setting}={_text(value)}")
        return self.label_separator.join(parts)


def flat_settings(cls: "type[Component]", unit: "Component | None") -> dict:
    """A flat unit's settings as its owner shows them: {switch: on/off (when not a field), every field}; a unit
    that is off (None) as its switch at switch_off and its other fields at their defaults."""
    view = getattr(cls, "flat_view", None)
    if view is not None:   # a unit whose kinds show their own settings (a method's sizing)
        return view(unit)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    out = {}
    if cls.switch and cls.switch not in names:
        out[cls.switch] = cls.switch_off if unit is None else not cls.switch_off
    for f in fields:
        out[f.name] = (cls.switch_off if f.name == cls.switch else f.default) if unit is None else getattr(unit, f.name)
    return out


# --- a model's identity by its content --------------------------------------------------------------

# The record the default model's conversion leaves in its folder: {"model": name, "content_digest": ...}
# (models/default_model.py).
MODEL_RECORD = "pyramidkv_source.json"
# Settings config.json records about where and with what it was saved, not what the model is.
_UNIDENTIFYING = ("_name_or_path", "transformers_version")
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_digests: dict[tuple, str] = {}


def model_digest(folder) -> Optional[str]:
    """What a local model folder holds, as one digest: its config.json settings (canonical JSON, less
    _name_or_path and transformers_version) and each weights file's name and whole content. None for a hub id
    or a folder without config.json. Computed once per process for unchanged files (~1 s for 0.5 GB)."""
    folder = Path(str(folder)).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        return None
    weights = sorted({p for pattern in _WEIGHTS for p in folder.glob(pattern) if p.is_file()})
    key = (str(folder.resolve()), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in [config, *weights]))
    if key not in _digests:
        settings = json.loads(config.read_text(encoding="utf-8"))
        for name in _UNIDENTIFYING:
            settings.pop(name, None)
        h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))
        for path in weights:
            h.update(f"\0{path.name}\0{path.stat().st_size}\0".encode("utf-8"))
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
        _digests[key] = h.hexdigest()[:16]
    return _digests[key]


def packaged_model(model_name_or_path, digests: dict[str, str]) -> tuple[Optional[str], Optional[str]]:
    """Which of the packaged models ({name: content digest}) the model at `model_name_or_path` is, by content:
    (the name, None) when its folder's digest is one of them, or its folder holds the default model's
    conversion record (MODEL_RECORD) naming one of them with the digest the folder still has; else (None, the
    name its folder is named like, as a case-insensitive substring, the longest) or (None, None)."""
    folder = Path(str(model_name_or_path).rstrip("/\\")).expanduser()
    digest = model_digest(folder)
    if digest is not None:
        for name, known in digests.items():
            if digest == known:
                return name, None
        try:
            record = json.loads((folder / MODEL_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and record.get("model") in digests and record.get("content_digest") == digest:
            return record["model"], None
    last = folder.name.lower()
    alike = [name for name in digests if name and name.lower() in last]
    return None, max(alike, key=len) if alike else None


def packaged_table(model_name_or_path, tables: dict, models_file: Path, *, made_on: str, missing: str, make: str) -> Path:
    """The packaged table ({model name: path}) made for the model at `model_name_or_path`, known by its content
    (models_file: {model name: content digest}); ValueError `missing` (none for this model) or, where its folder
    is named like a packaged model it is not, naming `made_on` ("its packaged ... table was made for"). `make`:
    how to get a table for any model."""
    digests = json.loads(Path(models_file).read_text(encoding="utf-8"))
    model, alike = packaged_model(model_name_or_path, {name: digests[name] for name in tables if name in digests})
    if model is not None:
        return tables[model]
    if alike is not None:
        raise ValueError(f"{model_name_or_path!r} is named like {alike} but is not the model {made_on} (its config or "
                         f"weights differ: a fine-tune or another checkpoint); {make}")
    raise ValueError(f"{missing} for this model ({model_name_or_path!r}; packaged: {', '.join(sorted(tables)) or 'none'}); "
                     f"{make}")



# --- files written whole -----------------------------------------------------------------------------

def new_file_mode(folder: bool = False) -> int:
    """The permissions open() gives a new file (0666) or mkdir() a new folder (0777) under this process's umask."""
    mask = os.umask(0o22)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def check_output(path, folder: bool = False) -> None:
    """ValueError (one line) unless `path` can be written when the work is done: a file (or, `folder`, a folder
    its files go in) whose place is not taken by the other kind, under a folder that takes a new entry. Checked by
    making and removing a temporary folder in the nearest folder that exists (access() tells root yes on /proc);
    what is missing between it and `path` would be made."""
    path = Path(path)
    kind = "folder" if folder else "file"
    if path.exists() and path.is_dir() != folder:
        raise ValueError(f"{path} is a {'file' if folder else 'folder'}; give the path of a {kind}")
    nearest = path if folder and path.is_dir() else path.parent
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ValueError(f"{path}: {nearest} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check.", dir=nearest))
    except OSError as e:
        raise ValueError(f"{path} cannot be written: {nearest} takes no new {kind} ({e.strerror}); choose a {kind} "
                         f"where this user can write") from None
    if path.exists() and not folder and not os.access(path, os.W_OK):
        raise ValueError(f"{path} cannot be written (permissions)")


def atomic_write(path, write: Callable[[str], None]) -> Path:
    """Replace `path` with what `write(temporary)` writes to a temporary file in the same folder, synced and then
    renamed over it: a killed or failed write leaves the old file and no temporary. The file gets the permissions
    open() gives a new one (`new_file_mode`), not the 0600 that mkstemp and safetensors' save_file give. The one
    way pyramidkv writes a file whole: results, run records, calibration artifacts, cache files, references."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        write(temporary)
        os.chmod(temporary, new_file_mode())
        handle = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
