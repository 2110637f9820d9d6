"""Our kept sets equal kvpress's on the same model and prompt, where the definitions agree (issue 27).

The reference is kvpress itself: tests/data/kvpress_reference.json, made by scripts/kvpress_reference.py in a
separate venv (kvpress 0.5.5, transformers 5.2, the recipe is in its docstring) on SmolLM2-135M-Instruct,
float32, sdpa, from the 600 token ids it records (kvpress KVzip's chat-template prefix, then LongBench text).
It holds kvpress's kept positions per layer and KV head and the raw scores its presses computed.

kvpress's compression_ratio r is the fraction removed; its ScorerPress keeps int(n (1 - r)) tokens per KV head,
which we ask for as budget=int(n (1 - r)) (exact; budget_ratio would round). Both sides compute in float32 with
different attention code, so a position may differ only where kvpress's own score lies within REL_TOL of the
cut-off (a near-tie). Where a definition differs, the case says how the comparison accounts for it.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pyramidkv import make_method
from tests.helpers import prefill

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "kvpress_reference.json"
REL_TOL = 1e-4
RATIOS = (0.5, 0.75)

# kvpress case in the fixture -> (our method, our settings, comparison). Our settings are those that give
# kvpress's definition; the rest are each method's defaults (issue 27, shared/LEADERS.md sections 1-4).
CASES = {
    # KeyDiff: -cos(k, mean of the normalised keys) per KV head, no sinks, no window, on both sides.
    "keydiff": ("keydiff", {"window_size": 0}, "per_head"),
    # TOVA: the last query's attention averaged over all 9 query heads, one kept set per layer. kvpress FORCES
    # the last token kept (score max + 1) and ranks the others; the official rule (ours) ranks the last token by
    # its own attention weight like any other. See tova_candidates.
    "tova": ("tova", {"window_size": 0}, "tova"),
    # Expected Attention, kvpress's defaults (epsilon 0, 512 future positions, covariance, value norms); its 4
    # sinks score max + 1, so they are kept and sit inside the budget, as our num_sinks do. No window in kvpress.
    "expected_attention": ("expected_attention", {"window_size": 0}, "per_head"),
    "expected_attention_eps1e-2": ("expected_attention", {"window_size": 0, "epsilon": 1e-2}, "per_head"),
    # The leaderboard's entry: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)). kvpress's AdaKV gives each head
    # its top max(1, int(0.2 k)) scores first (the safeguard), then keeps the layer's H k highest scores over
    # all heads. That is NOT the AdaKV paper's alpha blend (pyramidkv/allocation/adakv.py: floor 0.2 k +
    # 0.8 x the head's share of the global top H k): `ada_expected_attention` matches only if it uses
    # kvpress's safeguard rule. The layer total H k is the same either way. Measured with AdaKVHeads(floor_ratio
    # 0.2) (wip/i27b): 760 of 27,000 kept entries at r = 0.5 and 543 of 13,500 at 0.75 sit on other heads.
    "adakv_expected_attention_eps1e-2": ("ada_expected_attention", {"window_size": 0}, "per_layer"),
    # KVzip: scores = max over the repeat pass's queries and the group's query heads of the attention each
    # context key receives; one budget over every layer, head and position. The fixture's reference here is
    # KVzipPress(n_sink=<template prefix length>): the whole prefix is kept and is the softmax's sink part, as
    # in the authors' code. kvpress's default (case "kvzip") protects the first 4 tokens only, attends to those
    # 4 in the scoring softmax (different denominators: other scores, not only ties) and prunes the prefix's
    # other tokens first (score 0). One 2048-token chunk (kvpress) or 2000 (authors) covers this 600-token
    # prompt, and the repeat prompt for chunk 0 is the same in both: "\n\nRepeat the previous context exactly."
    # + "<|im_end|>\n<|im_start|>assistant\n" + the context. The counts differ (kvpress prunes exactly
    # int(L H n r) including the prefix; the authors keep int(N (1 - r)) - 1 context entries above a strict
    # threshold), so the comparison is: our kept context entries are the top-m of kvpress's context scores over
    # all layers and heads, m being however many we keep. Our kvzip's defaults are this rule (its prefix: the
    # template's 24 tokens; no suffix: the prompt ends with the context; one chunk of 2,000).
    "kvzip_prefix_sinks": ("kvzip", {}, "global"),
}


@functools.lru_cache(maxsize=1)
def reference() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def reference_scores(name: str) -> np.ndarray:
    """kvpress's raw scores [L, H, n] of one score set (float32 as kvpress computed them)."""
    ref = reference()
    n, heads = ref["prompt"]["length"], ref["model"]["kv_heads"]
    layers = [np.frombuffer(base64.b64decode(text), dtype="<f4").reshape(-1, n) for text in ref["scores"][name]]
    return np.stack([np.broadcast_to(layer, (heads, n)) for layer in layers]).astype(np.float64)


