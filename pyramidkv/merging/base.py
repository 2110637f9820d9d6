"""What a merge rule is: the third axis of a method (after scoring and budget allocation).

Selection decides WHICH prompt positions a head keeps; a merge rule then decides WHAT is stored
in them, folding the evicted tokens into the kept ones instead of dropping them. It never
changes the kept positions, and only real (non-padding) evicted tokens are merge sources.

The core calls `merge_prompt` once per prompt and layer, after selection and before storage.
A rule sees the heads of one prompt that keep the same count at once (`MergeGroup`: all heads
under a uniform split, one head at a time under a ragged one) and returns the kept keys and
values to store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch
import torch.nn.functional as F

from pyramidkv.components import Component


@dataclass
class MergeGroup:
    """Heads of one prompt (at one layer) that keep the same number k of tokens.

    Positions count from the prompt's first real token, ascending.
    kept_keys, kept_values: [H, k, D]; kept_positions: [H, k].
    evicted_keys, evicted_values: [H, e, D]; evicted_positions: [H, e] (e >= 1).
    attention: [H, n] mean attention of the observation window's queries to each of the n real
        prompt tokens (only for rules with `needs_attention`).
    window_size: the method's observation window (the last min(window_size, n) tokens).
    generator: seeded random generator for rules that sample (None otherwise).
    """

    kept_keys: torch.Tensor
    kept_values: torch.Tensor
    kept_positions: torch.Tensor
    evicted_keys: torch.Tensor
    evicted_values: torch.Tensor
    evicted_positions: torch.Tensor
    attention: Optional[torch.Tensor] = None
    window_size: int = 0
    generator: Optional[torch.Generator] = None


@dataclass(frozen=True)
class MergeRule(Component):
    """Base of the merge rules. Implement `merge`; settings are the dataclass fields."""

    needs_attention: ClassVar[bool] = False  # the core computes MergeGroup.attention for the rule

    def merge(self, group: MergeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """New kept keys and values [H, k, D], in the dtype of group.kept_keys."""
        raise NotImplementedError

    def check_method(self, method) -> None:
        """Raise ValueError if this rule cannot work with `method`'s settings."""

    def seed_for(self, layer_idx: int) -> Optional[int]:
        """Seed of the layer's random generator for rules that sample; None: the rule draws nothing.
        One generator per prompt and layer, so a prompt's draws do not depend on its batch."""
        return None


def most_similar_kept(evicted_keys: torch.Tensor, kept_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each evicted token the kept token whose key is most cosine-similar (float32).

    evicted_keys: [H, e, D]; kept_keys: [H, k, D]. Returns (similarity [H, e], target [H, e] index into k).
    Ties go to the earliest kept token (the lowest index). A zero key has similarity 0 to everything."""
    evicted = F.normalize(evicted_keys.float(), dim=-1)
    kept = F.normalize(kept_keys.float(), dim=-1)
    similarity = torch.matmul(evicted, kept.transpose(-1, -2))  # [H, e, k]
    best, target = similarity.max(dim=-1)
    return best, target


def weighted_fold(kept: torch.Tensor, sources: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """kept_j <- (kept_j + sum_{i -> j} w_i src_i) / (1 + sum_{i -> j} w_i), in float32; rows that receive
    no weight are returned unchanged (bit-identical). kept: [H, k, D]; sources: [H, e, D];
    target: [H, e] index into k; weight: [H, e]. Returns [H, k, D] in kept's dtype."""
    heads, k, dim = kept.shape
    weight = weight.float()
    mass = torch.zeros(heads, k, dtype=torch.float32, device=kept.device).scatter_add_(1, target, weight)
    added = torch.zeros(heads, k, dim, dtype=torch.float32, device=kept.device)
    added.scatter_add_(1, target[..., None].expand(-1, -1, dim), sources.float() * weight[..., None])
    merged = ((kept.float() + added) / (1.0 + mass[..., None])).to(kept.dtype)
    return torch.where((mass > 0)[..., None], merged, kept)


def merge_prompt(rule: MergeRule, keys: torch.Tensor, values: torch.Tensor, positions: Sequence[torch.Tensor],
                 pad: int, attention: Optional[torch.Tensor], window_size: int,
                 generator: Optional[torch.Generator]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run `rule` on one prompt's stored heads at one layer.

    keys, values: [H, n_padded, D]; positions: per head the kept padded positions (ascending);
    pad: left-padding length; attention: [H, n_padded] or None. Returns per head (keys [k_h, D]) and
    (values [k_h, D]) to store. Heads that evict nothing are stored as they are."""
    heads, n, _ = keys.shape
    real_len = n - pad
    counts = [len(p) for p in positions]
    out_keys = [keys[h].index_select(0, idx) for h, idx in enumerate(positions)]   # not keys[h, idx]: kept.py
    out_values = [values[h].index_select(0, idx) for h, idx in enumerate(positions)]
    evicting = [h for h in range(heads) if counts[h] < real_len]
    if not evicting:
        return out_keys, out_values
    # Heads with equal counts are merged together: all of them under a uniform split.
    groups: dict[int, list[int]] = {}
    for h in evicting:
        groups.setdefault(counts[h], []).append(h)
    for heads_in_group in groups.values():
        index = torch.tensor(heads_in_group, device=keys.device)
        kept_pos = torch.stack([positions[h] for h in heads_in_group]) - pad  # [G, k]
        evicted_mask = torch.ones(len(heads_in_group), real_len, dtype=torch.bool, device=keys.device)
        evicted_mask.scatter_(1, kept_pos, False)
        evicted_pos = evicted_mask.nonzero()[:, 1].view(len(heads_in_group), -1)  # [G, e] ascending
        real_keys, real_values = keys[index, pad:], values[index, pad:]  # [G, n, D]
        group = MergeGroup(
            kept_keys=torch.stack([out_keys[h] for h in heads_in_group]),
            kept_values=torch.stack([out_values[h] for h in heads_in_group]),
            kept_positions=kept_pos,
            evicted_keys=_take(real_keys, evicted_pos),
            evicted_values=_take(real_values, evicted_pos),
            evicted_positions=evicted_pos,
            attention=None if attention is None else attention[index, pad:],
            window_size=window_size,
            generator=generator,
        )
        merged_keys, merged_values = rule.merge(group)
        for i, h in enumerate(heads_in_group):
            out_keys[h], out_values[h] = merged_keys[i], merged_values[i]
    return out_keys, out_values


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [G, n, D], index: [G, m] -> [G, m, D]."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
