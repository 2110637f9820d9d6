"""The quantized layer store: kept and generated tokens in packed low-bit codes (`method.quant_method`).

Per segment (one prompt's stored head), in time order, a layer stores
  * sink   : KVQuant's attention sink (its first `sink_tokens` prompt tokens, if kept), full precision;
  * prefill: the oldest kept prompt tokens, quantized at prefill in whole groups of G tokens (one
             block per prompt and count: the segments of a prompt that quantize the same number);
  * decode : groups of G tokens that left the full-precision window while generating, one per event;
  * window : the most recent tokens, full precision: R to R + G - 1 of them (R = residual_length) once
             a segment holds R tokens or more, fewer before.
KIVI windowing: the append that brings a window to R + G quantizes its oldest G tokens (once: a block is never
touched again) and the window drops to R. At prefill, of k kept tokens (sink excluded) G * floor((k - R) / G) are
quantized. Every block holds the segments of ONE prompt, so codebooks, low-rank starts and outlier budgets never
depend on which prompts share a batch. Prefill blocks that split into G-token groups of the same bytes (no outliers,
low-rank term or codebook: KIVI) are stacked group by group with the decode groups (`DecodeBlocks`); the others stay
whole (`prefill`).

Keys are stored after RoPE, except for quantizers with `keys_before_rope` (KVQuant): their quantized keys are un-
rotated first (in float32, at the token's RoPE position, kept as int32) and rotated again when read. With ThinK the
prefill-quantized keys are thin (after RoPE, which mixes channels c and c + D/2). Attention: scores per part, one
joint softmax (float32), values per part; scale and zero fold into the query and the probabilities, so quantized
parts are read as levels, never dequantized (pyramidkv.quantization.kernels); a stack of plain groups as one grid
of cells (quantization/cells.py), others in as few spans as the scratch bound allows. See docs/quantization.md.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.core.kept import KeptKV
from pyramidkv.core.rotary import KeyRotation, layer_rotation
from pyramidkv.core.scoring import PLAIN, probabilities
from pyramidkv.core.store import Heads, LayerStore, StoreSetup
from pyramidkv.quantization.base import Quantizer
from pyramidkv.quantization.kernels import Scratch, dequantize_span, key_scores, weighted_values
from pyramidkv.quantization.stack import ByteLedger, DecodeBlocks, PrefillGroup, splits

# Largest span (segments x tokens x head dim values) attention unpacks or dequantizes at once.
CHUNK_ELEMENTS = 1 << 20


class QuantizedStore(LayerStore):
    multi_token = False   # the window's mask is per segment, not per new token: one new token per append

    @classmethod
    def open(cls, kept: list[KeptKV], setup: StoreSetup, layer_idx: int) -> "QuantizedStore":
        setup.method.quant_method.check_head_dim(kept[0].keys.shape[-1])
        return cls(setup.method.quant_method, kept, setup.rope_positions(kept), setup.real_lens,
                   layer_rotation(setup.rotary, layer_idx), setup.scratch, setup.form)

    def __init__(self, quantizer: Quantizer, kept: list[KeptKV], rope_positions: list[torch.Tensor],
                 real_lens: list[int], rotary: Optional[KeyRotation], scratch: Optional[Scratch] = None, form=PLAIN):
        """kept: per prompt what the prefill kept; rope_positions: per prompt, long [T] RoPE position of each kept
        row; real_lens: per prompt its real length; scratch: buffers shared by a cache's layers; form: the model's
        attention form (its logits)."""
        q = self.quantizer = quantizer
        self.scratch, self.form = scratch, form
        self.kept_lengths = [k.counts() for k in kept]                  # per prompt, per head
        self.kept_in_prompt = [torch.cat(k.all_positions()) for k in kept]  # per prompt, its kept rows' positions
        self.real_lens, self.heads, self.appended = list(real_lens), len(kept[0].lengths), 0
        self.rotary = rotary if q.keys_before_rope else None
        first = kept[0].keys
        self.dtype, self.device, dim = first.dtype, first.device, first.shape[-1]
        g, r = q.group_size, q.residual_length
        keys, values, positions, rope, thin, channels = [], [], [], [], [], []
        for kv, pos in zip(kept, rope_positions):
            for p, k, v in kv.full_width():  # ThinK's thin keys full width, 0 in the pruned channels
                positions.append(p), keys.append(k), values.append(v)
            rope += pos.split(kv.counts())
            if kv.thin is not None:  # the rows quantized at prefill are stored thin
                thin += kv.thin.keys.split(kv.thin.lengths)
                channels += list(kv.thin.channels)
        for p in positions:
            if p.numel() > 1 and bool((p[1:] < p[:-1]).any()):
                raise ValueError("a stored head's kept positions are not in time order")
        self.segments = len(keys)
        self.prompt_positions = [p.clone() for p in rope]  # RoPE positions of the kept rows, per segment
        self.tail_positions: list[torch.Tensor] = []       # RoPE position of each appended token, per prompt
        sink = [int((p < getattr(q, "sink_tokens", 0)).sum()) for p in positions]
        quantized = [g * (max(0, k.shape[0] - s - r) // g) for k, s in zip(keys, sink)]

        self.prefill: list[PrefillGroup] = []                      # blocks read whole
        self.decoded = DecodeBlocks(self.segments, self.device)    # G-token groups: split prefill blocks, then decode
        self.ledger = ByteLedger(self.segments, dim * first.element_size() * 2)
        for b in range(len(kept)):
            own = range(b * self.heads, (b + 1) * self.heads)
            for count in sorted({quantized[s] for s in own} - {0}):
                segs = [s for s in own if quantized[s] == count]
                if thin and any(sink[s] + count > thin[s].shape[0] for s in segs):
                    raise ValueError("ThinK with a quantizer: the rows quantized at prefill must be thin "
                                     "(quant residual_length >= key_recent_size)")
                k = torch.stack([(thin if thin else keys)[s][sink[s]:sink[s] + count] for s in segs])
                v = torch.stack([values[s][sink[s]:sink[s] + count] for s in segs])
                pos = torch.stack([rope[s][sink[s]:sink[s] + count] for s in segs])
                group = self._encode(torch.tensor(segs, device=self.device), k, v, pos, decoding=False,
                                     channels=torch.stack([channels[s] for s in segs]) if thin else None)
                self.ledger.count(group.segments, group.keys, group.values, group.positions, group.channels)
                if group.channels is None and splits(group.keys) and splits(group.values):
                    self.decoded.push(group.segments, group.keys, group.values, group.positions, prefill=True)
                else:
                    self.prefill.append(group)

        # Full-precision rows: the sink, then the window; room for the most a window ever holds (R + G).
        fp = [k.shape[0] - c for k, c in zip(keys, quantized)]
        capacity = max(max(fp) + 1, max(sink) + r + g)
        self.fp_keys, self.fp_values = (first.new_zeros(self.segments, capacity, dim) for _ in range(2))
        self.fp_positions = torch.zeros(self.segments, capacity, dtype=torch.long, device=self.device)
        for s in range(self.segments):
            rows = torch.cat([torch.arange(sink[s]), torch.arange(sink[s] + quantized[s], keys[s].shape[0])]).to(self.device)
            self.fp_keys[s, :fp[s]] = keys[s][rows]
            self.fp_values[s, :fp[s]] = values[s][rows]
            self.fp_positions[s, :fp[s]] = rope[s][rows]
        self.fp_len, self.sink = torch.tensor(fp, device=self.device), torch.tensor(sink, device=self.device)
        held = torch.arange(capacity, device=self.device) < self.fp_len.unsqueeze(1)
        self.fp_mask = first.new_zeros(held.shape).masked_fill_(~held, torch.finfo(self.dtype).min)  # added to scores
        self.every_segment = torch.arange(self.segments, device=self.device)
        self._window_changed()

    # ---- encoding ------------------------------------------------------------------------------
    def _encode(self, segments, keys, values, positions, decoding: bool, channels=None) -> PrefillGroup:
        """Thin keys (channels given) are quantized after RoPE: RoPE mixes channels c and c + D/2."""
        rotary = self.rotary if channels is None else None
        if rotary is not None:
            keys = rotary.rotate(keys, positions, inverse=True)
        stored = positions.to(torch.int32) if rotary is not None else None
        return PrefillGroup(segments, self.quantizer.quantize_keys(keys, decoding=decoding),
                            self.quantizer.quantize_values(values, decoding=decoding), stored, channels)

    # ---- growing -------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, rope_positions: torch.Tensor) -> None:
        bsz, heads, q_len, dim = keys.shape
        if q_len != 1:
            raise NotImplementedError("a quantized cache decodes one token per step (got q_len > 1)")
        rows = self.every_segment
        self.fp_keys[rows, self.fp_len] = keys.reshape(self.segments, dim)
        self.fp_values[rows, self.fp_len] = values.reshape(self.segments, dim)
        if self.rotary is not None:       # the window's RoPE positions only rotate keys stored before RoPE
            self.fp_positions[rows, self.fp_len] = rope_positions.repeat_interleave(heads)
        self.fp_mask[rows, self.fp_len] = 0
        self.fp_len += 1
        self.fp_width, self.steps_to_full, self.appended = self.fp_width + 1, self.steps_to_full - 1, self.appended + 1
        self.tail_positions.append(rope_positions.clone())
        if self.steps_to_full <= 0:       # some window holds R + G tokens: its oldest G are quantized
            g, r = self.quantizer.group_size, self.quantizer.residual_length
            segs = ((self.fp_len - self.sink) >= r + g).nonzero().squeeze(1)
            for b in (segs // self.heads).unique().tolist():  # one block per prompt
                self._quantize_oldest(segs[segs // self.heads == b])
            self._window_changed()

    def _window_changed(self) -> None:
        """Python counts the reads and the next append need: the widest window, the appends until one is full."""
        q, longest = self.quantizer, int((self.fp_len - self.sink).max())
        self.fp_width, self.steps_to_full = int(self.fp_len.max()), q.residual_length + q.group_size - longest

    def _quantize_oldest(self, segs: torch.Tensor) -> None:
        """The oldest G window tokens of these segments (each holding R + G) -> one stacked block each."""
        g, r = self.quantizer.group_size, self.quantizer.residual_length
        oldest = self.sink[segs].unsqueeze(1) + torch.arange(g, device=self.device)   # [n, G]
        index = segs.unsqueeze(1)
        group = self._encode(segs, self.fp_keys[index, oldest], self.fp_values[index, oldest],
                             self.fp_positions[index, oldest], decoding=True)
        self.decoded.push(segs, group.keys, group.values, group.positions)
        self.ledger.count(segs, group.keys, group.values, group.positions)
        rest = oldest[:, :1] + g + torch.arange(r, device=self.device)              # the R tokens that stay
        moved = oldest[:, :1] + torch.arange(r, device=self.device)
        self.fp_keys[index, moved] = self.fp_keys[index, rest]
        self.fp_values[index, moved] = self.fp_values[index, rest]
        self.fp_positions[index, moved] = self.fp_positions[index, rest]
        self.fp_mask[index, oldest + r] = torch.finfo(self.dtype).min        # the G rows freed
        self.fp_len[segs] -= g

    # ---- reading -------------------------------------------------------------------------------
    def _chunk(self, rows: int, dim: int) -> int:
        """Tokens per span of a prefill block read for `rows` segments: a multiple of G and of 4 (whole bytes)."""
        step = self.quantizer.group_size * 4
        return max(step, CHUNK_ELEMENTS // max(1, rows * dim) // step * step)

    def _key_scores(self, block, queries, start: int, stop: int, codebook, positions) -> torch.Tensor:
        """queries [n, rows, D'] . keys [start, stop) of a block: float32 [n, rows, stop - start]; positions (keys
        stored before RoPE, [n, T]): the keys are dequantized and rotated first, else scale and zero fold; soft-capped
        where the model caps."""
        if positions is None:
            return self.form.cap(key_scores(block, queries, start, stop, codebook, self.scratch))
        keys = dequantize_span(block, start, stop, torch.float32, codebook, self.scratch)
        return self.form.logits(queries.float(), self.rotary.rotate(keys, positions[:, start:stop]).transpose(1, 2))

    def attend(self, queries: torch.Tensor) -> torch.Tensor:
        bsz, num_q_heads, q_len, dim = queries.shape
        segs, rows, dtype = self.segments, num_q_heads // self.heads * q_len, queries.dtype
        grouped = queries.reshape(segs, rows, dim) * dim ** -0.5
        lowest, parts = torch.finfo(dtype).min, []
        # Prefill blocks read whole: [S, rows, P] with P the most any segment quantized (fewer: masked).
        longest = max((group.tokens for group in self.prefill), default=0)
        whole = len(self.prefill) == 1 and self.prefill[0].segments.numel() == segs
        if longest:
            pre = None if whole else grouped.new_full((segs, rows, longest), lowest)
            for group in self.prefill:
                step, stop = self._chunk(group.segments.numel(), dim), group.tokens
                q = group.queries(grouped if whole else grouped[group.segments])
                scores = torch.cat([self._key_scores(group.keys, q, a, min(a + step, stop), None, group.positions)
                                    for a in range(0, stop, step)], dim=-1).to(dtype)
                if whole:
                    pre = scores
                else:
                    pre[group.segments, :, :group.tokens] = scores
            parts.append(pre)
        # Stacked groups, [S, rows, J * G]: plain ones (KIVI's) as one grid of cells (quantization/cells.py), others
        # in spans into a table [S * J, rows, G] (the group in slot j of segment s in cell s * J + j).
        g, slots, grid = self.quantizer.group_size, self.decoded.most, self.decoded.grid()
        spans = [] if grid else self.decoded.spans(max(1, CHUNK_ELEMENTS // (g * dim)))
        if grid:
            parts.append(grid.scores(grouped, self.scratch, self.form.cap).to(dtype))
        elif slots:
            table = grouped.new_full((segs * slots, rows, g), lowest)
            for span in spans:
                queries_of_rows = grouped.index_select(0, span.segment)
                scores = self._key_scores(span.keys, queries_of_rows, 0, g, span.key_codebooks, span.positions)
                table.index_copy_(0, span.cell, scores.to(dtype))
            parts.append(table.view(segs, slots, rows, g).transpose(1, 2).reshape(segs, rows, slots * g))
        # Full-precision window: [S, rows, F], rows not held masked.
        width = self.fp_width
        fp_keys, fp_mask = self.fp_keys[:, :width].transpose(1, 2), self.fp_mask[:, None, :width]
        parts.append(self.form.cap(torch.bmm(grouped, fp_keys)) + fp_mask if self.form.capped else   # capped, masked
                     torch.baddbmm(fp_mask, grouped, fp_keys))

        probs = probabilities(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0], dtype=dtype)
        out = torch.bmm(probs[..., probs.shape[-1] - width:], self.fp_values[:, :width])
        for group in self.prefill:
            step, stop = self._chunk(group.segments.numel(), dim), group.tokens
            p = probs if whole else probs[group.segments]
            for a in range(0, stop, step):
                part = weighted_values(group.values, p[..., a:min(a + step, stop)], a, min(a + step, stop), dtype,
                                       scratch=self.scratch)
                out = out + part if whole else out.index_add(0, group.segments, part)
        if grid:
            out = out + grid.values_of(probs[..., longest:longest + slots * g], self.scratch).to(dtype)
        elif slots:
            cells = probs[..., longest:longest + slots * g].view(segs, rows, slots, g).transpose(1, 2).flatten(0, 1)
            for span in spans:
                out = out.index_add(0, span.segment, weighted_values(
                    span.values, cells.index_select(0, span.cell), 0, g, dtype, span.value_codebooks, self.scratch))
        return out.reshape(bsz, num_q_heads, q_len, dim)

    # ---- inspection ----------------------------------------------------------------------------
    def _segment_kv(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(RoPE positions [n], keys [n, D], values [n, D]) of everything segment s stores, dequantized
        (keys after RoPE), in time order: sink, prefill-quantized, stacked groups by slot, window."""
        sink, fp = int(self.sink[s]), int(self.fp_len[s])
        keys, values = [self.fp_keys[s, :sink]], [self.fp_values[s, :sink]]
        for group in self.prefill:
            hit = (group.segments == s).nonzero()
            if hit.numel():
                i = int(hit[0, 0])
                k = group.keys.dequantize(torch.float32, heads=i)
                k = k if group.positions is None else self.rotary.rotate(k, group.positions[i:i + 1])
                k = k[0].to(self.dtype)
                if group.channels is not None:
                    k = k.new_zeros(k.shape[0], self.fp_keys.shape[-1]).index_copy_(1, group.channels[i], k)
                keys.append(k)
                values.append(group.values.dequantize(self.dtype, heads=i)[0])
        rows = (self.decoded.segment == s).nonzero().squeeze(1)
        if rows.numel():
            rows = rows[self.decoded.slot[rows].argsort()]
            k, v = self.decoded.dequantize(rows)                                   # [n, G, D] each
            k = k if self.rotary is None else self.rotary.rotate(k, self.decoded.positions[rows])
            keys.append(k.to(self.dtype).flatten(0, 1)), values.append(v.to(self.dtype).flatten(0, 1))
        keys.append(self.fp_keys[s, sink:fp]), values.append(self.fp_values[s, sink:fp])
        positions = [self.prompt_positions[s]] + [p[s // self.heads: s // self.heads + 1] for p in self.tail_positions]
        return torch.cat(positions), torch.cat(keys), torch.cat(values)

    def kept_counts(self) -> list[list[int]]:
        return [list(lengths) for lengths in self.kept_lengths]

    def kept_positions(self, b: int) -> list[torch.Tensor]:
        return list(self.kept_in_prompt[b].split(self.kept_lengths[b]))

    def kept_kv(self, b: int) -> Heads:
        """Copies (dequantized), not views of the store."""
        segments = [self._segment_kv(b * self.heads + h) for h in range(self.heads)]
        return [(p, k[:len(p)], v[:len(p)]) for p, (_, k, v) in zip(self.kept_positions(b), segments)]

    def held_counts(self) -> list[list[int]]:
        return [[n + self.appended for n in lengths] for lengths in self.kept_lengths]

    def held_positions(self, b: int) -> list[torch.Tensor]:
        kept, start = self.kept_in_prompt[b], self.real_lens[b]
        tail = torch.arange(start, start + self.appended, dtype=kept.dtype, device=kept.device)
        return [torch.cat([p, tail]) for p in self.kept_positions(b)]

    def stored_kv(self, b: int) -> Heads:
        return [self._segment_kv(b * self.heads + h) for h in range(self.heads)]

    def bytes_by_part(self, b: Optional[int] = None) -> dict[str, int]:
        segments = slice(None) if b is None else slice(b * self.heads, (b + 1) * self.heads)
        return self.ledger.parts(segments, self.fp_len.cpu())

    def capacity_bytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in (self.fp_keys, self.fp_values, self.fp_mask))
                + self.decoded.capacity_bytes())
