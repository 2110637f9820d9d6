"""Per-step eviction in place equals the rebuild it replaces, step for step: TOVA's one eviction a step (and any
decode_interval-1 rule) through DecodeCompressor._drop_one against the general re-selection, and threshold
decoding's eviction against its per-head rebuild, on a float64 tiny random Llama: the same held positions in every
layer and head after every forward (as sets: the store reports them in position order whatever its slot order), the
same tokens and bytes, and each held position's stored keys and values within K_V_TOLERANCE (writing in place changes
the order the attention sums in, so the hidden states round otherwise in the last bits: never bitwise across the
two paths)."""

from __future__ import annotations


import pytest
import torch

from pyramidkv import make_method
from pyramidkv.core import in_place
from pyramidkv.core.decoding import DecodeCompressor
from pyramidkv.generation import generate
from tests.helpers import TokenIds, float64_tiny_llama

STEPS = 40
K_V_TOLERANCE = 1e-5   # relative and absolute: the decode softmax is float32 even in a float64 model (3e-7 seen)


@pytest.fixture(scope="module")
def model():
    with float64_tiny_llama() as tiny:
        yield tiny


def run(model, prompts, method, steps=STEPS):
    """Per forward, per prompt, per layer: every head's (held positions, stored keys, stored values); the tokens;
    the final bytes."""
    states, figures = [], []

    def record(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        states.append([[[(p.tolist(), k.clone(), v.clone()) for p, k, v in cache.stored_kv(layer, b)]
                        for layer in range(len(cache.layers))] for b in range(len(prompts))])
        decoder = getattr(cache, "decoding", None)   # the decode-time unit's running figures, as the benchmark reads
        figures.append(None if decoder is None else (decoder.peak_kv_bytes, decoder.stored_bytes(),
                                                     list(getattr(decoder, "compressions", []))))

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        out = generate(model, TokenIds(), prompts, method, steps, stop_token_ids=[])
    finally:
        hook.remove()
    return states, [g.text for g in out], [(g.kv_bytes_per_prompt, g.held_tokens) for g in out], figures


def assert_equal_runs(got, want):
    (states, tokens, nbytes, figures), (states_ref, tokens_ref, nbytes_ref, figures_ref) = got, want
    assert tokens == tokens_ref and nbytes == nbytes_ref and len(states) == len(states_ref)
    for step, (a, b) in enumerate(zip(figures, figures_ref)):   # peak and stored bytes, re-selections per layer
        assert a == b, f"forward {step}: the decode-time unit's (peak bytes, bytes, compressions) {a} != {b}"
    for step, (a, b) in enumerate(zip(states, states_ref)):
        for prompt, (layers, layers_ref) in enumerate(zip(a, b)):
            for layer, (heads, heads_ref) in enumerate(zip(layers, layers_ref)):
                for head, ((p, k, v), (p_ref, k_ref, v_ref)) in enumerate(zip(heads, heads_ref)):
                    where = f"forward {step}, prompt {prompt}, layer {layer}, head {head}"
                    assert p == p_ref, f"{where}: held {sorted(set(p) ^ set(p_ref))} differ"
                    assert p == sorted(set(p)), f"{where}: held positions reported out of order"
                    for got_kv, want_kv in ((k, k_ref), (v, v_ref)):
                        torch.testing.assert_close(got_kv, want_kv, rtol=K_V_TOLERANCE, atol=K_V_TOLERANCE,
                                                   msg=lambda m: f"{where}: stored K/V of a position differ: {m}")


def spy(monkeypatch, module, name):
    """Record each call of module.name (still calling it)."""
    calls, original = [], getattr(module, name)

    def recorded(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(module, name, recorded)
    return calls


def prompts_of(lengths):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("settings", [
    dict(name="tova", budget=24),                                       # TOVA's own rule
    dict(name="tova", budget=24, window_size=3, num_sinks=2),           # protected window and sinks
    dict(name="snapkv", budget=24, window_size=4, decode_budget=20, decode_interval=1),  # another scorer
    dict(name="tova", budget=24, gqa_layout="query_head"),
])
@pytest.mark.parametrize("lengths", [[40], [40, 17, 31]])   # one prompt; a left-padded batch, one under budget
def test_drop_one_equals_the_rebuild(model, monkeypatch, settings, lengths):
    settings = dict(settings)
    method = make_method(settings.pop("name"), **settings)
    prompts = prompts_of(lengths)
    calls = []
    original = DecodeCompressor._drop_one

    def counted(self, layer_idx, fire):
        done = original(self, layer_idx, fire)
        calls.append(done)
        return done

    monkeypatch.setattr(DecodeCompressor, "_drop_one", counted)
    writes = spy(monkeypatch, in_place, "fold_into")
    got = run(model, prompts, method)
    # TOVA decides from the step's own attention row and writes the new token in place once every prompt fires
    # (in the batch too, once its short prompt reached the budget), and from then on at each step straight from
    # after_attend (its steady state: no _drop_one call); the others go through _drop_one at every step
    assert (len(writes) > STEPS) == (method.name == "tova"), len(writes)
    assert sum(calls) > STEPS or len(writes) > STEPS, "the in-place path ran (else the rebuild is compared with itself)"
    monkeypatch.setattr(DecodeCompressor, "_drop_one", lambda self, layer_idx, fire: False)
    assert_equal_runs(got, run(model, prompts, method))


@pytest.mark.parametrize("lengths", [[40], [40, 17, 31]])
@pytest.mark.parametrize("layout", ["kv_head", "query_head"])
def test_threshold_eviction_equals_the_per_head_rebuild(model, monkeypatch, lengths, layout):
    """Threshold decoding (the DMS rule, a per-token scorer reading keys and the attention input): the index_select
    eviction against the per-head rebuild it replaced (taken where the store is not plain full precision)."""
    from pyramidkv.sizing import Threshold
    from pyramidkv.capabilities import Selection
    from pyramidkv.core import threshold
    from tests.sizing.test_threshold import KeyAndInput

    method = KeyAndInput(window_size=6, sizing=Threshold(threshold=0.1),
                         selection=Selection(num_sinks=2), gqa_layout=layout)
    prompts = prompts_of(lengths)
    monkeypatch.setattr(threshold, "COMPACT_EVERY", 16)   # at least two compactions in STEPS decisions
    marks, compactions = spy(monkeypatch, in_place, "mark_gone"), spy(monkeypatch, threshold.in_place, "compact")
    got = run(model, prompts, method)
    assert len(marks) > STEPS and len(compactions) >= 2, "rows were marked gone, reported between compactions"
    assert got[2][0][1] is not None and len({n for layer in got[2][0][1] for n in layer}) > 1, "heads differ"

    class NotFullPrecision:   # isinstance(store, FullPrecisionStore) fails: the per-head rebuild runs
        pass

    monkeypatch.setattr(threshold, "FullPrecisionStore", NotFullPrecision)
    assert_equal_runs(got, run(model, prompts, method))


@pytest.mark.parametrize("lengths", [[40], [40, 17, 31]])
def test_equal_minima_leave_the_older_in_place(model, monkeypatch, lengths):
    """TOVA's row scores made coarse (floor of 16 x the mean: most steps have equal minima), so the in-place step
    takes its tie path (the older of equal minima leaves) at every step: against the general re-selection's rule."""
    from pyramidkv.core import drop_one
    from pyramidkv.methods.tova import TOVA

    monkeypatch.setattr(TOVA, "newest_row_score", staticmethod(lambda rows: (rows.mean(dim=1, keepdim=True) * 16).floor()))
    method = make_method("tova", budget=24)
    prompts = prompts_of(lengths)
    ties, writes = spy(monkeypatch, drop_one, "slots_by_position"), spy(monkeypatch, in_place, "fold_into")
    got = run(model, prompts, method)
    assert len(writes) > STEPS and len(ties) > STEPS, (len(writes), len(ties))
    monkeypatch.setattr(DecodeCompressor, "_drop_one", lambda self, layer_idx, fire: False)
    assert_equal_runs(got, run(model, prompts, method))


@pytest.mark.parametrize("settings", [
    dict(budget=24, window_size=4, decode_budget=20, decode_interval=4),
    dict(budget=24, window_size=4, decode_budget=20, decode_interval=4, gqa_layout="query_head"),
])
@pytest.mark.parametrize("lengths", [[40], [40, 33, 31]])   # a batch: every prompt over the budget (dense rows)
def test_h2o_accumulates_from_the_steps_own_rows(model, monkeypatch, settings, lengths):
    """H2O's accumulated attention read from the rows the step's attention kept equals the float32 recomputation
    (`received_attention`) it replaced: the same held sets, tokens, bytes and K/V at every forward."""
    from pyramidkv.core.token_stats import AccumulatedAttention

    method = make_method("h2o", **settings)
    prompts = prompts_of(lengths)
    read = []
    original = AccumulatedAttention.step_rows

    def counted(self, store, q_len):
        got = original(self, store, q_len)
        read.append(got is not None)
        return got

    monkeypatch.setattr(AccumulatedAttention, "step_rows", counted)
    got = run(model, prompts, method)
    assert sum(read) > STEPS, "the steps' own rows were read (else the recomputation is compared with itself)"
    monkeypatch.setattr(AccumulatedAttention, "step_rows", lambda self, store, q_len: None)
    assert_equal_runs(got, run(model, prompts, method))
