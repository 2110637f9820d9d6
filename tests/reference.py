"""Independent reference computations for the tests: numpy, straight from eager attention weights.

Nothing here imports pyramidkv's scoring or selection code.
"""

from __future__ import annotations

import math

import numpy as np


def pool_1d(x: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """Stride-1 pooling over the last axis with kernel//2 padding (max pads -inf; avg counts the zero padding)."""
    half = kernel // 2
    m = x.shape[-1]
    out = np.empty_like(x)
    for j in range(m):
        lo, hi = max(0, j - half), min(m, j + half + 1)
        window = x[..., lo:hi]
        out[..., j] = window.max(axis=-1) if how == "max" else window.sum(axis=-1) / kernel
    return out


def reduce_groups(scores: np.ndarray, num_kv_heads: int, how: str) -> np.ndarray:
    hq, m = scores.shape
    g = scores.reshape(num_kv_heads, hq // num_kv_heads, m)
    return {"mean": g.mean(axis=1), "max": g.max(axis=1), "sum": g.sum(axis=1)}[how]


def top_positions(scores: np.ndarray, k: int) -> set[int]:
    """Top k of a 1-D score vector; ties go to the higher index."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], -j))
    return set(order[:k])


def snapkv_scores(attn: np.ndarray, window: int, kernel: int, pooling: str) -> np.ndarray:
    """attn: [H, n, n] eager attention probabilities of one layer -> [H, n - window] pooled scores."""
    n = attn.shape[-1]
    summed = attn[:, n - window :, : n - window].sum(axis=1)
    return pool_1d(summed, kernel, pooling)


def snapkv_scores_reduce_then_pool(attn: np.ndarray, num_kv_heads: int, how: str, window: int, kernel: int,
                                   pooling: str) -> np.ndarray:
    """The public code's GQA order: window sums per query head, reduced over each group, THEN pooled.

    attn: [Hq, n, n] -> [Hkv, n - window]."""
    n = attn.shape[-1]
    summed = attn[:, n - window :, : n - window].sum(axis=1)
    return pool_1d(reduce_groups(summed, num_kv_heads, how), kernel, pooling)


def h2o_scores(attn: np.ndarray, window: int) -> np.ndarray:
    """Column sums of the full causal attention matrix over the candidates [0, n - window)."""
    n = attn.shape[-1]
    return attn.sum(axis=1)[:, : n - window]


def l2norm_scores(keys: np.ndarray, window: int) -> np.ndarray:
    """keys: [H, n, D] -> negative key norms of the candidates."""
    n = keys.shape[1]
    return -np.linalg.norm(keys[:, : n - window], axis=-1)


def pyramid_counts(selected: int, num_layers: int, beta: float) -> list[int]:
    """PyramidKV's linear schedule, apportioned to integers that sum to num_layers * selected."""
    low = selected / beta
    high = 2 * selected - low
    exact = np.linspace(high, low, num_layers)
    counts = np.floor(exact).astype(int)
    missing = num_layers * selected - counts.sum()
    frac = exact - counts
    # largest remainders first, lower layer on ties
    order = np.lexsort((np.arange(num_layers), -np.round(frac, 12)))
    counts[order[:missing]] += 1
    return counts.tolist()


def assert_same_selection(kept: set[int], scores: np.ndarray, k: int, offset: int = 0, rel_tol: float = 1e-4):
    """kept (absolute positions) must be the top-k of scores (candidate j at position offset + j).

    Where the two computations order near-equal floats differently, a mismatch is
    accepted only if every differing candidate scores within rel_tol of the cut-off.
    """
    ref = {offset + j for j in top_positions(scores, k)}
    if kept == ref:
        return
    cutoff = sorted(scores, reverse=True)[k - 1]
    tol = rel_tol * max(1e-6, abs(cutoff))
    for pos in kept ^ ref:
        j = pos - offset
        assert 0 <= j < len(scores), f"kept position {pos} is not a candidate"
        assert math.isclose(scores[j], cutoff, rel_tol=0, abs_tol=tol), (
            f"position {pos} (score {scores[j]:.6g}) differs from the reference selection; cut-off {cutoff:.6g}")


# ---- merge rules (../shared/ADAPTIVE.md, "Merging evicted tokens"), one token at a time ----------------
def ref_route(evicted_keys, kept_keys):
    """Per evicted token: (cosine to its most similar kept key, that kept index); ties -> lowest index."""
    def unit(x):
        norms = np.linalg.norm(x, axis=-1, keepdims=True)
        return x / np.where(norms == 0, 1, norms)
    sims = unit(evicted_keys) @ unit(kept_keys).T  # [e, k]
    targets = [int(np.flatnonzero(row == row.max())[0]) for row in sims]
    return np.array([sims[i, t] for i, t in enumerate(targets)]), targets


def ref_pivot(kept, evicted, targets):
    out = kept.copy()
    for j in range(len(kept)):
        members = [kept[j]] + [(evicted[i] + kept[j]) / 2 for i, t in enumerate(targets) if t == j]
        out[j] = np.mean(members, axis=0)
    return out


def ref_weighted(kept, evicted, targets, weights):
    out = kept.copy()
    for j in range(len(kept)):
        mine = [i for i, t in enumerate(targets) if t == j]
        total = kept[j] + sum(weights[i] * evicted[i] for i in mine)
        out[j] = total / (1 + sum(weights[i] for i in mine))
    return out


def ref_mergingpress(kept_keys, kept_values, evicted_keys, evicted_values, threshold, fraction):
    sims, targets = ref_route(evicted_keys, kept_keys)
    eligible = [i for i in range(len(sims)) if sims[i] >= threshold]
    if fraction < 1:
        # highest similarity first, the earlier position first among equals
        ranked = sorted(eligible, key=lambda i: (-sims[i], i))
        eligible = ranked[:round(fraction * len(eligible))]
    weights = np.zeros(len(sims))
    for i in eligible:
        v_e, v_t = np.linalg.norm(evicted_values[i]), np.linalg.norm(kept_values[targets[i]])
        weights[i] = max(sims[i], 0.0) * v_e / (v_e + v_t + 1e-6)
    return ref_weighted(kept_values, evicted_values, targets, weights)


def ref_cam(kept_positions, kept_values, evicted_positions, evicted_values, attention, window, start_ratio, spread,
            draws=None):
    n = len(attention)
    start = math.ceil(start_ratio * n)
    reference = max(list(attention[:start]) + list(attention[n - window:]))
    out = kept_values.copy()
    for i, position in enumerate(evicted_positions):
        if position < start:
            continue
        p = min(max(attention[position] / reference, 0.0), 1.0)
        if draws is not None:
            p = draws[i]
        later = [j for j, kept in enumerate(kept_positions) if kept > position][:spread]
        for j in later:
            out[j] = out[j] + p * evicted_values[i] / spread
    return out


# ---- queries of a plain transformers forward (ThinK's channel scores) ---------------------------------
def prompt_queries_and_keys(model, ids) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer the post-RoPE queries [Hq, n, D] and keys [Hkv, n, D] (float64) of an unpatched forward of
    `ids` [1, n]: queries recomputed from each attention module's input with transformers' own RoPE."""
    import torch
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    queries = {}

    def grab(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        bsz, n, _ = hidden.shape
        q = module.q_proj(hidden).view(bsz, n, module.num_heads, module.head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        queries[module.layer_idx] = apply_rotary_pos_emb(q, q, cos, sin)[0][0].double().numpy()

    layers = model.model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            out = model(ids, past_key_values=DynamicCache(), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    keys = [out.past_key_values[layer][0][0].double().numpy() for layer in range(len(layers))]
    return [queries[layer] for layer in range(len(layers))], keys


# ---- Quest (../shared/NEXT_METHODS.md section 1.10), float64, one segment ------------------------------
def quest_page_bounds(keys: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """keys [n, D] -> (mins, maxs) [pages, D] over pages of `size` tokens aligned at 0, the last one partial."""
    pages = [keys[p:p + size] for p in range(0, len(keys), size)]
    return np.stack([p.min(axis=0) for p in pages]), np.stack([p.max(axis=0) for p in pages])


def quest_criticality(query: np.ndarray, mins: np.ndarray, maxs: np.ndarray) -> np.ndarray:
    """U_p = sum_c max(q_c m_c, q_c M_c) for query [D] -> [pages]."""
    return np.maximum(query * mins, query * maxs).sum(axis=1)


def quest_pages(scores: np.ndarray, k: int, forced: tuple[int, ...] = ()) -> list[int]:
    """The k best pages (the forced ones first), ties to the later page."""
    rest = sorted((p for p in range(len(scores)) if p not in forced), key=lambda p: (-scores[p], -p))
    return list(forced) + rest[:k - len(forced)]


def quest_attention(query: np.ndarray, keys: np.ndarray, values: np.ndarray, pages: list[int],
                    size: int) -> np.ndarray:
    """Softmax attention of query [D] over the tokens of `pages` only (-inf elsewhere) -> [D]."""
    allowed = np.zeros(len(keys), dtype=bool)
    for p in pages:
        allowed[p * size:(p + 1) * size] = True
    logits = np.where(allowed, keys @ query / math.sqrt(len(query)), -np.inf)
    weights = np.exp(logits - logits.max())
    return (weights / weights.sum()) @ values


# ---- MiniCache (../shared/NEXT_METHODS.md section 4.9), float64 ----------------------------------------
def minicache_merge(lower: np.ndarray, upper: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """lower, upper [n, D] -> (unit direction [n, D], norms [n, 2], angular distance [n] = Omega / pi), token by
    token with the SLERP formula (the lerp limit when the vectors are parallel)."""
    directions, norms, distances = [], [], []
    for a, b in zip(lower, upper):
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        ua, ub = a / na, b / nb
        omega = math.acos(min(1.0, max(-1.0, float(ua @ ub))))
        if math.sin(omega) < 1e-6:
            e = (1 - t) * ua + t * ub
        else:
            e = math.sin((1 - t) * omega) / math.sin(omega) * ua + math.sin(t * omega) / math.sin(omega) * ub
        directions.append(e / np.linalg.norm(e))
        norms.append([na, nb])
        distances.append(omega / math.pi)
    return np.array(directions), np.array(norms), np.array(distances)


def minicache_restore(lower: np.ndarray, upper: np.ndarray, t: float, retain: float) -> tuple[np.ndarray, np.ndarray]:
    """What each layer reads back: norm x direction, the ceil(retain n) pairs of largest distance (ties: the
    later token) as they were."""
    directions, norms, distances = minicache_merge(lower, upper, t)
    restored_lower, restored_upper = directions * norms[:, :1], directions * norms[:, 1:]
    count = math.ceil(retain * len(lower) - 1e-9) if retain > 0 else 0
    for j in top_positions(distances, count):
        restored_lower[j], restored_upper[j] = lower[j], upper[j]
    return restored_lower, restored_upper


# ---- MInference (../shared/NEXT_METHODS.md section 6.9), float64, one head -----------------------------
def minference_last_rows(queries: np.ndarray, keys: np.ndarray, last_q: int) -> np.ndarray:
    """Causal softmax [r, n] of the last r = min(last_q, n) queries over all keys."""
    n, dim = keys.shape
    r = min(last_q, n)
    logits = queries[n - r:] @ keys.T / math.sqrt(dim)
    for row in range(r):
        logits[row, n - r + row + 1:] = -np.inf
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def minference_vertical_slash(probs: np.ndarray, vertical: int, slash: int, forced=(30, 100),
                              minimum=(30, 50)) -> tuple[set[int], set[int]]:
    """(columns, diagonal offsets): the forced ones first, then the best sums; ties to the later column and
    the more recent (smaller) offset."""
    r, n = probs.shape
    column_scores = probs.sum(axis=0)
    diagonal_scores = np.zeros(n)
    for row in range(r):
        i = n - r + row
        for j in range(i + 1):
            diagonal_scores[i - j] += probs[row, j]
    columns = sorted(range(n), key=lambda j: (j >= forced[0], -column_scores[j], -j))
    offsets = sorted(range(n), key=lambda d: (d >= forced[1], -diagonal_scores[d], d))
    return set(columns[:min(n, max(vertical, minimum[0]))]), set(offsets[:min(n, max(slash, minimum[1]))])


def minference_kernel_columns(offsets: set[int], n: int, block: int) -> list[set[int]]:
    """Per row block, the columns the official CUDA index builder gives its diagonals (a line-by-line
    reading of `convert_vertical_slash_indexes_kernel`: ranges of `block` columns ending at end - d)."""
    out = []
    for start_m in range(0, n, block):
        end_m = start_m + block
        ordered = [d for d in sorted(offsets, reverse=True) if d < end_m]
        ranges = []
        range_start = range_end = None
        for d in ordered:
            s = max(end_m - d, block)
            if range_end is None:
                range_start, range_end = s - block, s
            elif s > range_end + block:
                ranges.append((range_start, range_end))
                range_start, range_end = s - block, s
            elif s > range_end:
                range_end += block
        if range_end is not None:
            ranges.append((range_start, range_end))
        out.append({j for a, b in ranges for j in range(a, b) if j < n})
    return out


def minference_block_sparse(queries: np.ndarray, keys: np.ndarray, block: int, top_k: int) -> list[set[int]]:
    """Per query block, the key blocks it reads: zero-padded mean pooling, causal block scores, the top
    min(top_k, ceil(n / block)) (the official code counts the padded length; all causal blocks when there are
    no more); ties to the later block."""
    n, dim = keys.shape
    count = -(-n // block)

    def pool(x):
        padded = np.zeros((count * block, dim))
        padded[:n] = x
        return padded.reshape(count, block, dim).mean(axis=1)

    scores = pool(queries) @ pool(keys).T
    k = min(top_k, count)
    return [set(range(m + 1)) if m + 1 <= k else set(sorted(range(m + 1), key=lambda c: (-scores[m, c], -c))[:k])
            for m in range(count)]


def masked_causal_attention(queries: np.ndarray, keys: np.ndarray, values: np.ndarray,
                            mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention over the entries of mask [n, n] (causal applied too) -> (output [n, D], probs [n, n])."""
    n, dim = keys.shape
    allowed = mask & np.tril(np.ones((n, n), dtype=bool))
    logits = np.where(allowed, queries @ keys.T / math.sqrt(dim), -np.inf)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = e / e.sum(axis=1, keepdims=True)
    return probs @ values, probs
