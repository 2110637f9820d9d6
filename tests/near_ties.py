"""Near-ties: selections that float rounding decides.

Two runs of the same computation on different shapes (a prompt in a batch and alone) or on different CPU
kernels (AVX2, AVX-512, MKL's reproducibility modes) round differently in the last bits. Where two
candidates' scores differ by less than that, which one a top-k keeps is decided by rounding, not by the
method: the layer-0 keys of one token at two positions have mathematically equal norms (RoPE is a rotation),
so L2Norm ranks them by their rounding. Such a decision is not a disagreement; every other is.

`DecisionLog` records every top-k decision of the selection rule (core/selection.py's select_kept_positions,
as prefill and decode-time re-selection call it) with the candidates' true positions and float64 scores. A
decision's `fragile` positions are the candidates on either side of its cut (kept by rank or not) that have a
candidate on the other side within `RESOLUTION_ULPS` float32 units in the last place, but not bit-equal to it:
bit-equal scores (SnapKV's pooled copies of one value) are ranked by the tie-break, which does not round. A kept
set that differs from another run's is explained when every differing position is fragile in one of the two
runs' decision for it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

# How far apart, in float32 units in the last place of the scores, two candidates may be and still be a
# near-tie. The scores of two runs differ by a few units after 30 layers of differently rounded arithmetic
# (2 seen between a batch and a prompt alone); anything decided by more is the method's decision.
RESOLUTION_ULPS = 8


def ulp32(x: float) -> float:
    return float(np.spacing(np.float32(abs(x))))


def to_mask(positions) -> str:
    """A set of non-negative positions, compact in JSON: a hex bit mask (bit p set: position p), or where shorter
    "r" and its runs ("r0-95,120,130-135")."""
    ordered = sorted({int(p) for p in positions})
    mask = 0
    for p in ordered:
        mask |= 1 << p
    runs: list[list[int]] = []
    for p in ordered:
        if runs and runs[-1][1] == p - 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    ranges = "r" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    hexadecimal = format(mask, "x")
    return ranges if len(ranges) < len(hexadecimal) else hexadecimal


def from_mask(mask: str) -> set[int]:
    if mask.startswith("r"):
        found: set[int] = set()
        for run in filter(None, mask[1:].split(",")):
            first, _, last = run.partition("-")
            found.update(range(int(first), int(last or first) + 1))
        return found
    bits = int(mask, 16)
    return {p for p in range(bits.bit_length()) if bits >> p & 1}


@dataclass
class Decision:
    """One head's top-k at one selection: kind "prefill" or "decode", layer, prompt (batch row), head;
    positions [m] the candidates' true positions (0 = first real token), ascending; scores [m] float64, k how
    many the rank keeps, kept the true positions kept by rank (protected and randomly drawn ones excluded).
    A decision read back from a record has no scores but its fragile positions as computed when recorded."""

    kind: str
    layer: int
    prompt: int
    head: int
    positions: np.ndarray
    scores: Optional[np.ndarray]
    k: int
    kept: frozenset
    recorded_fragile: frozenset = frozenset()

    def row(self) -> list:
        """The decision as a JSON row (no scores): [kind, layer, prompt, head, k, candidates, kept, fragile], the
        position sets as masks (to_mask)."""
        return [self.kind, self.layer, self.prompt, self.head, self.k, to_mask(self.positions.tolist()),
                to_mask(self.kept), to_mask(self.fragile())]

    @classmethod
    def from_row(cls, row: list) -> "Decision":
        kind, layer, prompt, head, k, candidates, kept, fragile = row
        return cls(kind, layer, prompt, head, np.array(sorted(from_mask(candidates))), None, k,
                   frozenset(from_mask(kept)), frozenset(from_mask(fragile)))

    def cut(self) -> tuple[float, float]:
        """(lowest score kept by rank, highest score not kept)."""
        ordered = np.sort(self.scores)[::-1]
        return float(ordered[self.k - 1]), float(ordered[self.k])

    def tolerance(self) -> float:
        low, high = self.cut()
        return RESOLUTION_ULPS * ulp32(max(abs(low), abs(high)))

    def gap_ulps(self) -> float:
        if self.scores is None:
            return float("nan")
        low, high = self.cut()
        return (low - high) / ulp32(max(abs(low), abs(high), 1e-30))

    def fragile(self) -> frozenset:
        """The candidates whose rank rounding decides: those with a candidate on the other side of the cut whose
        score is within the tolerance but not bit-equal (a bit-equal pair, such as two pooled copies of one
        score, is decided by the tie-break, which does not round)."""
        if self.scores is None:
            return self.recorded_fragile
        low, high = self.cut()
        tol = self.tolerance()
        if low - high > tol:
            return frozenset()
        kept = np.isin(self.positions, list(self.kept))
        near = (self.scores >= high - tol) & (self.scores <= low + tol)
        inside, outside = self.scores[near & kept], self.scores[near & ~kept]
        soft = set()
        for side, others, members in ((inside, outside, self.positions[near & kept]),
                                      (outside, inside, self.positions[near & ~kept])):
            for score, position in zip(side, members):
                apart = np.abs(others - score)
                if np.any((apart > 0) & (apart <= tol)):
                    soft.add(int(position))
        return frozenset(soft)

    def same_candidates(self, other: "Decision") -> bool:
        return self.k == other.k and np.array_equal(self.positions, other.positions)


def _caller_locals(depth: int = 2) -> dict:
    return sys._getframe(depth).f_locals


class DecisionLog:
    """Records the selections of everything run inside `with DecisionLog() as log:` (see the module docstring).

    The layer and prompt of a selection are read from its caller (core/prefill.py's kept_positions: layer_idx,
    b, self.pad_lens; core/decoding.py's _reselect: layer_idx, b, r, p): a rename there fails here, loudly. Under
    one budget over all layers (core/running_top.py) a layer's selection is recorded at every cut that changed it."""

    MODULES = ("pyramidkv.core.prefill", "pyramidkv.core.decoding")

    def __init__(self):
        self.decisions: list[Decision] = []
        self._saved: list = []

    def __enter__(self) -> "DecisionLog":
        for name in self.MODULES:
            module = sys.modules.get(name) or __import__(name, fromlist=["_"])
            original = module.select_kept_positions
            kind = "prefill" if name.endswith("prefill") else "decode"
            module.select_kept_positions = self._wrap(original, kind)
            self._saved.append((module, original))
        return self

    def __exit__(self, *exc) -> None:
        for module, original in self._saved:
            module.select_kept_positions = original
        self._saved.clear()

    def _wrap(self, original, kind: str):
        def select(scores, pad_len, head_budgets, window_size, num_sinks=0, random_fraction=0.0, generator_for=None):
            kept = original(scores, pad_len, head_budgets, window_size, num_sinks, random_fraction, generator_for)
            caller = _caller_locals()
            try:
                layer, prompt = caller["layer_idx"], caller["b"]
                if kind == "prefill":
                    pad = caller["self"].pad_lens[prompt]
                    true_positions = [np.arange(scores.shape[1]) - pad] * scores.shape[0]
                    heads = range(scores.shape[0])
                else:
                    held = caller["p"].cpu().numpy()
                    true_positions = [np.concatenate([np.full(pad_len, -1), held])]
                    heads = [caller["r"]]
            except KeyError as missing:
                raise RuntimeError(f"tests/near_ties.py reads {missing} from select_kept_positions' caller in {kind}: "
                                   f"update DecisionLog to the engine's names") from None
            self._record(kind, layer, prompt, heads, scores, pad_len, head_budgets, window_size, num_sinks,
                         random_fraction, kept, true_positions)
            return kept
        return select

    def _record(self, kind, layer, prompt, heads, scores, pad_len, head_budgets, window_size, num_sinks,
                random_fraction, kept, true_positions) -> None:
        """The selection rule's arithmetic as core/selection.py documents it: the real prompt is pad_len..n-1; its
        last min(window, real) tokens and first sinks are protected; of each head's budget the rest is the top
        (selected - floor(random_fraction x selected)) by score among the candidates in between."""
        n = scores.shape[1]
        real = n - pad_len
        window = min(window_size, real)
        sinks = min(num_sinks, real - window)
        values = scores.detach().double().cpu().numpy()
        for row, (head, budget) in enumerate(zip(heads, head_budgets)):
            if real <= budget:
                continue
            first, stop = pad_len + sinks, n - window
            selected = budget - window - sinks
            k = selected - int(random_fraction * selected + 1e-9)
            if k == 0 or k >= stop - first:
                continue
            candidates = np.arange(first, stop)
            chosen = kept[row].cpu().numpy()
            by_rank = chosen[(chosen >= first) & (chosen < stop)]
            if random_fraction:   # the rank's share: the k best of what was kept (the drawn ones rank below)
                by_rank = by_rank[np.argsort(-values[row, by_rank], kind="stable")[:k]]
            positions = true_positions[row]
            self.decisions.append(Decision(kind, layer, prompt, head, positions[candidates], values[row, candidates],
                                           k, frozenset(positions[by_rank].tolist())))

    def of(self, prompt: int, kind: Optional[str] = None) -> list[Decision]:
        """The decisions for one batch row, in the order they were made."""
        return [d for d in self.decisions if d.prompt == prompt and (kind is None or d.kind == kind)]


@dataclass
class NearTie:
    """A decision two runs made on the same candidates, their kept sets differing only in positions that
    rounding decides."""

    decision: Decision
    differing: frozenset

    def __str__(self) -> str:
        d = self.decision
        return (f"{d.kind} layer {d.layer} head {d.head}: positions {sorted(self.differing)} within "
                f"{RESOLUTION_ULPS} float32 ulps of the cut (gap {d.gap_ulps():.1f} ulps)")


class Disagreement(AssertionError):
    pass


def near_ties(ours: list[Decision], theirs: list[Decision]) -> list[NearTie]:
    """The near-ties between two runs' decision sequences for one prompt; raises Disagreement where they part
    otherwise: on other candidates (an earlier, unrecorded difference) or by more than rounding.

    Prefill decisions are compared all: each layer's selection reads only the prompt's own K/V and scores, so
    a near-tie in one layer leaves the others' decisions comparable. Decode-time decisions are compared until
    the first near-tie: from then on the two runs attend over different tokens and may part anywhere."""
    ties: list[NearTie] = []
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if ties and (a.kind == "decode" or b.kind == "decode"):
            break
        if (a.kind, a.layer, a.head) != (b.kind, b.layer, b.head) or not a.same_candidates(b):
            raise Disagreement(f"decision {index}: {a.kind} layer {a.layer} head {a.head} ranks other candidates "
                               f"than {b.kind} layer {b.layer} head {b.head} (positions or k differ)")
        if a.kept == b.kept:
            continue
        differing = a.kept ^ b.kept
        if not differing <= (a.fragile() | b.fragile()):
            raise Disagreement(f"decision {index}: {a.kind} layer {a.layer} head {a.head} keeps "
                               f"{sorted(a.kept - b.kept)} instead of {sorted(b.kept - a.kept)}; the cut's gap is "
                               f"{a.gap_ulps():.0f} and {b.gap_ulps():.0f} float32 ulps, more than the "
                               f"{RESOLUTION_ULPS} rounding can move")
        ties.append(NearTie(a, differing))
    else:
        if len(ours) != len(theirs) and not ties:
            raise Disagreement(f"{len(ours)} decisions against {len(theirs)}: the runs made different selections")
    return ties


def report(request, text: str) -> None:
    """Counts a near-tie for the session summary (conftest.py prints them; works under xdist)."""
    request.node.user_properties.append(("near_tie", text))
