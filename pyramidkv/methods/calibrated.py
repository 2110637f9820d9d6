"""Calibration artifacts: the per-model tensors a calibrated method reads (KVzap's predictors, DuoAttention's head
gates, Q-Filters' directions, KVzip's head scores), and the record of how they were made.

An artifact is one safetensors file whose metadata holds `RECORD_KEY`: JSON with the format version, the kind, the
model it was made on (name, content digest `components.model_digest`, shape), the data (sources and their
digests), the settings, the seed, the CPU time, versions and git commit, and the sha256 of the tensors
(`tensors_sha256`); the metadata's `RECORD_SHA_KEY` is the sha256 of the record's text. A file whose record or
tensors do not match their digest (one flipped byte) is refused in one line naming it, as a cache file is; a
DuoAttention pattern (a text file) records `pattern_sha256` of its text in its config.json's record. The model is
known by content: a file is refused, in one line, for a model whose folder has another digest (a fine-tune in a
folder named like the original included), or another shape. Packaged artifacts live in `data/calibrated/{model}_{kind}.safetensors`; the model
names and digests are the packaged tables' (allocation/data/models.json).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from pyramidkv.allocation.head_tables import PACKAGED_MODELS
from pyramidkv.components import ModelShape, atomic_write, model_digest, packaged_table

FORMAT = "pyramidkv-calibration"
VERSION = 2          # 2: the record holds the digest of what the file holds (tensors_sha256, pattern_sha256)
RECORD_KEY = "pyramidkv_calibration"
RECORD_SHA_KEY = "record_sha256"
PACKAGED_DIR = Path(__file__).resolve().parent / "data" / "calibrated"
SCRIPTS = {"kvzap-linear": "calibrate_kvzap.py --model_type linear", "kvzap-mlp": "calibrate_kvzap.py --model_type mlp",
           "duo": "calibrate_duo.py", "qfilter": "calibrate_qfilter.py", "kvzip-head": "kvzip_head_scores.py",
           "triattention": "calibrate_triattention.py"}


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of an artifact's tensors: each name, dtype, shape and bytes, in the order of the names."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\0{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def text_digest(text: str) -> str:
    """sha256 of a text artifact's bytes as written (UTF-8): DuoAttention's pattern."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def save_artifact(path, tensors: dict[str, torch.Tensor], record: dict) -> Path:
    """Write tensors and the record (kind, model, data, settings, ...) to `path` atomically (a temporary file in
    the same folder, then a rename: a killed run leaves no torn file). The record gets the digest of the tensors
    (`tensors_sha256`), the metadata the digest of the record (`RECORD_SHA_KEY`): a load checks both."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    text = json.dumps({**record, "format": FORMAT, "version": VERSION, "tensors_sha256": tensors_digest(tensors)},
                      sort_keys=True)
    meta = {RECORD_KEY: text, RECORD_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()}
    atomic_write(path, lambda temporary: save_file(tensors, temporary, metadata=meta))
    return path


def check_version(path, record: dict) -> None:
    """ValueError (one line) unless the record is of this format and version (a version 1 file holds no digest of
    what it holds: an edit could not be told)."""
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        why = " (version 1 records no digest of its tensors: an edited byte could not be told)" \
            if record.get("format") == FORMAT and record.get("version") == 1 else ""
        raise ValueError(f"calibration file {path}: format {record.get('format')!r} version {record.get('version')!r}"
                         f"{why}; this pyramidkv reads {FORMAT!r} version {VERSION}: re-make it with `python scripts/"
                         f"{SCRIPTS.get(record.get('kind'), '...')}`")


@lru_cache(maxsize=32)
def _read(path: str, stamp: tuple) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, record) of a calibration file, checked: readable, of this format and version, its record and its
    tensors what their digests say."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except FileNotFoundError:
        raise ValueError(f"calibration file {path}: no such file") from None
    except Exception as e:   # safetensors raises its own error types for a torn or foreign file
        raise ValueError(f"calibration file {path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") \
            from None
    try:
        record = json.loads(meta[RECORD_KEY])
    except (KeyError, ValueError):
        raise ValueError(f"calibration file {path}: no {RECORD_KEY} record in its metadata (not made by a pyramidkv "
                         f"calibration script)") from None
    check_version(path, record)
    if hashlib.sha256(meta[RECORD_KEY].encode()).hexdigest() != meta.get(RECORD_SHA_KEY):
        raise ValueError(f"calibration file {path} was edited: its record does not match its sha256")
    if tensors_digest(tensors) != record.get("tensors_sha256"):
        raise ValueError(f"calibration file {path} was edited: its tensors do not match the sha256 its record holds "
                         f"(re-make it with `python scripts/{SCRIPTS.get(record.get('kind'), '...')}`)")
    return tensors, record


def load_artifact(path, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, record) of a calibration file of `kind`; ValueError naming the file unless it is one, whole and
    unedited."""
    path = Path(path)
    stat = path.stat() if path.is_file() else None
    tensors, record = _read(str(path), (stat.st_size, stat.st_mtime_ns) if stat else ())
    if record.get("kind") != kind:
        raise ValueError(f"calibration file {path} holds {record.get('kind')!r}, not {kind!r}; make one with "
                         f"`python scripts/{SCRIPTS.get(kind, '...')}`")
    return tensors, record


