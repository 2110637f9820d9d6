"""The storage of a MiniCache layer pair (cross_layer.py has the rule) and the two layer stores reading it.

One `MergedPair` holds, for every segment (one prompt's stored head; S = B x H) of the pair's shared
token set, per tensor (keys, values; `MergedTensor`): the unit direction [S, C, D], the magnitudes of
both layers [S, C, 2] and the retained token pairs (index [S, R], originals of both layers [S, R, 2, D]).
Rows are padded to the longest segment (C, grown by appends); bytes count only real rows. A layer reads
it through a `PairedLayerStore` (which = 0 for the lower layer, 1 for the upper).

Attention never materialises the restored K/V: for layer w, logits = (q . e_K) mu_K,w / sqrt(D), the
retained keys' logits q . k_w / sqrt(D) written over theirs; output = sum_j p_j mu_V,w,j e_V,j over merged
values + sum over retained values of p_j v_w,j. Decode: each layer's newest tokens are staged unmerged
(attended as they are) until the upper layer has attended; then the pair merges them.

Bytes per segment of n tokens, r_K / r_V retained: directions 2 n D, magnitudes 4 n, retained originals
2 (r_K + r_V) D values of the model dtype, plus (r_K + r_V) int64 indices. The lower layer's store counts
the directions, the indices and its own magnitudes and originals; the upper layer's its own.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.capabilities.sharing import INDEX_BYTES   # retained indices are int64
from pyramidkv.core.cross_layer import merge_pair, retained_tokens
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV
from pyramidkv.core.store import Heads, LayerStore, StoreSetup



class MergedTensor:
    """Keys or values of a merged pair, per segment (see the module docstring for the shapes)."""

    def __init__(self, lower: list[torch.Tensor], upper: list[torch.Tensor], t: float, retain: float, capacity: int):
        """lower, upper: per segment the layer's rows [n_s, D] at the pair's shared tokens."""
        self.t = t
        first = lower[0]
        segments, dim = len(lower), first.shape[-1]
        self.direction = first.new_zeros(segments, capacity, dim)
        self.magnitude = first.new_zeros(segments, capacity, 2)
        self.retained = torch.zeros(segments, capacity, dtype=torch.bool, device=first.device)
        picks, thresholds = [], []
        for s, (lo, up) in enumerate(zip(lower, upper)):
            direction, magnitude, distance = merge_pair(lo, up, t)
            self.direction[s, :len(lo)], self.magnitude[s, :len(lo)] = direction, magnitude
            kept, threshold = retained_tokens(distance, retain)
            self.retained[s, kept] = True
            picks.append(kept)
            thresholds.append(threshold)
        self.threshold = torch.tensor(thresholds, dtype=torch.float64, device=first.device)
        self.count = torch.tensor([len(p) for p in picks], device=first.device)
        width = max(int(self.count.max()), 1) + 4
        self.index = torch.full((segments, width), -1, dtype=torch.long, device=first.device)
        self.original = first.new_zeros(segments, width, 2, dim)
        for s, kept in enumerate(picks):
            self.index[s, :len(kept)] = kept
            self.original[s, :len(kept), 0], self.original[s, :len(kept), 1] = lower[s][kept], upper[s][kept]

    def grow(self, capacity: int) -> None:
        extra = capacity - self.direction.shape[1]
        if extra > 0:
            self.direction = torch.cat([self.direction, self.direction.new_zeros(*self.direction.shape[:1], extra,
                                                                                 self.direction.shape[2])], 1)
            self.magnitude = torch.cat([self.magnitude, self.magnitude.new_zeros(self.magnitude.shape[0], extra, 2)], 1)
            self.retained = torch.cat([self.retained, self.retained.new_zeros(self.retained.shape[0], extra)], 1)

    def append(self, lower: torch.Tensor, upper: torch.Tensor, at: torch.Tensor) -> None:
        """lower, upper [S, D]: one new token pair per segment, stored at row `at` [S]."""
        direction, magnitude, distance = merge_pair(lower, upper, self.t)
        rows = torch.arange(lower.shape[0], device=lower.device)
        self.direction[rows, at], self.magnitude[rows, at] = direction, magnitude
        keep = distance > self.threshold
        self.retained[rows, at] = keep
        if bool(keep.any()):
            if int(self.count.max()) + 1 > self.index.shape[1]:
                more = self.index.shape[1] // 2 + 4
                self.index = torch.cat([self.index, self.index.new_full((self.index.shape[0], more), -1)], 1)
                self.original = torch.cat([self.original, self.original.new_zeros(self.original.shape[0], more,
                                                                                  *self.original.shape[2:])], 1)
            hit = keep.nonzero().squeeze(1)
            slot = self.count[hit]
            self.index[hit, slot] = at[hit]
            self.original[hit, slot, 0], self.original[hit, slot, 1] = lower[hit], upper[hit]
            self.count[hit] += 1

    def restored(self, s: int, which: int, n: int) -> torch.Tensor:
        """Segment s's first n rows as layer `which` sees them: mu e, and the originals where retained."""
        rows = self.direction[s, :n] * self.magnitude[s, :n, which:which + 1]
        count = int(self.count[s])
        index = self.index[s, :count]
        inside = index < n
        rows[index[inside]] = self.original[s, :count, which][inside]
        return rows


