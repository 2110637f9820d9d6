"""The per-step decode rule's steady state in place (decode_interval 1, TOVA's default: core/decoding.py).

Where each head of each firing prompt holds decode_budget + 1 tokens in a full-precision store keeping the same count
in every head (no thin rows), with no merge rule and no token statistics, each such head drops its lowest-scored
candidate (ties: the older, as select_kept_positions), scored from the very context the general re-selection builds
(same scores), a prompt's heads in one index_select of its [H * m] held rows, instead of the rebuild through per-head
copies, padding and sorts. The row index is the cached [H, m - 1] grid h * m + j shifted by one past each head's
lowest (one comparison and one add a step). tests/core/test_in_place_eviction.py: the same held positions, stored
K/V, tokens and bytes as the rebuild, step for step, on a float64 model.

A method whose decode score is the newest query's attention row, key by key (a `newest_row_score`: TOVA), is decided
without any copy where every prompt fires and its rows come from the step's own attention (float32 or float64: the
store's logits are then at least as precise as a recomputation's): each head's lowest candidate by that row
(ties: the older), and the new token written into its row (core/in_place.py `fold_into`). The rows are then in
slot order: sinks and the window are found by position, not by rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pyramidkv.core import in_place
from pyramidkv.core.context import DecodeScoreContext
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.scoring import scores_per_stored_head


def drop_one(compressor, layer_idx: int, fire: list[bool]) -> bool:
    """Drop each firing prompt's lowest candidate per head at this layer of `compressor` (a DecodeCompressor) and fold
    every prompt's tail into its kept rows; False, changing nothing, where the steady state does not hold."""
    store, method = compressor.stores[layer_idx], compressor.method
    if method.merge is not None or compressor.stats is not None or not isinstance(store, FullPrecisionStore) or \
            any(k.thin is not None or not k.uniform for k in store.kept):
        return False
    held, t, full = store.held_counts(), store.tail_len, compressor.budget + 1
    if any(f and set(h) != {full} for f, h in zip(fire, held)):
        return False
    if in_place_step(compressor, layer_idx, store, fire):
        return True
    in_place.compact(store)   # the rebuild reads the rows in position order
    tail_keys, tail_values = store.tail()
    heads, kept = store.heads, []
    for b, k in enumerate(store.kept):
        length, dim, start = k.lengths[0], k.keys.shape[-1], store.tail_start[b]
        m = length + t
        tail = torch.arange(start, start + t, device=k.positions.device, dtype=k.positions.dtype)
        keys = torch.cat([k.keys.view(heads, length, dim), tail_keys[b]], dim=1)        # [H, m, D]
        values = torch.cat([k.values.view(heads, length, dim), tail_values[b]], dim=1)
        positions = torch.cat([k.positions.view(heads, length), tail.expand(heads, t)], dim=1)
        count = m
        if fire[b]:
            rows = lowest_dropped(compressor, layer_idx, b, keys, values, positions)
            if rows is None:
                return False
            keys, values = keys.view(-1, dim).index_select(0, rows), values.view(-1, dim).index_select(0, rows)
            positions, count = positions.view(-1).index_select(0, rows), m - 1
        kept.append(KeptKV(keys.view(-1, dim), values.view(-1, dim), [count] * heads, positions.view(-1)))
    store.replace(kept, max_tail=compressor.interval)
    return True


def in_place_step(compressor, layer_idx: int, store: FullPrecisionStore, fire: Optional[list[bool]] = None) -> bool:
    """Every prompt fires (fire None: known to), its one new token in the tail: each head's lowest candidate by the
    step's own attention row leaves, the new token takes its row. False, changing nothing, where that does not
    apply."""
    method, rows = compressor.method, store.rows()
    row_score = getattr(method, "newest_row_score", None)
    if row_score is None or type(store) is not FullPrecisionStore or not all(fire or ()) or store.tail_len != 1 or \
            store.marks or rows is None or rows.shape[2] != compressor.group or \
            store.kept[0].keys.dtype not in (torch.float32, torch.float64):
        return False
    heads, length = store.heads, store.kept[0].lengths[0]
    m = length + 1
    window = min(method.window_size, m)
    sinks = min(method.selection.num_sinks, m - window)
    if compressor.budget < window + sinks or rows.shape[3] != m:
        return False
    scores = row_score(rows.view(rows.shape[0], -1, m))   # [B, 1 | Hq | H, m]: one row for every head, or a row each
    if scores.shape[1] not in (1, heads):
        scores = scores_per_stored_head(scores, method, heads, rows.shape[1] * rows.shape[2])
    two = scores.topk(2, dim=2, largest=False)   # each row's two lowest [B, 1 | H, 2] (NaN sorts above every number)
    if window or sinks or any(low != low or low == second for row in two.values.tolist() for low, second in row):
        # the window or sinks protected, equal minima (the older leaves), or a NaN: a row of probabilities is NaN
        # whole where it is NaN at all, its lowest NaN then
        slots = slots_by_position(store, scores, window, sinks)
        if slots is None:
            return False
    else:
        slots = two.indices[..., 0]
    in_place.fold_into(store, slots.expand(-1, heads), _grid(compressor, heads, m, rows.device)[3])
    store.steady = True
    return True


