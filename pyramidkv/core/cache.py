"""The compressed KV cache: a transformers `Cache` that is a list of per-layer stores.

The patched attention (pyramidkv/models/attention.py) talks to it through two entry points:

  prefill(layer, q, k, v)      after the model's own attention over the prompt: the prefill pipeline
                               (prefill.py) decides what the layer keeps and the layer's store is built
                               from it by the store kind the method's units name (`STORES`);
  decode_step(layer, q, k, v)  the new tokens are appended to the layer's store and attended over
                               everything it holds; with a decode_budget the decode compressor
                               (decoding.py) may then re-select.

A method scored by repeat passes (KVzip) has its own (`RepeatEntryPoints`, core/reconstructing.py).

Stored heads H are the KV heads (`kv_head` layout) or the query heads (`query_head`: K/V repeated over
the GQA group before compression). `get_seq_length()` reports the uncompressed count (padded prompt +
appended tokens), so transformers gives new tokens their true RoPE positions. Batches must be
left-padded; padding is never stored.

A sliding-window layer (window W) holds what the model attends to and no more: it keeps at most the last W - 1
prompt tokens (prefill.py), and each decode step first drops the held tokens the new token's window does not
cover, so it holds at most W (several new tokens in one forward are appended and attended one at a time, each
with its own window: `_piece`). Its store must be able to hand tokens back (`reselect`): under a store kind that cannot (the
quantized one) a sliding layer is stored in full precision.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache

from pyramidkv.components import AttentionForm, ModelShape
from pyramidkv.core.context import CompressionMethod
from pyramidkv.core.threshold import decoder_for
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.prefill import PromptCompressor
from pyramidkv.core.reconstructing import ReconstructingCompressor, RepeatEntryPoints
from pyramidkv.core.reconstruction import Reconstruction
from pyramidkv.core.store_kinds import STORES, store_abilities, store_kind
from pyramidkv.core.rotary import KeyRotation
from pyramidkv.core.scoring import left_padding_lengths
from pyramidkv.core.store import Heads, LayerStore, StoreSetup
from pyramidkv.quantization.kernels import Scratch


class CompressedCache(RepeatEntryPoints, Cache):
    """A transformers `Cache` whose prompt part is compressed by a method at prefill."""

    def __init__(self, method: CompressionMethod, shape: ModelShape, rotation: Optional[KeyRotation] = None):
        """shape: the model's shape the method was checked against (ScoreContext.model), with its attention form
        (`form`: scale, soft-cap, sliding windows), which every store and scorer reads from here; rotation: the
        model's RoPE on keys (the glue's `key_rotation`), needed by quantizers that store keys before RoPE."""
        super().__init__()
        self.method = method
        self.model_shape = shape
        num_layers, num_kv_heads, num_query_heads = shape.num_layers, shape.num_kv_heads, shape.num_query_heads
        self.num_layers, self.num_kv_heads, self.num_query_heads = num_layers, num_kv_heads, num_query_heads
        self.stored_heads = num_query_heads if method.gqa_layout == "query_head" else num_kv_heads
        self.pad_lens: Optional[list[int]] = None
        self.prompt_len = 0  # padded prompt length
        self.layers: list[Optional[LayerStore]] = [None] * num_layers
        self.prompt: Optional[PromptCompressor] = None
        self.peak_prefill_kv_bytes = 0   # most K/V bytes held at once during prefill (stored + waiting layers)
        self.prefill_density: list[Optional[list[float]]] = [None] * num_layers  # sparse prefill: per prompt the
        # fraction of its causal attention entries computed at each layer (None: dense)
        quantizer = method.quant_method
        if quantizer is not None and quantizer.keys_before_rope and rotation is None:
            raise ValueError(f"{quantizer.name} stores keys before RoPE: the cache needs the model's key rotation")
        self.rotary = rotation
        self.scratch = None if quantizer is None else Scratch()  # dequantization buffers shared by the layers
        self.store_class = STORES[store_kind(method)]
        missing = [a for a in store_abilities(method) if a not in self.store_class.abilities]
        if missing:  # make_method refuses these; an object driving the engine directly is checked here
            raise ValueError(f"{method.name}: the {store_kind(method)} store lacks the abilities {missing} it needs")
        if store_kind(method) == "paired" and (self.form.sliding or self.form.capped):  # check_model refuses it
            raise ValueError(f"{method.name}: the paired store holds no sliding-window layer and applies no soft-cap")
        # A sliding layer's store drops what leaves the window: one that cannot is replaced by full precision.
        self.sliding_class = self.store_class if "reselect" in self.store_class.abilities else FullPrecisionStore
        self.decoding = decoder_for(method, self.layers, self.model_shape, self.stored_heads, rotation)
        self.setup: Optional[StoreSetup] = None
        self.stopped_bytes: dict[int, int] = {}   # per prompt that stopped early, its bytes then (record_stop)
        self.reconstruction: Optional[Reconstruction] = None   # a reconstructing method's repeat passes (KVzip)
        self.chunked = None   # a chunked prefill's state while it runs (core/chunked.py ChunkedPrefill)

    @property
    def form(self) -> AttentionForm:
        """The model's attention form (its shape's): scale, soft-cap, the sliding window of each layer."""
        return self.model_shape.form

    # ---- transformers Cache API -------------------------------------------------------------
    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        store = self.layers[layer_idx or 0]
        return 0 if store is None else self.prompt_len + store.appended

    def get_max_length(self) -> Optional[int]:
        return None

    def update(self, *args, **kwargs):
        raise RuntimeError("CompressedCache is driven by pyramidkv's patched attention; "
                           "patch the model with pyramidkv.compress(model, method) before using it")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("beam search is not supported with a compressed cache")

    # ---- the two entry points ---------------------------------------------------------------
    def set_padding(self, attention_mask: Optional[torch.Tensor], batch_size: int, seq_len: int) -> None:
        """Record the left padding of the prompt batch (called once, before prefill)."""
        self.pad_lens = left_padding_lengths(attention_mask, batch_size, seq_len)

    def is_prefilled(self, layer_idx: int) -> bool:
        return self.layers[layer_idx] is not None

    def needs_column_sums(self, bsz: int, n: int) -> bool:
        """True: the prefill attention over a [bsz, n] prompt batch should also return its column sums
        (the method scores a compressed prompt by them, or decoding starts accumulating from them)."""
        if self.method.accumulates_attention and self.decoding is not None:
            return True
        return self._compressor(bsz, n).needs_column_sums()

    def _compressor(self, bsz: int, n: int) -> PromptCompressor:
        if self.pad_lens is None:
            self.pad_lens = [0] * bsz
        if self.prompt is None:
            pipeline = PromptCompressor if self.reconstruction is None else ReconstructingCompressor
            self.prompt = pipeline(self.method, self.model_shape, self.pad_lens, n, self.rotary)
        return self.prompt

    @torch.no_grad()
    def prefill(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, pattern=None,
                column_sums: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None) -> None:
        """The prompt's queries [B, Hq, n, D], keys and values [B, Hkv, n, D] (after RoPE; position_ids
        [B or 1, n] their RoPE positions), once the model's own attention over them has run; pattern: the
        sparse prefill pattern that attention followed (None: dense), which the scorers' statistics follow;
        column_sums: [B, Hq, n], that attention's column sums where `needs_column_sums` asked for them; hidden:
        [B, n, E] the layer's attention input, for methods that score by it (ScoreContext.hidden)."""
        bsz, _, n, _ = keys.shape
        self.prompt_len = n
        scored = self._compressor(bsz, n).score(layer_idx, queries, keys, values, pattern, column_sums, position_ids,
                                                hidden)
        if self.decoding is not None:
            self.decoding.observe_prefill(layer_idx, queries, keys, scored.raw_scores, self.pad_lens, pattern,
                                          column_sums)
        if self.setup is None:
            self.setup = StoreSetup(self.prompt.real_lens, self.pad_lens, position_ids, self.method, self.num_layers,
                                    self.rotary, self.scratch, self.form)
        self._store(self.prompt.keep(layer_idx, scored))

    def _store(self, ready: dict) -> None:
        """Build the stores of the layers whose kept tokens are known (layer -> per prompt its KeptKV)."""
        sliding = {layer: kv for layer, kv in ready.items() if self.form.window(layer) is not None}
        built = self.store_class.build({layer: kv for layer, kv in ready.items() if layer not in sliding}, self.setup)
        built.update(self.sliding_class.build(sliding, self.setup) if sliding else {})
        for layer, store in built.items():
            self.layers[layer] = store
        held = self.kv_bytes() + self.prompt.waiting_bytes()
        self.peak_prefill_kv_bytes = max(self.peak_prefill_kv_bytes, held, self.prompt.peak_waiting_bytes)
        if self.decoding is not None:
            for layer in ready:
                self.decoding.after_prefill(layer)

    @torch.no_grad()
    def decode_step(self, layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    position_ids: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """New tokens' queries [B, Hq, q, D], keys and values [B, Hkv, q, D] after RoPE (hidden [B, q, E]: their
        attention input, for scorers that read it): append them and return the attention output [B, Hq, q, D]
        over everything the layer holds. Several new tokens (a question, a follow-up turn) go in pieces, each as
        long as no unit decides inside it (`_piece`), so every unit decides as if they came one per step."""
        outs, done, q_len = [], 0, keys.shape[2]
        while done < q_len:
            cut = slice(done, done + self._piece(layer_idx, q_len - done))
            outs.append(self._step(layer_idx, queries[:, :, cut], keys[:, :, cut], values[:, :, cut],
                                   None if position_ids is None else position_ids[:, cut],
                                   None if hidden is None else hidden[:, cut]))
            done = cut.stop
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _piece(self, layer_idx: int, left: int) -> int:
        """How many of the `left` new tokens the next piece takes: all, unless a decision falls between two of them
        (a sliding window moves every token; a decode budget fires: `decoding.piece`) or the store attends one new
        token at a time (`multi_token` False: quantized windows), at most the store's `max_piece`."""
        store = self.layers[layer_idx]
        if left == 1 or self.form.window(layer_idx) is not None or not store.multi_token:
            return 1
        left = min(left, store.max_piece or left)
        return left if self.decoding is None else max(1, min(left, self.decoding.piece(layer_idx)))

    def _step(self, layer_idx: int, queries, keys, values, position_ids, hidden) -> torch.Tensor:
        """One piece of new tokens: appended, attended (causal among themselves), then the decoder's hooks."""
        store = self.layers[layer_idx]
        new = keys, values   # the KV heads' (a threshold decoder scores them)
        if self.stored_heads != keys.shape[1]:
            group = self.stored_heads // keys.shape[1]
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        bsz = keys.shape[0]
        if position_ids is None:   # the last new token's: after the prompt and every token appended before
            rope = torch.full((bsz,), self.get_seq_length(layer_idx) + keys.shape[2] - 1, device=keys.device)
        else:
            rope = position_ids[:, -1].expand(bsz).long()
        if self.form.window(layer_idx) is not None:
            self._slide(layer_idx)
        store.append(keys, values, rope)
        out = store.attend(queries)
        if self.decoding is not None:
            self.decoding.after_attend(layer_idx, queries, *new, hidden, rope)
        return out

    def _slide(self, layer_idx: int) -> None:
        """A sliding layer before a new token is appended: drop the held tokens its window does not cover
        (positions below new - W + 1, per prompt), so that it holds at most W with the new token."""
        store, window = self.layers[layer_idx], self.form.window(layer_idx)
        first = [real + store.appended - window + 1 for real in self.prompt.real_lens]   # new - W + 1
        if all(min((int(p[0]) for p in store.held_positions(b) if p.numel()), default=f) >= f
               for b, f in enumerate(first)):
            return
        if self.decoding is not None:
            self.decoding.drop_before(layer_idx, first)
        else:
            store.drop_before(first)

    # ---- inspection ---------------------------------------------------------------------------
    def kept_counts(self, layer_idx: int) -> list[list[int]]:
        """Kept tokens per prompt and stored head at one layer (prompt tokens, and after decode-time
        re-selections the generated tokens they kept)."""
        return self.layers[layer_idx].kept_counts()

    def kept_positions(self, layer_idx: int, batch_idx: int = 0) -> list[torch.Tensor]:
        """Kept positions (0 = first real token) per stored head."""
        return self.layers[layer_idx].kept_positions(batch_idx)

    def kept_kv(self, layer_idx: int, batch_idx: int = 0) -> Heads:
        """Per stored head, (positions [k], keys [k, D], values [k, D]) of the kept tokens, as stored (keys
        after RoPE; dequantized where quantized). Full precision: views of the cache, clone before modifying."""
        return self.layers[layer_idx].kept_kv(batch_idx)

    def held_counts(self, layer_idx: int) -> list[list[int]]:
        """Tokens held per prompt and stored head at one layer (kept + appended since)."""
        return self.layers[layer_idx].held_counts()

    def held_positions(self, layer_idx: int, batch_idx: int = 0) -> list[torch.Tensor]:
        """Positions (0 = first real prompt token) of every token held per stored head, ascending."""
        return self.layers[layer_idx].held_positions(batch_idx)

    def stored_kv(self, layer_idx: int, batch_idx: int = 0) -> Heads:
        """Per stored head, (positions [n], keys [n, D], values [n, D]) of every token it holds, in time
        order (dequantized, keys after RoPE; a quantized store gives RoPE positions)."""
        return self.layers[layer_idx].stored_kv(batch_idx)

    def kv_bytes_breakdown(self, batch_idx: Optional[int] = None) -> dict[str, int]:
        """Stored bytes by part now, all layers (full-precision rows are "residual"; quantized storage adds codes,
        scales, zeros, codebook, outliers, factors, positions); of one prompt when batch_idx is given."""
        totals: dict[str, int] = {}
        for store in self.layers:
            if store is not None:
                for part, size in store.bytes_by_part(batch_idx).items():
                    totals[part] = totals.get(part, 0) + size
        return totals

    def kv_bytes(self, batch_idx: Optional[int] = None) -> int:
        """Bytes of stored keys and values now (see kv_bytes_breakdown)."""
        return sum(self.kv_bytes_breakdown(batch_idx).values())

    def record_stop(self, batch_idx: int) -> None:
        """A prompt of the batch stopped generating: keep its bytes as they are now (the batch decodes on)."""
        self.stopped_bytes.setdefault(batch_idx, self.kv_bytes(batch_idx))

    def final_kv_bytes(self, batch_idx: int) -> int:
        """A prompt's bytes when it stopped (record_stop), else now."""
        return self.stopped_bytes.get(batch_idx, self.kv_bytes(batch_idx))

    def decode_read_bytes(self, batch_idx: Optional[int] = None) -> int:
        """K/V bytes the last decode step's attention read, all layers, of all prompts or one: everything
        held, except where Quest read only its chosen pages (their K/V plus the page metadata)."""
        return sum(store.read_bytes(batch_idx) for store in self.layers if store is not None)

    def tail_capacity_bytes(self) -> int:
        """Bytes allocated for appended tokens, all layers, including unused capacity (kv_bytes counts only
        what is stored)."""
        return sum(store.capacity_bytes() for store in self.layers if store is not None)

    def layer_budgets_used(self, batch_idx: int = 0) -> list[int]:
        """The per-layer token budget the method gave this prompt (the prompt length where it was kept whole)."""
        if self.prompt is None or self.prompt.layer_budgets is None:
            raise RuntimeError("nothing has been compressed yet: run the prompt through the patched model first")
        return list(self.prompt.layer_budgets[batch_idx])
