"""The attention form of a 5.x model (components.AttentionForm: scale, soft-cap, per-layer windows), read from its
attention modules: what each passes the attention interface (`scaling=self.scaling`, `sliding_window=...`,
`softcap=...`). A module without a `sliding_window` of its own (Mistral, Phi-3) passes its config's to every
layer. The registered attention function checks at every call that the module asks for this form
(models/tf5/attention.py `check_form`), so a family whose modules say otherwise fails loudly, not silently.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyramidkv.components import AttentionForm
from pyramidkv.models.glue import decoder


def call_window(window: Optional[int], context: int) -> Optional[int]:
    """A window as the engine holds it: None for a global layer, or one at or beyond the context window (it never
    binds; the 4.44.2 glue's rule)."""
    if window is None or (context and window >= context):
        return None
    return int(window)


def attention_modules(model) -> list:
    return [layer.self_attn for layer in decoder(model).layers]


def modules_form(modules: list, config) -> AttentionForm:
    """The form the modules ask for (scale None: 1 / sqrt(head_dim), as the 4.44.2 line's Llama files compute it)."""
    context = getattr(config, "max_position_embeddings", 0) or 0
    scales = {float(m.scaling) for m in modules}
    if len(scales) != 1:
        raise ValueError(f"the attention modules have several scales {sorted(scales)}: the engine holds one")
    scale, head_dim = scales.pop(), modules[0].head_dim
    caps = {getattr(m, "attn_logit_softcapping", None) for m in modules}
    if len(caps) != 1:
        raise ValueError(f"the attention modules have several soft-caps {sorted(caps)}: the engine holds one")
    windows = tuple(call_window(getattr(m, "sliding_window", getattr(config, "sliding_window", None)), context)
                    for m in modules)
    return AttentionForm(scale=None if abs(scale - head_dim ** -0.5) <= 1e-12 else scale, softcap=caps.pop(),
                         windows=windows if any(w is not None for w in windows) else ())


def config_form(config) -> AttentionForm:
    """The form of a model not yet loaded: its modules built on the meta device from the config (no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return modules_form(attention_modules(model), config)
