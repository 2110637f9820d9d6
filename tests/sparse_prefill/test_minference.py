"""MInference's sparse prefill: full coverage = full attention, the index builders on hand-made cases, the
masked prefill on the model against a float64 reference built from the rule (vertical-slash with both
coverages, A-shape, block-sparse), the weights scorers read, the pattern table's layout, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

import pyramidkv.models.attention as patched_attention
from pyramidkv import compress, make_method
from pyramidkv.models.patch import model_shape
from pyramidkv.sparse_prefill.attention import minference_kernels, sparse_prefill_attention
from pyramidkv.sparse_prefill.base import HeadMasks, PrefillPattern
from pyramidkv.sparse_prefill.indices import block_sparse_blocks, diagonal_blocks, vertical_slash_sets
from pyramidkv.sparse_prefill.minference import MInference
from pyramidkv.sparse_prefill.tables import load_pattern_table
from tests.engine_snapshot import assert_batch_equals_alone
from tests.helpers import prefill
from tests.prompts import STORY
from tests.reference import (assert_same_selection, masked_causal_attention, minference_block_sparse,
                             minference_kernel_columns, minference_last_rows, minference_vertical_slash)


def random_qkv(bsz=2, heads=4, kv_heads=2, n=40, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(bsz, h, n, dim, generator=generator) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("cover", ["columns", "diagonals", "blocks"])
def test_a_pattern_covering_every_entry_equals_full_attention(cover):
    """Every column marked (or every diagonal, or every block): each prompt of a left-padded batch gets
    full causal attention, and every causal entry counts as computed."""
    q, k, v = random_qkv()
    pads = [0, 7]
    heads, n = q.shape[1], q.shape[2]
    patterns = []
    for pad in pads:
        m = n - pad
        none = torch.zeros(heads, m, dtype=torch.bool)
        full = torch.ones(heads, m, dtype=torch.bool)
        if cover == "blocks":
            patterns.append(HeadMasks(none, none, torch.ones(heads, -(-m // 8), m, dtype=torch.bool), 8))
        else:
            patterns.append(HeadMasks(full if cover == "columns" else none, full if cover == "diagonals" else none))
    out, _, density = sparse_prefill_attention(q, k, v, PrefillPattern(patterns, pads))
    for b, pad in enumerate(pads):
        kr, vr = k[b, :, pad:].repeat_interleave(2, dim=0), v[b, :, pad:].repeat_interleave(2, dim=0)
        expected = F.scaled_dot_product_attention(q[b, :, pad:], kr, vr, is_causal=True)
        assert torch.allclose(out[b, pad:].transpose(0, 1), expected, atol=1e-6)
        assert density[b] == 1.0


def test_index_builder_matches_a_hand_made_8x8_case():
    """8 keys, the last 8 queries (all of them). Column 3 and the diagonal at offset 2 carry most of the mass.
    With 1 forced column (0) and 1 forced diagonal (offset 0), 2 of each: columns {0, 3}, offsets {0, 2}."""
    n = 8
    probs = torch.zeros(n, n)
    for i in range(n):
        probs[i, i] = 0.1                        # the main diagonal, forced anyway
        if i >= 3:
            probs[i, 3] += 0.5                   # a vertical line at column 3
        if i >= 2:
            probs[i, i - 2] += 0.3               # a slash at offset 2
        probs[i] /= probs[i].sum()
    columns, offsets = vertical_slash_sets(probs, 2, 2, forced=(1, 1), minimum=(1, 1))
    assert columns.tolist() == [0, 3] and offsets.tolist() == [0, 2]
    # The paper's mask (lines) and the official kernel's coverage with 4-row blocks, by hand:
    lines = [[j <= i and (j in (0, 3) or i - j in (0, 2)) for j in range(n)] for i in range(n)]
    masks = HeadMasks(torch.zeros(1, n, dtype=torch.bool), torch.zeros(1, n, dtype=torch.bool))
    masks.columns[0, columns], masks.diagonals[0, offsets] = True, True
    assert masks.allowed(0, n)[0].tolist() == lines
    # Row block 0 (rows 0-3, end 4): d = 2 -> s = max(2, 4) = 4, range [0, 4); d = 0 -> s = 4, inside.
    # Row block 1 (rows 4-7, end 8): d = 2 -> s = 6, range [2, 6); d = 0 -> s = 8 > 6: extend by a block, [2, 10).
    expected_blocks = [[True] * 4 + [False] * 4, [False] * 2 + [True] * 6]
    assert diagonal_blocks([offsets], n, 4)[0].tolist() == expected_blocks
    kernel = HeadMasks(masks.columns, torch.zeros(1, n, dtype=torch.bool), diagonal_blocks([offsets], n, 4), 4)
    by_hand = [[j <= i and (j in (0, 3) or expected_blocks[i // 4][j]) for j in range(n)] for i in range(n)]
    assert kernel.allowed(0, n)[0].tolist() == by_hand


def test_block_sparse_hand_made_case():
    """n = 8, blocks of 2, top 2: the pooled query of block 3 aligns with key block 1, so block 3 reads blocks
    1 and (next best) one more; blocks 0 and 1 read all their causal blocks (no more than 2)."""
    keys = torch.zeros(8, 2)
    keys[2:4] = torch.tensor([1.0, 0.0])         # key block 1 points along x
    keys[4:6] = torch.tensor([0.0, 1.0])         # key block 2 along y
    keys[6:8] = torch.tensor([0.5, 0.5])
    queries = torch.zeros(8, 2)
    queries[6:8] = torch.tensor([1.0, 0.1])      # query block 3 prefers x, then the diagonal block
    queries[4:6] = torch.tensor([0.0, 1.0])
    chosen = block_sparse_blocks(queries, keys, 2, 2)
    # block 2: scores to blocks 0, 1, 2 = 0, 0, 1 -> 2 and, of the 0-ties, the later block 1
    assert chosen.tolist() == [[True, False, False, False], [True, True, False, False],
                               [False, True, True, False], [False, True, False, True]]
    reference = minference_block_sparse(queries.double().numpy(), keys.double().numpy(), 2, 2)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in chosen] == reference


@pytest.mark.parametrize("n, last_block_reads", [(100, 2), (2000, 32), (2048, 32)])
def test_block_sparse_counts_the_padded_length_as_the_official_code(n, last_block_reads):
    """The official block_sparse_attention pads the prompt to whole blocks of 64 before it counts blocks:
    top min(100, ceil(n / 64)), so the last query block reads ceil(100 / 64) = 2, ceil(2000 / 64) = 32,
    2048 / 64 = 32 blocks (n // 64 would give 1, 31, 32)."""
    generator = torch.Generator().manual_seed(n)
    queries, keys = torch.randn(n, 4, generator=generator), torch.randn(n, 4, generator=generator)
    chosen = block_sparse_blocks(queries, keys, 64, 100)
    assert chosen.shape == (last_block_reads, last_block_reads)
    assert int(chosen[-1].sum()) == last_block_reads


def test_block_sparse_last_partial_block_reads_every_block_on_random_qkv():
    """n = 10, blocks of 4, top 100: ceil(10 / 4) = 3 blocks are read, so every query block reads all its
    causal blocks and the block-sparse head equals dense causal attention, computed here from softmax over
    explicit q.k (with n // 4 = 2 the last block, rows 8 and 9, would read 2 of its 3 blocks)."""
    generator = torch.Generator().manual_seed(3)
    n, dim = 10, 4
    q, k, v = (torch.randn(1, 1, n, dim, generator=generator) for _ in range(3))
    masks = MInference(block_size=4, block_top_k=100).head_masks([("block_sparse", 0, 0)], q[0], k[0])
    out, _, density = sparse_prefill_attention(q, k, v, PrefillPattern([masks], [0]))
    qd, kd, vd = (x[0, 0].double().numpy() for x in (q, k, v))
    logits = [[float(qd[i] @ kd[j]) / math.sqrt(dim) for j in range(i + 1)] for i in range(n)]
    expected = np.stack([np.exp(np.array(row) - max(row)) @ vd[:len(row)] / np.exp(np.array(row) - max(row)).sum()
                         for row in logits])
    assert np.allclose(out[0, :, 0].double().numpy(), expected, atol=1e-5)
    assert density[0] == 1.0


def mixed_table(path, layers=30, heads=9):
    """A table whose heads cycle through the three patterns, small enough to matter on a ~420-token prompt."""
    kinds = [["vertical_and_slash", 40, 120, 1.0], ["stream_llm", 16, 64, 1.0], ["block_sparse", 0, 0, 1.0]]
    path.write_text(json.dumps([{str(h): kinds[(h + layer) % 3] for h in range(heads)} for layer in range(layers)]))
    return str(path)


class Capture:
    def __init__(self, monkeypatch):
        self.calls = []
        real = patched_attention.sparse_prefill_attention

        def wrapped(queries, keys, values, pattern, need_weights=False):
            out, weights, density = real(queries, keys, values, pattern, need_weights)
            self.calls.append((queries, keys, values, pattern, out, weights, density))
            return out, weights, density

        monkeypatch.setattr(patched_attention, "sparse_prefill_attention", wrapped)


def reference_mask(kind, vertical, slash, q, k, source, coverage, block, top_k):
    """The float64 rule for one head -> bool [n, n]; the implementation's own index sets are accepted where
    the float64 scores put them within a near-tie of the cut."""
    n = len(k)
    mask = np.zeros((n, n), dtype=bool)
    if kind == "stream_llm":
        for i in range(n):
            for j in range(i + 1):
                mask[i, j] = j < vertical or i - j < slash
        return mask
    if kind == "block_sparse":
        for m, chosen in enumerate(minference_block_sparse(q, k, block, top_k)):
            for c in chosen:
                mask[m * block:(m + 1) * block, c * block:(c + 1) * block] = True
        return mask
    probs = minference_last_rows(q, k, 64)
    columns, offsets = minference_vertical_slash(probs, vertical, slash)
    got_columns, got_offsets = set(source[1].tolist()), set(source[2].tolist())
    assert len(got_columns) == len(columns) and len(got_offsets) == len(offsets)
    diagonal_scores = np.array([sum(probs[r, n - len(probs) + r - d] for r in range(len(probs))
                                    if n - len(probs) + r - d >= 0) for d in range(n)])
    for chosen, got, scores, forced in ((columns, got_columns, probs.sum(axis=0), 30),
                                        (offsets, got_offsets, diagonal_scores, 100)):
        free = sorted(scores[forced:], reverse=True)
        cut = free[len(chosen) - min(forced, n) - 1]
        for x in chosen ^ got:   # only a near-tie at the cut may differ (float32 scores in the engine)
            assert x >= forced and math.isclose(scores[x], cut, rel_tol=1e-5), (kind, x)
    columns, offsets = got_columns, got_offsets
    mask[:, sorted(columns)] = True
    if coverage == "lines":
        for i in range(n):
            for d in offsets:
                if i - d >= 0:
                    mask[i, i - d] = True
    else:
        for m, cols in enumerate(minference_kernel_columns(offsets, n, block)):
            mask[m * block:(m + 1) * block, sorted(cols)] = True
    return mask


@pytest.mark.parametrize("coverage", ["kernel", "lines"])
def test_masked_prefill_equals_a_float64_reference_on_the_model(smollm2, monkeypatch, tmp_path, coverage):
    """Every layer of a ~420-token prompt, every query head (vertical-slash, A-shape and block-sparse in turn):
    the prefill output equals float64 attention over the mask built from the rule, and the reported density is
    the mask's share of the causal entries."""
    model, tokenizer = smollm2
    table = mixed_table(tmp_path / "mixed.json")
    method = make_method("minference", pattern_table=table, block_size=16, block_top_k=4, slash_coverage=coverage)
    capture = Capture(monkeypatch)
    ids = torch.tensor([tokenizer(STORY * 2, add_special_tokens=False).input_ids])
    prefill(model, ids, method)
    assert len(capture.calls) == model.config.num_hidden_layers
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    rows = load_pattern_table(table)
    for layer, (queries, keys, values, pattern, out, _, density) in enumerate(capture.calls):
        masks = pattern.heads[0]
        computed = 0
        for h in range(queries.shape[1]):
            q, k = queries[0, h].double().numpy(), keys[0, h // group].double().numpy()
            kind, vertical, slash = rows[layer][h]
            mask = reference_mask(kind, vertical, slash, q, k, masks.sources[h], coverage, 16, 4)
            mask &= np.tril(np.ones(mask.shape, dtype=bool))
            computed += int(mask.sum())
            expected, _ = masked_causal_attention(q, k, values[0, h // group].double().numpy(), mask)
            np.testing.assert_allclose(out[0, :, h].double().numpy(), expected, rtol=1e-4, atol=1e-5)
        n = ids.shape[1]
        assert density[0] == pytest.approx(computed / (queries.shape[1] * n * (n + 1) / 2), abs=1e-12)
        assert density[0] < 0.7


def test_scorers_read_the_weights_of_the_sparse_attention(eager_setup, tmp_path):
    """output_attentions returns the masked softmax (0 outside the pattern); H2O's column sums under
    MInference are those of the sparse weights, so it keeps their top tokens."""
    model, ids, dense_attentions, _ = eager_setup
    table = mixed_table(tmp_path / "mixed.json")
    method = make_method("h2o", budget=64, window_size=16, prefill_attention="minference", pattern_table=table,
                         block_size=16, block_top_k=4)
    with torch.no_grad(), compress(model, method) as patch:
        cache = patch.new_cache()
        out = model(ids, past_key_values=cache, use_cache=True, output_attentions=True)
    n = ids.shape[1]
    causal = np.tril(np.ones((n, n), dtype=bool))
    for layer in (0, 7, 29):
        weights = out.attentions[layer][0].double().numpy()                  # [Hq, n, n]
        assert np.allclose(weights.sum(axis=-1), 1, atol=1e-5)
        assert (weights[:, ~causal] == 0).all()
        assert not np.allclose(weights, dense_attentions[layer], atol=1e-3)   # really sparse
        column_sums = weights.sum(axis=1)                                    # [Hq, n]
        group = weights.shape[0] // model.config.num_key_value_heads
        for h, kept in enumerate(cache.kept_positions(layer, 0)):
            scores = column_sums[h * group:(h + 1) * group].mean(axis=0)[:n - 16]
            assert_same_selection({int(p) for p in kept if p < n - 16}, scores, 64 - 16)


def test_batch_of_three_equals_single_runs(smollm2, tmp_path, request):
    model, tokenizer = smollm2
    table = mixed_table(tmp_path / "mixed.json")
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in (STORY * 2, STORY, "<|im_start|>user\nHi")]
    method = make_method("snapkv", budget=96, window_size=16, prefill_attention="minference", pattern_table=table,
                         block_size=16, block_top_k=4)
    assert_batch_equals_alone(model, tokenizer, method, prompts, 8, request)


def test_the_packaged_table_fits_the_default_model(smollm2_path):
    config = AutoConfig.from_pretrained(smollm2_path)
    make_method("minference").check_model(model_shape(config))


@pytest.mark.parametrize("content,message", [
    (lambda: [{str(h): ["vertical_and_slash", 30, 800, 1] for h in range(9)}] * 29, "has 29 layers x 9 query heads"),
    (lambda: [{str(h): ["vertical_and_slash", 30, 800, 1] for h in range(3)}] * 30, "has 30 layers x 3 query heads"),
    (lambda: [{str(h): ["diagonal", 30, 800, 1] for h in range(9)}] * 30, "pattern one of"),
    (lambda: [{str(h): ["vertical_and_slash", -1, 800, 1] for h in range(9)}] * 30, "sizes integers >= 0"),
    (lambda: {"0": ["vertical_and_slash", 30, 800, 1]}, "expected a list of one"),
])
def test_a_pattern_table_of_the_wrong_shape_fails_on_the_config(smollm2_path, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content()))
    config = AutoConfig.from_pretrained(smollm2_path)   # no weights loaded
    with pytest.raises(ValueError, match=message) as error:
        make_method("minference", pattern_table=str(path)).check_model(model_shape(config))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("settings,message", [
    (dict(name="minference", pattern_table="/nonexistent.json"), "is not a file"),
    (dict(name="minference", slash_coverage="blocks"), "slash_coverage must be one of"),
    (dict(name="minference", last_q=0), "last_q must be an integer >= 1"),
    (dict(name="snapkv", budget=64, last_q=32), "is a setting of the prefill attention minference"),
    (dict(name="scissorhands", budget=64, decode_budget=64, prefill_attention="minference"), "does not combine"),
])
def test_bad_settings_fail_with_one_line(settings, message):
    settings = dict(settings)
    with pytest.raises(ValueError, match=message) as error:
        make_method(settings.pop("name"), **settings)
    assert "\n" not in str(error.value)


@pytest.mark.skipif(not torch.cuda.is_available() or minference_kernels() is None,
                    reason="needs CUDA and the optional minference package (not on the CPU test machines)")
def test_cuda_kernels_equal_the_masked_reference():
    q, k, v = [t.cuda().to(torch.bfloat16) for t in random_qkv(bsz=1, heads=2, kv_heads=2, n=512, dim=64)]
    from pyramidkv.sparse_prefill.minference import MInference

    unit = MInference(block_size=64)
    masks = unit.head_masks([("vertical_and_slash", 30, 100), ("stream_llm", 64, 128)], q[0], k[0])
    pattern = PrefillPattern([masks], [0])
    kernel_out, _, _ = sparse_prefill_attention(q, k, v, pattern)
    reference, _, _ = sparse_prefill_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                               PrefillPattern([HeadMasks(masks.columns.cpu(), masks.diagonals.cpu(),
                                                                         masks.blocks.cpu(), 64)], [0]))
    assert torch.allclose(kernel_out.float().cpu(), reference, atol=2e-2)


def test_block_size_is_bounded_by_the_context_window(random_llama):
    """The random Llama has max_position_embeddings 8192: a longer block is refused in one line when
    compress() checks the model (2 ** 62 overflowed a tensor size in generate); 8192 itself runs."""
    from pyramidkv.generation import generate

    model, tokenizer, tables = random_llama
    assert model.config.max_position_embeddings == 8192
    ids = [list(range(10, 90))]
    for block in (8193, 2 ** 62):
        method = make_method("minference", pattern_table=tables["pattern_table"], block_size=block)
        with pytest.raises(ValueError, match=rf"block_size {block} is longer than the model's context window "
                                             r"\(8192 tokens\).*allowed: 1 <= block_size <= 8192"):
            generate(model, tokenizer, ids, method, max_new_tokens=2)
    method = make_method("minference", pattern_table=tables["pattern_table"], block_size=8192)
    assert generate(model, tokenizer, ids, method, max_new_tokens=2, stop_token_ids=[])[0].new_tokens == 2
