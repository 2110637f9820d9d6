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
import warnings
from typing import Optional

import torch
from transformers.cache_utils import Cache

from pyramidkv.components import AttentionForm, ModelShape
from pyramidkv.core.cache import CompressedCache
from pyramidkv.methods.base import Method
from pyramidkv.models import gemma2, llama, mistral, mixtral, phi3, qwen2, repeat
from pyramidkv.models.attention import compressed_attention_forward
from pyramidkv.models.glue import ModelGlue, decoder
from pyramidkv.models.line import INTERFACE_LINE
from pyramidkv.models.tf5 import families as tf5_families, hooks as tf5_hooks
from pyramidkv.models.tf5.cache import InterfaceCache
from pyramidkv.models.tf5.form import config_form

logger = logging.getLogger(__name__)

# The supported architectures by config.model_type: loading, patching, the command line's --model_class and
# the model tests read this, nothing else lists them. A family is a glue file (models/<arch>.py: a ModelGlue,
# models/glue.py) and a row here.
MODEL_GLUE: dict[str, ModelGlue] = {
    "llama": llama.GLUE,
    "mistral": mistral.GLUE,
    "qwen2": qwen2.GLUE,
    "phi3": phi3.GLUE,
    "mixtral": mixtral.GLUE,
    "gemma2": gemma2.GLUE,
}
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")


def family_implementations(glue: ModelGlue) -> tuple[str, ...]:
    """The attention implementations the family's transformers class has (eager always; sdpa and
    flash_attention_2 where it declares them: Phi-3 has no sdpa in 4.44.2)."""
    model = glue.causal_lm
    has = {"eager": True, "sdpa": model._supports_sdpa, "flash_attention_2": model._supports_flash_attn_2}
    return tuple(name for name in ATTENTION_IMPLEMENTATIONS if has[name])


def check_family_implementation(model_type: str, implementation: str) -> None:
    """Refuse an attention implementation the family's class lacks, with one line naming those it has."""
    glue = MODEL_GLUE[model_type]
    offered = family_implementations(glue)
    if implementation not in offered:
        named = [f"{name} (on CUDA)" if name == "flash_attention_2" else name for name in offered]
        raise ValueError(f"{glue.causal_lm.__name__} has no {implementation} attention in transformers 4.44.2; "
                         f"use attn_implementation {' or '.join(named)}")


def _check_appended(cache: CompressedCache, mask: Optional[torch.Tensor], seq_len: int) -> None:
    """New tokens for a prefilled cache: at least one, none of them padding (padding is never stored)."""
    if seq_len == 0:
        raise ValueError(f"this CompressedCache already holds a prompt ({cache.get_seq_length()} tokens) and the input "
                         f"adds no token after them: a compressed cache serves one generate() call (and its "
                         f"continuations); pass a new one (patch.new_cache()) or none (compress() gives every "
                         f"generate() its own)")
    if mask is not None and mask.dim() == 2 and not bool(mask[:, -seq_len:].bool().all()):
        raise ValueError(f"the {seq_len} new tokens for a prefilled CompressedCache hold padding (attention_mask 0 in "
                         f"its last {seq_len} columns): only the prompt may be padded, on the left; append tokens "
                         f"every row has")

class UncompressedWarning(UserWarning):
    """A forward inside compress() that runs without a cache, so nothing is compressed."""