def model_record(model_path: str, config) -> dict:
    """What an artifact records of the model it was made on: name, content digest (None for a hub id), shape."""
    heads = config.num_attention_heads
    return {"name": str(model_path), "digest": model_digest(model_path),
            "num_layers": config.num_hidden_layers, "num_query_heads": heads,
            "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "hidden_size": config.hidden_size}


def check_made_for(path, record: dict, model: ModelShape) -> None:
    """ValueError (one line) unless the artifact was made on this model: same shape, and the same content digest
    where both are known (a hub id has none)."""
    made = record.get("model", {})
    shape = {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "num_query_heads": model.num_query_heads}
    for key, value in shape.items():
        if made.get(key) != value:
            raise ValueError(f"calibration file {path} was made on {made.get('name')!r} ({key} {made.get(key)}); this "
                             f"model has {key} {value}: calibrate it with `python scripts/"
                             f"{SCRIPTS.get(record.get('kind'), '...')} --model_path MODEL`")
    digest = model_digest(model.name) if model.name else None
    if digest is not None and made.get("digest") is not None and digest != made["digest"]:
        raise ValueError(f"calibration file {path} was made on {made.get('name')!r} (content {made['digest']}); the "
                         f"model at {model.name!r} has content {digest} (another checkpoint or a fine-tune): calibrate "
                         f"it with `python scripts/{SCRIPTS.get(record.get('kind'), '...')} --model_path "
                         f"{model.name}`")


def artifact_path(kind: str, path: Optional[str], model: ModelShape) -> Path:
    """The file to read: `path` when given, else the packaged artifact made on this model (by content)."""
    if path is not None:
        return Path(path)
    suffix = f"_{kind}.safetensors"
    packaged = {p.name[: -len(suffix)]: p for p in sorted(PACKAGED_DIR.glob(f"*{suffix}"))}
    script = SCRIPTS.get(kind, "...")
    return packaged_table(model.name, packaged, PACKAGED_MODELS, made_on=f"its packaged {kind} file was made on",
                          missing=f"no packaged {kind} calibration",
                          make=f"make one with `python scripts/{script} --model_path {model.name or 'MODEL'} --out "
                               f"FILE` and pass its path")


def model_artifact(kind: str, path: Optional[str], model: ModelShape) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, record) of the artifact of `kind` for this model (given file or packaged), checked to be made on
    it."""
    where = artifact_path(kind, path, model)
    tensors, record = load_artifact(where, kind)
    check_made_for(where, record, model)
    return tensors, record


def checked_artifact(kind: str, path: Optional[str], model: Optional[ModelShape], check):
    """What `check(file, tensors, record, model)` makes of the artifact of `kind` for this model (given file or
    packaged; ValueError in one line for another model or a misshapen file), read once per model and file version
    and shared by every method instance: a method's check_model calls it to refuse early, its score() with the
    context's model (ScoreContext.model)."""
    if model is None:
        raise ValueError(f"the {kind} calibration is found by the model: score through a cache the model patch makes "
                         f"(pyramidkv.compress), which gives the scorer the model's shape (ScoreContext.model)")
    stat = Path(path).stat() if path is not None and Path(path).is_file() else None
    return _checked(kind, path, (stat.st_size, stat.st_mtime_ns) if stat else None, model, check)


@lru_cache(maxsize=32)
def _checked(kind: str, path: Optional[str], stamp, model: ModelShape, check):
    tensors, record = model_artifact(kind, path, model)
    return check(artifact_path(kind, path, model), tensors, record, model)
