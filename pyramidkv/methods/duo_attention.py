"""DuoAttention (Xiao et al., 2024, arXiv 2410.10819): "Efficient Long-Context LLM Inference with Retrieval and
Streaming Heads", ICLR 2025.

Each stored KV head is a retrieval head (keeps every token) or a streaming head (keeps the first `num_sinks` tokens
and the last `window_size`, physically stored that small; while decoding its window slides: sinks + the last
`window_size` tokens). Which heads stream comes from a per-model pattern: one gate per (layer, KV head), in the
official format (`full_attention_heads.tsv`: L rows of Hkv tab-separated floats, read with clip(0, 1)), trained by
scripts/calibrate_duo.py (the authors' gate optimisation) or scored on the fly (kvpress's variant); the share
`streaming_share` of the L x Hkv heads with the lowest gates stream.

On the threshold engine (sizing/threshold.py): every token of a retrieval head scores 1.0, of a streaming head
0.0, kept iff >= 0.5 once out of the window; sinks and window are the selection's sinks and the method's window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar, Optional

import numpy as np
import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.sizing import Sizing, Threshold
from pyramidkv.capabilities import Selection
from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method

KIND = "duo"
PATTERN_FILE = "full_attention_heads.tsv"
CONFIG_FILE = "config.json"
SELECTIONS = ("quantile", "argsort")
NOISE_SEED = 42     # the official tie-break noise U(0, 1e-6), seeded here (unseeded global numpy there)


def removed_share(streaming_fraction: float, sinks: int, recent: int, n: int) -> float:
    """Share of an n-token cache removed when `streaming_fraction` of the heads keep sinks + recent tokens and the
    others keep all n: frac_streaming * (1 - (sinks + recent) / n), 0 where n <= sinks + recent (kvpress #228)."""
    return streaming_fraction * max(0.0, 1.0 - (sinks + recent) / n)


def read_pattern(path) -> tuple[np.ndarray, Optional[dict], Path]:
    """(gates [L, Hkv] clipped to [0, 1], the pyramidkv record of its config.json or None, the .tsv read) of a
    pattern folder (full_attention_heads.tsv + config.json) or a .tsv file; ValueError naming the file otherwise."""
    path = Path(path)
    tsv = path / PATTERN_FILE if path.is_dir() else path
    if not tsv.is_file():
        raise ValueError(f"duo_pattern {path}: no such file (a folder holding {PATTERN_FILE} or that file)")
    try:
        gates = np.loadtxt(tsv, dtype=np.float64, delimiter="\t", ndmin=2)
    except ValueError as e:
        raise ValueError(f"duo_pattern {tsv}: not rows of tab-separated numbers ({str(e).splitlines()[0][:100]})") \
            from None
    if gates.size == 0 or not np.isfinite(gates).all():
        raise ValueError(f"duo_pattern {tsv}: empty or not finite (L rows of Hkv gates expected)")
    config = tsv.parent / CONFIG_FILE
    record = None
    if config.is_file():
        from pyramidkv.methods.calibrated import RECORD_KEY, check_version, text_digest

        try:
            record = json.loads(config.read_text(encoding="utf-8")).get(RECORD_KEY)
        except (ValueError, AttributeError):
            raise ValueError(f"duo_pattern {config}: not a JSON object") from None
        if record is not None:   # ours (an official folder's config.json has no record): what it says it holds
            check_version(config, record)
            if text_digest(tsv.read_text(encoding="utf-8")) != record.get("pattern_sha256"):
                raise ValueError(f"duo_pattern {tsv} was edited: it does not match the sha256 the record in "
                                 f"{config} holds (re-make it with `python scripts/calibrate_duo.py`)")
    return np.clip(gates, 0.0, 1.0), record, tsv


def streaming_heads(gates: np.ndarray, share: float, selection: str = "quantile",
                    seed: int = NOISE_SEED) -> np.ndarray:
    """[L, Hkv] bool, True where the head streams. quantile (the official rule): gates + U(0, 1e-6) noise
    (seeded), thr = quantile(all L x Hkv, share), retrieval iff >= thr (share 1: all stream, 0: none); argsort
    (kvpress): the round(L * Hkv * share) lowest gates in np.argsort's order stream."""
    gates = np.asarray(gates, dtype=np.float64)
    if selection == "argsort":
        count = int(round(gates.size * share))
        flat = np.zeros(gates.size, dtype=bool)
        flat[np.argsort(gates.reshape(-1))[:count]] = True
        return flat.reshape(gates.shape)
    noisy = gates + np.random.default_rng(seed).uniform(0.0, 1e-6, gates.shape)
    threshold = 2.0 if share >= 1 else -1.0 if share <= 0 else np.quantile(noisy, share)
    return ~(noisy >= threshold)


def packaged_pattern(model: ModelShape) -> Path:
    """The packaged pattern folder made on `model` (known by content); ValueError naming how to make one."""
    from pyramidkv.allocation.head_tables import PACKAGED_MODELS
    from pyramidkv.components import packaged_table
    from pyramidkv.methods.calibrated import PACKAGED_DIR

    suffix = f"_{KIND}"
    folders = {p.name[: -len(suffix)]: p for p in sorted(PACKAGED_DIR.glob(f"*{suffix}")) if p.is_dir()}
    return packaged_table(model.name, folders, PACKAGED_MODELS, made_on="its packaged DuoAttention pattern was made on",
                          missing="no packaged DuoAttention pattern",
                          make=f"make one with `python scripts/calibrate_duo.py --model_path {model.name or 'MODEL'} "
                               f"--out DIR` and pass duo_pattern=DIR (--duo_pattern DIR)")


@lru_cache(maxsize=16)
def model_pattern(path: Optional[str], model: ModelShape) -> tuple[np.ndarray, Path]:
    """(gates [L, Hkv], file) for the model: `path` or the packaged one, checked to fit it: the shape always, the
    model it was made on where its config.json holds our record (an official folder has none)."""
    from pyramidkv.methods.calibrated import check_made_for

    gates, record, tsv = read_pattern(path if path is not None else packaged_pattern(model))
    if gates.shape != (model.num_layers, model.num_kv_heads):
        raise ValueError(f"duo_pattern {tsv} holds {gates.shape[0]} rows x {gates.shape[1]} gates; this model has "
                         f"{model.num_layers} layers x {model.num_kv_heads} KV heads: make one with `python "
                         f"scripts/calibrate_duo.py --model_path {model.name or 'MODEL'} --out DIR`")
    if record is not None:
        check_made_for(tsv, record, model)
    return gates, tsv


@lru_cache(maxsize=32)
def _streaming(path: Optional[str], share: float, selection: str, model: ModelShape) -> torch.Tensor:
    """[L, Hkv] bool: the heads that stream on this model (read once per model, pattern and share)."""
    gates, _ = model_pattern(path, model)
    return torch.from_numpy(streaming_heads(gates, share, selection))


@lru_cache(maxsize=32)
def _retrieval(path: Optional[str], share: float, selection: str, model: ModelShape) -> torch.Tensor:
    """[L, Hkv] float32: 1.0 on a retrieval head, 0.0 on a streaming one (the score's rows, made once, not per step)."""
    return (~_streaming(path, share, selection, model)).float()


@dataclass(frozen=True)
class DuoAttention(Method):
    """Retrieval heads keep everything; streaming heads keep num_sinks + the last window_size tokens.

    streaming_share: fraction of the L x Hkv KV heads that stream, in (0, 1] (the official `sparsity`, kvpress's
        `head_compression_ratio`); the share of the cache removed is another figure (`removed_share`).
    duo_pattern: a pattern folder (full_attention_heads.tsv + config.json) or a .tsv file in the official format;
        none: the pattern packaged for the model (known by content; scripts/calibrate_duo.py makes one).
    duo_selection: quantile (the official rule: seeded U(0, 1e-6) tie-break noise, the heads below the
        share-quantile of all gates stream) or argsort (kvpress: the round(L x Hkv x share) lowest gates, np.argsort
        order).
    """

    name = "duo_attention"
    token_scores: ClassVar[bool] = True
    path_settings = ("duo_pattern",)

    window_size: int = 256
    selection: Selection = Selection(num_sinks=64)
    sizing: Sizing = Threshold(threshold=0.5)
    streaming_share: float = 0.5
    duo_pattern: Optional[str] = None
    duo_selection: str = "quantile"

    def validate(self) -> None:
        if isinstance(self.streaming_share, bool) or not 0.0 <= self.streaming_share <= 1.0:
            raise ValueError(f"streaming_share must be in (0, 1] (fraction of KV heads that stream), got "
                             f"{self.streaming_share!r}")
        if self.streaming_share == 0:
            raise ValueError("streaming_share 0: no head streams, every head keeps every token (that is fullkv); "
                             "allowed: 0 < streaming_share <= 1")
        if self.duo_selection not in SELECTIONS:
            raise ValueError(f"duo_selection must be one of {'|'.join(SELECTIONS)}, got {self.duo_selection!r}")
        if not isinstance(self.sizing, Threshold) or self.sizing.threshold is None \
                or not 0.0 < self.sizing.threshold <= 1.0:
            got = ", ".join(f"{k}={v!r}" for k, v in self.sizing.settings().items() if v is not None) or "none"
            raise ValueError(f"duo_attention scores a retrieval head's tokens 1 and a streaming head's 0: it evicts "
                             f"by a threshold with 0 < threshold <= 1, got {got}")
        super().validate()

    def streaming(self, model: Optional[ModelShape]) -> torch.Tensor:
        """[L, Hkv] bool: the heads that stream on this model."""
        if model is None:
            raise ValueError("duo_attention finds its pattern by the model: score through a cache the model patch "
                             "makes (pyramidkv.compress), which gives the scorer the model's shape (ScoreContext.model)")
        return _streaming(self.duo_pattern, self.streaming_share, self.duo_selection, model)

    def check_model(self, model: ModelShape) -> None:
        super().check_model(model)
        streaming = self.streaming(model)
        if not streaming.any():   # argsort: round(L x Hkv x share) is 0
            raise ValueError(f"streaming_share {self.streaming_share!r} makes no head of the model's "
                             f"{streaming.numel()} KV heads stream (duo_selection {self.duo_selection}), every head "
                             f"keeps every token (that is fullkv); allowed: streaming_share > "
                             f"{0.5 / streaming.numel():.3g}")

    def file_read(self, name: str) -> Path:
        path = super().file_read(name)
        return path / PATTERN_FILE if path.is_dir() else path

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        if self.duo_pattern is not None or model is None or not model.name:
            return {}
        tsv = packaged_pattern(model) / PATTERN_FILE
        return {f"duo_pattern=packaged {tsv.parent.name}": str(tsv)}

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hkv, n]: 1.0 on a retrieval head, 0.0 on a streaming head, whatever the token."""
        bsz, _, n, _ = ctx.keys.shape
        if ctx.model is None:
            self.streaming(ctx.model)   # refuses, naming why
        keep = _retrieval(self.duo_pattern, self.streaming_share, self.duo_selection, ctx.model)[ctx.layer_idx]
        return keep.to(ctx.keys.device)[None, :, None].expand(bsz, keep.shape[0], n)