class CompressionPatch:
    """Patches a model to use a compressed cache with `method`; `remove()` (or leaving the `with`) undoes it.
    On the 5.x transformers line the patch is pyramidkv's registered attention function and a pre-hook per
    attention module (models/tf5/), not a forward per module."""

    def __init__(self, model, method: Method):
        if INTERFACE_LINE:
            self._check_interface(model, method)
            return
        model_type = getattr(model.config, "model_type", None)
        if model_type not in MODEL_GLUE:
            raise ValueError(f"unsupported model type {model_type!r}; supported: {', '.join(MODEL_GLUE)}")
        implementation = model.config._attn_implementation
        if implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"unsupported attn_implementation {implementation!r}; "
                             f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        check_family_implementation(model_type, implementation)
        if not isinstance(method, Method):
            raise TypeError(f"method must be a pyramidkv Method (see pyramidkv.make_method), got {type(method).__name__}")
        if getattr(model, "_pyramidkv_patch", None) is not None:
            raise RuntimeError("this model is already patched by pyramidkv; remove that patch first")
        glue = MODEL_GLUE[model_type]
        for name in glue.unapplied_settings:
            value = getattr(model.config, name, None)
            if value is not None:
                logger.warning("config.%s=%s is not applied to the compressed cache during decoding", name, value)
        # e.g. HeadKV's table, a quantizer's group size or bytes, l2norm's skipped layers: fail here, not mid-run
        self.shape = model_shape(model.config, next(model.parameters()).dtype.itemsize, implementation)
        method.check_model(self.shape)
        check_shared_layers(model, method)
        self.model = model
        self.method = method
        self.glue = glue
        self.implementation = implementation
        self._modules = []
        self._hook = self._repeat_hook = self._layer_repeats = None
        self._cache_implementation = None
        self._undo_interface = None

    def _check_interface(self, model, method: Method) -> None:
        """The 5.x line's checks: the family's row (models/tf5/families.py), the implementation, the form."""
        if not isinstance(method, Method):
            raise TypeError(f"method must be a pyramidkv Method (see pyramidkv.make_method), got {type(method).__name__}")
        if getattr(model, "_pyramidkv_patch", None) is not None:
            raise RuntimeError("this model is already patched by pyramidkv; remove that patch first")
        self.implementation, form = tf5_hooks.check_model(model)
        self.shape = model_shape(model.config, next(model.parameters()).dtype.itemsize, self.implementation, form)
        method.check_model(self.shape)
        check_shared_layers(model, method)
        self.model, self.method, self.glue = model, method, None
        self._modules, self._hook, self._repeat_hook, self._cache_implementation = [], None, None, None
        self._layer_repeats = None
        self._undo_interface = None
        if method.needs_rotation or getattr(method.quant_method, "keys_before_rope", False):
            tf5_families.key_rotation(model, method.name)   # refused here, not at the first forward

    # ---- lifecycle ----------------------------------------------------------------------------
    def apply(self) -> "CompressionPatch":
        if INTERFACE_LINE:
            self._undo_interface = tf5_hooks.install(self.model, self.implementation, self.method.needs_hidden)
        forward = functools.partial(compressed_attention_forward, project_qkv=self.glue.project_qkv,
                                    implementation=self.implementation) if self.glue is not None else None
        for layer in decoder(self.model).layers if forward is not None else ():
            attention = layer.self_attn
            if not isinstance(attention, self.glue.attention_classes):
                raise TypeError(f"unexpected attention class {type(attention).__name__}")
            # accelerate's hook on a module mapped alone wraps its forward and calls `_old_forward`: patch that
            patched = "_old_forward" if hasattr(attention, "_hf_hook") else "forward"
            self._modules.append((attention, patched, attention.__dict__.get(patched)))
            setattr(attention, patched, types.MethodType(forward, attention))
        self._hook = decoder(self.model).register_forward_pre_hook(self._provide_cache, with_kwargs=True)
        if self.method.reconstructs and repeat.layer_major(self.model):   # models/repeat.py: the two orders
            self._layer_repeats = repeat.LayerMajorRepeats(self.model)
        elif self.method.reconstructs:
            self._repeat_hook = decoder(self.model).register_forward_hook(self._reconstruct, with_kwargs=True)
        # generate() would allocate the cache its config names (Gemma2's "hybrid": every layer at full length)
        # only for the patch to replace it: while patched it starts from an empty DynamicCache instead.
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and getattr(generation, "cache_implementation", None) is not None:
            self._cache_implementation = generation.cache_implementation
            generation.cache_implementation = None
        self.model._pyramidkv_patch = self
        return self

    def remove(self) -> None:
        if self._undo_interface is not None:
            self._undo_interface()
            self._undo_interface = None
        for attention, patched, before in self._modules:
            if before is None:
                delattr(attention, patched)  # back to the class's forward
            else:
                setattr(attention, patched, before)
        self._modules = []
        for hook in (self._hook, self._repeat_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._repeat_hook = None
        if self._layer_repeats is not None:
            self._layer_repeats.remove()
            self._layer_repeats = None
        if self._cache_implementation is not None:
            self.model.generation_config.cache_implementation = self._cache_implementation
            self._cache_implementation = None
        self.model._pyramidkv_patch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def _reconstruct(self, module, args, kwargs, output):
        """After the decoder's forward: where it was a reconstructing method's prefill, run its repeat passes."""
        cache = tf5_hooks.given_cache(kwargs)[1]
        if not isinstance(cache, CompressedCache) or cache.prompt is None or len(cache.prompt.waiting) == 0:
            return None
        if cache.reconstruction is None:
            raise ValueError(f"{self.method.name} scores by making the model repeat each prompt's context: the cache "
                             f"needs the repeat inputs, which pyramidkv.generate builds with the tokenizer (or pass "
                             f"patch.new_cache(prompt_token_lists, tokenizer) to model.generate)")
        if cache.reconstruction.current is None:
            repeat.run_repeats(module, cache)
        return None

    # ---- cache provisioning -------------------------------------------------------------------
    def new_cache(self, prompts=None, tokenizer=None) -> CompressedCache:
        """An empty cache for one generate(); prompts (token-id lists) and their tokenizer: what a reconstructing
        method (KVzip) repeats."""
        needed = self.method.quant_method is not None or self.method.needs_rotation
        if INTERFACE_LINE:
            has = tf5_families.family(self.model.config.model_type).rotation is not None   # else not needed: checked
            rotation = tf5_families.key_rotation(self.model, self.method.name) if needed and has else None
            cache = InterfaceCache(self.method, self.shape, rotation=rotation)
        else:
            rotation = self.glue.key_rotation(self.model) if needed else None
            cache = CompressedCache(self.method, self.shape, rotation=rotation)
        if self.method.reconstructs and prompts is not None:
            cache.reconstruction = self.method.reconstruction(prompts, tokenizer)
        return cache

    def _provide_cache(self, module, args, kwargs):
        argument, cache = tf5_hooks.given_cache(kwargs) if INTERFACE_LINE else ("past_key_values",
                                                                                 kwargs.get("past_key_values"))
        inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        bsz, seq_len = inputs.shape[:2]
        if isinstance(cache, CompressedCache):
            if cache.pad_lens is None:
                cache.set_padding(kwargs.get("attention_mask"), bsz, seq_len)
            elif cache.get_seq_length() > 0:   # new tokens after what it holds, any number in one forward
                _check_appended(cache, kwargs.get("attention_mask"), seq_len)
            return None
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = self.model.config.use_cache
        if not use_cache:
            warnings.warn("use_cache=False inside compress(): the model runs its own attention with no cache, so "
                          f"nothing is compressed by {self.method.name}; leave use_cache on to compress",
                          UncompressedWarning, stacklevel=2)
            return None
        empty = cache is None or (isinstance(cache, Cache) and cache.get_seq_length() == 0) or cache == ()
        if not empty:
            raise ValueError(f"a model patched by pyramidkv cannot continue from a prefilled {type(cache).__name__}; "
                             "start from an empty cache (or pass a pyramidkv CompressedCache)")
        cache = self.new_cache()
        cache.set_padding(kwargs.get("attention_mask"), bsz, seq_len)
        kwargs[argument] = cache
        return args, kwargs


def model_shape(config, dtype_bytes: int = 0, implementation: Optional[str] = None,
                form: Optional[AttentionForm] = None) -> ModelShape:
    """What a method's checks need to know of a model, from its config (and the bytes of its dtype, and the
    attention implementation: None, the config's), with its attention form as the family's glue builds it (none
    for a family without one; on the 5.x line as its attention modules ask for it, models/tf5/form.py) unless
    `form` is given."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    context = getattr(config, "max_position_embeddings", 0) or 0
    glue = MODEL_GLUE.get(config.model_type)
    if form is None and INTERFACE_LINE:
        form = config_form(config)
    elif form is None and glue is None:
        form = AttentionForm()
    elif form is None:
        implementation = implementation or getattr(config, "_attn_implementation", None) or "eager"
        form = glue.attention_form(config, implementation)
    return ModelShape(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                      getattr(config, "_name_or_path", "") or "", head_dim=head_dim, dtype_bytes=dtype_bytes,
                      context_window=context, form=form)


def layer_devices(model) -> list[str]:
    """Per decoder layer, the device it computes on: its accelerate hook's execution device (a model loaded with a
    device_map), else its weights'."""
    out = []
    for layer in decoder(model).layers:
        device = getattr(getattr(layer, "_hf_hook", None), "execution_device", None)
        if device is None:
            device = next(layer.parameters()).device
        out.append(str(torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)))
    return out


def check_shared_layers(model, method: Method) -> None:
    """Layers that share one storage (MiniCache's pairs) must compute on one device."""
    sharing = method.layer_sharing
    if sharing is None:
        return
    devices = layer_devices(model)
    for lower, upper in sharing.pairs(len(devices)).items():
        if devices[lower] != devices[upper]:
            raise ValueError(f"{method.name}: layers {lower} and {upper} share one storage but compute on "
                             f"{devices[lower]} and {devices[upper]}; set cross_layer_start so that no pair spans "
                             f"two devices, or map both layers to one device")


def compress(model, method: Method) -> CompressionPatch:
    """Patch `model` to compress its KV cache with `method`. Use as a context manager or call `.remove()`."""
    return CompressionPatch(model, method).apply()