class MergedPair:
    """A merged layer pair's storage for every prompt of the batch."""

    def __init__(self, lower: list[KeptKV], upper: list[KeptKV], real_lens: list[int], t: float, retain: float):
        """lower, upper: per prompt what each layer kept (the same tokens: one selection for the pair)."""
        self.heads = len(lower[0].lengths)
        self.batch = len(lower)
        low_heads = [h for kept in lower for h in kept.per_head()]
        up_heads = [h for kept in upper for h in kept.per_head()]
        self.kept_len = torch.tensor([len(k) for k, _ in low_heads], device=lower[0].keys.device)
        self.lengths = self.kept_len.clone()
        capacity = int(self.lengths.max()) + 64
        self.keys = MergedTensor([k for k, _ in low_heads], [k for k, _ in up_heads], t, retain, capacity)
        self.values = MergedTensor([v for _, v in low_heads], [v for _, v in up_heads], t, retain, capacity)
        self.positions = torch.zeros(len(low_heads), capacity, dtype=torch.long, device=self.lengths.device)
        for s, p in enumerate(p for kept in lower for p in kept.positions_per_head()):
            self.positions[s, :len(p)] = p
        self.next_position = torch.tensor(real_lens, device=self.lengths.device).repeat_interleave(self.heads)
        self.staged: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None, None]  # per layer [S, q, D] k, v
        self.element = lower[0].keys.element_size()

    # ---- growing -------------------------------------------------------------------------------
    def stage(self, which: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A layer's new tokens [B, H, q, D], attended unmerged until the upper layer has attended."""
        bsz, heads, q_len, dim = keys.shape
        self.staged[which] = (keys.reshape(bsz * heads, q_len, dim), values.reshape(bsz * heads, q_len, dim))

    def merge_staged(self) -> None:
        """Both layers' staged tokens become merged rows (after the upper layer's attention)."""
        (lo_k, lo_v), (up_k, up_v) = self.staged
        q_len = lo_k.shape[1]
        need = int(self.lengths.max()) + q_len
        if need > self.positions.shape[1]:
            capacity = need + need // 8 + 64
            for tensor in (self.keys, self.values):
                tensor.grow(capacity)
            self.positions = torch.cat([self.positions, self.positions.new_zeros(self.positions.shape[0],
                                                                                 capacity - self.positions.shape[1])], 1)
        rows = torch.arange(lo_k.shape[0], device=lo_k.device)
        for i in range(q_len):
            self.keys.append(lo_k[:, i], up_k[:, i], self.lengths)
            self.values.append(lo_v[:, i], up_v[:, i], self.lengths)
            self.positions[rows, self.lengths] = self.next_position
            self.next_position += 1
            self.lengths += 1
        self.staged = [None, None]

    # ---- attention -----------------------------------------------------------------------------
    def attend(self, which: int, queries: torch.Tensor) -> torch.Tensor:
        """queries [B, Hq, q, D] of layer `which`'s staged tokens -> [B, Hq, q, D] over the merged rows and
        its staged tokens (causal among those)."""
        bsz, num_q_heads, q_len, dim = queries.shape
        segments = bsz * self.heads
        rows = num_q_heads // self.heads * q_len
        grouped = queries.reshape(segments, rows, dim) * dim ** -0.5
        width = int(self.lengths.max())
        keys, values = self.keys, self.values
        merged = torch.matmul(grouped, keys.direction[:, :width].transpose(1, 2)) * keys.magnitude[:, None, :width, which]
        kept = int(keys.count.max())
        if kept:
            index = keys.index[:, :kept]
            exact = torch.matmul(grouped, keys.original[:, :kept, which].transpose(1, 2))      # [S, rows, R]
            widened = torch.cat([merged, merged.new_zeros(segments, rows, 1)], dim=-1)
            target = torch.where(index >= 0, index, width)[:, None, :].expand(-1, rows, -1)
            merged = widened.scatter(-1, target, exact)[..., :width]
        unused = torch.arange(width, device=queries.device)[None, :] >= self.lengths[:, None]
        merged = merged.masked_fill(unused[:, None, :], torch.finfo(merged.dtype).min)
        staged_keys, staged_values = self.staged[which]
        fresh = torch.matmul(grouped, staged_keys.transpose(1, 2))                             # [S, rows, q]
        if q_len > 1:
            query_pos = torch.arange(q_len, device=queries.device).repeat(num_q_heads // self.heads)
            visible = torch.arange(q_len, device=queries.device)[None, :] <= query_pos[:, None]
            fresh = fresh.masked_fill(~visible, torch.finfo(fresh.dtype).min)
        scores = torch.cat([merged, fresh], dim=-1)  # softmax in float32, or float64 for a float64 model
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(queries.dtype)
        merged_probs = probs[..., :width]
        scale = values.magnitude[:, :width, which].masked_fill(values.retained[:, :width], 0)
        out = torch.matmul(merged_probs * scale[:, None, :], values.direction[:, :width])
        kept = int(values.count.max())
        if kept:
            index = values.index[:, :kept]
            weights = merged_probs.gather(-1, index.clamp(min=0)[:, None, :].expand(-1, rows, -1))
            weights = weights * (index >= 0)[:, None, :]
            out = out + torch.matmul(weights, values.original[:, :kept, which])
        out = out + torch.matmul(probs[..., width:], staged_values)
        return out.reshape(bsz, num_q_heads, q_len, dim)

    # ---- inspection ----------------------------------------------------------------------------
    def segment_rows(self, which: int, s: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [n], keys [n, D], values [n, D]) of segment s's first n merged rows, restored for `which`."""
        return self.positions[s, :n], self.keys.restored(s, which, n), self.values.restored(s, which, n)

    def parts(self, which: int, b: int) -> dict[str, int]:
        """Layer `which`'s share of prompt b's stored bytes, by part."""
        own = slice(b * self.heads, (b + 1) * self.heads)
        dim, element = self.keys.direction.shape[-1], self.element
        n = int(self.lengths[own].sum())
        retained = int(self.keys.count[own].sum() + self.values.count[own].sum())
        parts = {"magnitudes": 2 * n * element, "retained": retained * dim * element}
        if which == 0:
            parts.update(directions=2 * n * dim * element, indices=retained * INDEX_BYTES)
        staged = self.staged[which]
        parts["residual"] = 0 if staged is None else 2 * self.heads * staged[0].shape[1] * dim * element
        return parts

    def allocated_bytes(self) -> int:
        tensors = [self.positions] + [t for m in (self.keys, self.values)
                                      for t in (m.direction, m.magnitude, m.index, m.original)]
        return sum(t.numel() * t.element_size() for t in tensors)


class PairedLayerStore(LayerStore):
    """One layer of a merged pair (which = 0: the lower layer, 1: the upper)."""

    @classmethod
    def build(cls, kept: dict[int, list[KeptKV]], setup: StoreSetup) -> dict[int, LayerStore]:
        """Layers outside the unit's pairs get a full-precision store; a pair's two layers come together."""
        sharing = setup.method.layer_sharing
        pairs = sharing.pairs(setup.num_layers)
        stores: dict[int, LayerStore] = {}
        for layer, kv in kept.items():
            if layer in pairs:
                pair = MergedPair(kv, kept[layer + 1], setup.real_lens, sharing.cross_layer_t, sharing.cross_layer_retain)
                stores[layer], stores[layer + 1] = cls(pair, 0), cls(pair, 1)
            elif layer - 1 not in pairs:
                stores[layer] = FullPrecisionStore(kv, setup.real_lens, setup.form)
        return stores

    def __init__(self, pair: MergedPair, which: int):
        self.pair, self.which = pair, which
        self.heads = pair.heads
        self.appended = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor, rope_positions: torch.Tensor) -> None:
        if self.which == 1 and (self.pair.staged[0] is None or self.pair.staged[0][0].shape[1] != keys.shape[2]):
            raise RuntimeError("the upper layer of a merged pair got new tokens before the lower layer")
        self.pair.stage(self.which, keys, values)
        self.appended += keys.shape[2]

    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        out = self.pair.attend(self.which, queries)
        if self.which == 1:
            self.pair.merge_staged()
        return out

    def _segments(self, b: int) -> range:
        return range(b * self.heads, (b + 1) * self.heads)

    def kept_counts(self) -> list[list[int]]:
        return self.pair.kept_len.view(-1, self.heads).tolist()

    def kept_positions(self, b: int) -> list[torch.Tensor]:
        return [self.pair.positions[s, :int(self.pair.kept_len[s])] for s in self._segments(b)]

    def kept_kv(self, b: int) -> Heads:
        """The restored vectors (mu e, the originals where retained) of the kept prompt tokens."""
        return [self.pair.segment_rows(self.which, s, int(self.pair.kept_len[s])) for s in self._segments(b)]

    def held_counts(self) -> list[list[int]]:
        staged = self.pair.staged[self.which]
        extra = 0 if staged is None else staged[0].shape[1]
        return (self.pair.lengths + extra).view(-1, self.heads).tolist()

    def stored_kv(self, b: int) -> Heads:
        """Every held token: the merged rows restored, then this layer's staged tokens as they are."""
        out = []
        staged = self.pair.staged[self.which]
        for s in self._segments(b):
            positions, keys, values = self.pair.segment_rows(self.which, s, int(self.pair.lengths[s]))
            if staged is not None:
                q_len = staged[0].shape[1]
                start = int(self.pair.next_position[s])
                positions = torch.cat([positions, torch.arange(start, start + q_len, device=positions.device)])
                keys, values = torch.cat([keys, staged[0][s]]), torch.cat([values, staged[1][s]])
            out.append((positions, keys, values))
        return out

    def held_positions(self, b: int) -> list[torch.Tensor]:
        return [positions for positions, _, _ in self.stored_kv(b)]

    def bytes_by_part(self, b: Optional[int] = None) -> dict[str, int]:
        chosen = [self.pair.parts(self.which, i) for i in (range(self.pair.batch) if b is None else [b])]
        return {part: sum(p[part] for p in chosen) for part in chosen[0]}

    def capacity_bytes(self) -> int:
        """The pair's allocation is reported once, by its lower layer."""
        return self.pair.allocated_bytes() if self.which == 0 else 0
