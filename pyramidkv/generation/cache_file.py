"""Compressed caches on disk: `save_cache(cache, path)` writes everything a `CompressedCache` holds, `load_cache(path,
model)` gives it back, bit for bit, ready to continue decoding.

The state written is the state core/snapshot.py sets aside: the cache object's attributes (its stores, the prefill's
record, decode-time compressors, stop records), with the objects the model and the method provide (`SHARED`) referred
to by name and rebuilt for the model on load, as `CompressionPatch.new_cache` makes them. One code path serves every
store kind: the state is walked generically, so a new store kind is saved with no edit here.

The file is a safetensors file:
  tensors   `s0`, `s1`, ...: each distinct storage the state's tensors view, once, as its raw bytes (uint8, unused
            capacity included), so tensors that share a storage share it again after loading;
  metadata  `pyramidkv-cache`: the record (JSON, below), and `record_sha256`: the sha256 of that JSON text.
The record: `kind` ("pyramidkv-cache"), `version` (FORMAT_VERSION), `method` (its canonical spec), `model` (name,
content digest, shape, dtype, a fingerprint of its weights), `positions` (padded prompt length, left padding per
prompt, tokens held so far, the sha256 of the contexts' token ids), `versions` (torch, transformers, pyramidkv),
`storages` (per storage its bytes and device), `dtypes` (of the state's tensors), `tensors_sha256` (of the storages'
bytes in order), `state` (the cache's attributes, encoded) and `objects` (what they refer to: see `_Encoder`).

The sha256 values find a torn or accidentally edited file; they are no signature (a rewritten record can carry a
recomputed one), so a load also checks the state against what its recorded method gives (`_check_layout`), and a save
never replaces a file of another configuration (`check_replaceable`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import importlib.metadata
import json
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch
import transformers
from safetensors.torch import save_file

from pyramidkv.allocation import UniformHeads
from pyramidkv.components import atomic_write, model_digest
from pyramidkv.core.cache import CompressedCache
from pyramidkv.core.snapshot import SHARED, shared_objects
from pyramidkv.methods import Method, method_spec, parse_method_spec
from pyramidkv.models.patch import CompressionPatch, model_shape

KIND = "pyramidkv-cache"
# 2: the stores hold the model's attention form (scale, soft-cap, windows) where version 1 held a soft-cap and the
# cache its windows; a version 1 file is refused by name (compress the context again to save it in version 2).
FORMAT_VERSION = 2
RECORD_KEY, RECORD_SHA_KEY = "pyramidkv-cache", "record_sha256"
FINGERPRINT_VALUES = 1024   # per weight, the first values the fingerprint reads


class CacheFileError(ValueError):
    """A cache that cannot be saved, or a file that cannot be loaded for this model and method (one line)."""


# ---- the model's identity ----------------------------------------------------------------------------------------

def weights_fingerprint(model) -> str:
    """sha256 (16 hex digits) of each weight's name, shape, dtype and first FINGERPRINT_VALUES values: another model
    of the same shape (other weights, a fine-tune) differs here also where it has no folder to take a digest of."""
    h = hashlib.sha256()
    for name, weight in model.named_parameters():
        h.update(f"\0{name}\0{tuple(weight.shape)}\0{weight.dtype}\0".encode())
        h.update(weight.detach().reshape(-1)[:FINGERPRINT_VALUES].cpu().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()[:16]


SHAPE_KEYS = ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "dtype_bytes")


def model_identity(shape, model=None) -> dict:
    """What a cache file records of the model it was made on: its name, content digest (components.model_digest; None
    for a hub id or a model in memory) and shape (a ModelShape), and with the model itself its dtype and
    weights fingerprint."""
    out = {"name": shape.name, "digest": model_digest(shape.name) if shape.name else None,
           **{key: getattr(shape, key) for key in SHAPE_KEYS}, "dtype": None, "weights": None}
    if model is not None:
        out.update(dtype=str(next(model.parameters()).dtype).removeprefix("torch."), weights=weights_fingerprint(model))
    return out


def kv_dtype(cache: CompressedCache) -> str:
    """The dtype of the keys and values the cache attends over (dequantized where stored quantized): the model's."""
    layer = next(i for i, store in enumerate(cache.layers) if store is not None)
    dtype = getattr(cache.layers[layer], "dtype", None)   # a quantized store's: its stored_kv would memoize blocks
    if not isinstance(dtype, torch.dtype):
        dtype = cache.stored_kv(layer, 0)[0][1].dtype
    return str(dtype).removeprefix("torch.")


