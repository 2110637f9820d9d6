"""MInference's index builders (Jiang et al., NeurIPS 2024, "MInference 1.0: Accelerating Pre-filling for
Long-Context LLMs via Dynamic Sparse Attention"): which keys each query of one head reads. Pure tensor code,
one head of one prompt at a time, in the prompt's own coordinates (n real tokens, no padding).

  vertical-slash  From the last `last_q` queries' causal softmax P [last_q, n] (float32): a column's score is
                  its sum over those rows, a diagonal's (offset d = i - j) the sum of P along it. The first
                  FORCED_COLUMNS columns and the FORCED_DIAGONALS most recent diagonals are taken first, then the
                  best by score, up to max(vertical, MIN_VERTICAL) columns and max(slash, MIN_SLASH) diagonals
                  (capped at n). Ties: the later column, the more recent diagonal.
  kernel coverage The official CUDA index builder (`convert_vertical_slash_indexes`) turns the diagonals into
                  64-column blocks per 64-row block; `diagonal_blocks` reproduces the columns it covers.
  block-sparse    Queries and keys mean-pooled over blocks (zero-padded), block scores q_pool . k_pool,
                  causal; each query block reads its top min(top_k, ceil(n / block)) key blocks (all its causal
                  blocks when it has no more than that): the official code pads the prompt to whole blocks
                  before counting, so a last partial block counts. Ties: the later block.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FORCED_COLUMNS = 30
FORCED_DIAGONALS = 100
MIN_VERTICAL = 30
MIN_SLASH = 50


def _top_later_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of scores [m], ties to the higher index (a stable sort of the flipped scores)."""
    order = torch.sort(scores.flip(-1), descending=True, stable=True).indices[:k]
    return scores.shape[-1] - 1 - order


def last_query_attention(queries: torch.Tensor, keys: torch.Tensor, last_q: int) -> torch.Tensor:
    """queries, keys [n, D] of one head -> the causal softmax P [min(last_q, n), n] (float32) of the last queries."""
    n, dim = keys.shape
    rows = min(last_q, n)
    logits = queries[n - rows:].float() @ keys.float().T / math.sqrt(dim)
    query_pos = torch.arange(n - rows, n, device=keys.device)[:, None]
    logits = logits.masked_fill(torch.arange(n, device=keys.device)[None, :] > query_pos, float("-inf"))
    return torch.softmax(logits, dim=-1)


def vertical_slash_sets(probs: torch.Tensor, vertical: int, slash: int, forced: tuple[int, int] = (FORCED_COLUMNS,
                        FORCED_DIAGONALS), minimum: tuple[int, int] = (MIN_VERTICAL, MIN_SLASH)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [r, n]: the last r queries' attention. Returns (columns, offsets) long, each ascending.
    forced, minimum: (columns, diagonals) taken first / at least (the official 30, 100 / 30, 50)."""
    rows, n = probs.shape
    columns = probs.sum(dim=0)
    columns[:min(forced[0], n)] = float("inf")
    query_pos = torch.arange(n - rows, n, device=probs.device)[:, None]
    offset = (query_pos - torch.arange(n, device=probs.device)[None, :])     # i - j, negative above the diagonal
    visible = offset >= 0
    diagonals = torch.zeros(n, dtype=probs.dtype, device=probs.device)
    diagonals.index_add_(0, offset[visible], probs[visible])
    recent_first = diagonals.flip(0)   # index n - 1 - d: ties go to the higher index = the smaller offset
    recent_first[n - min(forced[1], n):] = float("inf")
    chosen_columns = _top_later_first(columns, min(n, max(vertical, minimum[0])))
    chosen_offsets = n - 1 - _top_later_first(recent_first, min(n, max(slash, minimum[1])))
    return chosen_columns.sort().values, chosen_offsets.sort().values


def diagonal_blocks(offsets: list[torch.Tensor], n: int, block: int) -> torch.Tensor:
    """The columns the official kernel computes for each head's diagonals: bool [H, ceil(n / block), n].

    Per row block (rows [start, end), end = start + block) the diagonals d < end, taken in decreasing d,
    become column ranges ending at s = max(end - d, block): a range starts as [s - block, s); a later s more
    than one block past its end starts a new range, one inside the next block extends it by a block. The
    heads and row blocks are stepped together (numpy), one diagonal at a time."""
    heads, blocks = len(offsets), -(-n // block)
    longest = max(len(o) for o in offsets)
    steps = np.full((heads, longest), np.iinfo(np.int64).max, dtype=np.int64)    # padding: never live
    for h, o in enumerate(offsets):
        steps[h, :len(o)] = np.sort(o.cpu().numpy())[::-1]                       # decreasing offsets
    ends = (np.arange(blocks, dtype=np.int64) + 1)[None, :] * block              # [1, R]
    starts = np.full((heads, blocks), -1, dtype=np.int64)
    stops = np.full((heads, blocks), -1, dtype=np.int64)
    edges = np.zeros((heads, blocks, n + 2 * block + 1), dtype=np.int64)
    head_index, block_index = np.indices((heads, blocks))

    def close(which: np.ndarray) -> None:
        np.add.at(edges, (head_index[which], block_index[which], starts[which]), 1)
        np.add.at(edges, (head_index[which], block_index[which], stops[which]), -1)

    for k in range(longest):
        d = steps[:, k:k + 1]
        live = d < ends
        s = np.maximum(ends - np.minimum(d, ends), block)
        fresh = live & (starts < 0)
        seen = live & ~fresh
        apart = seen & (s > stops + block)
        close(apart)
        grow = seen & ~apart & (s > stops)
        starts = np.where(fresh | apart, s - block, starts)
        stops = np.where(fresh | apart, s, np.where(grow, stops + block, stops))
    close(starts >= 0)
    covered = np.cumsum(edges, axis=2)[:, :, :n] > 0
    return torch.from_numpy(covered).to(offsets[0].device)


def block_sparse_blocks(queries: torch.Tensor, keys: torch.Tensor, block: int, top_k: int) -> torch.Tensor:
    """queries, keys [n, D] of one head -> bool [R, R] (R = ceil(n / block)): key blocks each query block reads."""
    n, dim = keys.shape
    count = -(-n // block)
    padded = count * block

    def pool(x: torch.Tensor) -> torch.Tensor:  # zero-padded mean over each block, as the official code
        full = x.new_zeros(padded, dim)
        full[:n] = x
        return full.float().view(count, block, dim).mean(dim=1)

    scores = pool(queries) @ pool(keys).T                                               # [R, R]
    causal = torch.arange(count, device=keys.device)[None, :] <= torch.arange(count, device=keys.device)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    k = min(top_k, count)
    chosen = torch.zeros(count, count, dtype=torch.bool, device=keys.device)
    for r in range(count):
        if r + 1 <= k:
            chosen[r, :r + 1] = True
        else:
            chosen[r, _top_later_first(scores[r, :r + 1], k)] = True
    return chosen
