"""KVzip's repeat passes layer-major (models/repeat.py, core/reconstructing.py) against the two-forward path (every
layer waiting whole until the repeat inputs have run through the decoder after the prompt's forward, forced by
monkeypatching `layer_major`), on tiny models (float64 but Phi-3's) of the families kvzip runs on (Llama with and
without GQA; Mistral, Qwen2 and Phi-3, whose attention computes RoPE from position_ids itself; Gemma2's scaled
embeddings and soft-capped logits): the same scores, kept positions, stored K/V and bytes in a left-padded batch of
three (one prompt kept whole), for kvzip under one budget over every layer (its default), uniform heads, the
query_head layout, and kvzip_head (no repeat: unchanged); the peak prefill K/V counted by hand (the final cache,
one layer's whole prompt K/V and one repeat input's own K/V at one layer)."""

from __future__ import annotations

import copy

import pytest
import torch

import pyramidkv.models.repeat as repeat_module
from pyramidkv import compress, make_method
from pyramidkv.core.reconstruction import Reconstruction, ReconstructionPlan, RepeatChunk
from tests.conftest import tiny_llama
from tests.helpers import write_calibrations
from tests.models.families import FAMILY_CONFIGS, tiny_family

LAYERS, VOCAB, N = 4, 96, 60
LENGTHS = [60, 45, 12]           # left-padded to N; the last is kept whole
PREFIX, SUFFIX, CHUNK, INSTRUCTION = 3, 2, 16, 5

# name -> a shared tiny model (sharp weights: scores far from ties), computed in float64 where the family's own
# forward of a left-padded batch is free of NaN in float64: its eager attention adds two float64 minima at a padding
# row (-inf, then NaN) in Mistral, Qwen2, Gemma2 and Phi-3, so those run sdpa, and Phi-3 (eager only) float32 (Mixtral:
# Mistral's attention and decoder loop, its experts aside)
MODELS = {
    "llama": (lambda: tiny_llama(layers=LAYERS, heads=4, kv_heads=4, seed=3, std=0.2), torch.float64),
    "llama-gqa": (lambda: tiny_llama(layers=LAYERS, heads=4, kv_heads=2, seed=3, std=0.2), torch.float64),
    **{family: (lambda family=family: tiny_family(family, "sdpa", cached=True, num_hidden_layers=LAYERS, std=0.2),
                torch.float64) for family in ("mistral", "qwen2")},
    "phi3": (lambda: tiny_family("phi3", cached=True, num_hidden_layers=LAYERS, std=0.2), torch.float32),
    # Gemma2 with a window that never binds (kvzip refuses sliding layers): its scaled embeddings and soft-capped
    # logits (the repeat's explicit softmax)
    "gemma2": (lambda: tiny_family("gemma2", "sdpa", cached=True, num_hidden_layers=LAYERS, std=0.2,
                                   sliding_window=FAMILY_CONFIGS["gemma2"]["max_position_embeddings"]), torch.float64),
}
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5}
METHODS = {
    "kvzip": dict(name="kvzip", budget=8),
    "kvzip-uniform": dict(name="kvzip", budget=8, head_allocation="uniform"),
    "kvzip-query_head": dict(name="kvzip", budget=8, gqa_layout="query_head"),
    "kvzip_head": dict(name="kvzip_head", budget=12),
}


def model_of(name: str):
    shared, dtype = MODELS[name]
    return copy.deepcopy(shared()).to(dtype)


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = torch.zeros(len(LENGTHS), N, dtype=torch.long), torch.zeros(len(LENGTHS), N, dtype=torch.long)
    for b, length in enumerate(LENGTHS):
        ids[b, N - length:] = torch.randint(3, VOCAB, (length,), generator=generator)
        mask[b, N - length:] = 1
    return ids, mask


def plans(lengths: list[int], generator: torch.Generator, chunk: int = CHUNK) -> list[ReconstructionPlan]:
    """Per prompt: PREFIX and SUFFIX protected, the context in chunks, each repeat input INSTRUCTION random tokens
    and the chunk's (what KVzip's plans hold, without a tokenizer for a 96-token vocabulary)."""
    out = []
    for length in lengths:
        chunks = [RepeatChunk(torch.randint(3, VOCAB, (INSTRUCTION + min(start + chunk, length - SUFFIX) - start,),
                                            generator=generator).tolist(), start, min(start + chunk, length - SUFFIX))
                  for start in range(PREFIX, length - SUFFIX, chunk)]
        out.append(ReconstructionPlan(PREFIX, SUFFIX, chunks))
    return out


def prefilled(model, method, ids, mask, repeat_plans):
    with torch.no_grad(), compress(model, method) as patch:
        cache = patch.new_cache()
        if method.reconstructs:
            cache.reconstruction = Reconstruction(copy.deepcopy(repeat_plans))
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache


def two_forwards(monkeypatch, *args):
    with monkeypatch.context() as patch:
        patch.setattr(repeat_module, "layer_major", lambda model: False)
        return prefilled(*args)


def stored_head_scores(cache, layer: int, b: int) -> torch.Tensor:
    """[H, n] the repeat scores per stored head: the query group's maximum (kv_head), each query head (query_head)."""
    scores = cache.reconstruction.scores[layer][b].double()
    heads = cache.stored_heads
    return scores.reshape(heads, -1, scores.shape[-1]).amax(1)