HALF = ("float16", "bfloat16")


def identity_before_loading(config, dtype: str) -> dict:
    """model_identity of the model `config` describes, to be loaded in `dtype` (a name: "float32"), known before its
    weights load: everything but the weights fingerprint (what the runners check saved files against early)."""
    return {**model_identity(model_shape(config, getattr(torch, dtype).itemsize)), "dtype": dtype}


def check_identity(path, made: dict, here: dict, dtypes=()) -> None:
    """CacheFileError unless the model `here` (a model_identity) is the one the record names (`made`): same shape, and
    the same content digest, dtype and weights fingerprint where both have them. dtypes: the record's `dtypes`, for a
    file of before the dtype was recorded without the model: a float16 or bfloat16 model's cache holding the other
    16-bit type only."""
    if made.get("dtype") is None and made.get("dtype_bytes") == 2 and len(set(HALF) & set(dtypes)) == 1:
        made = {**made, "dtype": next(d for d in HALF if d in dtypes)}
    for key in SHAPE_KEYS + ("dtype",):
        if made.get(key) is not None and here.get(key) is not None and made.get(key) != here[key]:
            raise CacheFileError(f"cache file {path} was made on {made.get('name')!r} ({key} {made.get(key)}); this "
                                 f"model has {key} {here[key]}")
    if made.get("digest") and here.get("digest") and made["digest"] != here["digest"]:
        raise CacheFileError(f"cache file {path} was made on {made.get('name')!r} (content {made['digest']}); this "
                             f"model {here['name']!r} has content {here['digest']}: another checkpoint")
    if made.get("weights") and here.get("weights") and made["weights"] != here["weights"]:
        raise CacheFileError(f"cache file {path} was made on a model with other weights (fingerprint "
                             f"{made['weights']}, this model's {here['weights']}): another checkpoint")


def _check_model(path, made: dict, model, dtypes=()) -> None:
    """check_identity against a loaded model (its weights fingerprint included)."""
    check_identity(path, made, model_identity(model_shape(model.config, next(model.parameters()).dtype.itemsize),
                                              model), dtypes)


# ---- the state, encoded --------------------------------------------------------------------------------------------

def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _pyramidkv_class(name: str) -> type:
    """The pyramidkv class `module:qualname` names; nothing else is looked up."""
    module, _, qualname = name.partition(":")
    if not (module == "pyramidkv" or module.startswith("pyramidkv.")) or not qualname:
        raise CacheFileError(f"the cache file names class {name!r}: only pyramidkv classes are loaded")
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        raise CacheFileError(f"the cache file names class {name!r}, which this pyramidkv does not have") from None
    if not isinstance(found, type):
        raise CacheFileError(f"the cache file names {name!r}, which is not a class")
    return found


def _is_ours(cls: type) -> bool:
    return cls.__module__ == "pyramidkv" or cls.__module__.startswith("pyramidkv.")


def _attributes(obj) -> dict:
    """An object's state: its __dict__ and its set __slots__."""
    state = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in [slots] if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                state[slot] = getattr(obj, slot)
    return state