def slots_by_position(store, scores: torch.Tensor, window: int, sinks: int) -> Optional[torch.Tensor]:
    """scores [B, 1 | H, m] in slot order (the new token last) -> [B, H] each head's lowest candidate, of equal
    minima the older; the newest `window` positions and the oldest `sinks` held are no candidates. None where a
    candidate's score is NaN."""
    heads, length = store.heads, store.kept[0].lengths[0]
    slots = []
    for b, k in enumerate(store.kept):
        newest = store.tail_start[b]
        positions = torch.cat([k.positions.view(heads, length), k.positions.new_full((heads, 1), newest)], dim=1)
        row = scores[b].expand(heads, -1)
        if window or sinks:
            candidate = positions <= newest - window
            if sinks:
                candidate &= positions > positions.kthvalue(sinks, dim=1, keepdim=True).values
            row = row.masked_fill(~candidate, float("inf"))
        lowest = row.min(dim=1, keepdim=True).values   # NaN where a candidate's score is NaN
        if math.isnan(lowest.sum().item()):   # a row of probabilities: no -inf, so a NaN sum is a NaN minimum
            return None
        slots.append(torch.where(row == lowest, positions, newest + 1).argmin(dim=1))   # of equal minima the older
    return torch.stack(slots)


def lowest_dropped(compressor, layer_idx: int, b: int, keys, values, positions) -> Optional[torch.Tensor]:
    """Prompt b's held rows [H, m, ...] (m = decode_budget + 1): the rows of [H * m] that stay (all but each head's
    lowest-scored candidate); None where a score is NaN or budget < window + sinks (the general path decides)."""
    method = compressor.method
    heads, m = keys.shape[:2]
    window = min(method.window_size, m)
    sinks = min(method.selection.num_sinks, m - window)
    if compressor.budget < window + sinks:
        return None
    real, every, rows, _ = _grid(compressor, heads, m, keys.device)   # [1, m] all real; [m - 1]; [H, m - 1]: h * m + j
    buffered = compressor.queries[layer_idx][b:b + 1]
    w = min(buffered.shape[2], m)
    ctx = DecodeScoreContext(
        layer_idx, compressor.num_layers, buffered[:, :, buffered.shape[2] - w:].to(keys.dtype), keys[None],
        values[None], real, positions=positions[None], rotation=compressor.rotation, model=compressor.model)
    scores = scores_per_stored_head(method.decode_score(ctx), method, heads, ctx.queries.shape[1])[0]
    candidates = scores[:, sinks:m - window]
    if bool(candidates.isnan().any()):
        return None
    lowest = candidates.argmin(dim=-1, keepdim=True) + sinks                    # [H, 1]: first of equal minima
    return (rows + (every >= lowest)).view(-1)


def _grid(compressor, heads: int, m: int, device) -> tuple[torch.Tensor, ...]:
    """The step's constant tensors, kept on the compressor while the shape holds (it does at every step): [1, m] all
    real; [m - 1]; [H, m - 1] h * m + j; [H] each head's first kept row h * (m - 1)."""
    cached = compressor.drop_grid
    if cached is None or cached[0] != (heads, m, device):
        every = torch.arange(m - 1, device=device)
        cached = ((heads, m, device), torch.ones(1, m, dtype=torch.bool, device=device), every,
                  every + torch.arange(0, heads * m, m, device=device)[:, None],
                  torch.arange(0, heads * (m - 1), m - 1, device=device))
        compressor.drop_grid = cached
    return cached[1:]
