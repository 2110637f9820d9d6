"""The compressed KV cache: one shared core for every method and every model.

Layout, per layer:
  * prefix: for each prompt of the batch a `KeptKV` holding the prompt tokens
    that survived compression. Keys/values are flat [T, D] rows, head-major,
    with a length per stored head: heads may keep different counts (AdaKV,
    HeadKV) and prompts of a batch different counts (short prompts are kept
    whole) without padding or masks. Nothing is stored for left padding.
  * tail: tokens appended after the prompt, dense [B, H, t, D] (every prompt of
    the batch appends one token per step), a view of a buffer that grows geometrically.
Decoding (`attend`) batches all prompts and heads of a layer: one matmul over [B, H, L, D]
views when every head keeps the same count; otherwise the layer's rows are attended in
blocks of (prompt, head) segments with a mask of which row belongs to which segment (see
`DecodeLayout`): no Python loop over heads, no padded copy.
Stored heads H are the KV heads (`kv_head` layout) or the query heads
(`query_head`: K/V repeated over the GQA group before compression).

`get_seq_length()` reports the uncompressed count (prompt incl. padding +
appended tokens), so transformers gives new tokens their true RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers.cache_utils import Cache

from pyramidkv.allocation.base import ModelShape
from pyramidkv.core.scoring import scores_per_stored_head, window_attention
from pyramidkv.core.selection import select_kept_positions
from pyramidkv.merging.base import merge_prompt
from pyramidkv.methods.base import Method, ScoreContext


@dataclass
class KeptKV:
    """The prompt tokens one layer keeps for one prompt.

    keys, values: [T, D], rows of head h at offsets[h]:offsets[h+1].
    positions: [T] position of each kept token in its prompt (0 = first real token).
    """

    keys: torch.Tensor
    values: torch.Tensor
    lengths: list[int]
    positions: torch.Tensor

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) <= 1

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[H, L, D] views (no copy); only when every head keeps the same count."""
        heads, dim = len(self.lengths), self.keys.shape[-1]
        return self.keys.view(heads, -1, dim), self.values.view(heads, -1, dim)

    def per_head(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys.split(self.lengths), self.values.split(self.lengths)))

    def positions_per_head(self) -> list[torch.Tensor]:
        return list(self.positions.split(self.lengths))

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


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


# The tail buffer grows by this many tokens, or by an eighth of its length when that is more:
# amortised O(1) appends, at most max(128 tokens, 12.5 %) of the tail allocated but unused.
TAIL_GROWTH_TOKENS = 128
# Ragged attention multiplies each query block with every key row of its block of segments and
# masks the rows of other segments: at most this many segments per block bounds the wasted FLOPs.
SEGMENTS_PER_BLOCK = 4


