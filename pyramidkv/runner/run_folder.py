"""Guards on a run folder, shared by the three runners.

* `check_writable`: the save folder can be written (checked at start-up, before any model loads).
* `RunLock`: one run at a time per folder; a lock whose holder died on this host is taken over.
* `generation_fingerprint` / `open_run_folder`: a rerun into a folder that holds results must
  have the same generation fingerprint (method settings, every argument that can change a
  prediction, the model files, device kind and dtype); otherwise it is refused with the
  differing settings named. `--overwrite` clears the folder's results instead.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

# Arguments that cannot change a prediction, so a resumed run may differ in them. Everything else
# a runner's parser defines (including flags added later) is part of the fingerprint.
NON_GENERATING_ARGS = {
    "save_dir": "the folder itself",
    "overwrite": "how to treat old results, not how to make new ones",
    "num_threads": "CPU threads: same arithmetic, other speed",
    "decode_threads": "CPU threads of the decode steps (same reason)",
    "eval": "score afterwards",
    "print_run_dir": "prints the folder and exits",
    "prepare_only": "checks, prepares and exits",
    "eval_batch_size": "left-padded batches are built to give each prompt's own output "
                       "(tested in tests/core/test_memory_and_batch.py); a resumed run may use another size",
    "num_samples": "how many samples run; each prediction row is keyed and checked on its own",
    "max_num_examples": "how many samples run (same reason)",
    "tasks": "which task files run (one predictions file per task and length)",
    "context_lengths": "which task files run (same reason)",
    "datasets": "which dataset files run (one predictions file per dataset)",
    "s_len": "which needle cells run (each row is keyed by context length and depth)",
    "e_len": "which needle cells run (same reason)",
    "step": "which needle cells run (same reason)",
    "num_depths": "which needle cells run (same reason)",
    "questions_per_context": "which task files run ({task}_{length}_q{K}.jsonl; rows keyed per question)",
    "save_compressed": "writes each compressed context to a file as well",
    "load_compressed": "a saved compressed context is the cache compressing again gives, bit for bit "
                       "(tests/generation/test_cache_file.py)",
}
# Arguments fingerprinted by their resolved value instead (auto -> cpu/cuda, default dtype -> its name).
RESOLVED_ARGS = ("device", "dtype", "model_path")
# Method flags that fingerprints written before the method spec recorded among the arguments. The method
# section holds the method's whole configuration, so a stored fingerprint's copies of them are not compared
# (a run made with `--quant_method kivi` resumes with `--quant_method kivi --nbits 2`).
LEGACY_METHOD_ARGS = frozenset({
    "method", "max_capacity_prompts", "max_capacity_prompts_ratio", "window_sizes", "kernel_sizes", "pooling", "beta",
    "num_sinks", "gqa_layout", "gqa_reduce", "gqa_pooling", "skip_layers", "head_allocation", "layer_allocation",
    "floor", "normalize", "head_path", "head_beta", "attention_threshold", "b_bound_ratio", "merge",
    "similarity_threshold", "merge_fraction", "merge_budget", "start_budget_ratio", "merge_sampling", "merge_seed",
    "quant_method", "nbits", "q_group_size", "quant_residual_length", "quant_outlier_fraction", "quant_sink_tokens",
    "quant_datatype", "quant_rank", "quant_decode_rank", "decode_budget", "decode_interval",
})

LOCK_NAME = ".run.lock"
RUN_META = "run_meta.json"
# Files a run writes into its folder (what --overwrite clears and what counts as "has results").
RESULT_GLOBS = ("*.jsonl", "results.json", "results.csv", RUN_META)
_SMALL_FILE = 8 << 20     # model files up to this size are hashed whole
_SAMPLE = 1 << 20         # larger ones: size + hash of the first, middle and last MiB


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked (locked, other configuration, unwritable)."""


# --- write access ------------------------------------------------------------------------------

def check_writable(folder: Path) -> None:
    """Fail unless `folder` (or the nearest existing folder above it) can be written. Writes nothing."""
    folder = Path(folder).absolute()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunFolderError(f"cannot write results to {folder}: {existing} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RunFolderError(f"cannot write results to {folder}: {existing} is not writable "
                             f"({e.strerror or e}); choose another --save_dir") from None


