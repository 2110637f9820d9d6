"""TriAttention (Mao et al., 2026, arXiv 2604.04921), "TriAttention: Efficient Long Reasoning with Trigonometric KV
Compression": each head's queries before RoPE have a stable centre; the attention a future query will give a key is
predicted from that centre alone, as a trigonometric series over the RoPE frequencies in the distance between the
key's position and the future query's. Keys are scored with no query of the prompt at all, while decoding.

Defaults are the authors' HF experiment settings: per layer and KV head, back to the budget each time the cache
holds budget + 128 tokens, no recent window; the centres shipped for SmolLM2 (scripts/calibrate_triattention.py).

The authors' rule, read from their HF code (repository WeianMao/triattention, commit c3744ee6: PU =
`triattention/methods/pruning_utils.py`, TA = `triattention/methods/triattention.py`, CAL = their
`WeianMao/triattention/scripts/calibrate.py`, and their `cli.py` and `worker.py` in the same folder):

* Calibration (CAL 156-237): one forward of plain text; per layer and query head the queries before RoPE, as
  complex pairs z_f = q[f] + i q[f + D/2] (the rotate_half pairing, PU 86-98), f < D/2; kept: the complex mean
  c_f = mean z_f and the mean magnitude a_f = mean |z_f| (our scripts/calibrate_triattention.py).
* Score of a key k at position p for one query head (PU 256-309, TA 566-667), k un-rotated to z_f(k):
  S(k) = agg_o [ sum_f |c_f| |k_f| s_f^2 cos(w_f (t + o - p) + phi_f) ] + sum_f (a_f - |c_f|) |k_f| s_f^2,
  phi_f = arg(c_f conj(k_f)), w_f the RoPE frequencies, s_f the RoPE attention factor (1 for plain RoPE), t the
  position of the next token (TA 892: tokens so far), o over the geometric offsets 1, 2, 4, ... <= 65536 (PU
  245-253, `--triattention_frequency_window` 65536), agg the mean over offsets (`score_aggregation` "mean").
  The first sum is the centre rotated to the future position t + o dotted with the key as the cache holds it;
  that is how it is computed here (no angle is taken).
* Per layer and KV head (`per_layer_perhead_pruning`, TA 452-564): each query head's scores z-normalised over
  the candidate tokens (mean, biased std clamped at 1e-6, `triattention_normalize_scores` true in cli.py 307),
  the group's maximum (`layer_perhead_aggregation` "max"), the top `budget` tokens kept.
* Schedule (TA 894-911 with cli.py 304-308): the cache grows to budget + divide_length (128) counting the prompt
  (`count_prompt_tokens`, `slack_budget_trigger`), then goes back to budget: decode_budget = budget, decode_interval
  = 128 here (docs/decoding.md). No recent window in the HF code (`window_size` is parsed by worker.py but never
  passed to `apply_triattention_patch`, worker.py 614-633): window_size 0.

Differences (docs/methods.md, "TriAttention"): the authors' default selection (`per_head_pruning`, TA 368-450) is
one kept set per KV head index shared by every layer (mean over layers of the per-layer group maxima); the engine
selects per layer, so this is their `per_layer_perhead_pruning` option. They pin the prompt (`allow_prefill_
compression` false, TA 198-217); here the prompt competes (their `allow_prefill_compression` true). They add 1e-6
seeded uniform noise to break ties (TA 264-271); here ties go to the more recent token. They score batch row 0
only (TA 626, `key_states[0]`); here every prompt alone. A prompt longer than budget + 128 is cut right after
prefill here, at the first decode step there. `disable_mlr` / `disable_trig` ablations are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.capabilities import DecodeBudget
from pyramidkv.core.context import DecodeScoreContext, ScoreContext
from pyramidkv.methods.base import Method
from pyramidkv.methods.own_decode import DecodesAtItsBudget
from pyramidkv.methods.calibrated import artifact_path, checked_artifact

KIND = "triattention"
AGGREGATIONS = ("mean", "max")
# The authors' schedule: back to the budget each time the cache holds budget + 128 (decode_budget filled in).
SLACK = DecodeBudget(decode_budget=None, decode_interval=128)


def _centres(where, tensors: dict, record: dict, model: ModelShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(centres [L, Hq, D] float32 as real vectors (real parts, then imaginary: the rotate_half layout), the
    magnitude term a_f - |c_f| [L, Hq, D/2]) of a file, checked to fit the model."""
    expected = (model.num_layers, model.num_query_heads, model.head_dim // 2)
    for name in ("q_mean_real", "q_mean_imag", "q_abs_mean"):
        found = tensors.get(name)
        if found is None or tuple(found.shape) != expected:
            raise ValueError(f"calibration file {where} holds {name} of shape "
                             f"{None if found is None else tuple(found.shape)}; this model needs {expected} "
                             f"(layers, query heads, head dim / 2)")
    real, imag = tensors["q_mean_real"].float(), tensors["q_mean_imag"].float()
    return torch.cat([real, imag], dim=-1), tensors["q_abs_mean"].float() - torch.complex(real, imag).abs()


def offsets(frequency_window: int) -> list[int]:
    """The future distances scored: 1, 2, 4, ... up to frequency_window."""
    return [1 << i for i in range(frequency_window.bit_length())]


@dataclass(frozen=True)
class TriAttention(DecodesAtItsBudget, Method):
    """TriAttention's scorer: each key's predicted attention from the calibrated query centres; by default the cache
    goes back to the budget whenever it holds budget + 128 tokens (decode_budget defaults to the budget).

    triattention_path: the query-centre file (scripts/calibrate_triattention.py makes one: per layer and query
        head the complex mean and the mean magnitude of the queries before RoPE); none: the file shipped for the
        model.
    frequency_window: the farthest future distance scored: the offsets 1, 2, 4, ... up to it (the authors' 65536).
    offset_aggregation: how the offsets' predictions become a key's score: mean (the authors') or max.
    normalize_scores: z-normalise each query head's scores over the held tokens before the query group's maximum
        (the authors' default).
    """

    name = "triattention"
    decode_rule = "compresses while decoding (back to the budget every decode_interval tokens)"
    needs_rotation = True
    path_settings = ("triattention_path",)
    window_size: int = 0
    gqa_reduce: str = "max"
    decode: Optional[DecodeBudget] = SLACK
    triattention_path: Optional[str] = None
    frequency_window: int = 65536
    offset_aggregation: str = "mean"
    normalize_scores: bool = True

    def validate(self) -> None:
        if isinstance(self.frequency_window, bool) or not isinstance(self.frequency_window, int) or \
                self.frequency_window < 1:
            raise ValueError(f"frequency_window must be an integer >= 1 (the farthest future distance scored), "
                             f"got {self.frequency_window!r}")
        if self.offset_aggregation not in AGGREGATIONS:
            raise ValueError(f"offset_aggregation must be one of {'|'.join(AGGREGATIONS)}, "
                             f"got {self.offset_aggregation!r}")
        super().validate()

    def check_model(self, model: ModelShape) -> None:
        """The centres made on this model (refused in one line for another model or a misshapen file)."""
        super().check_model(model)
        checked_artifact(KIND, self.triattention_path, model, _centres)

    def packaged_files(self, model: Optional[ModelShape]) -> dict[str, str]:
        if self.triattention_path is not None or model is None or not model.name:
            return {}
        try:
            path = artifact_path(KIND, None, model)
        except ValueError:   # none for this model: check_model refuses it
            return {}
        return {f"triattention_path=packaged {path.name}": str(path)}

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hq, n]: each query head's predicted attention for every key (z-normalised over the real keys of
        its stored head), reduced over the query group by gqa_reduce (max) by the engine."""
        if ctx.rotation is None:
            raise ValueError(f"{self.name} needs the model's RoPE (ScoreContext.rotation): score through a cache "
                             f"made by pyramidkv.compress")
        centres, magnitude = checked_artifact(KIND, self.triattention_path, ctx.model, _centres)
        keys = ctx.keys.float()                                                   # [B, H, m, D] after RoPE
        bsz, heads, m, dim = keys.shape
        centre = centres[ctx.layer_idx].to(keys.device)                           # [Hq, D]
        group = centre.shape[0] // heads
        if isinstance(ctx, DecodeScoreContext):
            upcoming = ctx.positions.amax().view(1) + 1                           # [1]: the next token's position
        else:
            upcoming = ctx.positions[:, -1] + 1                                   # [B] (left padding: last is real)
        future = upcoming[:, None] + torch.tensor(offsets(self.frequency_window), device=keys.device)   # [B, O]
        count = future.shape[1]
        turned = ctx.rotation.rotate(centre[None, :, None].expand(bsz, -1, count, -1),
                                     future[:, None].expand(-1, centre.shape[0], -1))   # [B, Hq, O, D]
        turned = turned.view(bsz, heads, group, count, dim)
        if self.offset_aggregation == "mean":
            trig = torch.einsum("bkgd,bknd->bkgn", turned.mean(dim=3), keys)
        else:
            trig = torch.einsum("bkgod,bknd->bkgon", turned, keys).amax(dim=3)    # [B, H, g, m]
        # The magnitude term reads |k_f| before RoPE: the held pair's length over the RoPE factor s_f.
        factor = ctx.rotation.rotate(torch.ones(1, dim, device=keys.device),
                                     torch.zeros(1, dtype=torch.long, device=keys.device))[0, :dim // 2]   # s_f
        lengths = torch.complex(keys[..., :dim // 2], keys[..., dim // 2:]).abs()   # [B, H, m, D/2]
        weight = (magnitude[ctx.layer_idx].to(keys.device) * factor).view(heads, group, -1)
        scores = trig + torch.einsum("kgf,bknf->bkgn", weight, lengths)           # [B, H, g, m]
        real = (ctx.real if ctx.real.dim() == 3 else ctx.real[:, None])[:, :, None].expand_as(scores)
        if self.normalize_scores:
            counted = real.sum(dim=-1, keepdim=True).clamp(min=1)
            mean = scores.masked_fill(~real, 0.0).sum(dim=-1, keepdim=True) / counted
            spread = ((scores - mean).masked_fill(~real, 0.0).square().sum(dim=-1, keepdim=True) / counted).sqrt()
            scores = (scores - mean) / spread.clamp(min=1e-6)
        return scores.masked_fill(~real, 0.0).reshape(bsz, heads * group, m)
