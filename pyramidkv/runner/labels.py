"""How a run is named: its folder (`run_dir`: {save_dir}/{model}_{budget}/{method label}; the budget part is the
method's sizing's), the model part, and the method label and budget of a recorded run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pyramidkv.methods import Method


def recorded_method_label(meta: dict, folder: Path) -> str:
    """The method label (as results.json and the folder name give it: snapkv_merge=pivot) of a run from its
    run_meta.json's method_spec; the method folder's name where the record has none."""
    from pyramidkv.methods import parse_method_spec

    spec = meta.get("method_spec") if isinstance(meta, dict) else None
    if isinstance(spec, str):
        try:
            return parse_method_spec(spec).label()
        except (ValueError, TypeError):
            pass
    return Path(folder).name


def recorded_budget(meta: dict):
    """The budget (as results.json records it: 128, "r0.25", "threshold", None) of a run from its run_meta.json:
    its method_spec's sizing; where the record has no readable spec, its description's budget or budget_ratio."""
    from pyramidkv.methods import parse_method_spec

    spec = meta.get("method_spec") if isinstance(meta, dict) else None
    if isinstance(spec, str):
        try:
            method = parse_method_spec(spec)
            return method.sizing.recorded(method)
        except (ValueError, TypeError):
            pass
    described = (meta.get("method") if isinstance(meta, dict) else None) or {}
    ratio = described.get("budget_ratio")
    return described.get("budget") if ratio is None else f"r{ratio:g}"


def model_label(model_path: str) -> str:
    return Path(model_path.rstrip("/")).name


# The method folder's suffix of a run with the question fed as decode steps (--question_as_decode).
QUESTION_AS_DECODE_SUFFIX = "_question_as_decode"


def run_dir(save_dir: str, model_path: str, method: Method, question_as_decode: bool = False,
            shared_context: Optional[str] = None, prefill_chunk_size: Optional[int] = None) -> Path:
    """{save_dir}/{model}_{budget}/{method.label()}: the public harness's layout for a method at its
    defaults; settings other than the defaults are appended to the method folder (Component.label:
    snapkv_window_size=8_pooling=avg, adakv_floor_ratio=0.5, snapkv_head_allocation=adakv-floor_ratio=0.3),
    and QUESTION_AS_DECODE_SUFFIX when the question is fed as decode steps, `_{mode}` under --shared_context,
    `_prefill_chunk_size=N` under chunked prefill."""
    folder = method.label() + (QUESTION_AS_DECODE_SUFFIX if question_as_decode else "")
    folder += f"_{shared_context}" if shared_context else ""
    folder += f"_prefill_chunk_size={prefill_chunk_size}" if prefill_chunk_size is not None else ""
    return Path(save_dir) / f"{model_label(model_path)}_{method.sizing.folder_part(method)}" / folder
