"""R-KV (Cai et al., 2025, arXiv 2505.24133), "R-KV: Redundancy-aware KV Cache Compression for Training-Free
Reasoning Models Acceleration", as its code github.com/Zefan-Cai/R-KV does it: score = mix_lambda (0.07) x the
attention of the last window_size (8) queries, max-pooled along positions (GQA: the query group's logits reduced by
their max), minus (1 - mix_lambda) x the key's redundancy (softmax of its mean cosine similarity to every held key,
each key's newest near-duplicate spared); per KV head the top budget - window_size plus the window. The prompt is cut
to the budget at prefill and the cache re-selected back to it every decode_interval (128) generated tokens
(decode_budget defaults to the budget).

The authors' rule, read from their code (commit d15c976; `rkv/compression/r1_kv.py` R1KV.update_kv, `rkv/utils.py`
compute_attention_scores and cal_similarity, `rkv/modeling.py` the query cache and CausalLM_forward, `run_math.py`
the defaults), each point as implemented here:

  * importance (r1_kv.py 49-67; utils.py 8-39): logits q . k / sqrt(D) of the last `window_size` queries against
    every held key; with GQA the query group's logits are reduced by their MAX before any softmax
    (compute_attention_scores' default pooling="max"); softmax over the keys before the window only (the window's
    own keys are left out of the denominator), in float32; mean over the window's queries; then 1-D max pooling
    along positions (kernel_size 7, stride 1, padding 3) over those keys.
  * redundancy (utils.py 42-94, called with threshold 0.5 and retain_direction "last"): keys divided by their
    norm + 1e-8, the cosine matrix of every held key (the window included) with every other, diagonal set to 0;
    in each row i the most recent j with cosine > 0.5 gets its entry set to 0 (the newest near-duplicate of a
    token is not charged for it; a row with none zeroes its entry at the first token, as argmax over an empty
    match does there); each key's redundancy is the mean of its column over all rows, then a softmax over all
    held keys (window included), of which the keys before the window are read.
  * combined (r1_kv.py 75-77): mix_lambda * importance - (1 - mix_lambda) * redundancy, mix_lambda 0.07; the top
    budget - window_size keys before the window plus the window are kept, per KV head (r1_kv.py 82, 168-179).
  * schedule (modeling.py 101-173, 589-611; r1_kv.py 46): the prompt is compressed to `budget` at prefill by the
    same rule when it holds >= budget tokens; while decoding the cache grows and is compressed back to budget
    every divide_length = 128 tokens (run_math.py 154), the window's queries being the last window_size (8)
    queries, the newest included. Defaults: budget 128 (their run.sh), window_size 8, kernel 7, lambda 0.07.

Differences (docs/methods.md, "R-KV", lists them with the reasons): the firing phase (theirs: when the running
token count, prompt included, is 1 mod 128, from the first such count after the prompt; here: when a head holds
decode_budget + decode_interval, so the first decode-time compression comes after decode_interval generated
tokens; in steady state both compress every 128 tokens from budget + 128 to budget); batches (theirs read the
redundancy of prompt 0 for the whole batch and score padding as tokens; here each prompt's real tokens alone);
arithmetic (theirs bfloat16 with float32 softmax; here float32, or float64 for a float64 model); the order of the
held tokens (theirs, after a compression, hold the kept tokens in top-k order, by score, then the window, so at the
next compression their max pooling pools neighbours in that order and their "most recent" near-duplicate is the
last in it; here both go by position, the evident intent, and the first compression is the same in both); the
running count is per generation (theirs a model attribute never reset between prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pyramidkv.capabilities import DecodeBudget
from pyramidkv.components import AttentionForm
from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.base import Method
from pyramidkv.methods.own_decode import DecodesAtItsBudget

# The authors' schedule: back to the budget (decode_budget None: the method's budget, filled in when built) every
# 128 generated tokens (run_math.py --divide_length 128), the window's queries buffered (decode_query_window None:
# window_size).
EVERY_128 = DecodeBudget(decode_budget=None, decode_interval=128)

ROW_CHUNK = 1024   # rows of the cosine matrix built at once: memory [B, H, ROW_CHUNK, n], not [B, H, n, n]


def _per_head(real: torch.Tensor, heads: int) -> torch.Tensor:
    """real [B, n] or [B, H, n] -> [B, H, n]."""
    return (real[:, None, :] if real.dim() == 2 else real).expand(real.shape[0], heads, real.shape[-1])


def importance(queries: torch.Tensor, keys: torch.Tensor, real: torch.Tensor, window: int, kernel_size: int,
               form: AttentionForm) -> torch.Tensor:
    """The window's attention to each key before it, pooled. queries [B, Hq, q, D] (the last q tokens'), keys
    [B, H, n, D], real [B, H, n] -> [B, H, n - w] (w = min(window, q, n)), in keys' dtype promoted to float32."""
    dtype = torch.promote_types(keys.dtype, torch.float32)
    bsz, heads, n, dim = keys.shape
    w = min(window, queries.shape[2], n)
    group = queries.shape[1] // heads
    q = queries[:, :, queries.shape[2] - w:].to(dtype).reshape(bsz, heads, group, w, dim)
    before = keys[:, :, : n - w].to(dtype)[:, :, None]                # [B, H, 1, n - w, D]
    logits = form.cap(q @ before.transpose(-1, -2) / dim ** 0.5).amax(dim=2)   # [B, H, w, n - w]: max over the group
    allowed = real[..., None, : n - w]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1, dtype=dtype).nan_to_num(0.0)
    rows = real[..., n - w:, None].to(dtype)                      # a padding query (a prompt shorter than w) counts 0
    mean = (probs * rows).sum(dim=2) / rows.sum(dim=2).clamp(min=1)
    if kernel_size > 1 and n - w > 0:   # padding holds 0 and every real value is >= 0: max pooling ignores it
        flat = F.max_pool1d(mean.reshape(bsz * heads, 1, n - w), kernel_size, stride=1, padding=kernel_size // 2)
        mean = flat.reshape(bsz, heads, n - w)
    return mean


def redundancy(keys: torch.Tensor, real: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each key's redundancy: the softmax over the real keys of its mean cosine similarity to every real key, the
    newest near-duplicate of each row spared. keys [B, H, n, D], real [B, H, n] -> [B, H, n]."""
    dtype = torch.promote_types(keys.dtype, torch.float32)
    k = keys.to(dtype)
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    n = k.shape[2]
    padded = not bool(real.all())
    first = (~real).sum(dim=-1, keepdim=True)                     # [B, H, 1]: the first real token (left padding)
    columns = torch.zeros(real.shape, dtype=dtype, device=k.device)
    for start in range(0, n, ROW_CHUNK):
        stop = min(start + ROW_CHUNK, n)
        sim = unit[:, :, start:stop] @ unit.transpose(-1, -2)       # [B, H, c, n]
        if padded:
            sim.masked_fill_(~(real[..., start:stop, None] & real[..., None, :]), 0.0)
        sim.diagonal(offset=start, dim1=-2, dim2=-1).zero_()        # a key is no duplicate of itself
        above = sim > threshold
        # Each row's newest near-duplicate: the last column above the threshold (none: the first real token).
        last = n - 1 - above.flip(-1).to(torch.uint8).argmax(dim=-1)
        newest = torch.where(above.any(dim=-1), last, first)         # [B, H, c]
        columns += sim.sum(dim=2)
        columns.scatter_add_(-1, newest, -sim.gather(-1, newest[..., None])[..., 0])   # spared: its entry counts 0
    mean = columns / real.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)
    return torch.softmax(mean.masked_fill(~real, float("-inf")), dim=-1).nan_to_num(0.0)


@dataclass(frozen=True)
class RKV(DecodesAtItsBudget, Method):
    """R-KV's scorer: pooled window attention minus key redundancy; by default re-selected every 128 generated
    tokens back to the budget (decode_budget defaults to the budget).

    mix_lambda: the weight of the importance against the redundancy, in [0, 1]: score = mix_lambda * importance
        - (1 - mix_lambda) * redundancy (1: attention only, 0: redundancy only).
    kernel_size: width of the max pooling of the importance along positions (odd; 1 = none).
    similarity_threshold: cosine similarity above which two keys are near-duplicates (the newest near-duplicate
        of each key is not charged for it), in [-1, 1].
    """

    name = "rkv"
    decode_rule = "re-selects while decoding (every decode_interval tokens, back to the budget)"
    window_size: int = 8
    decode: Optional[DecodeBudget] = EVERY_128
    mix_lambda: float = 0.07
    kernel_size: int = 7
    similarity_threshold: float = 0.5

    def validate(self) -> None:
        if not (isinstance(self.mix_lambda, (int, float)) and not isinstance(self.mix_lambda, bool)
                and 0.0 <= self.mix_lambda <= 1.0):
            raise ValueError(f"mix_lambda must be a number in [0, 1] (the importance's weight against the "
                             f"redundancy), got {self.mix_lambda!r}")
        if not (isinstance(self.kernel_size, int) and self.kernel_size >= 1 and self.kernel_size % 2 == 1):
            raise ValueError(f"kernel_size must be a positive odd integer (1 = no pooling), got {self.kernel_size!r}")
        if not (isinstance(self.similarity_threshold, (int, float)) and not isinstance(self.similarity_threshold, bool)
                and -1.0 <= self.similarity_threshold <= 1.0):
            raise ValueError(f"similarity_threshold must be a cosine similarity in [-1, 1], got "
                             f"{self.similarity_threshold!r}")
        if self.window_size < 1:
            raise ValueError(f"rkv needs window_size >= 1 (the queries whose attention is the importance), got "
                             f"{self.window_size}")
        super().validate()

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, H, n] (H: the context's stored heads): the combined score before the window, 0 on the window (kept
        by the engine whatever its score). The same at prefill and at a decode-time re-selection."""
        keys = ctx.keys
        n = keys.shape[2]
        real = _per_head(ctx.real, keys.shape[1])
        attention = importance(ctx.queries, keys, real, self.window_size, self.kernel_size, ctx.form)   # [B, H, n - w]
        prefix = attention.shape[-1]
        spread = redundancy(keys, real, self.similarity_threshold)[..., :prefix]
        combined = self.mix_lambda * attention - (1.0 - self.mix_lambda) * spread
        return torch.cat([combined, combined.new_zeros(*combined.shape[:2], n - prefix)], dim=-1)
