"""Driving a reconstructing method's repeat passes (KVzip: core/reconstruction.py scores, core/reconstructing.py
keeps) through a patched model, in one of two orders:

    layer-major    (the 4.44.2 line, every family of MODEL_GLUE) inside the prompt's forward: right after the prompt
                   passes layer l, every repeat input passes layer l, and the layer is kept (or cut) before layer
                   l + 1 runs. The repeat inputs enter as the decoder hands its first layer an input (one forward of
                   the decoder stopped there gives the family's embeddings, position ids and RoPE tables), and wait
                   between layers as hidden states [1, m, E], never as K/V.
    two forwards   (the 5.x line, whose decoders hand their layers other arguments) after the prompt's forward: each
                   repeat input through the whole decoder while every layer waits with its whole prompt K/V.

Both run the same layer computations on the same inputs, so they score, keep and store the same.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pyramidkv.core.cache import CompressedCache
from pyramidkv.core.reconstruction import RepeatChunk, RepeatDone
from pyramidkv.models.glue import decoder
from pyramidkv.models.line import INTERFACE_LINE


def layer_major(model) -> bool:
    """True: the model's repeat passes run layer-major (the 4.44.2 line); False: after the forward (the 5.x line)."""
    return not INTERFACE_LINE


@dataclass
class RepeatInput:
    """One repeat input on its way through the decoder: prompt b's chunk, its hidden states [1, m, E] before the next
    layer, and the other arguments the decoder hands its layers (`rest` positional, `named` by keyword)."""

    prompt: int
    chunk: RepeatChunk
    hidden: torch.Tensor
    rest: tuple
    named: dict


class FirstLayerInput(Exception):
    """Ends a decoder's forward where its first layer would start, with that layer's arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args, self.kwargs = args, kwargs


def _stop(module, args, kwargs):
    raise FirstLayerInput(args, kwargs)


class LayerMajorRepeats:
    """Forward hooks on every decoder layer of a patched model: after the prompt's prefill passes a layer, the repeat
    inputs of its cache's `reconstruction` pass that layer, and the cache keeps it (`repeat_scored`). `remove()`."""

    def __init__(self, model):
        self.decoder = decoder(model)
        self.layers = list(self.decoder.layers)
        self.hooks = [layer.register_forward_hook(functools.partial(self._after_layer, index), with_kwargs=True)
                      for index, layer in enumerate(self.layers)]
        self.inputs: list[RepeatInput] = []

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.inputs = [], []

    @torch.no_grad()
    def _after_layer(self, index: int, layer, args, kwargs, output):
        cache = kwargs.get("past_key_value")
        if not isinstance(cache, CompressedCache) or cache.reconstruction is None or cache.prompt is None \
                or cache.reconstruction.current is not None or index not in cache.prompt.waiting:
            return None    # no repeat to run, a repeat input's own pass, or not a prefill (a decode step)
        recon = cache.reconstruction
        if index == 0:
            cache.start_repeats(layer_major=True)
            self.inputs = self.first_inputs(cache)
        try:
            for item in self.inputs:
                recon.current = (item.prompt, item.chunk)
                try:
                    item.hidden = layer(item.hidden, *item.rest, **item.named)[0]
                except RepeatDone:    # the last layer: its scores are in, its output is read by nothing
                    pass
        finally:
            recon.current = None
        cache.repeat_scored(index)
        if index == len(self.layers) - 1:
            self.inputs = []
        return None

    def first_inputs(self, cache: CompressedCache) -> list[RepeatInput]:
        """Each compressed prompt's repeat inputs as the decoder hands them to its first layer (positions from the
        first of the prompt's suffix, which the repeat does not read), the attention mask left out: the repeat's
        attention reads the prompt's K/V and its own by their extent (core/reconstruction.py), not by a mask."""
        recon, prompt = cache.reconstruction, cache.prompt
        device = prompt.waiting[0].keys.device
        stop = self.layers[0].register_forward_pre_hook(_stop, with_kwargs=True)
        inputs = []
        try:
            for b, plan in enumerate(recon.plans):
                if not prompt.compressed(b):
                    continue
                start = prompt.real_lens[b] - plan.suffix
                for chunk in plan.chunks:
                    try:
                        self.decoder(input_ids=torch.tensor([chunk.ids], device=device), use_cache=True,
                                     position_ids=torch.arange(start, start + len(chunk.ids), device=device)[None],
                                     past_key_values=cache)
                        raise RuntimeError(f"{type(self.decoder).__name__} ran past its first layer's input")
                    except FirstLayerInput as given:
                        args, named = given.args, dict(given.kwargs)
                    hidden, rest = (args[0], args[1:]) if args else (named.pop("hidden_states"), ())
                    named["attention_mask"] = None
                    inputs.append(RepeatInput(b, chunk, hidden, rest, named))
                    recon.repeat_tokens += len(chunk.ids)
        finally:
            stop.remove()
        return inputs


@torch.no_grad()
def run_repeats(decoder_module, cache: CompressedCache) -> None:
    """Two forwards: the repeat passes once the prompt's prefill has run with every layer waiting; each compressed
    prompt's repeat inputs through the decoder alone (positions from the first of the prompt's suffix; the cache in
    its repeat mode: nothing is stored; each forward ends after the last layer's attention, RepeatDone), then every
    layer keeps what they scored."""
    recon, prompt = cache.reconstruction, cache.prompt
    cache.start_repeats(layer_major=False)
    device = prompt.waiting[0].keys.device
    for b, plan in enumerate(recon.plans):
        if not prompt.compressed(b):
            continue
        start = prompt.real_lens[b] - plan.suffix
        for chunk in plan.chunks:
            recon.current = (b, chunk)
            try:
                decoder_module(input_ids=torch.tensor([chunk.ids], device=device), use_cache=True,
                               position_ids=torch.arange(start, start + len(chunk.ids), device=device)[None],
                               **{"cache" if INTERFACE_LINE else "past_key_values": cache})
            except RepeatDone:    # the last layer's scores are in: nothing after them is read
                pass
            recon.repeat_tokens += len(chunk.ids)
    recon.current = None
    cache.reconstructed()
