"""Installing the 5.x seam on one model instance, and taking it off (models/patch.py's CompressionPatch calls these
on the 5.x line): the model's attn_implementation becomes `pyramidkv_<its own>` (the function registered in
models/tf5/attention.py), and each attention module gets a pre-hook that adds the cache (and, for methods that
score by it, the layer's attention input) to the kwargs the module hands the attention function.
"""

from __future__ import annotations

from typing import Callable

from pyramidkv.components import AttentionForm
from pyramidkv.models.tf5.attention import BASES, CACHE_KEY, FLASH, HIDDEN_KEY, register, registered_name
from pyramidkv.models.tf5.families import family
from pyramidkv.models.tf5.form import attention_modules, modules_form

CACHE_ARGUMENTS = ("cache", "past_key_values")   # 5.x's name for the cache argument, and its deprecated one


def check_model(model) -> tuple[str, AttentionForm]:
    """(the implementation the patched model extends, the form its modules ask for), or a one-line refusal."""
    family(model.config.model_type)
    implementation = model.config._attn_implementation
    if implementation not in BASES:
        raise ValueError(f"attn_implementation {implementation!r} is not supported on the 5.x line; use one of "
                         f"{', '.join(BASES)}")
    modules = attention_modules(model)
    if any(hasattr(m, "sinks") for m in modules):
        raise ValueError(f"{model.config.model_type}'s attention adds sinks to the softmax, which the engine's "
                         f"stores do not apply")
    return implementation, modules_form(modules, model.config)


def given_cache(kwargs: dict):
    """(argument name, cache) of a forward's kwargs; (the 5.x name, None) when none was given."""
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return name, kwargs[name]
    return CACHE_ARGUMENTS[0], None


def switch_implementation(model, name: str) -> None:
    """The model's attention implementation set to `name`. A flash one is set on the config: 5.x's
    `set_attn_implementation` would load a flash kernel named after it (which for pyramidkv_flash_attention_2 is
    none: models/tf5/attention.py's `flash_attention` names the kernel itself)."""
    if FLASH in name:   # every family of models/tf5/families.py calls the interface (check_model refuses others)
        model.config._attn_implementation = name
    else:
        model.set_attn_implementation(name)


def install(model, implementation: str, needs_hidden: bool) -> Callable[[], None]:
    """Switch the model to pyramidkv's attention function and hook its attention modules; returns the undo."""
    register()

    def add_cache(module, args, kwargs):
        kwargs[CACHE_KEY] = given_cache(kwargs)[1]
        if needs_hidden:
            kwargs[HIDDEN_KEY] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return args, kwargs

    switch_implementation(model, registered_name(implementation))
    if model.config._attn_implementation != registered_name(implementation):   # transformers only warns
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation (it does not call "
                         f"the attention interface), so pyramidkv cannot run it on the 5.x line")
    handles = [m.register_forward_pre_hook(add_cache, with_kwargs=True) for m in attention_modules(model)]

    def undo() -> None:
        for handle in handles:
            handle.remove()
        switch_implementation(model, implementation)

    return undo