def _softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last axis in float32 (as transformers' eager attention), back in `dtype`."""
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


@dataclass
class SegmentBlock:
    """Consecutive segments (one segment = one prompt's stored head) of a layer, attended in one matmul.

    segments: [start, stop) into the B * H segments; rows: [start, stop) into the layer's flat K/V rows;
    own_rows: bool [stop - start segments, rows], True where a row belongs to that segment.
    """

    segments: tuple[int, int]
    rows: tuple[int, int]
    own_rows: torch.Tensor


@dataclass
class DecodeLayout:
    """How `attend` reads one layer's kept prompt tokens; built at the layer's first decode step.

    Either every prompt and head keeps the same count L: dense_keys/values [B, H, L, D] (views of
    the KeptKV storage); or ragged: flat_keys/values [R, D], all prompts' rows prompt-major then
    head-major (the KeptKV keys/values are views of them), attended block by block.
    """

    prefix: list[KeptKV]  # the layer's prefix this layout was built for
    dense_keys: Optional[torch.Tensor] = None
    dense_values: Optional[torch.Tensor] = None
    flat_keys: Optional[torch.Tensor] = None
    flat_values: Optional[torch.Tensor] = None
    blocks: Optional[list[SegmentBlock]] = None

    @classmethod
    def build(cls, prefix: list[KeptKV]) -> "DecodeLayout":
        """One storage block per layer: the prompts' K/V are moved into one tensor (a copy only when
        B > 1 or the rows are not contiguous) and each KeptKV keeps views of it; nothing is duplicated."""
        if len(prefix) == 1 and prefix[0].keys.is_contiguous() and prefix[0].values.is_contiguous():
            flat_keys, flat_values = prefix[0].keys, prefix[0].values
        else:
            flat_keys = torch.cat([kept.keys for kept in prefix])
            flat_values = torch.cat([kept.values for kept in prefix])
            start = 0
            for kept in prefix:
                stop = start + kept.keys.shape[0]
                kept.keys, kept.values = flat_keys[start:stop], flat_values[start:stop]
                start = stop
        lengths = [n for kept in prefix for n in kept.lengths]  # per segment (prompt-major, head-major)
        heads, dim = len(prefix[0].lengths), flat_keys.shape[-1]
        if len(set(lengths)) == 1:
            shape = (len(prefix), heads, lengths[0], dim)
            return cls(prefix, dense_keys=flat_keys.view(shape), dense_values=flat_values.view(shape))
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        blocks = []
        for first in range(0, len(lengths), SEGMENTS_PER_BLOCK):
            last = min(first + SEGMENTS_PER_BLOCK, len(lengths))
            rows = torch.arange(offsets[first], offsets[last], device=flat_keys.device)
            starts = torch.tensor(offsets[first:last], device=flat_keys.device)
            stops = torch.tensor(offsets[first + 1:last + 1], device=flat_keys.device)
            own_rows = (rows[None, :] >= starts[:, None]) & (rows[None, :] < stops[:, None])
            blocks.append(SegmentBlock((first, last), (offsets[first], offsets[last]), own_rows))
        return cls(prefix, flat_keys=flat_keys, flat_values=flat_values, blocks=blocks)


class CompressedCache(Cache):
    """A transformers `Cache` whose prompt part is compressed by a `Method` at prefill."""

    def __init__(self, method: Method, num_layers: int, num_kv_heads: int, num_query_heads: int,
                 model_name: str = ""):
        super().__init__()
        self.method = method
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_query_heads = num_query_heads
        self.group = num_query_heads // num_kv_heads
        self.model_shape = ModelShape(num_layers, num_query_heads, num_kv_heads, model_name)
        self.pad_lens: Optional[list[int]] = None
        self.prompt_len = 0  # padded prompt length
        self.prefix: list[Optional[list[KeptKV]]] = [None] * num_layers
        self.tail_keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.tail_values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.layer_budgets_per_prompt: Optional[list[list[int]]] = None
        # Layers scored but not yet gathered (allocations that need every layer's scores, e.g. ZigZagKV):
        # layer -> (stored keys [B, H, n, D], stored values, scores [B, H, n] or None,
        #           the merge rule's window attention [B, H, n] or None).
        self._deferred: dict[int, tuple] = {}
        self.peak_prefill_kv_bytes = 0   # most K/V bytes held at once during prefill (kept + deferred)
        # Decode-time state: tail buffers (key, value) [B, H, capacity, D]; per-layer DecodeLayout.
        self._tail_buffers: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * num_layers
        self._decode_layouts: list[Optional[DecodeLayout]] = [None] * num_layers
        # RoPE positions [B or 1, q] of the tokens of the current forward (set by the patched attention;
        # a quantized cache that stores keys before RoPE reads them).
        self.rope_position_ids: Optional[torch.Tensor] = None
        # Compression during decoding (method.decode_budget): pyramidkv/core/decoding.py.
        self.decoding = None
        if method.decode_budget is not None:
            from pyramidkv.core.decoding import DecodeCompressor

            self.decoding = DecodeCompressor(self)

    # ---- transformers Cache API -------------------------------------------------------------
    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        layer_idx = layer_idx or 0
        if self.prefix[layer_idx] is None:
            return 0
        tail = self.tail_keys[layer_idx]
        folded = 0 if self.decoding is None else self.decoding.folded[layer_idx]  # tokens moved out of the tail
        return self.prompt_len + folded + (0 if tail is None else tail.shape[2])

    def get_max_length(self) -> Optional[int]:
        return None

    def update(self, *args, **kwargs):
        raise RuntimeError("CompressedCache is driven by pyramidkv's patched attention; "
                           "patch the model with pyramidkv.compress(model, method) before using it")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("beam search is not supported with a compressed cache")

    # ---- set-up -------------------------------------------------------------------------------
    def set_padding(self, attention_mask: Optional[torch.Tensor], batch_size: int, seq_len: int) -> None:
        """Record the left padding of the prompt batch (called once, before prefill)."""
        self.pad_lens = left_padding_lengths(attention_mask, batch_size, seq_len)

    def is_prefilled(self, layer_idx: int) -> bool:
        return self.prefix[layer_idx] is not None

    def _nominal_budget(self, real_len: int) -> int:
        return self.method.prompt_budget(real_len) if self.method.needs_budget else real_len

    def _prompt_layer_budgets(self, real_lens: list[int],
                              layer_scores: Optional[list[list[torch.Tensor]]] = None) -> list[list[int]]:
        """Per prompt, the tokens each layer keeps. A prompt no longer than the method's budget is
        not compressed in any layer (SnapKV's and PyramidKV's rule), even where a layer's own share
        would be smaller. layer_scores: per prompt, per layer [H, candidates] (allocations that need them)."""
        if self.layer_budgets_per_prompt is None:
            self.layer_budgets_per_prompt = []
            for b, n in enumerate(real_lens):
                budget = self._nominal_budget(n)
                if n <= budget:
                    self.layer_budgets_per_prompt.append([n] * self.num_layers)
                else:
                    scores = layer_scores[b] if layer_scores is not None else None
                    self.layer_budgets_per_prompt.append(self.method.layer_budgets(budget, self.num_layers, n, scores))
        return self.layer_budgets_per_prompt

    # ---- prefill: score, select, store ------------------------------------------------------
    @torch.no_grad()
    def compress_prompt(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the selected prompt tokens of one layer (or, for allocations that need every layer's
        scores, hold the layer until the last one is scored, then gather all).

        queries: [B, Hq, n, D]; keys, values: [B, Hkv, n, D] (after RoPE).
        """
        bsz, _, n, dim = keys.shape
        if self.pad_lens is None:
            self.pad_lens = [0] * bsz
        self.prompt_len = n
        real_lens = [n - p for p in self.pad_lens]
        method = self.method

        stored_keys, stored_values = keys, values
        if method.gqa_layout == "query_head" and self.group > 1:
            stored_keys = keys.repeat_interleave(self.group, dim=1)
            stored_values = values.repeat_interleave(self.group, dim=1)

        scores = merge_attention = raw_scores = None
        if any(real > self._nominal_budget(real) for real in real_lens):
            real = torch.arange(n, device=keys.device)[None, :] >= torch.tensor(self.pad_lens, device=keys.device)[:, None]
            raw_scores = method.score(ScoreContext(layer_idx, self.num_layers, queries, keys, values, real))
            scores = scores_per_stored_head(raw_scores, method, self.num_kv_heads, self.num_query_heads)  # [B, H, n]
            if method.merge is not None and method.merge.needs_attention:
                # The observation window's mean attention to every prompt token, per stored head.
                attention = window_attention(queries, keys, real, method.window_size).mean(dim=2)  # [B, Hq, n]
                merge_attention = scores_per_stored_head(attention, method, self.num_kv_heads, self.num_query_heads)
        if self.decoding is not None:
            self.decoding.observe_prefill(layer_idx, queries, keys, raw_scores)
        if method.layer_allocation.needs_scores:
            self._deferred[layer_idx] = (stored_keys, stored_values, scores, merge_attention)
            self._note_prefill_bytes()
            if layer_idx == self.num_layers - 1:
                self._gather_deferred(real_lens)
                if self.decoding is not None:
                    self.decoding.after_prefill(range(self.num_layers))
            return
        budgets = [b[layer_idx] for b in self._prompt_layer_budgets(real_lens)]
        kept = self._select(layer_idx, stored_keys, stored_values, scores, budgets, merge_attention)
        self._store_prefix(layer_idx, kept)
        self._note_prefill_bytes()
        if self.decoding is not None:
            self.decoding.after_prefill([layer_idx])

    def _gather_deferred(self, real_lens: list[int]) -> None:
        """All layers are scored: allocate the layer budgets from their scores, then select and gather."""
        window = self.method.window_size
        layer_scores = []
        for b, pad in enumerate(self.pad_lens):
            n = self.prompt_len
            if self._deferred[0][2] is None or real_lens[b] <= self._nominal_budget(real_lens[b]):
                layer_scores.append(None)
                continue
            w = min(window, real_lens[b])
            layer_scores.append([self._deferred[layer][2][b, :, pad:n - w] for layer in range(self.num_layers)])
        self._prompt_layer_budgets(real_lens, layer_scores)
        for layer in range(self.num_layers):
            keys, values, scores, merge_attention = self._deferred.pop(layer)
            budgets = [b[layer] for b in self.layer_budgets_per_prompt]
            self._store_prefix(layer, self._select(layer, keys, values, scores, budgets, merge_attention))

    def _store_prefix(self, layer_idx: int, kept: list[KeptKV]) -> None:
        """Store one layer's kept prompt tokens (a quantized cache, core/quantized.py, encodes them here)."""
        self.prefix[layer_idx] = kept

    def _select(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, scores: Optional[torch.Tensor],
                budgets: list[int], merge_attention: Optional[torch.Tensor] = None) -> list[KeptKV]:
        """Per prompt: split its layer budget over the heads, select, merge (if the method has a merge
        rule), gather.

        keys, values: [B, H, n, D] stored heads; scores: [B, H, n] (None when nothing is compressed);
        merge_attention: [B, H, n] for merge rules that need it."""
        n = keys.shape[2]
        method = self.method
        kept = []
        for b, pad in enumerate(self.pad_lens):
            real_len = n - pad
            if real_len <= budgets[b]:
                positions = [torch.arange(pad, n, device=keys.device)] * keys.shape[1]
                kept.append(self._gather(keys[b], values[b], positions, pad))
                continue
            w = min(method.window_size, real_len)
            head_budgets = method.head_budgets(scores[b, :, pad:n - w], budgets[b], layer_idx, self.model_shape)
            positions = select_kept_positions(scores[b], pad, head_budgets, method.window_size)
            merged = None
            if method.merge is not None:
                seed = method.merge.seed_for(layer_idx)
                generator = None if seed is None else torch.Generator(device=keys.device).manual_seed(seed)
                attention = None if merge_attention is None else merge_attention[b]
                merged = merge_prompt(method.merge, keys[b], values[b], positions, pad, attention, method.window_size,
                                      generator)
            kept.append(self._gather(keys[b], values[b], positions, pad, merged))
        return kept

    def _note_prefill_bytes(self) -> None:
        held = sum(k.nbytes() for layer in self.prefix if layer is not None for k in layer)
        held += sum(t.numel() * t.element_size() for k, v, *_ in self._deferred.values() for t in (k, v))
        self.peak_prefill_kv_bytes = max(self.peak_prefill_kv_bytes, held)

    @staticmethod
    def _gather(keys: torch.Tensor, values: torch.Tensor, positions: list[torch.Tensor], pad: int,
                merged: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None) -> KeptKV:
        """keys, values: [H, n, D] of one prompt; positions: per head, padded coordinates. merged: the
        per-head kept (keys, values) a merge rule rewrote, stored instead of the gathered rows."""
        if merged is None:
            merged = ([keys[h, idx] for h, idx in enumerate(positions)],
                      [values[h, idx] for h, idx in enumerate(positions)])
        kept_keys, kept_values = torch.cat(merged[0]), torch.cat(merged[1])
        return KeptKV(kept_keys.contiguous(), kept_values.contiguous(), [len(p) for p in positions],
                      torch.cat(positions) - pad)

    # ---- decoding: append and attend --------------------------------------------------------
    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [B, Hkv, q, D] new tokens (after RoPE).

        Written into a per-layer buffer [B, H, capacity, D] that grows geometrically (no copy of the
        tail per step); `tail_keys[layer_idx]` is the view [B, H, t, D] of the t tokens appended so far.
        """
        if self.method.gqa_layout == "query_head" and self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=1)
            values = values.repeat_interleave(self.group, dim=1)
        bsz, heads, q_len, dim = keys.shape
        tail = self.tail_keys[layer_idx]
        t = 0 if tail is None else tail.shape[2]
        key_buffer, value_buffer = self._tail_buffers[layer_idx] or (None, None)
        if key_buffer is None or t + q_len > key_buffer.shape[2]:
            capacity = t + q_len + max(TAIL_GROWTH_TOKENS, t // 8)
            grown = [keys.new_empty(bsz, heads, capacity, dim) for _ in range(2)]
            if t:
                grown[0][:, :, :t] = key_buffer[:, :, :t]
                grown[1][:, :, :t] = value_buffer[:, :, :t]
            key_buffer, value_buffer = grown
            self._tail_buffers[layer_idx] = (key_buffer, value_buffer)
        key_buffer[:, :, t:t + q_len] = keys
        value_buffer[:, :, t:t + q_len] = values
        self.tail_keys[layer_idx] = key_buffer[:, :, :t + q_len]
        self.tail_values[layer_idx] = value_buffer[:, :, :t + q_len]

    def tail_capacity_bytes(self) -> int:
        """Bytes allocated for appended tokens, all layers, including the not yet used part of the
        tail buffers (`kv_bytes` counts only what is stored)."""
        return sum(buffer.numel() * buffer.element_size()
                   for buffers in self._tail_buffers if buffers is not None for buffer in buffers)

    def decode_layout(self, layer_idx: int) -> DecodeLayout:
        """The layer's `DecodeLayout`, built on first use (and again if the prefix was replaced)."""
        layout = self._decode_layouts[layer_idx]
        if layout is None or layout.prefix is not self.prefix[layer_idx]:
            layout = DecodeLayout.build(self.prefix[layer_idx])
            self._decode_layouts[layer_idx] = layout
        return layout

    def attend(self, layer_idx: int, queries: torch.Tensor) -> torch.Tensor:
        """Attention of new queries over kept prompt tokens + appended tokens, all prompts and heads batched.

        queries: [B, Hq, q, D] for the q most recently appended tokens. Returns [B, Hq, q, D].
        """
        bsz, num_q_heads, q_len, dim = queries.shape
        tail_keys, tail_values = self.tail_keys[layer_idx], self.tail_values[layer_idx]  # [B, H, t, D]
        heads, t = tail_keys.shape[1], tail_keys.shape[2]
        rows = num_q_heads // heads * q_len
        # Query rows of one stored head (its query heads x q tokens), pre-scaled: [B, H, rows, D].
        grouped = queries.reshape(bsz, heads, rows, dim) * dim ** -0.5
        # New token i (of q) sees the tail up to its own position: bool [rows, t].
        tail_mask = None
        if q_len > 1:
            query_pos = torch.arange(t - q_len, t, device=queries.device).repeat(num_q_heads // heads)
            tail_mask = torch.arange(t, device=queries.device)[None, :] <= query_pos[:, None]
        tail_scores = torch.matmul(grouped, tail_keys.transpose(-1, -2))  # [B, H, rows, t]
        if tail_mask is not None:
            tail_scores = tail_scores.masked_fill(~tail_mask, torch.finfo(tail_scores.dtype).min)
        layout = self.decode_layout(layer_idx)
        if layout.dense_keys is not None:
            prefix_scores = torch.matmul(grouped, layout.dense_keys.transpose(-1, -2))  # [B, H, rows, L]
            probs = _softmax(torch.cat([prefix_scores, tail_scores], dim=-1), queries.dtype)
            kept = prefix_scores.shape[-1]
            out = torch.matmul(probs[..., :kept], layout.dense_values)
            out = out + torch.matmul(probs[..., kept:], tail_values)  # [B, H, rows, D]
            return out.reshape(bsz, num_q_heads, q_len, dim)
        # Ragged: segments (prompt, head) in blocks; each block's query rows meet all the block's
        # key rows in one matmul, and the rows of other segments are masked out.
        grouped = grouped.reshape(bsz * heads, rows, dim)
        tail_scores = tail_scores.reshape(bsz * heads, rows, t)
        tail_values = tail_values.reshape(bsz * heads, t, dim)
        outputs = []
        for block in layout.blocks:
            (first, last), (row_start, row_stop) = block.segments, block.rows
            block_queries = grouped[first:last].reshape(-1, dim)  # [S * rows, D]
            scores = torch.matmul(block_queries, layout.flat_keys[row_start:row_stop].T).view(last - first, rows, -1)
            scores = scores.masked_fill(~block.own_rows[:, None, :], torch.finfo(scores.dtype).min)
            probs = _softmax(torch.cat([scores, tail_scores[first:last]], dim=-1), queries.dtype)
            kept = row_stop - row_start
            out = torch.matmul(probs[..., :kept].reshape(-1, kept), layout.flat_values[row_start:row_stop])
            outputs.append(out.view(last - first, rows, dim) + torch.matmul(probs[..., kept:], tail_values[first:last]))
        return torch.cat(outputs).reshape(bsz, num_q_heads, q_len, dim)

    def after_attend(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Called by the patched attention after each decode step's `attend` (queries [B, Hq, q, D]):
        compression during decoding, when the method has a decode_budget."""
        if self.decoding is not None:
            self.decoding.after_attend(layer_idx, queries)

    # ---- inspection ---------------------------------------------------------------------------
    def held_counts(self, layer_idx: int) -> list[list[int]]:
        """Tokens held per prompt and stored head at one layer: kept (prompt and, after decode-time
        compressions, generated) tokens + the tail."""
        tail = self.tail_keys[layer_idx]
        t = 0 if tail is None else tail.shape[2]
        return [[n + t for n in kept.lengths] for kept in self.prefix[layer_idx]]

    def held_positions(self, layer_idx: int, batch_idx: int = 0) -> list[torch.Tensor]:
        """Positions (0 = first real prompt token) of every token held per stored head, ascending."""
        kept = self.prefix[layer_idx][batch_idx]
        tail = self.tail_keys[layer_idx]
        t = 0 if tail is None else tail.shape[2]
        start = self.prompt_len - self.pad_lens[batch_idx] + (0 if self.decoding is None else self.decoding.folded[layer_idx])
        tail_positions = torch.arange(start, start + t, dtype=kept.positions.dtype, device=kept.positions.device)
        return [torch.cat([p, tail_positions]) for p in kept.positions_per_head()]

    def kv_bytes(self, batch_idx: Optional[int] = None, tail_tokens: Optional[int] = None) -> int:
        """Bytes of stored keys and values (prompt part + appended tokens), all layers;
        of one prompt of the batch when batch_idx is given. tail_tokens counts only the first
        that many appended tokens (a prompt that stopped while the rest of its batch decoded on)."""
        if self.decoding is not None and batch_idx is not None and tail_tokens is not None:
            recorded = self.decoding.bytes_history.get(tail_tokens)  # compression during decoding folds the tail
            if recorded is not None:
                return recorded[batch_idx]
        total = 0
        for layer_idx in range(self.num_layers):
            kept_per_prompt = self.prefix[layer_idx] or []
            if batch_idx is not None and kept_per_prompt:
                kept_per_prompt = [kept_per_prompt[batch_idx]]
            total += sum(kept.nbytes() for kept in kept_per_prompt)
            for tail in (self.tail_keys[layer_idx], self.tail_values[layer_idx]):
                if tail is not None:
                    tail = tail if batch_idx is None else tail[batch_idx]
                    if tail_tokens is not None:
                        tail = tail[..., :tail_tokens, :]
                    total += tail.numel() * tail.element_size()
        return total

    def kept_counts(self, layer_idx: int) -> list[list[int]]:
        """Kept prompt tokens per prompt and stored head at one layer."""
        return [list(kept.lengths) for kept in self.prefix[layer_idx]]

    def kept_positions(self, layer_idx: int, batch_idx: int = 0) -> list[torch.Tensor]:
        """Kept prompt positions (0 = first real token) per stored head."""
        return self.prefix[layer_idx][batch_idx].positions_per_head()

    def kept_kv(self, layer_idx: int, batch_idx: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per stored head, (positions [k], keys [k, D], values [k, D]) of the kept prompt tokens,
        exactly as stored (keys after RoPE). Views of the cache: clone before modifying."""
        kept = self.prefix[layer_idx][batch_idx]
        return [(positions, keys, values)
                for positions, (keys, values) in zip(kept.positions_per_head(), kept.per_head())]

    def layer_budgets_used(self, batch_idx: int = 0) -> list[int]:
        """The per-layer token budget the method gave this prompt (the prompt length where it was kept whole)."""
        if self.layer_budgets_per_prompt is None:
            raise RuntimeError("nothing has been compressed yet: run the prompt through the patched model first")
        return list(self.layer_budgets_per_prompt[batch_idx])
