"""ThinK's key-channel pruning (Xu et al., ICLR 2025): the key channels each stored head keeps, its keys cut to them.

After token selection (and merging), per stored head: score every key channel c by
s_c = ||Q_w[:, c]||^2 * ||K_kept[:, c]||^2, the exact Frobenius criterion ||Q_w[:, c] K[:, c]^T||_F^2
(Q_w: the prompt's last `key_query_window` queries, in the kv_head layout averaged over the head's
query group; K_kept: all its kept keys), keep the D - floor(lambda D) best channels (ties: the lower
channel index) and store the keys of every kept token but the `key_recent_size` most recent on those
channels only. Values are never pruned. Attention keeps the 1/sqrt(D) scale of the full dimension.
"""

from __future__ import annotations

import torch

from pyramidkv.core.kept import KeptKV, ThinRows


def kept_channels(queries: torch.Tensor, keys: torch.Tensor, ratio: float) -> torch.Tensor:
    """queries: [g, w, D] of one stored head (its query group); keys: [k, D] its kept keys.
    Returns the D - floor(ratio D) channels kept, ascending (long)."""
    dim = keys.shape[-1]
    query_term = queries.double().pow(2).sum(dim=1).mean(dim=0)        # [D]
    score = query_term * keys.double().pow(2).sum(dim=0)                # [D]
    keep = dim - int(ratio * dim + 1e-9)
    order = torch.sort(score, descending=True, stable=True).indices     # ties: lower index first
    return order[:keep].sort().values


def prune_key_channels(kept: KeptKV, queries: torch.Tensor, ratio: float, recent: int) -> KeptKV:
    """kept: what a layer keeps of one prompt (full width); queries: [Hq, w, D] the prompt's last w
    queries. Returns the same tokens with each head's older keys stored thin (KeptKV.thin)."""
    heads = len(kept.lengths)
    group = queries.shape[0] // heads
    thin_keys, thin_values, thin_positions, thin_lengths, channels = [], [], [], [], []
    full_keys, full_values, full_positions, full_lengths = [], [], [], []
    for h, ((keys, values), positions) in enumerate(zip(kept.per_head(), kept.positions_per_head())):
        chosen = kept_channels(queries[h * group:(h + 1) * group], keys, ratio)
        cut = max(0, keys.shape[0] - recent)
        thin_keys.append(keys[:cut][:, chosen])
        thin_values.append(values[:cut])
        thin_positions.append(positions[:cut])
        thin_lengths.append(cut)
        channels.append(chosen)
        full_keys.append(keys[cut:])
        full_values.append(values[cut:])
        full_positions.append(positions[cut:])
        full_lengths.append(keys.shape[0] - cut)
    thin = ThinRows(torch.cat(thin_keys).contiguous(), torch.cat(thin_values).contiguous(), thin_lengths,
                    torch.cat(thin_positions), torch.stack(channels).to(kept.keys.device))
    return KeptKV(torch.cat(full_keys).contiguous(), torch.cat(full_values).contiguous(), full_lengths,
                  torch.cat(full_positions), thin)
