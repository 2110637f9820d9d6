"""Explicit, reversible patching of a loaded model.

    with pyramidkv.compress(model, make_method("snapkv", budget=128)):
        model.generate(...)

Only the given model instance is changed (its attention modules get an
instance-level forward); leaving the block restores it. Every forward that
starts from an empty cache gets a fresh `CompressedCache`, so nothing carries
over from one `generate()` call to the next.
"""

from __future__ import annotations

import functools
import logging
import types

from transformers.cache_utils import Cache

from pyramidkv.allocation.base import ModelShape
from pyramidkv.core.cache import CompressedCache
from pyramidkv.methods.base import Method
from pyramidkv.models import llama, mistral
from pyramidkv.models.attention import compressed_attention_forward

logger = logging.getLogger(__name__)

MODEL_GLUE = {"llama": llama, "mistral": mistral}
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")


def _decoder(model):
    decoder = getattr(model, "model", model)
    if not hasattr(decoder, "layers"):
        raise TypeError(f"{type(model).__name__} has no decoder layers to patch")
    return decoder


def check_method_for_model(method: Method, config) -> None:
    """What a method needs from a model, checked on its config alone (no weights): the runners call it before
    loading the model, `compress` again. One-line ValueError naming the setting: a HeadKV table or a sparse
    prefill pattern table of another shape, a quantizer group that does not divide the head dim, a MiniCache
    start layer with no pair above it, Quest dense layers covering the whole model."""
    layers = config.num_hidden_layers
    shape = ModelShape(layers, config.num_attention_heads, config.num_key_value_heads,
                       getattr(config, "_name_or_path", "") or "")
    check_allocation = getattr(method.head_allocation, "check_model", None)
    if check_allocation is not None:  # e.g. HeadKV's table: missing or misshapen fails here, not mid-run
        check_allocation(shape)
    if method.quant_method is not None:  # e.g. a group size that does not divide the head dim fails here
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        method.quant_method.check_head_dim(head_dim)
    if method.cross_layer_merge and method.cross_layer_start is not None and method.cross_layer_start >= layers - 1:
        raise ValueError(f"cross_layer_start {method.cross_layer_start} leaves no layer pair to merge in this "
                         f"{layers}-layer model (layers 0..{layers - 1}); use at most {layers - 2}")
    if method.selects_pages and method.page_dense_layers >= layers:
        raise ValueError(f"page_dense_layers {method.page_dense_layers} leaves no layer of this {layers}-layer "
                         f"model to Quest; use at most {layers - 1}")
    if method.prefill_attention is not None:  # e.g. a pattern table of another model
        method.prefill_attention.check_model(layers, config.num_attention_heads, shape.name)


class CompressionPatch:
    """Patches a model to use a compressed cache with `method`; `remove()` (or leaving the `with`) undoes it."""

    def __init__(self, model, method: Method):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in MODEL_GLUE:
            raise ValueError(f"unsupported model type {model_type!r}; supported: {', '.join(MODEL_GLUE)}")
        implementation = model.config._attn_implementation
        if implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"unsupported attn_implementation {implementation!r}; "
                             f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if not isinstance(method, Method):
            raise TypeError(f"method must be a pyramidkv Method (see pyramidkv.make_method), got {type(method).__name__}")
        if getattr(model, "_pyramidkv_patch", None) is not None:
            raise RuntimeError("this model is already patched by pyramidkv; remove that patch first")
        sliding = getattr(model.config, "sliding_window", None)
        if model_type == "mistral" and sliding is not None:
            logger.warning("config.sliding_window=%s is not applied to the compressed cache during decoding", sliding)
        check_method_for_model(method, model.config)
        self.model = model
        self.method = method
        self.glue = MODEL_GLUE[model_type]
        self.implementation = implementation
        self._modules = []
        self._hook = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def apply(self) -> "CompressionPatch":
        forward = functools.partial(compressed_attention_forward, apply_rotary=self.glue.apply_rotary_pos_emb,
                                    implementation=self.implementation)
        for layer in _decoder(self.model).layers:
            attention = layer.self_attn
            if not isinstance(attention, self.glue.ATTENTION_CLASSES):
                raise TypeError(f"unexpected attention class {type(attention).__name__}")
            attention.forward = types.MethodType(forward, attention)
            self._modules.append(attention)
        self._hook = _decoder(self.model).register_forward_pre_hook(self._provide_cache, with_kwargs=True)
        self.model._pyramidkv_patch = self
        return self

    def remove(self) -> None:
        for attention in self._modules:
            del attention.forward  # back to the class's forward
        self._modules = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.model._pyramidkv_patch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    # ---- cache provisioning -------------------------------------------------------------------
    def new_cache(self) -> CompressedCache:
        config = self.model.config
        rotary = _decoder(self.model).layers[0].self_attn.rotary_emb if self.method.quant_method is not None else None
        return CompressedCache(self.method, config.num_hidden_layers, config.num_key_value_heads,
                               config.num_attention_heads, model_name=getattr(config, "_name_or_path", "") or "",
                               rotary_emb=rotary)

    def _provide_cache(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        bsz, seq_len = inputs.shape[:2]
        if isinstance(cache, CompressedCache):
            if cache.pad_lens is None:
                cache.set_padding(kwargs.get("attention_mask"), bsz, seq_len)
            return None
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = self.model.config.use_cache
        if not use_cache:
            return None
        empty = cache is None or (isinstance(cache, Cache) and cache.get_seq_length() == 0) or cache == ()
        if not empty:
            raise ValueError(f"a model patched by pyramidkv cannot continue from a prefilled {type(cache).__name__}; "
                             "start from an empty cache (or pass a pyramidkv CompressedCache)")
        cache = self.new_cache()
        cache.set_padding(kwargs.get("attention_mask"), bsz, seq_len)
        kwargs["past_key_values"] = cache
        return args, kwargs


def compress(model, method: Method) -> CompressionPatch:
    """Patch `model` to compress its KV cache with `method`. Use as a context manager or call `.remove()`."""
    return CompressionPatch(model, method).apply()
