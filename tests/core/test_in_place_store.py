"""A full-precision store evicting in place (core/in_place.py), against a hand-kept reference in float64: the
tokens it holds (a dict position -> key, value per head), the attention over them computed by a plain softmax, the
counts, positions (reported ascending), stored K/V and bytes. Rows marked gone must be out of the attention and of
every report; a slot a new token takes must hold that token; a compaction must change nothing observable."""

from __future__ import annotations

import pytest
import torch

from pyramidkv.core import in_place
from pyramidkv.core.full_precision import FullPrecisionStore
from pyramidkv.core.kept import KeptKV

D, HEADS, GROUP = 8, 3, 2
TOLERANCE = 1e-6   # float64 store against a float64 reference; the store's softmax is float32 (scoring.probabilities)


def random_store(lengths_per_prompt, seed=0):
    """A store of float64 rows at random sorted positions, and the reference: per prompt and head, position ->
    (key, value)."""
    gen = torch.Generator().manual_seed(seed)
    kept, reference, real_lens = [], [], []
    for lengths in lengths_per_prompt:
        real = max(lengths) + 5
        heads, held = [], []
        for n in lengths:
            positions = torch.randperm(real, generator=gen)[:n].sort().values
            keys, values = torch.randn(n, D, generator=gen, dtype=torch.float64), \
                torch.randn(n, D, generator=gen, dtype=torch.float64)
            heads.append((keys, values, positions))
            held.append({int(p): (k, v) for p, k, v in zip(positions, keys, values)})
        kept.append(KeptKV.from_heads(heads))
        reference.append(held)
        real_lens.append(real)
    return FullPrecisionStore(kept, real_lens), reference, gen


def append(store, reference, gen):
    """One new token per prompt and head, as a decode step appends it."""
    bsz = len(reference)
    keys = torch.randn(bsz, HEADS, 1, D, generator=gen, dtype=torch.float64)
    values = torch.randn(bsz, HEADS, 1, D, generator=gen, dtype=torch.float64)
    for b in range(bsz):
        position = store.tail_start[b] + store.tail_len
        for h in range(HEADS):
            reference[b][h][position] = (keys[b, h, 0], values[b, h, 0])
    store.append(keys, values, torch.zeros(bsz, dtype=torch.long))


def reference_attention(queries, reference):
    """[B, Hq, 1, D]: each query head's softmax over its stored head's held tokens, float64."""
    out = torch.empty_like(queries)
    for b, held in enumerate(reference):
        for q in range(queries.shape[1]):
            tokens = held[q // GROUP]
            keys = torch.stack([k for k, _ in tokens.values()])
            values = torch.stack([v for _, v in tokens.values()])
            probs = torch.softmax(keys @ queries[b, q, 0] / D ** 0.5, dim=0)
            out[b, q, 0] = probs @ values
    return out


def assert_store_is(store, reference, gen):
    token = D * 8 * 2   # float64 key and value of one token of one head
    assert store.held_counts() == [[len(h) for h in held] for held in reference]
    assert store.nbytes() == sum(len(h) for held in reference for h in held) * token
    for b, held in enumerate(reference):
        assert store.nbytes(b) == sum(len(h) for h in held) * token
        for h, ((k, v, p), want) in enumerate(zip(store.held(b), held)):
            assert p.tolist() == sorted(want), f"prompt {b}, head {h}: held positions"
            assert torch.equal(k, torch.stack([want[int(i)][0] for i in p]))
            assert torch.equal(v, torch.stack([want[int(i)][1] for i in p]))
        for h, p in enumerate(store.held_positions(b)):
            assert p.tolist() == sorted(held[h])
        for h, p in enumerate(store.kept_positions(b)):
            assert p.tolist() == sorted(p.tolist()) and set(p.tolist()) <= set(held[h])
    queries = torch.randn(len(reference), HEADS * GROUP, 1, D, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(store.attend(queries), reference_attention(queries, reference), rtol=TOLERANCE,
                               atol=TOLERANCE)


@pytest.mark.parametrize("by_segment", [False, True])   # ragged rows in blocks, or one segment at a time
@pytest.mark.parametrize("lengths", [[[6, 9, 4]], [[6, 9, 4], [5, 5, 7]], [[7, 7, 7]]])   # ragged, batch, dense
def test_rows_marked_gone_leave_the_attention_and_every_report(lengths, by_segment):
    store, reference, gen = random_store(lengths)
    store.by_segment = by_segment
    for step in range(7):
        append(store, reference, gen)
        assert_store_is(store, reference, gen)   # attends: the layout exists, as after a decode step
        cuts = []
        for b, held in enumerate(reference):
            prompt_cuts = []
            for h in range(HEADS):
                # what the head's slots hold in order, gone rows included: its kept rows, then the tail
                slots = store.kept[b].positions_per_head()[h].tolist() + \
                    list(range(store.tail_start[b], store.tail_start[b] + store.tail_len))
                position = sorted(held[h])[(step + h) % len(held[h])]
                prompt_cuts.append([slots.index(position)])
                del held[h][position]
            cuts.append(prompt_cuts)
        assert in_place.mark_gone(store, cuts) == len(reference) * HEADS
        assert_store_is(store, reference, gen)
        if step == 4:
            in_place.compact(store)
            assert store.marks == 0 and store.gone_rows is None
            assert_store_is(store, reference, gen)


def test_a_new_token_takes_the_row_of_the_token_it_evicts():
    """TOVA's write (fold_into): the tail token goes into the chosen slot (or leaves, slot L); reports in position
    order, attention over exactly the held tokens."""
    store, reference, gen = random_store([[6, 6, 6], [6, 6, 6]], seed=1)
    for step in range(9):
        append(store, reference, gen)
        assert_store_is(store, reference, gen)
        slots = torch.tensor([[(step + h + b) % 7 for h in range(HEADS)] for b in range(2)])
        for b, held in enumerate(reference):
            for h in range(HEADS):
                slot = int(slots[b, h])
                leaving = store.tail_start[b] if slot == 6 else int(store.kept[b].positions[h * 6 + slot])
                del held[h][leaving]
        in_place.fold_into(store, slots)
        assert not store.in_order or step == 0 and all(int(s) == 6 for s in slots.view(-1))
        assert_store_is(store, reference, gen)
    assert store.tail_len == 0 and store.kept_counts() == [[6] * HEADS] * 2
