"""Per-step eviction in place in a full-precision store: a slot that loses its token takes the new one, or is marked
gone until the store compacts; reports read the held tokens in position order.

Two ways a store's rows stop being "kept rows in position order, then the tail" (the layout every report and every
rebuild assumes), each undone by `clean` (a copy, for a report) or `compact` (the store itself):

- TOVA's step (core/drop_one.py, `fold_into`): each head's one new tail token is written into the kept row of the
  token it evicts (the new token itself may be the one: nothing is written then). No copy, no new layout; the kept
  rows are in slot order (`store.in_order` False).
- A threshold decision (core/threshold.py, `mark_gone`): the leaving rows are marked gone, in the kept rows
  (`store.gone_rows`, flat over every prompt's rows, the layout's order) or in the tail (`store.tail_gone`
  [B, H, s]); the attention gives them probability 0 (core/layout.py). The tail tokens up to the decision
  (`store.settled` of them) count as kept, as the rebuild folded them; `compact` does that fold for real.

Counts: `store.gone[b][h]` tokens marked gone in prompt b's head h (kept rows and settled tail rows), so counts and
bytes are running figures, never re-summed from tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.core.kept import KeptKV


def reset(store) -> None:
    """A store whose rows are in position order, nothing gone (after it is built, replaced or compacted)."""
    store.in_order = True
    store.steady = False            # the last step was TOVA's in place, nothing else since (core/decoding.py)
    store.settled = 0
    store.marks = 0                 # threshold decisions marked since the last compaction
    store.gone = [[0] * store.heads for _ in store.kept]
    store.gone_rows = None          # bool [sum of the prompts' kept rows]
    store.tail_gone = None          # bool [B, H, >= settled]: of the first `settled` tail rows, those gone


def clean(store, b: int) -> KeptKV:
    """Prompt b's kept tokens as the rebuild would hold them: position order, gone tokens out, the settled tail in."""
    k = store.kept[b]
    if store.in_order and not store.marks:
        return k
    heads, dim = store.heads, k.keys.shape[-1]
    if not store.in_order:   # slot order (TOVA's writes: every head keeps L rows)
        length = k.lengths[0]
        order = k.positions.view(heads, length).argsort(dim=1)
        rows = (order + torch.arange(0, heads * length, length, device=order.device)[:, None]).view(-1)
        return KeptKV(k.keys.index_select(0, rows), k.values.index_select(0, rows), list(k.lengths),
                      k.positions.index_select(0, rows))
    s, total = store.settled, k.keys.shape[0]
    tail_keys, tail_values = store.tail()
    start = sum(kv.keys.shape[0] for kv in store.kept[:b])
    stay = torch.ones(total, dtype=torch.bool, device=k.keys.device) if store.gone_rows is None else \
        ~store.gone_rows[start:start + total]
    tail_stay = torch.ones(heads, s, dtype=torch.bool, device=k.keys.device) if store.tail_gone is None else \
        ~store.tail_gone[b, :, :s]
    index, keep, offset = [], [], 0
    for h, n in enumerate(k.lengths):   # head h: its kept rows, then its settled tail rows
        index += [torch.arange(offset, offset + n), torch.arange(total + h * s, total + (h + 1) * s)]
        keep += [stay[offset:offset + n], tail_stay[h]]
        offset += n
    rows = torch.cat(index).to(k.keys.device)[torch.cat(keep)]
    tail_positions = torch.arange(store.tail_start[b], store.tail_start[b] + s, device=k.positions.device,
                                  dtype=k.positions.dtype)
    keys = torch.cat([k.keys, tail_keys[b, :, :s].reshape(-1, dim)]).index_select(0, rows)
    values = torch.cat([k.values, tail_values[b, :, :s].reshape(-1, dim)]).index_select(0, rows)
    positions = torch.cat([k.positions, tail_positions.repeat(heads)]).index_select(0, rows)
    return KeptKV(keys, values, [n + s - g for n, g in zip(k.lengths, store.gone[b])], positions)


def compact(store) -> None:
    """The store's rows back in position order with nothing gone: `clean` per prompt, the settled tail folded in."""
    if store.in_order and not store.marks:
        return
    store.fold([clean(store, b) for b in range(len(store.kept))], store.settled)


def fold_into(store, slots: torch.Tensor, first_rows: Optional[torch.Tensor] = None) -> None:
    """slots [B, H]: each head's one tail token takes kept row slots[b, h] of its head (that row's token leaves;
    slot L, the tail token's own: it leaves, nothing is written). Every prompt keeps L rows a head, the tail empties.
    first_rows: [H] each head's first kept row, h * L (made here where not given)."""
    heads, length = store.heads, store.kept[0].lengths[0]
    if first_rows is None:
        first_rows = torch.arange(0, heads * length, length, device=slots.device)
    rows = slots + first_rows   # [B, H] flat kept rows
    written = None if max(max(row) for row in slots.tolist()) < length else slots < length
    tail_keys, tail_values = store.tail()
    for b, k in enumerate(store.kept):
        new_keys, new_values, at = tail_keys[b, :, 0], tail_values[b, :, 0], rows[b]
        if written is not None:
            new_keys, new_values, at = new_keys[written[b]], new_values[written[b]], at[written[b]]
        k.keys.index_copy_(0, at, new_keys)
        k.values.index_copy_(0, at, new_values)
        k.positions.index_fill_(0, at, store.tail_start[b])
    store.tail_start = [start + 1 for start in store.tail_start]
    store.tail_len = 0
    store.in_order = False


def mark_gone(store, cuts: list[list[list[int]]]) -> int:
    """cuts[b][h]: rows of prompt b's head h that leave, counted over what the head's slots hold in order (kept rows
    r < L_h, then tail row r - L_h; gone rows count). Returns how many (prompt, head, token) entries left."""
    layout = store.layout()
    t = store.tail_len
    if store.gone_rows is None:
        store.gone_rows = torch.zeros(sum(k.keys.shape[0] for k in store.kept), dtype=torch.bool,
                                      device=store.kept[0].keys.device)
    layout.gone = store.gone_rows
    if store.tail_gone is None or store.tail_gone.shape[2] < t:   # as wide as the tail buffer: grown when it grows
        grown = torch.zeros(len(store.kept), store.heads, max(t, store.tail_capacity()), dtype=torch.bool,
                            device=store.gone_rows.device)
        if store.tail_gone is not None:
            grown[:, :, :store.tail_gone.shape[2]] = store.tail_gone
        store.tail_gone = grown
    flat, tail, start = [], [], 0
    for b, k in enumerate(store.kept):
        offset = start
        for h, (n, rows) in enumerate(zip(k.lengths, cuts[b])):
            for r in rows:
                if r < n:
                    flat.append(offset + r)
                else:
                    tail.append((b, h, r - n))
            store.gone[b][h] += len(rows)
            offset += n
        start += k.keys.shape[0]
    if flat:
        store.gone_rows.index_fill_(0, torch.tensor(flat, device=store.gone_rows.device), True)
        layout.mark(flat)
    if tail:
        store.tail_gone[tuple(torch.tensor(tail, device=store.gone_rows.device).T)] = True
    store.settled = t
    store.marks += 1
    return len(flat) + len(tail)
