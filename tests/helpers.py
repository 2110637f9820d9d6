"""Small helpers the tests share (they drive pyramidkv; the references live in tests/reference.py)."""

from __future__ import annotations

import torch

from pyramidkv import compress


def prefill(model, ids, method, attention_mask=None):
    """The CompressedCache `method` leaves after one prefill forward of `ids` (the model is unpatched after)."""
    with compress(model, method) as patch:
        cache = patch.new_cache()
        with torch.no_grad():
            model(ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    return cache
