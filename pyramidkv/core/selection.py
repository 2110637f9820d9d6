"""Which prompt positions each head keeps: the one selection rule every method shares.

Given scores (higher = keep) for the positions of a left-padded prompt, a head keeps
  * the first `num_sinks` real tokens (attention sinks) and the last `window_size` real tokens
    (the observation window): protected, whatever their scores;
  * of the budget left, the best-scored other tokens; with `random_fraction` > 0, floor(fraction x
    that share) of them are instead drawn without replacement from softmax(score) over the tokens the
    top share did not take (NACL's random eviction), with a generator the caller seeds.
A prompt whose real length is at most the budget is kept whole (SnapKV's rule). Padding is never kept.

Tie-break (documented, deterministic): among equal scores the more recent position wins. Max-pooled
SnapKV scores tie very often, so this matters.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def top_k_recent_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; ties go to the higher index.

    scores: [..., m]. Returns [..., k] indices in ascending order.
    """
    m = scores.shape[-1]
    if not 0 <= k <= m:
        raise ValueError(f"cannot keep {k} of {m} candidates")
    # A stable descending sort keeps equal scores in their input order; flipping
    # first puts later positions ahead among equals.
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(m - 1 - order, dim=-1).values


def sample_without_replacement(scores: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k distinct indices of scores [m], drawn one after the other with probabilities softmax(scores) over
    those not drawn yet (float64). Returns them ascending."""
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    probs = torch.softmax(scores.double().cpu(), dim=-1)
    drawn = torch.multinomial(probs, k, replacement=False, generator=generator)
    return drawn.sort().values.to(scores.device)


def select_kept_positions(
    scores: torch.Tensor,
    pad_len: int,
    head_budgets: Sequence[int],
    window_size: int,
    num_sinks: int = 0,
    random_fraction: float = 0.0,
    generator_for: Optional[Callable[[int], torch.Generator]] = None,
) -> list[torch.Tensor]:
    """Kept positions of one prompt, per head.

    scores: [H, n] for one sample, in padded coordinates (the real prompt is positions pad_len .. n-1).
    head_budgets: tokens to keep per head, sinks and window included.
    generator_for(head): the seeded generator of a head's random share (needed when random_fraction > 0).
    Returns a list of H ascending LongTensors of padded positions.
    """
    num_heads, n = scores.shape
    real_len = n - pad_len
    window = min(window_size, real_len)
    sinks = min(num_sinks, real_len - window)
    budget = head_budgets[0] if len(set(head_budgets)) == 1 else None
    if (budget is not None and window + sinks <= budget < real_len
            and not int(random_fraction * (budget - window - sinks) + 1e-9)):
        # every head the same count, none drawn: one top-k over all heads (each row as the loop below does it)
        first = pad_len + sinks
        chosen = top_k_recent_first(scores[:, first: n - window], budget - window - sinks) + first
        parts = [chosen, torch.arange(n - window, n, device=scores.device).expand(num_heads, window)]
        if sinks:
            parts.insert(0, torch.arange(pad_len, first, device=scores.device).expand(num_heads, sinks))
        return list(torch.cat(parts, 1).unbind(0))
    kept: list[torch.Tensor] = []
    for head, budget in enumerate(head_budgets):
        if budget < window + sinks:
            raise ValueError(f"head budget {budget} is smaller than the window ({window}) plus the sinks ({sinks})")
        if real_len <= budget:
            kept.append(torch.arange(pad_len, n, device=scores.device))
            continue
        first = pad_len + sinks  # the first candidate
        candidates = scores[head, first: n - window]
        selected = budget - window - sinks
        drawn = int(random_fraction * selected + 1e-9)
        chosen = top_k_recent_first(candidates, selected - drawn)
        if drawn:
            rest = torch.ones(candidates.shape[0], dtype=torch.bool, device=scores.device)
            rest[chosen] = False
            others = rest.nonzero().squeeze(1)
            picked = others[sample_without_replacement(candidates[others], drawn, generator_for(head))]
            chosen = torch.cat([chosen, picked]).sort().values
        recent = torch.arange(n - window, n, device=scores.device)
        parts = [chosen + first, recent]
        if sinks:
            parts.insert(0, torch.arange(pad_len, first, device=scores.device))
        kept.append(torch.cat(parts))
    return kept