class _Encoder:
    """The state as JSON. A primitive (None, bool, int, str, finite float) is itself; anything else is an entry of
    `objects`, written once and referred to as {"$ref": index} wherever it appears (so identity is kept: an object
    referenced twice is one object after loading). An entry is {"$": tag, ...}:
      list / tuple / set / frozenset {"items": [...]}; dict / odict {"items": [[key, value], ...]} (any keys);
      float {"repr": "nan"} (non-finite); dtype / device {"name"}; class {"name": "module:qualname"};
      enum {"class", "name"}; object {"class", "state": {attribute: value}} (a pyramidkv class or a dataclass of
      one); tensor {"storage": key, "dtype", "shape", "stride", "offset"}; shared {"name"}: one of SHARED."""

    def __init__(self, shared: dict[str, object]):
        self.objects: list = []
        self.memo: dict[int, int] = {}
        self.keep: list = []   # what the memo's ids refer to, alive until the end
        self.storages: dict[tuple, str] = {}
        self.storage_tensors: list[torch.Tensor] = []
        self.storage_devices: list[str] = []
        for name, obj in shared.items():
            self._entry(obj, {"$": "shared", "name": name})

    def _entry(self, obj, entry) -> dict:
        self.memo[id(obj)] = len(self.objects)
        self.keep.append(obj)
        self.objects.append(entry)
        return {"$ref": len(self.objects) - 1}

    def encode(self, value, path: str):
        if value is None or isinstance(value, (bool, str)) or type(value) is int:
            return value
        if type(value) is float:
            return value if value == value and abs(value) != float("inf") else {"$": "float", "repr": repr(value)}
        if id(value) in self.memo:
            return {"$ref": self.memo[id(value)]}
        kind = type(value)
        if kind in (list, tuple, set, frozenset):
            entry = {"$": kind.__name__, "items": []}
            ref = self._entry(value, entry)
            entry["items"] = [self.encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
            return ref
        if kind in (dict, OrderedDict):
            entry = {"$": "dict" if kind is dict else "odict", "items": []}
            ref = self._entry(value, entry)
            entry["items"] = [[self.encode(k, f"{path}.<key>"), self.encode(v, f"{path}[{k!r}]")]
                              for k, v in value.items()]
            return ref
        if kind is torch.dtype:
            return self._entry(value, {"$": "dtype", "name": str(value).removeprefix("torch.")})
        if kind is torch.device:
            return self._entry(value, {"$": "device", "name": str(value)})
        if kind is torch.Tensor:
            return self._entry(value, self._tensor(value))
        if isinstance(value, type) and _is_ours(value):
            return self._entry(value, {"$": "class", "name": _qualname(value)})
        if isinstance(value, enum.Enum) and _is_ours(kind):
            return self._entry(value, {"$": "enum", "class": _qualname(kind), "name": value.name})
        if _is_ours(kind) and not isinstance(value, (type, tuple, enum.Enum)) and \
                (hasattr(value, "__dict__") or hasattr(kind, "__slots__")):
            entry = {"$": "object", "class": _qualname(kind), "state": {}}
            ref = self._entry(value, entry)
            entry["state"] = {name: self.encode(item, f"{path}.{name}") for name, item in _attributes(value).items()}
            return ref
        raise CacheFileError(f"cannot save the cache: {path} is a {kind.__module__}.{kind.__qualname__}, which a cache "
                             f"file does not hold (only primitives, containers, tensors, dtypes, devices and pyramidkv "
                             f"objects)")

    def _tensor(self, tensor: torch.Tensor) -> dict:
        storage = tensor.untyped_storage()
        device = str(tensor.device)
        key = (device, storage.data_ptr(), storage.nbytes()) if storage.nbytes() else ("empty", len(self.storages))
        if key not in self.storages:
            self.storages[key] = f"s{len(self.storages)}"
            self.storage_tensors.append(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage))
            self.storage_devices.append(device)
        return {"$": "tensor", "storage": self.storages[key], "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape), "stride": list(tensor.stride()), "offset": tensor.storage_offset()}


class _Decoder:
    """The inverse of `_Encoder`: `objects` back to Python, SHARED names to the given objects, tensors as views of the
    loaded storages, devices mapped as the storages were (`place`)."""

    def __init__(self, objects: list, shared: dict[str, object], storages: dict[str, torch.Tensor], place):
        self.objects, self.shared, self.storages, self.place = objects, shared, storages, place
        self.built: dict[int, object] = {}

    def decode(self, value):
        if isinstance(value, list):
            raise CacheFileError("the cache file's record holds a bare list where a reference belongs")
        if not isinstance(value, dict):
            return value
        if "$ref" in value:
            index = value["$ref"]
            if index not in self.built:
                self._build(index)
            return self.built[index]
        if value.get("$") == "float":
            return float(value["repr"])
        raise CacheFileError(f"the cache file's record holds an unknown value {str(value)[:60]}")

    def _build(self, index: int) -> None:
        entry = self.objects[index]
        tag = entry["$"]
        if tag == "shared":
            if entry["name"] not in self.shared:
                raise CacheFileError(f"the cache file refers to the cache's {entry['name']}, which a cache for this "
                                     f"model and method does not have")
            self.built[index] = self.shared[entry["name"]]
        elif tag == "list":
            self.built[index] = out = []
            out.extend(self.decode(item) for item in entry["items"])
        elif tag in ("dict", "odict"):
            self.built[index] = out = {} if tag == "dict" else OrderedDict()
            for key, item in entry["items"]:
                out[self.decode(key)] = self.decode(item)
        elif tag in ("tuple", "set", "frozenset"):
            self.built[index] = {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](
                self.decode(item) for item in entry["items"])
        elif tag == "dtype":
            self.built[index] = _dtype(entry["name"])
        elif tag == "device":
            self.built[index] = self.place(entry["name"])
        elif tag == "class":
            self.built[index] = _pyramidkv_class(entry["name"])
        elif tag == "enum":
            self.built[index] = _pyramidkv_class(entry["class"])[entry["name"]]
        elif tag == "object":
            cls = _pyramidkv_class(entry["class"])
            self.built[index] = obj = object.__new__(cls)
            for name, item in entry["state"].items():
                object.__setattr__(obj, name, self.decode(item))
        elif tag == "tensor":
            storage = self.storages[entry["storage"]]
            self.built[index] = torch.empty(0, dtype=_dtype(entry["dtype"]), device=storage.device).set_(
                storage.untyped_storage(), entry["offset"], entry["shape"], entry["stride"])
        else:
            raise CacheFileError(f"the cache file's record holds an unknown entry {tag!r}")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CacheFileError(f"the cache file names dtype {name!r}, which this torch does not have")
    return dtype


# ---- the context and the configuration a file holds ----------------------------------------------------------------

def context_rows(path, context, pad_lens: list[int], prompt_len: int) -> list[list[int]]:
    """Per prompt its context's token ids without left padding, from `context`: one prompt's ids, one list per prompt,
    or a [B, n] tensor (a row of the padded length is cut by its padding). CacheFileError (one line) for another
    number of prompts or other lengths than the cache holds."""
    if isinstance(context, torch.Tensor):
        context = context.tolist()
    rows = list(context)
    if not rows or not isinstance(rows[0], (list, tuple, torch.Tensor)):
        rows = [rows]
    rows = [[int(t) for t in (row.tolist() if isinstance(row, torch.Tensor) else row)] for row in rows]
    if len(rows) != len(pad_lens):
        raise CacheFileError(f"cache file {path}: the context given has {len(rows)} prompt(s); the cache holds "
                             f"{len(pad_lens)}")
    rows = [row[pad:] if pad and len(row) == prompt_len else row for row, pad in zip(rows, pad_lens)]
    for b, (row, pad) in enumerate(zip(rows, pad_lens)):
        if len(row) != prompt_len - pad:
            raise CacheFileError(f"cache file {path}: the context given{f' (prompt {b})' if len(rows) > 1 else ''} "
                                 f"has {len(row)} tokens; the cache holds a context of {prompt_len - pad}")
    return rows


def context_digest(rows: list[list[int]]) -> str:
    """sha256 of the contexts' token ids (`context_rows`), as a record keeps it (`positions.context_sha256`)."""
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def check_context(path, record: dict, context) -> None:
    """CacheFileError (one line) unless the file's cache was made from `context` (token ids, see `context_rows`): the
    same lengths, and the digest its record holds (a file saved without context= has none: refused too)."""
    positions = record["positions"]
    given = context_digest(context_rows(path, context, positions["pad_lens"], positions["prompt_len"]))
    recorded = positions.get("context_sha256")
    if recorded is None:
        raise CacheFileError(f"cache file {path} records no digest of its context (saved without context=), so it "
                             f"cannot be checked against the context it is used for")
    if recorded != given:
        raise CacheFileError(f"cache file {path} holds another context of the same length (token ids sha256 "
                             f"{recorded[:16]}); the context it is used for has {given[:16]}")


def _same_model(a: dict, b: dict) -> bool:
    """Two records' models are one: the same shape and dtype, and the same content digest and weights fingerprint
    where both have them (the name where neither has either)."""
    if any(a.get(key) != b.get(key) for key in SHAPE_KEYS + ("dtype",)):
        return False
    known = [key for key in ("digest", "weights") if a.get(key) and b.get(key)]
    return all(a[key] == b[key] for key in known) if known else a.get("name") == b.get("name")


def configuration(record: dict) -> str:
    """How a message names what made a file's cache: its method, model and context."""
    made, context = record["model"], record["positions"].get("context_sha256")
    return (f"{record['method']!r} on {made.get('name') or 'a model in memory'!r} ({made.get('dtype')}"
            f"{', content ' + made['digest'] if made.get('digest') else ''}), context "
            f"{context[:16] if context else 'not recorded'}")


def check_replaceable(path, record: dict) -> None:
    """CacheFileError (one line) when `path` holds a pyramidkv cache file of another configuration than `record`'s
    (method, model, or context where both record it): a save never replaces another configuration's cache. A file
    of the same configuration (a rerun, or decoded further) is replaced; so is a file that is not a whole cache
    file."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        held = read_record(path)[0]
    except (CacheFileError, OSError, ValueError, KeyError):
        return
    contexts = (held["positions"].get("context_sha256"), record["positions"].get("context_sha256"))
    if held.get("method") != record["method"] or not _same_model(held.get("model", {}), record["model"]) or \
            (all(contexts) and contexts[0] != contexts[1]):
        raise CacheFileError(f"cannot save the cache to {path}: it holds the cache of another configuration "
                             f"({configuration(held)}; this one: {configuration(record)}); save it elsewhere, or "
                             f"delete that file")


def _check_layout(path, spec: str, fresh: CompressedCache, cache: CompressedCache) -> None:
    """CacheFileError (one line) unless the loaded state has the layout its recorded method gives: the store kinds,
    stored heads, windows and decode-time compressor a new cache for that method has, the layer budgets the method
    gives the prompts (where they do not depend on the scores), and, where the method fixes it (one budget per layer,
    uniform over the heads, no decode-time re-selection), each head's kept count as its stores hold it. A method with
    the same layout (h2o and snapkv at one budget) is not told apart: only recomputing the scores would
    (docs/shared_context.md, "What a digest proves")."""
    def refuse(what: str):
        raise CacheFileError(f"cache file {path} is recorded as {spec!r}, but its state is not that method's: {what} "
                             f"(its record was rewritten, or it was made otherwise)")

    def shown(value):
        return value.__name__ if isinstance(value, type) else type(value).__name__ if value is not None else value

    for name in ("store_class", "sliding_class", "stored_heads", "form"):
        if getattr(cache, name, None) != getattr(fresh, name):
            refuse(f"its {name} is {shown(getattr(cache, name, None))}, the method's {shown(getattr(fresh, name))}")
    if type(getattr(cache, "decoding", None)) is not type(fresh.decoding):
        refuse(f"its decode-time compressor is {shown(getattr(cache, 'decoding', None))}, the method's "
               f"{shown(fresh.decoding)}")
    method, prompt = fresh.method, getattr(cache, "prompt", None)
    if prompt is None or prompt.layer_budgets is None or method.layer_budgets_need_scores:
        return
    expected = type(prompt)(method, fresh.model_shape, list(cache.pad_lens), cache.prompt_len, fresh.rotary)
    expected.edges = prompt.edges
    budgets, plans = expected.planned_budgets()
    if (budgets, plans) != (prompt.layer_budgets, prompt.head_plans):
        refuse(f"its layer budgets are {prompt.layer_budgets}, the method's {budgets}")
    if cache.decoding is not None or not isinstance(method.head_allocation, UniformHeads) or method.sizing.outcome:
        return
    for layer, store in enumerate(cache.layers):
        if store is None or cache.form.window(layer) is not None:
            continue
        for b, counts in enumerate(store.kept_counts()):
            want = min(expected.real_lens[b], budgets[b][layer])
            if plans[b] is None and any(count != want for count in counts):
                refuse(f"layer {layer} keeps {counts} tokens per head of prompt {b}, the method {want} each")


# ---- save --------------------------------------------------------------------------------------------------------

def _versions() -> dict:
    """The versions the file records; pyramidkv's is None when it runs from a checkout that is not installed."""
    try:
        ours = importlib.metadata.version("pyramidkv")
    except importlib.metadata.PackageNotFoundError:
        ours = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "pyramidkv": ours}


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.numpy().data)
    return h.hexdigest()


