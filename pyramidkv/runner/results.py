"""Results that survive a kill -9: append-and-flush JSONL, resume without duplicates, atomic writes."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from pyramidkv.components import atomic_write
from pyramidkv.native import status as native_status


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically, its folder made if missing (components.atomic_write: the permissions
    open() gives a new file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda temporary: Path(temporary).write_text(text, encoding="utf-8"))


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")


def iter_jsonl(path: Path, skip_torn_last_line: bool = False):
    """Yield (line number, row) of a JSONL file of objects.

    A malformed line is an error naming the file and line. With skip_torn_last_line,
    an unterminated last line (a run still writing, or killed mid-write) is skipped.
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         f"JSONL files must be UTF-8") from None
    lines = text.split("\n")
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if skip_torn_last_line and line_no == len(lines) and not text.endswith("\n"):
                return
            raise ValueError(f"{path}:{line_no}: malformed JSON line ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        yield line_no, row


def read_jsonl(path: Path, skip_torn_last_line: bool = False) -> list[dict]:
    """The rows of a JSONL file (see iter_jsonl)."""
    return [row for _, row in iter_jsonl(path, skip_torn_last_line)]


def read_text_file(path: Path) -> str:
    """A UTF-8 text file's content; a binary file (NUL bytes) or other encoding is an error naming it."""
    data = Path(path).read_bytes()
    if b"\0" in data:
        raise ValueError(f"{path}: a binary file (NUL bytes), not text; remove it from the folder")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         f"convert it to UTF-8") from None


# The key of a prediction row, per runner: RULER "index", LongBench "_id", needle "key".
PREDICTION_KEYS = ("index", "_id", "key")


def read_unique_rows(path: Path, key: str, skip_torn_last_line: bool = False) -> list[dict]:
    """The rows of a results JSONL, refusing a repeated or missing `key` (a sample must count once)."""
    first_line: dict = {}
    rows = []
    for line_no, row in iter_jsonl(path, skip_torn_last_line):
        if key not in row:
            raise ValueError(f"{path}:{line_no}: row without {key!r}")
        value = row[key]
        marker = json.dumps(value, sort_keys=True)
        if marker in first_line:
            raise ValueError(f"{path}:{line_no}: {key} {value!r} repeats line {first_line[marker]} (two runs "
                             f"into one folder at once?); each sample must appear once: delete the repeated "
                             f"line, or rerun with --overwrite")
        first_line[marker] = line_no
        rows.append(row)
    return rows


class ResultsWriter:
    """Append-only JSONL of per-sample results, keyed by `key`, resumable.

    On open, a partially written last line (a run killed mid-write) is cut off;
    rows already present are reported by `done` so a rerun skips them. Each
    appended row is flushed and fsynced before `append` returns.
    """

    def __init__(self, path: Path, key: str):
        self.path = Path(path)
        self.key = key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_tail()
        self.done: set = set()
        if self.path.exists():
            self.done = {row[key] for row in read_unique_rows(self.path, key)}
        self._file = open(self.path, "a", encoding="utf-8")

    def _repair_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as f:
                f.truncate(keep)

    def append(self, row: dict) -> None:
        if row[self.key] in self.done:
            raise ValueError(f"duplicate result for {self.key}={row[self.key]!r} in {self.path}")
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(row[self.key])

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _versions(packages: Iterable[str]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in packages:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def write_run_meta(out_dir: Path, args: dict, method=None, extra: dict | None = None,
                   fingerprint: dict | None = None) -> Path:
    """run_meta.json: the full configuration of a run (arguments, method, versions, git commit, time)
    and its generation `fingerprint` (what a resumed run must match, see runner/run_folder.py)."""
    meta = {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "command": [sys.executable, *sys.argv],
        "arguments": args,
        "method": method.describe() if method is not None else None,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": _versions(["torch", "transformers", "pyramidkv", "flash-attn", "datasets"]),
        "native_kernels": native_status(),   # on, or why the torch ops ran instead (pyramidkv/native)
        **(extra or {}),
        "fingerprint": fingerprint,
    }
    path = Path(out_dir) / "run_meta.json"
    atomic_write_json(path, meta)
    return path


def record_placement(out_dir: Path, device_map: dict) -> None:
    """Add to run_meta.json where accelerate placed each module (`model.hf_device_map`, known once the model has
    loaded), as "device_map_placed"; the device map as given is among the arguments."""
    path = Path(out_dir) / "run_meta.json"
    meta = json.loads(path.read_text())
    meta["device_map_placed"] = {name: str(device) for name, device in device_map.items()}
    atomic_write_json(path, meta)