# --- lock --------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive lock file in the run folder: {"pid", "host", "started"}.

    A second run into the folder fails naming the holder. A lock left by a process that no
    longer runs on this host (kill -9, power loss) is reported and taken over.
    """

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_NAME
        self.held = False

    def acquire(self) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue          # removed meanwhile, or torn: try again
                if holder.get("host") == me["host"] and not _pid_alive(int(holder.get("pid", -1))):
                    print(f"note: taking over the stale lock {self.path} (pid {holder.get('pid')} on "
                          f"{holder.get('host')}, started {holder.get('started')}, no longer runs)",
                          file=sys.stderr)
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunFolderError(
                    f"{self.path.parent} is in use by another run (pid {holder.get('pid')} on host "
                    f"{holder.get('host')}, started {holder.get('started')}); wait for it to finish, or "
                    f"delete {self.path} if that run is gone") from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise RunFolderError(f"could not take the lock {self.path}; try again")

    def _holder(self) -> Optional[dict]:
        try:
            holder = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            # A lock being written right now, or garbage: treat as held by an unknown run.
            return {"pid": "?", "host": "?", "started": "?"}
        return holder if isinstance(holder, dict) else {"pid": "?", "host": "?", "started": "?"}

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


# --- configuration fingerprint -----------------------------------------------------------------

def file_digest(path: Path) -> str:
    """size:sha256 of a file (whole up to 8 MiB, else its first, middle and last MiB)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _SMALL_FILE:
            h.update(f.read())
        else:
            for start in (0, size // 2, size - _SAMPLE):
                f.seek(start)
                h.update(f.read(_SAMPLE))
    return f"{size}:{h.hexdigest()[:16]}"


def model_fingerprint(resolved_path: str) -> dict:
    """{file name: size:hash} of a local model folder (a changed weight, config or tokenizer file shows);
    {"hub_id": ...} for a hub id, whose files are not local."""
    folder = Path(resolved_path)
    if not folder.is_dir():
        return {"hub_id": str(resolved_path)}
    return {p.name: file_digest(p) for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".")}


def input_files(named: dict[str, str]) -> dict[str, str]:
    """{name: absolute path} of the files a run reads ({"pattern_table=t.json": "t.json"}), a folder as each
    file under it ({"data_dir=d/qasper.jsonl": ...}, hidden files left out), paths resolved against the working
    directory now: what run_meta.json records and input_digests reads."""
    out = {}
    for name, given in named.items():
        path = Path(given).expanduser().absolute()
        if path.is_dir():
            for inner in sorted(p for p in path.rglob("*") if p.is_file()):
                relative = inner.relative_to(path)
                if not any(part.startswith(".") for part in relative.parts):
                    out[f"{name.rstrip('/')}/{relative.as_posix()}"] = str(inner)
        else:
            out[name] = str(path)
    return out


def input_digests(files: dict[str, str]) -> dict[str, str]:
    """{name: size:hash} of input_files' files (a file that is not there: "missing")."""
    return {name: file_digest(Path(path)) if Path(path).is_file() else "missing" for name, path in files.items()}


def generation_fingerprint(args: dict, method, model_files: dict, resolved: dict,
                           extra: Optional[dict] = None, inputs: Optional[dict] = None) -> dict:
    """What decides the predictions: the method's full description, every argument not in
    NON_GENERATING_ARGS (with RESOLVED_ARGS replaced by `resolved`), the model files, the content of every
    other file the run reads (`inputs`, input_digests: a table or data file edited in place, or a relative path
    read from another working directory, shows) and runner-specific `extra` facts (e.g. the needle text)."""
    arguments = {k: v for k, v in args.items() if k not in NON_GENERATING_ARGS and k not in RESOLVED_ARGS}
    arguments.update(resolved)
    fingerprint = {"method": method.describe(), "arguments": dict(sorted(arguments.items())),
                   "model_files": model_files, **({"input_files": inputs} if inputs else {}), **(extra or {})}
    return json.loads(json.dumps(fingerprint, default=str))   # the form it has once read back from disk


