"""Attention statistics the scorers share, computed without repeating K/V over GQA groups.

Shapes: B batch, Hq query heads, Hkv key/value heads, g = Hq // Hkv,
n tokens, q <= n queries (those of the last q tokens: all n at prefill, the buffered recent ones at
decode), w window, D head dim. `real` is a bool mask of non-padding entries, [B, n] when every head
pads alike (always at prefill) or [B, Hkv, n] per head (ragged heads at decode). Softmax is taken in
float32 as in the papers' code. With a sparse prefill pattern (MInference) the statistics are those of
the attention the model ran: only the pattern's entries (`pattern.mask`), renormalised over them.

The model's attention form (components.AttentionForm: its soft-cap) turns q . k / sqrt(D) into its logits
(`form.cap`, `form.logits`), and `probabilities` turns logits into attention: the stores' decode attention and
the patched eager attention use the same two.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pyramidkv.components import AttentionForm

PLAIN = AttentionForm()   # no soft-cap: what a helper assumes when it is given no form


def real_positions(pad_lens: list[int], n: int, device) -> torch.Tensor:
    """[B, n] bool: False at each prompt's left padding (pad_lens: per prompt its padding tokens)."""
    return torch.arange(n, device=device)[None, :] >= torch.tensor(pad_lens, device=device)[:, None]


