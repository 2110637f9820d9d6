"""The quantized reads in C (native_read.c): decode attention's key scores and weighted values over plain
uniform blocks (KIVI's: no codebook, outliers or low-rank term; groups of whole bytes), reading the packed
codes where torch ops (kernels.py, cells.py) first write every level as a float32 to memory. Same products,
same float32 operands; the sums run in another order, so results agree to float32 rounding, not bit for bit.

Built on first use with the system C compiler (`CC`, else `cc`) for this machine's CPU (`-march=native`) into
a cache folder (`PYRAMIDKV_NATIVE_CACHE`, else ~/.cache/pyramidkv), keyed by the source, the flags and the
CPU. CPU tensors only. `PYRAMIDKV_NATIVE=0` turns it off; where no compiler works the torch ops run instead,
with one warning. `status()` says which (run_meta.json records it).
"""

from __future__ import annotations

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

import torch

from pyramidkv.quantization.block import QuantizedBlock

SOURCE = Path(__file__).with_name("native_read.c")
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
        subprocess.run([compiler, *flags, str(SOURCE), "-o", partial], check=True, capture_output=True, text=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    errors = []
    for flags in (FLAGS + _CPU_FLAGS, FLAGS):
        key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *flags, platform.machine(), _cpu()])
                             .encode()).hexdigest()[:16]
        target = _cache_folder() / f"native_read-{key}.so"
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
    for function in (library.pk_key_scores, library.pk_weighted_values):
        function.restype = ctypes.c_int
    return library


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The built kernels, or None (turned off, or no compiler: the reason is in `status()`)."""
    if os.environ.get("PYRAMIDKV_NATIVE", "1") == "0":
        _REASON.append("off (PYRAMIDKV_NATIVE=0)")
        return None
    try:
        return _declare(_build())
    except OSError as error:
        _REASON.append(f"unavailable ({error})")
        warnings.warn(f"pyramidkv: the C reads of quantized KV could not be built, torch ops read them instead "
                      f"(slower, same products): {error}", RuntimeWarning, stacklevel=2)
        return None


def status() -> str:
    """'on', 'off (...)' or 'unavailable (...)': whether quantized CPU reads run in C."""
    return "on" if library() is not None else _REASON[-1]


def reads(block: QuantizedBlock) -> bool:
    """Whether the C kernels read this block: a CPU block of plain uniform groups of whole bytes."""
    return (block.codes.device.type == "cpu" and block.codebook is None and block.outlier_index is None
            and block.left is None and block.group_size % (8 // block.nbits) == 0
            and block.scale.dtype == block.zero.dtype == torch.float16 and library() is not None)


def _pointer(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(code: int) -> None:
    if code:
        raise MemoryError("pyramidkv: the C read of quantized KV could not allocate its work buffer")


def key_scores(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, queries: torch.Tensor, groups: int,
               group_size: int, nbits: int, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keys in channel layout read as N x `groups` groups of G = group_size tokens -> float32 [N, rows, J * G].

    codes uint8 [N, D, J * G / per] and scale, zero fp16 [N, D, J] (a block, or a token span of one: J groups
    from its start), or with `order` (long [N * J]: the row of each group) codes [R, D, G / per] and scale, zero
    [R, D, 1] (one group a row: a stack read as a grid). queries [N, rows, D], any float dtype."""
    q = queries.float().contiguous()
    n, rows, dim = q.shape
    codes, scale, zero = _inner(codes), _inner(scale), _inner(zero)
    per = 8 // nbits
    if order is None:
        sn, sj, ssn, ssj = codes.stride(0), group_size // per, scale.stride(0), 1
    else:
        order = order.contiguous()
        sn, sj, ssn, ssj = codes.stride(0), 0, scale.stride(0), 0
    out = torch.empty(n, rows, groups * group_size)
    _check(library().pk_key_scores(codes.data_ptr(), sn, sj, codes.stride(1), scale.data_ptr(), zero.data_ptr(),
                                   ssn, ssj, scale.stride(1), _pointer(order), q.data_ptr(), n, groups, rows, dim,
                                   group_size, nbits, out.data_ptr()))
    return out


def weighted_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, probs: torch.Tensor, groups: int,
                    tokens: int, channels: int, nbits: int, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """probs [N, rows, J * T] @ values in token layout read as N x `groups` runs of T = `tokens` tokens ->
    float32 [N, rows, D]; `channels`: the channels of a scale group.

    codes uint8 [N, J * T, D / per] and scale, zero fp16 [N, J * T, D / channels], or with `order` (long [N * J]:
    the row of each run) codes [R, T, D / per] and scale, zero [R, T, D / channels]."""
    p = _inner(probs.float())
    n, rows, _ = p.shape
    codes, scale, zero = _inner(codes), _inner(scale), _inner(zero)
    dim = codes.shape[-1] * (8 // nbits)
    if order is None:
        sn, sj, ssn, ssj = codes.stride(0), tokens * codes.stride(1), scale.stride(0), tokens * scale.stride(1)
    else:
        order = order.contiguous()
        sn, sj, ssn, ssj = codes.stride(0), 0, scale.stride(0), 0
    out = torch.empty(n, rows, dim)
    _check(library().pk_weighted_values(codes.data_ptr(), sn, sj, codes.stride(1), scale.data_ptr(), zero.data_ptr(),
                                        ssn, ssj, scale.stride(1), _pointer(order), p.data_ptr(), p.stride(0),
                                        p.stride(1), n, groups, rows, dim, tokens, channels, nbits, out.data_ptr()))
    return out