def fingerprint_differences(old: dict, new: dict, argument_defaults: Optional[dict] = None,
                            method_at_default: Iterable[str] = ()) -> list[str]:
    """Readable 'setting: old -> new' lines for each differing leaf (one level into each section).

    An argument the stored fingerprint lacks (a flag added since) counts as equal when the new run leaves it
    at its default (`argument_defaults`), and one only the stored fingerprint has counts as equal when it was
    not given (None: a flag since removed or folded into the method section), or is in NON_GENERATING_ARGS (found
    since not to change predictions); the method flags older
    fingerprints listed among the arguments are compared through the method section instead
    (LEGACY_METHOD_ARGS). A method setting the stored description lacks (a setting added since, whose
    default changes nothing) counts as equal when the new run leaves it at its default (`method_at_default`)."""
    defaults = json.loads(json.dumps(argument_defaults or {}, default=str))
    at_default = set(method_at_default)
    old = _legacy_head_scores(old)
    lines = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        if section == "arguments" and isinstance(a, dict) and isinstance(b, dict):
            a, b = ({k: v for k, v in d.items() if k not in NON_GENERATING_ARGS} for d in (a, b))
            a = {k: v for k, v in a.items() if (k not in LEGACY_METHOD_ARGS or k in b) and (k in b or v is not None)}
            a.update({k: defaults[k] for k in b if k not in a and k in defaults and b[k] == defaults[k]})
        if section == "method" and isinstance(a, dict) and isinstance(b, dict):
            a = {**{k: b[k] for k in b if k not in a and k in at_default}, **_legacy_threshold(_legacy_quest(a))}
            a = {k: {**{s: b[k][s] for s in b[k] if s not in v and f"{k}.{s}" in at_default}, **v}   # a unit's
                 if isinstance(v, dict) and isinstance(b.get(k), dict) else v for k, v in a.items()}  # new setting
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key, "<unset>") != b.get(key, "<unset>"):
                    name = {"model_files": "model file ", "input_files": "input file "}.get(section, f"{section}.")
                    name += key
                    lines.append(f"{name}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
        elif a != b:
            lines.append(f"{section}: {a!r} -> {b!r}")
    return lines


def _legacy_head_scores(fingerprint: dict) -> dict:
    """A fingerprint from before every input file was digested: its head table's digest ("head_scores_file")
    as the input_files entry of that table."""
    if "head_scores_file" not in fingerprint:
        return fingerprint
    out = {k: v for k, v in fingerprint.items() if k != "head_scores_file"}
    table = ((fingerprint.get("method") or {}).get("head_allocation") or {}).get("head_scores")
    out["input_files"] = {**(fingerprint.get("input_files") or {}), f"head_scores={table}": fingerprint["head_scores_file"]}
    return out


def _legacy_quest(method: dict) -> dict:
    """A quest configuration recorded before its token budget moved to its page unit (budget -> page_budget,
    budget_ratio -> page_budget_ratio), as it reads now."""
    if method.get("method") != "quest" or "page_budget_ratio" in method:
        return method
    return {**method, "budget": None, "budget_ratio": None, "page_budget": method.get("budget"),
            "page_budget_ratio": method.get("budget_ratio")}


def _legacy_threshold(method: dict) -> dict:
    """A threshold configuration recorded while threshold eviction was a head allocation ({"head_allocation":
    {"name": "threshold", "threshold": t, "threshold_decoding": d}}), as it reads now: the sizing's flat settings
    beside a uniform head allocation."""
    heads = method.get("head_allocation")
    if not isinstance(heads, dict) or heads.get("name") != "threshold":
        return method
    return {**method, "head_allocation": {"name": "uniform"}, "threshold": heads.get("threshold"),
            "threshold_decoding": heads.get("threshold_decoding")}


def _result_files(folder: Path) -> list[Path]:
    return sorted({p for pattern in RESULT_GLOBS for p in folder.glob(pattern) if p.is_file()})


def open_run_folder(folder: Path, fingerprint: dict, overwrite: bool = False,
                    argument_defaults: Optional[dict] = None, method_at_default: Iterable[str] = ()) -> RunLock:
    """Create and lock the run folder; check that its results came from `fingerprint` (or clear them
    with `overwrite`). Returns the held lock. On refusal nothing is left behind: the lock is
    released and folders this call created are removed again."""
    folder = Path(folder)
    created = []
    for parent in reversed([folder, *folder.parents]):
        if not parent.exists():
            created.append(parent)
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder)
    try:
        lock.acquire()
        results = [p for p in _result_files(folder) if p.name != RUN_META]
        if overwrite:
            for path in _result_files(folder):
                path.unlink()
            if results:
                print(f"--overwrite: removed {len(results)} earlier result file(s) from {folder}", file=sys.stderr)
        elif results:
            stored = _stored_fingerprint(folder)
            if stored is None:
                raise RunFolderError(
                    f"{folder} holds results ({results[0].name}, ...) but no configuration fingerprint in "
                    f"{RUN_META} (written by an older version or by hand), so resuming could mix "
                    f"configurations; rerun with --overwrite or use another --save_dir")
            diffs = fingerprint_differences(stored, fingerprint, argument_defaults, method_at_default)
            if diffs:
                raise RunFolderError(
                    f"{folder} holds results of another configuration ({'; '.join(diffs)}); rerun with "
                    f"--overwrite to replace them, or use another --save_dir")
    except BaseException:
        lock.release()
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                pass
        raise
    return lock


def _stored_fingerprint(folder: Path) -> Optional[dict]:
    path = folder / RUN_META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        raise RunFolderError(f"{path} is not valid JSON ({e}); rerun with --overwrite or use another "
                             f"--save_dir") from None
    fingerprint = meta.get("fingerprint") if isinstance(meta, dict) else None
    return fingerprint if isinstance(fingerprint, dict) else None


# --- disk full ---------------------------------------------------------------------------------

@contextmanager
def exit_on_disk_full(folder: Path):
    """Inside: a full disk (or quota) while writing `folder` ends the run with one line saying what
    was kept and that a rerun resumes (disk_full_message); any other OSError propagates."""
    try:
        yield
    except OSError as e:
        message = disk_full_message(folder, e)
        if message is None:
            raise
        sys.exit(message)


def disk_full_message(folder: Path, error: OSError) -> Optional[str]:
    """One line for a full disk (or quota) while writing `folder`; None for any other OSError."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    kept = 0
    for path in Path(folder).glob("*.jsonl"):
        try:
            kept += path.read_bytes().count(b"\n")
        except OSError:
            pass
    return (f"error: disk full while writing {folder} ({error.strerror}); the {kept} completed row(s) "
            f"there are kept; free space and rerun the same command to resume")