def left_padding_lengths(attention_mask: Optional[torch.Tensor], batch_size: int, seq_len: int) -> list[int]:
    """Number of left-padding tokens per row of a 2-D attention mask (0 = padding)."""
    if attention_mask is None:
        return [0] * batch_size
    if attention_mask.dim() != 2 or attention_mask.shape != (batch_size, seq_len):
        raise ValueError(f"expected a [batch, seq] attention mask of shape {(batch_size, seq_len)}, "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    pads = (~mask).sum(dim=1)
    # Left padding means every row is 0...0 1...1.
    expected = torch.arange(seq_len, device=mask.device)[None, :] >= pads[:, None]
    if not torch.equal(mask, expected):
        raise ValueError("the attention mask is not left-padded (padding must come before the prompt); "
                         "set tokenizer.padding_side = 'left'")
    if int(pads.max()) >= seq_len:
        raise ValueError("a prompt in the batch is empty (all padding)")
    return [int(p) for p in pads]


def real_per_query_head(real: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """real [B, n] or [B, Hkv, n] -> [B, 1 or Hq, n]: each query head reads its KV head's mask."""
    if real.dim() == 2:
        return real[:, None, :]
    return real.repeat_interleave(num_query_heads // real.shape[1], dim=1)


def probabilities(logits: torch.Tensor, allowed: Optional[torch.Tensor] = None,
                  dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Attention probabilities: the softmax of logits over the last axis, in float32 (as transformers' eager
    attention and the papers' code), returned in `dtype` (None: float32). allowed: bool, broadcastable to logits,
    the keys each row may attend (None: every key the logits hold, masked already where needed); a row with none
    allowed gives 0 (a padding query)."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if allowed is not None:
        probs = torch.nan_to_num(probs, nan=0.0)
    return probs if dtype is None else probs.to(dtype)


def grouped_scores(queries: torch.Tensor, keys: torch.Tensor, form: AttentionForm = PLAIN) -> torch.Tensor:
    """q.k^T / sqrt(D) for every query head against its KV head, as the model's logits (`form`: soft-capped
    where it caps).

    queries: [B, Hq, q, D]; keys: [B, Hkv, n, D] -> [B, Hq, q, n] (float32).
    """
    bsz, num_q_heads, q_len, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    q = queries.float().reshape(bsz, num_kv_heads, group * q_len, head_dim)
    s = form.cap(torch.matmul(q, keys.float().transpose(-1, -2)) / head_dim**0.5)
    return s.reshape(bsz, num_q_heads, q_len, keys.shape[2])


def window_attention(queries: torch.Tensor, keys: torch.Tensor, real: torch.Tensor, window_size: int,
                     pattern=None, causal: bool = True, form: AttentionForm = PLAIN) -> torch.Tensor:
    """Attention of the last `window_size` queries to all keys, causal inside the window (causal=False: each
    row's softmax also covers the window's later keys, a separate dense pass, so no pattern).

    queries: [B, Hq, q, D], those of the last q tokens (only the last w are used, the i-th of them at
    token n - w + i); keys: [B, Hkv, n, D]; real: [B, n] or [B, Hkv, n]; pattern: the layer's sparse
    prefill pattern or None; form: the model's attention form. Returns [B, Hq, w, n] float32, w = min(window_size,
    q, n).
    """
    n, q = keys.shape[2], queries.shape[2]
    w = min(window_size, q, n)
    s = grouped_scores(queries[:, :, q - w :], keys, form)  # [B, Hq, w, n]
    allowed = real_per_query_head(real, queries.shape[1])[:, :, None, :]
    if not causal or (w == 1 and pattern is None):   # one query, the last: it sees every key (no causal mask)
        return probabilities(s, allowed)
    query_pos = torch.arange(n - w, n, device=keys.device)[:, None]
    key_pos = torch.arange(n, device=keys.device)[None, :]
    allowed = (key_pos <= query_pos)[None, None] & allowed
    if pattern is not None:
        allowed = allowed & pattern.mask(n - w, n, n, keys.device)
    return probabilities(s, allowed)


def attention_column_sums(
    queries: torch.Tensor, keys: torch.Tensor, real: torch.Tensor, max_chunk_elements: int = 1 << 24, pattern=None,
    form: AttentionForm = PLAIN,
) -> torch.Tensor:
    """Sum over all real queries of their causal attention to each key (H2O's score).

    Computed in query chunks so no [n, n] matrix per head is ever built.
    queries: [B, Hq, q, D], those of the last q tokens; keys: [B, Hkv, n, D]; real: [B, n] or [B, Hkv, n].
    Returns [B, Hq, n] float32.
    """
    bsz, num_q_heads, q, _ = queries.shape
    n = keys.shape[2]
    first = n - q  # the token of the first query
    chunk = max(1, max_chunk_elements // max(1, bsz * num_q_heads * n))
    key_pos = torch.arange(n, device=keys.device)
    real = real_per_query_head(real, num_q_heads)  # [B, 1 or Hq, n]
    totals = torch.zeros(bsz, num_q_heads, n, dtype=torch.float32, device=keys.device)
    for start in range(0, q, chunk):
        stop = min(q, start + chunk)
        s = grouped_scores(queries[:, :, start:stop], keys, form)  # [B, Hq, c, n]
        query_pos = torch.arange(first + start, first + stop, device=keys.device)
        allowed = (key_pos[None, :] <= query_pos[:, None])[None, None] & real[:, :, None, :]
        allowed = allowed & real[:, :, first + start:first + stop, None]  # padding queries contribute nothing
        if pattern is not None:
            allowed = allowed & pattern.mask(first + start, first + stop, n, keys.device)
        totals += probabilities(s, allowed).sum(dim=2)
    return totals


def attention_with_column_sums(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor,
    max_chunk_elements: Optional[int] = None, form: AttentionForm = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's causal attention and, from the same probabilities, each key's column sum (H2O's score).

    One pass over chunks of queries: a chunk's rows see all the keys before them, so each softmax is
    exact and no [n, n] matrix per head is built. Scores and softmax in float32 as in
    `attention_column_sums`, which this equals to float rounding; the output is cast back to the
    queries' dtype and differs from the model's own sdpa/flash kernel by rounding only. A real query
    never sees padding; a padding query sees the padding before it (its output is never read) and adds
    nothing to the sums.
    queries: [B, Hq, n, D]; keys, values: [B, Hkv, n, D]; real: [B, n]. max_chunk_elements: the most score
    entries per chunk (default 2M on CPU, where chunks that fit the caches are fastest; 128M on a GPU).
    Returns (output [B, Hq, n, D], column sums [B, Hq, n] float32).
    """
    if max_chunk_elements is None:
        max_chunk_elements = 1 << 27 if queries.is_cuda else 1 << 21
    bsz, num_q_heads, n, dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    chunk = max(1, min(n, max_chunk_elements // max(1, bsz * num_q_heads * n)))   # the [chunk, chunk] mask: n at most
    scaled = (queries.float() / dim**0.5).reshape(bsz, num_kv_heads, group, n, dim)
    keys_t, values = keys.float().transpose(-1, -2), values.float()   # [B, Hkv, D, n], [B, Hkv, n, D]
    padding = ~real
    pad_max = int(padding.sum(dim=1).max())  # left padding: keys [0, pad_max) are padding somewhere
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=keys.device).triu(1)
    out = torch.empty(bsz, num_q_heads, n, dim, dtype=torch.float32, device=keys.device)
    totals = torch.zeros(bsz, num_q_heads, n, dtype=torch.float32, device=keys.device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = stop - start
        q = scaled[:, :, :, start:stop].reshape(bsz, num_kv_heads, group * rows, dim)
        s = form.logits(q, keys_t[..., :stop]).view(bsz, num_q_heads, rows, stop)
        s[..., start:].masked_fill_(future[:rows, :rows], float("-inf"))
        if pad_max > 0:
            cut = min(pad_max, stop)
            hidden = padding[:, None, :cut] & real[:, start:stop, None]   # [B, rows, cut]
            s[..., :cut].masked_fill_(hidden[:, None], float("-inf"))
        probs = probabilities(s)
        counted = probs if start >= pad_max else probs * real[:, None, start:stop, None]
        totals[..., :stop] += counted.sum(dim=2)
        attended = torch.matmul(probs.view(bsz, num_kv_heads, group * rows, stop), values[:, :, :stop])
        out[:, :, start:stop] = attended.view(bsz, num_q_heads, rows, dim)
    return out.to(queries.dtype), totals


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """1-D pooling along positions, stride 1, padding kernel_size // 2 (SnapKV's smoothing).

    scores: [B, H, m] -> [B, H, m]. kernel_size must be odd.
    """
    if kernel_size <= 1:
        return scores
    bsz, heads, m = scores.shape
    flat = scores.reshape(bsz * heads, 1, m)
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    elif pooling == "avg":
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    return pooled.reshape(bsz, heads, m)


def reduce_query_groups(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """[B, Hq, n] per-query-head scores -> [B, Hkv, n] by mean|max|sum over each GQA group."""
    bsz, num_q_heads, n = scores.shape
    grouped = scores.reshape(bsz, num_kv_heads, num_q_heads // num_kv_heads, n)
    if how == "mean":
        return grouped.mean(dim=2)
    if how == "max":
        return grouped.amax(dim=2)
    if how == "sum":
        return grouped.sum(dim=2)
    raise ValueError(f"gqa_reduce must be one of mean|max|sum, got {how!r}")


def scores_per_stored_head(scores: torch.Tensor, method, num_kv_heads: int, num_query_heads: int) -> torch.Tensor:
    """Bring a method's [B, Hq|Hkv, n] scores to one row per stored head of its GQA layout: reduced over
    each query group (`method.gqa_reduce`) in the kv_head layout, repeated over it in the query_head one."""
    stored = num_query_heads if method.gqa_layout == "query_head" else num_kv_heads
    heads = scores.shape[1]
    if heads == stored:
        return scores
    if heads == num_query_heads and stored == num_kv_heads:
        return reduce_query_groups(scores, num_kv_heads, method.gqa_reduce)
    if heads == num_kv_heads and stored == num_query_heads:
        return scores.repeat_interleave(num_query_heads // num_kv_heads, dim=1)
    raise ValueError(f"{method.name}.score returned {heads} heads; expected {num_query_heads} "
                     f"(query heads) or {num_kv_heads} (KV heads)")
