"""Every store kind of `STORES` fulfils the `LayerStore` contract and the abilities it declares, and a
configuration asking a store for an ability it lacks is refused when the method is made.

Each kind is built the way the cache builds it (`STORES[kind].build`, through a prefill on a tiny random Llama
with a method whose units name that kind) and then checked from outside: counts, positions and bytes agree
with each other; one appended token is held; the attention output equals a float64 softmax over what the
store says it holds (`stored_kv`, dequantized), computed here; a declared ability is an implemented interface.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from pyramidkv.components import ModelShape
from pyramidkv.core.cache import STORES, CompressedCache, store_kind
from pyramidkv.core.store import ABILITIES, LayerStore
from pyramidkv.methods import make_method
from tests.helpers import prefill

# One method per store kind whose units name it. A kind added to STORES without a row here fails below.
KIND_METHODS = {
    "full_precision": dict(name="snapkv", budget=40, window_size=8),
    "paged": dict(name="quest", budget=4096, page_size=4, page_dense_layers=1),   # every page read: a dense reference
    "quantized": dict(name="snapkv", budget=40, window_size=8, quant_method="kivi", nbits=4, group_size=8,
                      residual_length=8),
    "paired": dict(name="snapkv", budget=40, window_size=8, cross_layer_merge=True, cross_layer_start=0),
}
PROMPT = 64


def test_every_store_kind_has_a_conformance_case():
    assert set(KIND_METHODS) == set(STORES)


def _store_of_kind(random_llama, kind):
    model, _, _ = random_llama
    settings = dict(KIND_METHODS[kind])
    method = make_method(settings.pop("name"), **settings)
    assert store_kind(method) == kind
    ids = torch.randint(3, 200, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    cache = prefill(model, ids, method)
    store = next(s for s in cache.layers if isinstance(s, STORES[kind]))   # a layer of that kind (not a dense one)
    return model, cache, store


def _dense_reference(store, queries, b, group):
    """[Hq, D] float64 attention of one new query per head over everything stored head h of prompt b holds."""
    out = []
    for h, (_, keys, values) in enumerate(store.stored_kv(b)):
        for q in queries[b, h * group:(h + 1) * group, -1].double():
            k, v = keys.double(), values.double()
            weights = torch.softmax(k @ q / math.sqrt(q.shape[-1]), dim=0)
            out.append(weights @ v)
    return torch.stack(out)


@pytest.mark.parametrize("kind", sorted(KIND_METHODS))
def test_store_fulfils_the_contract(random_llama, kind):
    model, cache, store = _store_of_kind(random_llama, kind)
    cls = type(store)
    assert isinstance(store, LayerStore) and not inspect.isabstract(cls)
    for ability in cls.abilities:   # a declared ability is an implemented interface
        assert ability in ABILITIES and isinstance(store, ABILITIES[ability]), (kind, ability)
    batch, heads = 2, store.heads
    kept = store.kept_counts()
    assert len(kept) == batch and all(len(row) == heads for row in kept)
    for b in range(batch):
        positions = store.kept_positions(b)
        assert [len(p) for p in positions] == kept[b]
        assert all(bool((p[1:] > p[:-1]).all()) for p in positions)
        assert [len(p) for p, _, _ in store.kept_kv(b)] == kept[b]
    total = store.bytes_by_part()
    per_prompt = [store.bytes_by_part(b) for b in range(batch)]
    assert {part: sum(p.get(part, 0) for p in per_prompt) for part in total} == total
    assert store.nbytes() == sum(total.values()) > 0

    # One new token per prompt: held = kept + 1, and attention equals a float64 softmax over what is stored.
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(batch, heads, 1, dim, generator=generator)
    values = torch.randn(batch, heads, 1, dim, generator=generator)
    queries = torch.randn(batch, config.num_attention_heads, 1, dim, generator=generator)
    before = store.nbytes()
    store.append(keys, values, torch.full((batch,), PROMPT))
    out = store.attend(queries)
    if kind == "paired":   # the lower layer's new tokens merge once the upper layer has attended
        upper = cache.layers[cache.layers.index(store) + 1]
        upper.append(keys, values, torch.full((batch,), PROMPT))
        upper.attend(queries)
    assert store.appended == 1
    assert store.held_counts() == [[c + 1 for c in row] for row in kept]
    assert store.nbytes() > before and store.capacity_bytes() >= 0
    assert out.shape == (batch, config.num_attention_heads, 1, dim)
    group = config.num_attention_heads // heads
    for b in range(batch):
        held = store.held_positions(b)
        assert [len(p) for p in held] == store.held_counts()[b]
        expected = _dense_reference(store, queries, b, group)
        tolerance = 1e-4 if kind != "quantized" else 2e-3
        assert torch.allclose(out[b, :, 0].double(), expected, atol=tolerance), kind


@pytest.mark.parametrize("settings,ability,kind", [
    (dict(name="snapkv", budget=64, decode_budget=64, quant_method="kivi"), "re-select while decoding", "quantized"),
    (dict(name="snapkv", budget=64, decode_budget=64, cross_layer_merge=True), "re-select while decoding", "paired"),
    (dict(name="h2o", budget=64, decode_budget=64, page_budget=48), "keep decode-time attention statistics", "paged"),
    (dict(name="scissorhands", budget=64, decode_budget=64, page_budget=48), "keep decode-time attention statistics",
     "paged"),
])
def test_an_ability_the_store_lacks_is_refused_when_the_method_is_made(settings, ability, kind):
    settings = dict(settings)
    with pytest.raises(ValueError, match=f"decode_budget .* the {kind} store it needs cannot {ability}") as error:
        make_method(settings.pop("name"), **settings)
    assert "\n" not in str(error.value)


def test_the_cache_refuses_an_engine_object_that_skipped_the_method_checks(random_llama):
    """An object driving the engine directly (not built by make_method) is checked when its cache is built."""
    model, _, _ = random_llama
    method = make_method("snapkv", budget=64, decode_budget=64)
    object.__setattr__(method, "quant_method", make_method("snapkv", budget=64, quant_method="kivi").quant_method)
    config = model.config
    with pytest.raises(ValueError, match="quantized store lacks the abilities \\['reselect'\\]"):
        CompressedCache(method, ModelShape(config.num_hidden_layers, config.num_attention_heads,
                                           config.num_key_value_heads))
    assert dataclasses.is_dataclass(method)
