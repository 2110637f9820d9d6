"""H2O's column sums beside a fused attention kernel (its prefill path on CUDA): the kernel's causal attention and
each row's logsumexp, then one more product per chunk of queries for the probabilities.

The kernel returns each query row's logsumexp (natural log) over the keys it sees; [q / sqrt(D), -lse] . [k, 1] is
the row's log-probability of each key, exp'd and summed over the real queries:

    column_sum[h, j] = sum_{i >= j, i real} exp(q_i . k_j / sqrt(D) - lse_i)                     [B, Hq, n]

The kernel: on CUDA `aten._scaled_dot_product_efficient_attention` (float32, float16, bfloat16; it returns the
logsumexp when asked), on CPU `aten._scaled_dot_product_flash_attention_for_cpu` (the kernel the model's own sdpa
runs there). Each prompt of a batch runs on its own real tokens (left padding cut off, causal, no mask: the
padding rows' output is 0, read by nothing, as in models/attention.causal_per_prompt). Chunks of queries hold at
most `chunk_entries(device)` score entries: a fixed count on the CPU (chunks that fit its caches), a share of the
free device memory on CUDA (torch.cuda.mem_get_info). A soft-capped model's logits are not the kernel's: its
column sums keep the one-pass explicit softmax (scoring.attention_with_column_sums).

`column_sums_attention` picks the path per device (FUSED_DEVICES).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.core.scoring import PLAIN, attention_with_column_sums

FUSED_DEVICES = ("cuda",)   # where column_sums_attention takes the fused kernel (the CPU: see docs/speed.md)
CPU_ENTRIES = 1 << 21       # score entries per chunk on the CPU (as the explicit pass: chunks that fit its caches)
FREE_SHARE = 8              # on CUDA a chunk's float32 scores take at most 1/FREE_SHARE of the free memory
KERNELS = {"cuda": getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None),
           "cpu": getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)}


def chunk_entries(device: torch.device) -> int:
    """The most score entries one chunk of the column-sum pass holds on `device`."""
    if device.type != "cuda":
        return CPU_ENTRIES
    free, _ = torch.cuda.mem_get_info(device)
    return max(CPU_ENTRIES, free // (4 * FREE_SHARE))


def fused_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one prompt by the device's fused kernel, with each row's logsumexp.
    queries [Hq, n, D] (q . k / sqrt(D) the logit), keys, values [Hkv, n, D] -> output [Hq, n, D] (the queries'
    dtype), lse [Hq, n] float32."""
    num_q, n, dim = queries.shape
    group = num_q // keys.shape[0]
    if queries.is_cuda:
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        out, lse = KERNELS["cuda"](queries[None], keys[None], values[None], None, True, 0.0, True)[:2]
        return out[0], lse[0, :, :n].float()
    # CPU: the query heads grouped per KV head, the K/V expanded (not copied) over the group
    shape = (keys.shape[0], group, n, dim)
    out, lse = KERNELS["cpu"](queries.reshape(shape), keys[:, None].expand(shape), values[:, None].expand(shape),
                              0.0, True)[:2]
    return out.reshape(num_q, n, dim), lse.reshape(num_q, n).float()


def column_sums_from_lse(queries: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor,
                         max_entries: int) -> torch.Tensor:
    """sum_{i >= j} exp(q_i . k_j / sqrt(D) - lse_i) for one prompt's real tokens, in chunks of queries each
    against the keys up to its last row. queries [Hq, n, D], keys [Hkv, n, D], lse [Hq, n] -> [Hq, n] float32."""
    num_q, n, dim = queries.shape
    heads = keys.shape[0]
    group = num_q // heads
    rows = max(1, min(n, max_entries // max(1, num_q * n)))
    # [q / sqrt(D), -lse] . [k, 1]: the log-probability comes out of the product
    lifted = torch.cat([queries.float() * dim ** -0.5, -lse[..., None]], -1).view(heads, group, n, dim + 1)
    keys_t = torch.cat([keys.float(), keys.new_ones(heads, n, 1, dtype=torch.float32)], -1).transpose(1, 2)
    future = torch.ones(rows, rows, dtype=torch.bool, device=keys.device).triu(1)
    totals = torch.zeros(num_q, n, dtype=torch.float32, device=keys.device)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        block = lifted[:, :, start:stop].reshape(heads, group * (stop - start), dim + 1)
        logp = torch.matmul(block, keys_t[..., :stop]).view(num_q, stop - start, stop)
        logp[..., start:].masked_fill_(future[:stop - start, :stop - start], float("-inf"))
        totals[:, :stop] += logp.exp_().sum(1)
    return totals


def fused_attention_with_column_sums(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                     real: torch.Tensor, max_entries: Optional[int] = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's causal attention by the fused kernel and H2O's column sums from its logsumexp.
    queries [B, Hq, n, D] (q . k / sqrt(D) the logit), keys, values [B, Hkv, n, D], real [B, n] (left padding
    False) -> (output [B, Hq, n, D] in the queries' dtype, 0 at padding rows; column sums [B, Hq, n] float32, 0 at
    padding keys). max_entries: score entries per chunk (None: chunk_entries of the device)."""
    bsz, num_q, n, dim = queries.shape
    entries = chunk_entries(queries.device) if max_entries is None else max_entries
    out = torch.zeros_like(queries)
    totals = torch.zeros(bsz, num_q, n, dtype=torch.float32, device=queries.device)
    pads = (~real).sum(1).tolist()
    for b, pad in enumerate(pads):
        if pad >= n:
            continue
        q, k, v = queries[b, :, pad:], keys[b, :, pad:], values[b, :, pad:]
        out[b, :, pad:], lse = fused_attention(q, k, v)
        totals[b, :, pad:] = column_sums_from_lse(q, k, lse, entries)
    return out, totals


def column_sums_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor,
                          form: AttentionForm = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """H2O's prefill attention and column sums by the path of the queries' device: the fused kernel and the
    logsumexp pass on FUSED_DEVICES (a model without a soft-cap, a torch with the device's kernel), else the
    one-pass explicit softmax. Shapes as `fused_attention_with_column_sums`."""
    kind = queries.device.type
    if kind in FUSED_DEVICES and KERNELS.get(kind) is not None and not form.capped:
        return fused_attention_with_column_sums(queries, keys, values, real)
    return attention_with_column_sums(queries, keys, values, real, form=form)
