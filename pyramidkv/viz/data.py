"""The data behind the figures: attention weights, kept positions, scores and budgets of one prompt.

Everything is read from the model's own eager attention and from the compressed cache's public
inspection API (`kept_positions`, `kept_counts`, `layer_budgets_used`); nothing reads private fields.

Heads: attention maps are per QUERY head (the model's attention); kept maps, score curves and
budget maps are per STORED head of the cache (the KV heads in the default `kv_head` layout, the
query heads in `query_head`). Positions count from the first prompt token (0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from pyramidkv.core.context import ScoreContext
from pyramidkv.core.scoring import scores_per_stored_head
from pyramidkv.methods.base import Method
from pyramidkv.models.glue import decoder
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.models.capture import capturing_qkv
from pyramidkv.models.patch import compress


# ---- prompts and spans -----------------------------------------------------------------------------
@dataclass
class Prompt:
    """A tokenised prompt: ids, one display string per token, character offsets per token."""

    text: str
    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.ids)

    def span_of(self, needle: str) -> list[int]:
        """Token positions overlapping any occurrence of `needle` in the prompt text (all occurrences)."""
        if not needle:
            raise ValueError("the highlighted text is empty")
        positions: set[int] = set()
        start = self.text.find(needle)
        if start < 0:
            raise ValueError(f"highlight {needle!r} does not occur in the prompt")
        while start >= 0:
            stop = start + len(needle)
            positions.update(i for i, (a, b) in enumerate(self.offsets) if a < stop and b > start)
            start = self.text.find(needle, start + 1)
        return sorted(positions)


def tokenize(tokenizer, prompt: str | Sequence[int]) -> Prompt:
    """Tokenise like `pyramidkv.generation.generate` (no special tokens added); token-id lists are taken as is."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give a non-empty string or token-id list")
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc.input_ids), [tuple(o) for o in enc.offset_mapping]
        text = prompt
    else:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: give a non-empty string or token-id list")
        pieces = [tokenizer.decode([t]) for t in ids]
        text, offsets, pos = "", [], 0
        for piece in pieces:
            offsets.append((pos, pos + len(piece)))
            text += piece
            pos += len(piece)
    if not ids:
        raise ValueError(f"prompt {prompt!r} gives no tokens")
    tokens = [tokenizer.decode([t]) for t in ids]
    return Prompt(text, ids, tokens, offsets)


def highlight_positions(prompt: Prompt, highlight: Optional[str | Sequence[int]]) -> list[int]:
    """Positions to highlight: the tokens of a text (every occurrence) or explicit positions."""
    if highlight is None:
        return []
    if isinstance(highlight, str):
        return prompt.span_of(highlight)
    positions = sorted({int(p) for p in highlight})
    bad = [p for p in positions if not 0 <= p < len(prompt)]
    if bad:
        raise ValueError(f"highlight positions {bad} are outside the prompt (0..{len(prompt) - 1})")
    return positions


# ---- methods ---------------------------------------------------------------------------------------
def allocation_variants(name: str, **settings) -> dict[str, Method]:
    """The method `name` under every budget allocation: one entry per (layer allocation, head
    allocation) of `pyramidkv.allocation`'s registries that can be combined (a head allocation that
    spans all layers, HeadKV, only with uniform layers; threshold, which takes no budget, left out). Labels name the
    allocation."""
    from pyramidkv.allocation import HEAD_ALLOCATIONS, LAYER_ALLOCATIONS
    from pyramidkv.methods import make_method

    return {f"{name} layer={layer} head={head}": make_method(name, layer_allocation=layer, head_allocation=head,
                                                             **settings)
            for layer in LAYER_ALLOCATIONS for head, head_cls in HEAD_ALLOCATIONS.items()
            if layer == "uniform" or not head_cls.global_over_layers}


# ---- model helpers ---------------------------------------------------------------------------------
def num_layers(model) -> int:
    return model.config.num_hidden_layers


def decoder_layers(model):
    """The model's decoder layers (`model.model.layers` for Llama/Mistral causal LMs)."""
    return decoder(model).layers


class _LayerDone(Exception):
    """Raised by a hook once the layer it waits for has run: the layers above it are not needed."""