def cut_margin(cache, b: int, over_every_layer: bool) -> float:
    """The smallest relative gap between a kept and an evicted context score of prompt b: over every layer and head
    (one budget over all of them), else within each layer and head."""
    n, pad = cache.prompt_len, cache.pad_lens[b]
    context = torch.arange(pad + PREFIX, n - SUFFIX)
    groups = []
    for layer in range(LAYERS):
        scores = stored_head_scores(cache, layer, b)
        for h, kept in enumerate(cache.kept_positions(layer, b)):
            chosen = torch.isin(context - pad, kept)
            groups.append((scores[h, context][chosen], scores[h, context][~chosen]))
    if over_every_layer:
        groups = [tuple(torch.cat(side) for side in zip(*groups))]
    return min((float(kept.min()) - float(evicted.max())) / float(kept.min())
               for kept, evicted in groups if len(kept) and len(evicted))


# every method on the GQA Llama; kvzip under both allocations on the others
CASES = [("llama-gqa", method) for method in METHODS] + [
    (model, method) for model in MODELS if model != "llama-gqa" for method in ("kvzip", "kvzip-uniform")]


@pytest.mark.parametrize("model_name, method_name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_layer_major_keeps_what_two_forwards_keep(model_name, method_name, monkeypatch, tmp_path):
    """Per layer, prompt and head: the same kept positions (the scores of both paths within 1e-6 relative in
    float64, 1e-5 in float32, the cut decided by a gap wider than both moves), the same stored K/V (within the same
    tolerance) and bytes; layer-major cuts one budget over every layer as it goes (the running top) and holds less at
    its peak where a prompt is compressed."""
    model = model_of(model_name)
    tolerance = TOLERANCE[MODELS[model_name][1]]
    spec = dict(METHODS[method_name])
    if spec["name"] == "kvzip_head":
        spec["kvzip_head_path"] = write_calibrations(tmp_path, model.config)["kvzip_head_path"]
    method = make_method(**spec)
    generator = torch.Generator().manual_seed(11)
    ids, mask = batch(generator)
    repeat_plans = plans(LENGTHS, generator)
    ours = prefilled(model, method, ids, mask, repeat_plans)
    theirs = two_forwards(monkeypatch, model, method, ids, mask, repeat_plans)
    if method.reconstructs:
        for layer in range(LAYERS):
            torch.testing.assert_close(ours.reconstruction.scores[layer], theirs.reconstruction.scores[layer],
                                       rtol=tolerance, atol=1e-12)
        for b in range(2):
            assert cut_margin(theirs, b, method.head_allocation.name == "global") > 2 * tolerance
        assert ours.reconstruction.repeat_tokens == theirs.reconstruction.repeat_tokens > 0
        assert ours.peak_prefill_kv_bytes < theirs.peak_prefill_kv_bytes
        assert (ours.prompt.running is not None) == (method.head_allocation.name == "global")
    for layer in range(LAYERS):
        assert ours.kept_counts(layer) == theirs.kept_counts(layer), layer
        for b in range(len(LENGTHS)):
            for (p, k, v), (q, k2, v2) in zip(ours.stored_kv(layer, b), theirs.stored_kv(layer, b)):
                assert torch.equal(p, q), (layer, b)
                torch.testing.assert_close(k, k2, rtol=tolerance, atol=tolerance)
                torch.testing.assert_close(v, v2, rtol=tolerance, atol=tolerance)
    assert [ours.kv_bytes(b) for b in range(3)] == [theirs.kv_bytes(b) for b in range(3)]
    assert [ours.layer_budgets_used(b) for b in range(3)] == [theirs.layer_budgets_used(b) for b in range(3)]
    assert ours.kept_counts(0)[2] == [LENGTHS[2]] * ours.stored_heads      # kept whole


@pytest.mark.parametrize("allocation", ["global", "uniform"])
def test_peak_prefill_bytes_counted_by_hand(allocation):
    """One prompt of 64 tokens (prefix 3, suffix 2, context 59 in chunks of 20, 20, 19: repeat inputs of 25, 25 and
    24 tokens), 4 layers, 2 KV heads, budget 8 (each head keeps its 5 protected tokens and on average 8 of the
    context). While the repeat runs at layer l the cache holds what layers 0..l-1 keep, layer l's whole prompt
    (2 x 64 rows) and the repeat input's own K/V (2 x 25 rows at most):
      uniform: l x 2 x 13 + 128 + 50, the most at l = 3: 256 rows;
      global:  l x 2 x 5 + min(B = 4 x 2 x 8 = 64, l x 2 x 59) + 128 + 50, the most at l = 3: 272 rows;
    within the final cache (104 rows) + one layer's whole prompt + one repeat input's own K/V (282 rows); the
    two-forward path holds every layer whole (512 rows) + the repeat input's own."""
    model = tiny_llama(layers=LAYERS, heads=4, kv_heads=2, seed=3, std=0.2)
    generator = torch.Generator().manual_seed(5)
    n, row = 64, 2 * 16 * 4                       # K and V of one token of one head, float32
    ids = torch.randint(3, VOCAB, (1, n), generator=generator)
    method = make_method("kvzip", budget=8, head_allocation=allocation)
    cache = prefilled(model, method, ids, None, plans([n], generator, chunk=20))
    assert [len(c.ids) for c in cache.reconstruction.plans[0].chunks] == [25, 25, 24]
    protected, whole, own = PREFIX + SUFFIX, 2 * n, 2 * 25
    if allocation == "uniform":
        by_hand = max(layer * 2 * (protected + 8) + whole + own for layer in range(LAYERS))
    else:
        by_hand = max(layer * 2 * protected + min(LAYERS * 2 * 8, layer * 2 * (n - protected)) + whole + own
                      for layer in range(LAYERS))
    assert by_hand == {"uniform": 256, "global": 272}[allocation]
    assert cache.peak_prefill_kv_bytes == by_hand * row
    final = LAYERS * 2 * (protected + 8)
    assert cache.kv_bytes() == final * row
    assert cache.peak_prefill_kv_bytes <= (final + whole + own) * row
