"""Sparse prefill attentions: which query-key entries of the prompt's attention are computed (one unit of a
method, like its allocation, merge rule and quantizer). None on a method = the model's own dense attention."""

from __future__ import annotations

from pyramidkv.sparse_prefill.base import SparsePrefill
from pyramidkv.sparse_prefill.minference import MInference

SPARSE_PREFILLS: dict[str, type[SparsePrefill]] = {cls.name: cls for cls in (MInference,)}


def make_sparse_prefill(name: str) -> SparsePrefill:
    if name not in SPARSE_PREFILLS:
        raise ValueError(f"unknown prefill_attention {name!r}; choose one of: {', '.join(SPARSE_PREFILLS)}")
    return SPARSE_PREFILLS[name]()


__all__ = ["SPARSE_PREFILLS", "SparsePrefill", "make_sparse_prefill"]