def check_index(kind: str, index: int, count: int) -> int:
    """`index` must be an int in 0..count-1 (negative counts from the end); the error names both."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"{kind} index must be an integer, got {index!r}")
    if not -count <= index < count:
        raise IndexError(f"{kind} {index} is out of range: the model has {count} {kind}s (0..{count - 1})")
    return int(index) % count


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _input_ids(model, prompt: Prompt) -> torch.Tensor:
    return torch.tensor([prompt.ids], dtype=torch.long, device=_device(model))


# ---- attention weights ------------------------------------------------------------------------------
@torch.no_grad()
def attention_weights(model, prompt: Prompt, layer: int) -> np.ndarray:
    """[Hq, n, n] eager attention probabilities of one layer over the prompt (float32, rows = queries).

    Only that layer's weights are kept (hooks ask its attention module for them), so memory is
    Hq x n x n, not layers x Hq x n x n. The model must be loaded with attn_implementation="eager".
    """
    implementation = model.config._attn_implementation
    if implementation != "eager":
        raise ValueError(f"attention maps need the eager attention weights; the model uses {implementation!r}: "
                         f"load it with load_model(..., attn_implementation='eager')")
    layer = check_index("layer", layer, num_layers(model))
    if getattr(model, "_pyramidkv_patch", None) is not None:
        raise RuntimeError("the model is patched by pyramidkv.compress: take attention maps outside the `with` block")
    attention = decoder_layers(model)[layer].self_attn
    captured = {}

    def ask_for_weights(module, args, kwargs):
        kwargs["output_attentions"] = True
        return args, kwargs

    def keep_weights(module, args, output):
        captured["weights"] = output[1]
        raise _LayerDone

    handles = [attention.register_forward_pre_hook(ask_for_weights, with_kwargs=True),
               attention.register_forward_hook(keep_weights)]
    try:   # the decoder up to this layer: the layers above it and the LM head would compute what is never read
        decoder(model)(_input_ids(model, prompt), use_cache=False)
    except _LayerDone:
        pass
    finally:
        for h in handles:
            h.remove()
    return captured["weights"][0].float().cpu().numpy()


# ---- compressed prefill -----------------------------------------------------------------------------
@dataclass
class Prefill:
    """What a method kept for one prompt, read through the cache's public inspection API.

    kept: kept[layer][head] = ascending kept positions. counts: [layers, heads] kept counts.
    layer_budgets: the per-layer budget the method gave this prompt.
    qkv: layer -> (queries, keys, values) captured at prefill, for the layers asked for.
    """

    method: Method
    prompt: Prompt
    kept: list[list[np.ndarray]]
    counts: np.ndarray
    layer_budgets: list[int]
    qkv: dict = field(default_factory=dict, repr=False)

    @property
    def num_heads(self) -> int:
        return self.counts.shape[1]

    def kept_mask(self) -> np.ndarray:
        """[layers, heads, n] bool: True where the position is kept."""
        mask = np.zeros((len(self.kept), self.num_heads, len(self.prompt)), dtype=bool)
        for layer, heads in enumerate(self.kept):
            for head, positions in enumerate(heads):
                mask[layer, head, positions] = True
        return mask


@torch.no_grad()
def prefill(model, prompt: Prompt, method: Method, capture_layers: Sequence[int] = ()) -> Prefill:
    """Run the prompt through the model patched with `method` and read back what the cache kept.

    capture_layers: layers whose post-RoPE queries/keys/values are recorded (for scoring), as the layer's
    attention received them on either transformers line (models/capture.py `capturing_qkv`).
    """
    if not isinstance(method, Method):
        raise TypeError(f"method must be a pyramidkv Method (see pyramidkv.make_method), got {type(method).__name__}")
    layers = [check_index("layer", layer, num_layers(model)) for layer in capture_layers]
    captured: dict = {}
    with compress(model, method) as patch, capturing_qkv(model, layers, captured):
        cache = patch.new_cache()
        # the decoder alone: the LM head's logits over the prompt are not read here
        decoder(model)(_input_ids(model, prompt), use_cache=True, **{CACHE_ARGUMENT: cache})
    kept = [[p.cpu().numpy() for p in cache.kept_positions(layer, 0)] for layer in range(num_layers(model))]
    counts = np.array([cache.kept_counts(layer)[0] for layer in range(num_layers(model))], dtype=np.int64)
    return Prefill(method, prompt, kept, counts, cache.layer_budgets_used(0), captured)


# ---- scores -----------------------------------------------------------------------------------------
@dataclass
class ScoreCurve:
    """One head's per-position scores at one layer and where the method cut.

    scores: [n] (higher = keep; window positions carry whatever the method gives them).
    kept: kept positions (from the cache). window_start: first position of the forced window.
    cutoff: the lowest score among the kept candidates before the window (None when nothing was cut).
    """

    method: str
    layer: int
    head: int
    scores: np.ndarray
    kept: np.ndarray
    window_start: int
    cutoff: Optional[float]
    budget: int


def score_curve(model, prompt: Prompt, method: Method, layer: int, head: int) -> ScoreCurve:
    """The method's score for every prompt position of one stored head, with the cache's kept set."""
    if not method.sizing.evicts:
        raise ValueError(f"{method.name} keeps every token and has no scores; pick a compressing method")
    layer = check_index("layer", layer, num_layers(model))
    run = prefill(model, prompt, method, capture_layers=[layer])
    head = check_index("head", head, run.num_heads)
    queries, keys, values = run.qkv[layer]
    real = torch.ones(1, len(prompt), dtype=torch.bool, device=keys.device)
    raw = method.score(ScoreContext(layer, num_layers(model), queries, keys, values, real))
    scores = scores_per_stored_head(raw, method, model.config.num_key_value_heads, model.config.num_attention_heads)
    curve = scores[0, head].float().cpu().numpy()
    kept = run.kept[layer][head]
    n = len(prompt)
    window_start = n - min(method.window_size, n)
    candidates = kept[kept < window_start]
    cut = len(kept) < n
    cutoff = float(curve[candidates].min()) if cut and len(candidates) else None
    return ScoreCurve(method.name, layer, head, curve, kept, window_start, cutoff, run.layer_budgets[layer])
