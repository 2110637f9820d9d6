"""KVzap (Jégou and Jeblick, 2026, arXiv 2601.07891): a small per-layer predictor reads each token's attention
input (the hidden state after the layer's input norm) and predicts, per KV head, the log of the importance KVzip+
would give that token; with threshold eviction (DMS's rule, pyramidkv/sizing/threshold.py) a token outside the
recent window stays iff its predicted log score >= threshold.

The predictor is `Linear(E, Hkv)` (`kvzap_model="linear"`) or `Linear(E, 512) -> GELU -> Linear(512, Hkv)` ("mlp"),
one per layer, fitted by scripts/calibrate_kvzap.py on the model's own targets and read from a calibration artifact
(pyramidkv/methods/calibrated.py). The score is computed in float32: the hidden state is cast to float32 and the
predictor is stored in float32. Each prompt of a batch is scored on its own real tokens (no padding row enters its
matmul), and a token's score reads that token alone (`token_scores`), so threshold decisions can be made while
decoding as tokens leave the window. docs/methods.md, "KVzap", has the targets, the shipped predictor and thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method
from pyramidkv.sizing import Sizing, Threshold
from pyramidkv.methods.calibrated import artifact_path, checked_artifact

KVZAP_MODELS = ("linear", "mlp")
MLP_WIDTH = 512
# Tensor names of an artifact: per kind, name -> its shape as (L, then what each layer holds), E the hidden size.
TENSORS = {"linear": {"weight": ("H", "E"), "bias": ("H",)},
           "mlp": {"w1": ("W", "E"), "b1": ("W",), "w2": ("H", "W"), "b2": ("H",)}}
DEFAULT_THRESHOLD = -3.0   # SmolLM2-135M: ~39% of the tokens out of the window kept (docs/methods.md, "KVzap")


def predict(tensors: dict[str, torch.Tensor], layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., E] (any float dtype) -> [..., H] float32 predicted log scores of one layer; tensors: an artifact's,
    linear (weight [L, H, E], bias [L, H]) or mlp (w1 [L, 512, E], b1, w2 [L, H, 512], b2)."""
    x = hidden.float()
    t = {name: value[layer].to(x.device) for name, value in tensors.items()}
    if "weight" in t:
        return torch.nn.functional.linear(x, t["weight"], t["bias"])
    inner = torch.nn.functional.gelu(torch.nn.functional.linear(x, t["w1"], t["b1"]))
    return torch.nn.functional.linear(inner, t["w2"], t["b2"])


def check_tensors(path, kind: str, tensors: dict[str, torch.Tensor], model: ModelShape, hidden_size: int) -> None:
    """ValueError (one line) unless the artifact holds the predictor of `kind` for every layer and KV head."""
    sizes = {"H": model.num_kv_heads, "E": hidden_size, "W": MLP_WIDTH}
    for name, dims in TENSORS[kind].items():
        want = (model.num_layers, *(sizes[d] for d in dims))
        got = tuple(tensors[name].shape) if name in tensors else None
        if got != want or tensors[name].dtype != torch.float32:
            raise ValueError(f"calibration file {path}: tensor {name!r} is {got} "
                             f"{tensors[name].dtype if name in tensors else ''}, a kvzap-{kind} predictor for this "
                             f"model needs {want} float32")


def _predictor(where, tensors: dict, record: dict, model: ModelShape) -> dict[str, torch.Tensor]:
    """The predictor's tensors of a file, checked to fit the model (`check_tensors`)."""
    kind = record["kind"].removeprefix("kvzap-")
    check_tensors(where, kind, tensors, model, record["model"]["hidden_size"])
    return tensors


@dataclass(frozen=True)
class KVzap(Method):
    """KVzap's scorer: per KV head the predicted log importance of each token, from its attention input alone.
    Threshold eviction by default (kvpress's DMSPress(KVzapPress)): a token out of the last window_size tokens
    stays iff its score >= threshold; no sinks. Given a budget it keeps that many by score (kvpress's kvzap_mlp_head
    is budget=N, kvzap_mlp_layer budget=N with head_allocation=adakv).

    kvzap_model: the predictor, linear (Linear(E, Hkv) per layer) or mlp (Linear(E, 512) -> GELU ->
        Linear(512, Hkv) per layer).
    kvzap_path: a calibration file of that predictor (scripts/calibrate_kvzap.py); none: the one packaged
        for the model (SmolLM2-135M: linear only).
    """

    name = "kvzap"
    needs_hidden: ClassVar[bool] = True
    token_scores: ClassVar[bool] = True
    path_settings = ("kvzap_path",)
    window_size: int = 128
    sizing: Sizing = Threshold(threshold=DEFAULT_THRESHOLD)
    kvzap_model: str = "linear"
    kvzap_path: Optional[str] = None

    @property
    def kind(self) -> str:
        """The calibration artifact kind this method reads."""
        return f"kvzap-{self.kvzap_model}"

    def validate(self) -> None:
        if self.kvzap_model not in KVZAP_MODELS:
            raise ValueError(f"kvzap_model must be one of {'|'.join(KVZAP_MODELS)}, got {self.kvzap_model!r}")
        if self.decode is not None:
            raise ValueError(f"{self.name} does not combine with decode_budget={self.decode.decode_budget}: a "
                             f"re-selection re-scores held tokens, whose attention inputs are gone; use "
                             f"threshold eviction (threshold_decoding decides each token as it leaves the window)")
        super().validate()

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        if self.kvzap_path is not None or model is None or not model.name:
            return {}
        path = artifact_path(self.kind, None, model)
        return {f"kvzap_path=packaged {path.name}": str(path)}

    def check_model(self, model: ModelShape) -> None:
        """The predictor made on this model (a file made on another is refused in one line)."""
        super().check_model(model)
        self.predictor(model)

    def predictor(self, model: Optional[ModelShape]) -> dict[str, torch.Tensor]:
        """The predictor's tensors for this model (read once per model and file)."""
        return checked_artifact(self.kind, self.kvzap_path, model, _predictor)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hkv, n] float32 predicted log scores of the tokens whose attention inputs ctx.hidden [B, n, E] holds;
        0 at padding. Each prompt is scored on its own real tokens."""
        if ctx.hidden is None:
            raise ValueError(f"{self.name} scores a token from its attention input (ScoreContext.hidden), which this "
                             f"context lacks")
        tensors = self.predictor(ctx.model)
        hidden = ctx.hidden
        bsz, n, _ = hidden.shape
        real = ctx.real if ctx.real is not None and ctx.real.dim() == 2 and ctx.real.shape[-1] == n else None
        if bsz == 1 and (real is None or n == 1):   # one prompt, no padding (a decode step's token): no masks
            return predict(tensors, ctx.layer_idx, hidden[0]).T[None]
        out = torch.zeros(bsz, n, tensors["bias" if "bias" in tensors else "b2"].shape[-1], device=hidden.device)
        for row in range(bsz):
            if real is None:
                out[row] = predict(tensors, ctx.layer_idx, hidden[row])
            else:
                out[row, real[row]] = predict(tensors, ctx.layer_idx, hidden[row, real[row]])
        return out.transpose(1, 2)