def reference_run(case: str, ratio: float) -> dict:
    return next(run for run in reference()["runs"] if run["case"] == case and run["compression_ratio"] == ratio)


def reference_kept(run: dict) -> list[list[set[int]]]:
    """kvpress's kept positions per layer and KV head (the fixture stores packed bit masks)."""
    n = reference()["prompt"]["length"]
    return [[set(np.flatnonzero(np.unpackbits(np.frombuffer(bytes.fromhex(mask), np.uint8))[:n]).tolist())
             for mask in layer] for layer in run["kept"]]


def our_kept(model, ids: torch.Tensor, method, tokenizer=None) -> list[list[set[int]]]:
    cache = prefill(model, ids, method, tokenizer=tokenizer)
    return [[set(p.tolist()) for p in cache.kept_positions(layer, 0)] for layer in range(model.config.num_hidden_layers)]


def assert_differ_only_at_ties(ours: set, theirs: set, scores, cut: float, where: str):
    """Every position kept by one side only scores (by kvpress) within REL_TOL of the cut-off."""
    for position in sorted(ours ^ theirs):
        score = scores[position]
        assert abs(score - cut) <= REL_TOL * abs(cut), (
            f"{where}: position {position} kept by {'us' if position in ours else 'kvpress'} only; kvpress scores it "
            f"{score:.7g}, its cut-off is {cut:.7g}")


def kth_highest(values, k: int) -> float:
    return float(np.sort(np.asarray(values).ravel())[::-1][k - 1])