def _writable_folder(path: Path) -> None:
    if path.is_dir():
        raise CacheFileError(f"cannot save the cache to {path}: it is a directory; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise CacheFileError(f"cannot save the cache to {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CacheFileError(f"cannot save the cache to {path}: folder {folder} is not writable")


@torch.no_grad()
def save_cache(cache: CompressedCache, path, model=None, context=None) -> Path:
    """Write `cache` (prefilled, possibly decoded further) to `path` (a .safetensors file), atomically: a temporary
    file in the same folder, renamed; returns the path. The file records the model by the cache's record of it (name,
    content digest of its folder, shape, the dtype of its keys and values); model: the model the cache was made on,
    to record its weights fingerprint too (so that a model of the same shape with other weights and no folder, one
    made in memory, is refused). context: the token ids of the context the cache holds (one prompt's, or per prompt
    of the batch, without its left padding; a [B, prompt_len] tensor is cut by the padding), recorded as a digest
    that `load_cache(..., context=)` checks. One-line CacheFileError for a path that cannot be written, a context
    of other lengths than the cache's, a state the format cannot hold (naming the attribute and its type), or a
    file at `path` that holds another configuration's cache (`check_replaceable`); nothing is left behind then."""
    path = Path(path)
    if not isinstance(cache, CompressedCache):
        raise CacheFileError(f"save_cache takes a pyramidkv CompressedCache, got {type(cache).__name__}")
    if cache.pad_lens is None or cache.layers[0] is None:
        raise CacheFileError("cannot save the cache: it holds no prompt yet (save it after the prefill)")
    _writable_folder(path)
    spec = method_spec(cache.method)
    if parse_method_spec(spec) != cache.method:
        raise CacheFileError(f"cannot save the cache: its method's spec {spec!r} does not rebuild the method (a load "
                             f"would decode on with another)")
    encoder = _Encoder(shared_objects(cache))
    state = {name: encoder.encode(value, f"cache.{name}") for name, value in cache.__dict__.items()}
    storages = [tensor.cpu() for tensor in encoder.storage_tensors]
    made_on = model_identity(cache.model_shape, model)
    if made_on["dtype"] is None:
        made_on["dtype"] = kv_dtype(cache)
    positions = {"prompt_len": cache.prompt_len, "pad_lens": list(cache.pad_lens), "held": cache.get_seq_length(),
                 "context_sha256": None if context is None else context_digest(
                     context_rows(path, context, cache.pad_lens, cache.prompt_len))}
    record = {
        "kind": KIND, "version": FORMAT_VERSION, "method": spec,
        "model": made_on,
        "positions": positions,
        "versions": _versions(),
        "storages": [{"key": f"s{i}", "nbytes": t.numel(), "device": d}
                     for i, (t, d) in enumerate(zip(storages, encoder.storage_devices))],
        "dtypes": sorted({entry["dtype"] for entry in encoder.objects if entry["$"] == "tensor"}),
        "tensors_sha256": _digest(storages),
        "state": state, "objects": encoder.objects,
    }
    check_replaceable(path, record)
    text = json.dumps(record, separators=(",", ":"))
    metadata = {RECORD_KEY: text, RECORD_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()}
    try:
        atomic_write(path, lambda temporary: save_file({f"s{i}": t for i, t in enumerate(storages)}, temporary,
                                                       metadata=metadata))
    except OSError as e:
        raise CacheFileError(f"cannot save the cache to {path}: {e.strerror or e}") from None
    return path


# ---- load --------------------------------------------------------------------------------------------------------

def read_record(path) -> tuple[dict, dict, int]:
    """(record, the safetensors header, where the data starts) of a cache file, checked: the file is whole, the record
    unedited, of this kind and version. Reads the header only."""
    path = Path(path)
    if not path.is_file():
        raise CacheFileError(f"cache file {path} does not exist" if not path.exists() else
                             f"cache file {path} is not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CacheFileError(f"cache file {path} is torn: {size} bytes, not even a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise CacheFileError(f"cache file {path} is torn: its header claims {length} bytes, the file has {size}")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise CacheFileError(f"cache file {path} is torn or edited: its safetensors header is not JSON") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or RECORD_KEY not in metadata:
        raise CacheFileError(f"{path} is not a pyramidkv cache file (no {RECORD_KEY!r} record in its metadata)")
    ends = [spec["data_offsets"][1] for name, spec in header.items() if name != "__metadata__"]
    if 8 + length + max(ends, default=0) != size:
        raise CacheFileError(f"cache file {path} is torn: {size} bytes, its header describes "
                             f"{8 + length + max(ends, default=0)}")
    text = metadata[RECORD_KEY]
    if hashlib.sha256(text.encode()).hexdigest() != metadata.get(RECORD_SHA_KEY):
        raise CacheFileError(f"cache file {path} was edited: its record does not match its sha256")
    record = json.loads(text)
    if record.get("kind") != KIND:
        raise CacheFileError(f"{path} is a {record.get('kind')!r} file, not a {KIND!r} one")
    if record.get("version") != FORMAT_VERSION:
        raise CacheFileError(f"cache file {path} has format version {record.get('version')!r}; this pyramidkv reads "
                             f"version {FORMAT_VERSION} (compress the context again and save it to read it here)")
    return record, header, 8 + length


def _device_exists(name: str) -> bool:
    device = torch.device(name)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "mps":
        return torch.backends.mps.is_available()
    return False


def _patch_for(model, method: Method) -> CompressionPatch:
    """The patch whose new_cache makes this model's SHARED objects for `method`: the model's own when it is patched
    with that method, else an unapplied one (the model stays as it is)."""
    applied = getattr(model, "_pyramidkv_patch", None)
    if applied is None:
        return CompressionPatch(model, method)
    if applied.method != method:
        raise CacheFileError(f"the model is patched with {method_spec(applied.method)}, the cache file holds "
                             f"{method_spec(method)}: load it outside that compress() block or inside one with its "
                             f"method")
    return applied


@torch.no_grad()
def load_cache(path, model, method: Optional[Method] = None, device=None, context=None) -> CompressedCache:
    """The cache `save_cache` wrote to `path`, for `model` (the one it was made on) and its method (the recorded one;
    a given `method` must equal it). Continue it with `with pyramidkv.compress(model, method):
    model.generate(input_ids=<prompt + tokens so far + the next>, attention_mask=..., past_key_values=cache)` (a
    prefilled cache takes any number of new tokens per forward). device: where every tensor goes; None: each storage where it
    was saved from if that device exists here, else the model's device. context: the token ids the cache is used for
    (see `save_cache`), checked against the digest the file records. One-line CacheFileError for a missing, torn or
    edited file, another format version or kind, another model (dtype included) or method, another context, or a
    state whose layout is not its recorded method's (`_check_layout`; all but the edited tensor bytes and the
    layout found before the tensors are read)."""
    record, header, start = read_record(path)
    _check_model(path, record["model"], model, record.get("dtypes", ()))
    if context is not None:
        check_context(path, record, context)
    recorded = record["method"]
    if method is None:
        try:
            method = parse_method_spec(recorded)
        except ValueError as e:
            raise CacheFileError(f"cache file {path}: its method {recorded!r} cannot be made here: {e}") from None
    elif method_spec(method) != recorded:
        raise CacheFileError(f"cache file {path} holds a cache of {recorded!r}, not of {method_spec(method)!r}")
    model_device = next(model.parameters()).device

    def place(name: str) -> torch.device:
        if device is not None:
            return torch.device(device)
        return torch.device(name) if _device_exists(name) else model_device

    storages, h = {}, hashlib.sha256()
    with open(path, "rb") as f:   # each storage read straight into its own (aligned) buffer
        for spec in record["storages"]:
            described = header.get(spec["key"])
            if described is None or described["dtype"] != "U8" or described["shape"] != [spec["nbytes"]]:
                raise CacheFileError(f"cache file {path} was edited: storage {spec['key']} is not as its record says")
            raw = torch.empty(spec["nbytes"], dtype=torch.uint8)
            f.seek(start + described["data_offsets"][0])
            if f.readinto(raw.numpy().data) != spec["nbytes"]:
                raise CacheFileError(f"cache file {path} is torn: storage {spec['key']} ends early")
            h.update(raw.numpy().data)
            storages[spec["key"]] = raw
    if h.hexdigest() != record["tensors_sha256"]:
        raise CacheFileError(f"cache file {path} was edited: its tensor bytes do not match their sha256")
    for spec in record["storages"]:
        storages[spec["key"]] = storages[spec["key"]].to(place(spec["device"]))
    cache = _patch_for(model, method).new_cache()
    fresh = _patch_for(model, method).new_cache()   # what the method gives, to check the loaded state against
    decoder = _Decoder(record["objects"], shared_objects(cache), storages, place)
    try:
        state = {name: decoder.decode(value) for name, value in record["state"].items()}
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, CacheFileError):
            raise
        raise CacheFileError(f"cache file {path}: its record is malformed ({type(e).__name__}: {e})".split("\n")[0]) \
            from None
    missing = [name for name in SHARED if name not in state]
    if missing:
        raise CacheFileError(f"cache file {path}: its state lacks {missing}")
    cache.__dict__.clear()
    cache.__dict__.update(state)
    _check_layout(path, recorded, fresh, cache)
    return cache
