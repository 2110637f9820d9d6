"""C kernels for the CPU, built on first use with the system C compiler (`CC`, else `cc`) for this machine's CPU
(`-march=native`) into a cache folder (`PYRAMIDKV_NATIVE_CACHE`, else ~/.cache/pyramidkv), keyed by the sources, the
flags and the CPU, and loaded with ctypes. Two families, one library:

  quantized_read.c   decode attention's two products over uniformly quantized KV, read from the packed codes
                     (quantization/native.py wraps them)
  segment_attend.c   decode attention over ragged full-precision segments, one call a layer (core/layout.py)

Each replaces torch ops that stay as the fallback: `PYRAMIDKV_NATIVE=0` turns the kernels off, and where no compiler
works the torch ops run, with one warning. `status()` says which (run_meta.json records it). Same products on the
same float32 operands as the torch ops; the sums run in another order, so results agree to float32 rounding, not
bit for bit. Floor 0: imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

SOURCES = tuple(Path(__file__).with_name(name) for name in ("quantized_read.c", "segment_attend.c"))
HEADER = Path(__file__).with_name("common.h")
FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC")
_CPU_FLAGS = ("-march=native",)
_REASON: list[str] = []


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line for line in lines if line.startswith(("flags", "Features"))), platform.processor())


def _cache_folder() -> Path:
    root = os.environ.get("PYRAMIDKV_NATIVE_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pyramidkv"


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile into a file beside target, then move it in (two processes building at once both succeed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-lm", "-o", partial], check=True, capture_output=True,
                       text=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _folder() -> Path:
    """The cache folder, or where it cannot be made or written, one of the temporary directory."""
    folder = _cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    user = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"pyramidkv-native-{user}"


def _build() -> ctypes.CDLL:
    """Build (or find built) and load: for this CPU first, else portable."""
    compiler = os.environ.get("CC", "cc")
    folder, errors = _folder(), []
    for flags in (FLAGS + _CPU_FLAGS, FLAGS):
        texts = [source.read_text() for source in (*SOURCES, HEADER)]
        key = hashlib.sha256("\0".join([*texts, compiler, *flags, platform.machine(), _cpu()]).encode()).hexdigest()
        target = folder / f"native-{key[:16]}.so"
        try:
            if not target.exists():
                _compile(compiler, flags, target)
            return ctypes.CDLL(str(target))
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            errors.append(f"{compiler} {' '.join(flags)}: {detail.strip().splitlines()[-1] if detail else error}")
    raise OSError("; ".join(errors))


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.pk_key_scores.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr,
                                      i64, i64, i64, i64, i64, i32, ptr]
    library.pk_weighted_values.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, i64, i64,
                                           i64, i64, i64, i64, i64, i64, i32, ptr]
    library.pk_segment_attend.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    for function in (library.pk_key_scores, library.pk_weighted_values, library.pk_segment_attend):
        function.restype = ctypes.c_int
    return library


_OFF = [0]   # depth of `off()` blocks open


def library() -> Optional[ctypes.CDLL]:
    """The built kernels, or None (turned off, inside `off()`, or no compiler: the reason is in `status()`)."""
    return None if _OFF[0] else _loaded()


@contextlib.contextmanager
def off():
    """Inside, every caller reads through the torch ops (measurements and tests put both side by side)."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


def reset() -> None:
    """Look for the kernels again at the next call (after the environment changed)."""
    _loaded.cache_clear()


@functools.lru_cache(maxsize=None)
def _loaded() -> Optional[ctypes.CDLL]:
    setting = os.environ.get("PYRAMIDKV_NATIVE", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"PYRAMIDKV_NATIVE must be 1 (the C kernels, the default) or 0 (the torch ops), got {setting!r}")
    if setting == "0":
        _REASON.append("off (PYRAMIDKV_NATIVE=0)")
        return None
    try:
        return _declare(_build())
    except OSError as error:
        _REASON.append(f"unavailable ({error})")
        warnings.warn(f"pyramidkv: the C kernels could not be built, torch ops run instead (slower, same products): "
                      f"{error}", RuntimeWarning, stacklevel=2)
        return None


def status() -> str:
    """'on', 'off (...)' or 'unavailable (...)': whether the C kernels run."""
    return "on" if _loaded() is not None else _REASON[-1]


def check(code: int) -> None:
    if code:
        raise MemoryError("pyramidkv: a C kernel could not allocate its work buffer")