def adakv_rule(scores: np.ndarray, k: int) -> tuple[list[set[int]], float, list[float]]:
    """kvpress AdaKVPress on one layer's scores [H, n]: each head's top max(1, int(0.2 k)) become +inf (the
    safeguard), then the layer keeps its H k highest entries. (kept per head, the layer's cut-off, each head's
    safeguard cut-off)."""
    heads = scores.shape[0]
    n_safe = max(1, int(0.2 * k))
    effective = scores.copy()
    for head in range(heads):
        effective[head, np.argsort(-scores[head], kind="stable")[:n_safe]] = np.inf
    order = np.argsort(-effective.ravel(), kind="stable")[:heads * k]
    kept = [set() for _ in range(heads)]
    for index in order.tolist():
        kept[index // scores.shape[1]].add(index % scores.shape[1])
    return kept, kth_highest(effective, heads * k), [kth_highest(row, n_safe) for row in scores]


def assert_adakv_ties(ours: set, theirs: set, scores, cut: float, safe_cut: float, where: str):
    """Positions kept by one side only lie within REL_TOL of the layer's cut-off or the head's safeguard one."""
    for position in sorted(ours ^ theirs):
        score = scores[position]
        assert min(abs(score - cut), abs(score - safe_cut)) <= REL_TOL * max(abs(cut), abs(safe_cut)), (
            f"{where}: position {position} kept by {'us' if position in ours else 'kvpress'} only; kvpress scores it "
            f"{score:.7g}, its cut-offs are {cut:.7g} (layer) and {safe_cut:.7g} (safeguard)")


def test_fixture_is_kvpress_selection_of_its_scores():
    """The fixture's kept sets are what kvpress's rule gives on the fixture's scores (up to float ties): the
    reference is self-consistent, so a mismatch below is ours. Also its size and versions, as documented."""
    ref = reference()
    n, layers, heads = ref["prompt"]["length"], ref["model"]["layers"], ref["model"]["kv_heads"]
    assert n == len(ref["prompt"]["token_ids"]) == 600 and ref["versions"]["kvpress"] == "0.5.5"
    assert FIXTURE.stat().st_size < 2_000_000
    for run in ref["runs"]:
        k = int(n * (1 - run["compression_ratio"]))
        kept, scores = reference_kept(run), reference_scores(run["scores"])
        where = f"{run['case']} r={run['compression_ratio']}"
        if run["case"] in ("keydiff", "tova", "expected_attention", "expected_attention_eps1e-2"):
            for layer in range(layers):
                for head in range(heads):
                    assert len(kept[layer][head]) == k
                    top = set(np.argsort(-scores[layer, head], kind="stable")[:k].tolist())
                    assert_differ_only_at_ties(kept[layer][head], top, scores[layer, head],
                                               kth_highest(scores[layer, head], k), f"{where} layer {layer} head {head}")
        elif run["case"].startswith("adakv"):
            for layer in range(layers):
                top, cut, safe_cuts = adakv_rule(scores[layer], k)
                assert sum(map(len, kept[layer])) == heads * k, where
                for head in range(heads):
                    assert_adakv_ties(kept[layer][head], top[head], scores[layer, head], cut, safe_cuts[head],
                                      f"{where} layer {layer} head {head}")
        else:  # KVzipPress: its n_sink first scores become max + 1, then the bottom int(N r) go, over the whole
            # model (layerwise: int(H n r) in each layer)
            effective = scores.copy()
            effective[:, :, :run["settings"]["n_sink"]] = scores.max() + 1
            groups = effective.reshape(layers, -1) if run["settings"]["layerwise"] else effective.reshape(1, -1)
            kept_flat = np.zeros(effective.shape, dtype=bool)
            for layer in range(layers):
                for head in range(heads):
                    kept_flat[layer, head, sorted(kept[layer][head])] = True
            for group, mask in zip(groups, kept_flat.reshape(len(groups), -1)):
                m = group.size - int(group.size * run["compression_ratio"])
                assert mask.sum() == m, where
                top = set(np.argsort(-group, kind="stable")[:m].tolist())
                assert_differ_only_at_ties(set(np.flatnonzero(mask).tolist()), top, group, kth_highest(group, m), where)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("case", list(CASES))
def test_kept_sets_equal_kvpress(smollm2, case, ratio):
    name, settings, comparison = CASES[case]
    model, tokenizer = smollm2
    ref = reference()
    ids = torch.tensor([ref["prompt"]["token_ids"]])
    n, heads = ids.shape[1], ref["model"]["kv_heads"]
    k = int(n * (1 - ratio))
    run = reference_run(case, ratio)
    theirs, scores = reference_kept(run), reference_scores(run["scores"])
    if comparison == "global":
        method = make_method(name, compression_ratio=ratio, **settings)
    else:
        method = make_method(name, budget=k, **settings)
    ours = our_kept(model, ids, method, tokenizer)
    layers = range(len(ours))

    if comparison == "per_head":
        for layer in layers:
            for head in range(heads):
                where = f"{case} r={ratio} layer {layer} head {head}"
                assert len(ours[layer][head]) == k, where
                assert_differ_only_at_ties(ours[layer][head], theirs[layer][head], scores[layer, head],
                                           kth_highest(scores[layer, head], k), where)

    elif comparison == "tova":
        last = n - 1
        for layer in layers:
            assert all(kept == ours[layer][0] for kept in ours[layer]), f"tova layer {layer}: heads differ"
            kept = ours[layer][0]
            assert len(kept) == k, layer
            # Without the forced last token both rules rank positions 0..n-2 by the same attention weights: ours,
            # less the last token if we kept it, are the top of kvpress's scores over those positions.
            m = k - (last in kept)
            others = scores[layer, 0, :last]
            top = set(np.argsort(-others, kind="stable")[:m].tolist())
            assert_differ_only_at_ties(kept - {last}, top, others, kth_highest(others, m), f"tova r={ratio} layer {layer}")
            if last in kept:
                assert_differ_only_at_ties(kept, theirs[layer][0], scores[layer, 0], kth_highest(others, m),
                                           f"tova r={ratio} layer {layer}")

    elif comparison == "per_layer":
        for layer in layers:
            _, cut, safe_cuts = adakv_rule(scores[layer], k)
            assert sum(map(len, ours[layer])) == heads * k, layer
            for head in range(heads):
                assert_adakv_ties(ours[layer][head], theirs[layer][head], scores[layer, head], cut, safe_cuts[head],
                                  f"ada r={ratio} layer {layer} head {head}")

    else:  # global
        prefix = ref["prompt"]["prefix_length"]
        for layer in layers:
            for head in range(heads):
                assert set(range(prefix)) <= ours[layer][head], f"kvzip layer {layer} head {head}: prefix evicted"
        context = scores[:, :, prefix:]                                    # [L, H, n - prefix]
        flat = context.ravel()
        ours_flat = {(layer * heads + head) * (n - prefix) + p - prefix
                     for layer in layers for head in range(heads) for p in ours[layer][head] if p >= prefix}
        theirs_flat = {(layer * heads + head) * (n - prefix) + p - prefix
                       for layer in layers for head in range(heads) for p in theirs[layer][head] if p >= prefix}
        m = len(ours_flat)
        assert 0 < m < flat.size, m
        top = set(np.argsort(-flat, kind="stable")[:m].tolist())
        assert_differ_only_at_ties(ours_flat, top, flat, kth_highest(flat, m), f"kvzip r={ratio} (flat index)")
        # Both are thresholds on the same scores: the smaller kept set lies inside the larger one (up to ties).
        small, large = sorted((ours_flat, theirs_flat), key=len)
        cut = kth_highest(flat, len(large))
        for index in small - large:
            assert abs(flat[index] - cut) <= REL_TOL * abs(cut), f"kvzip r={ratio}: flat index {index}"
