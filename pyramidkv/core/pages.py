"""Quest's page metadata and page choice (Tang et al., ICML 2024): min and max keys per page, which pages a query reads.

Per segment (one prompt's stored head of a layer) the held tokens, in held order (the kept rows, then
the generated tail), are cut into pages of S consecutive tokens; the last page may be partial. Each
page keeps the element-wise min m and max M of its keys, updated as tokens are appended. A query q
scores page p by its criticality

    U_p = sum_c max(q_c m_c, q_c M_c)  >=  q . k  for every key k of the page, whatever the signs of q,

and attention reads the tokens of the K best pages only. Nothing is evicted: the other pages compete
again at the next step.

Rules (docs/methods.md): K = min(max(page_min_count, floor(budget / S)), pages) per segment, as the
official accuracy path (`evaluation/quest_attention.py`); the partial last page is scored by the
min/max of the tokens it holds (the official code pads it with -inf before the max, which is the
same); ties go to the later page; with `keep_last` the page holding the newest token is always taken
and counts in K (the official kernel path, with page_min_count 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_SELECTIONS = ("query_head", "group_max", "group_mean")


@dataclass(frozen=True)
class PageSettings:
    """What a paged store needs of the method. selection: "query_head" (each query head picks its own
    pages, as the official code after repeat_kv) or "group_max" / "group_mean" (U reduced over the query
    heads of a stored head: one page set per stored head)."""

    size: int
    min_count: int
    keep_last: bool
    selection: str


@dataclass(frozen=True)
class PieceBounds:
    """What `PageTable.extend` returns: first [S] the page the piece starts in; mins, maxs [S, q, J, D] the bounds of
    pages first .. first + J - 1 as new token i saw them; exists [S, q, J] whether that page held a token then."""

    first: torch.Tensor
    mins: torch.Tensor
    maxs: torch.Tensor
    exists: torch.Tensor


def bound_scores(queries: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """queries [S, r, q', D], bounds [S, q', P, D] -> U [S, r, q', P]: sum_c max(q_c m_c, q_c M_c), each query
    row i against the bounds mins[:, i], maxs[:, i]."""
    dtype = torch.promote_types(mins.dtype, torch.float32)
    q = queries.to(dtype)
    return (torch.einsum("srqd,sqpd->srqp", q.clamp(min=0), maxs.to(dtype))
            + torch.einsum("srqd,sqpd->srqp", q.clamp(max=0), mins.to(dtype)))


class PageTable:
    """Min and max key of every page of every segment of a layer.

    mins, maxs: [S, capacity, D] in the keys' dtype (pages beyond a segment's count unused);
    counts: long [S] tokens held per segment (pages = ceil(counts / size))."""

    def __init__(self, size: int, segment_keys: list[torch.Tensor]):
        """segment_keys: per segment its held keys [n_s, D], in held order."""
        self.size = size
        first = segment_keys[0]
        self.counts = torch.tensor([k.shape[0] for k in segment_keys], device=first.device)
        capacity = int(self.pages().max()) + 16
        self.mins = first.new_zeros(len(segment_keys), capacity, first.shape[-1])
        self.maxs = first.new_zeros(len(segment_keys), capacity, first.shape[-1])
        for s, keys in enumerate(segment_keys):
            pages = -(-keys.shape[0] // size)
            if pages == 0:   # a head that kept nothing (threshold eviction with no window): no page yet
                continue
            padded = keys.new_empty(pages * size, keys.shape[-1])
            padded[:keys.shape[0]] = keys
            padded[keys.shape[0]:] = keys[-1]  # repeating a key of the last page leaves its min and max unchanged
            self.mins[s, :pages] = padded.view(pages, size, -1).amin(dim=1)
            self.maxs[s, :pages] = padded.view(pages, size, -1).amax(dim=1)

    def pages(self) -> torch.Tensor:
        """long [S]: pages per segment (the last one possibly partial)."""
        return (self.counts + self.size - 1) // self.size

    def append(self, keys: torch.Tensor) -> None:
        """keys [S, D]: one new token per segment, at the end of its held tokens."""
        page = self.counts // self.size
        if int(page.max()) >= self.mins.shape[1]:
            grow = self.mins.shape[1] // 8 + 16
            self.mins = torch.cat([self.mins, self.mins.new_zeros(self.mins.shape[0], grow, self.mins.shape[2])], 1)
            self.maxs = torch.cat([self.maxs, self.maxs.new_zeros(self.maxs.shape[0], grow, self.maxs.shape[2])], 1)
        rows = torch.arange(keys.shape[0], device=keys.device)
        opens = (self.counts % self.size == 0)[:, None]  # the token starts a new page
        self.mins[rows, page] = torch.where(opens, keys, torch.minimum(self.mins[rows, page], keys))
        self.maxs[rows, page] = torch.where(opens, keys, torch.maximum(self.maxs[rows, page], keys))
        self.counts += 1

    def extend(self, keys: torch.Tensor) -> "PieceBounds":
        """keys [S, q, D]: q new tokens per segment, at the end of its held tokens (q `append`s, the same bounds).
        Returns, for each new token i, the bounds of the pages the piece touches as they were when i arrived."""
        segments, q, dim = keys.shape
        size, first = self.size, self.counts // self.size               # first: the page the piece starts in
        offset = self.counts - first * size                             # held tokens already in that page
        width = int(((self.counts + q - 1) // size - first).max()) + 1  # J: pages the piece touches, at most
        if int(first.max()) + width > self.mins.shape[1]:
            grow = max(self.mins.shape[1] // 8 + 16, int(first.max()) + width - self.mins.shape[1])
            self.mins = torch.cat([self.mins, self.mins.new_zeros(segments, grow, dim)], 1)
            self.maxs = torch.cat([self.maxs, self.maxs.new_zeros(segments, grow, dim)], 1)
        rows = torch.arange(segments, device=keys.device)
        slot = torch.arange(width * size, device=keys.device)[None, :]
        at = (offset[:, None] + torch.arange(q, device=keys.device))[..., None].expand(-1, -1, dim)
        pages = first[:, None] + torch.arange(width, device=keys.device)                    # [S, J]
        filled = (pages * size < (self.counts + q)[:, None])[..., None]                      # holds a token after
        prefixes = []
        neutral = ((self.mins, float("inf"), torch.cummin), (self.maxs, float("-inf"), torch.cummax))
        for bounds, fill, running in neutral:
            # The first page's earlier tokens stand as its bound so far, then the new keys; empty slots are neutral.
            block = keys.new_full((segments, width * size, dim), fill)
            block = torch.where((slot < offset[:, None])[..., None], bounds[rows, first][:, None], block)
            block.scatter_(1, at, keys)
            prefix = running(block.view(segments, width, size, dim), dim=2).values      # [S, J, size, D]
            bounds[rows[:, None], pages] = torch.where(filled, prefix[:, :, -1], bounds[rows[:, None], pages])
            prefixes.append(prefix)
        # Token i sees page first + j up to its own slot offset + i - j * size (< 0: the page does not exist yet).
        step = offset[:, None, None] + torch.arange(q, device=keys.device)[None, :, None] \
            - torch.arange(width, device=keys.device)[None, None, :] * size                # [S, q, J]
        index = (torch.arange(width, device=keys.device) * size + step.clamp(0, size - 1)).view(segments, -1)
        index = index[..., None].expand(-1, -1, dim)
        mins, maxs = (p.view(segments, -1, dim).gather(1, index).view(segments, q, width, dim) for p in prefixes)
        self.counts += q
        return PieceBounds(first, mins, maxs, step >= 0)

    def criticality(self, queries: torch.Tensor) -> torch.Tensor:
        """queries [S, r, D] -> U [S, r, P] (P the most pages of any segment; -inf beyond a segment's own pages),
        in float32 (float64 for float64 keys): max(q_c m_c, q_c M_c) is q_c M_c for q_c >= 0, else q_c m_c."""
        pages = self.pages()
        width = int(pages.max())
        scores = bound_scores(queries[:, :, None], self.mins[:, None, :width], self.maxs[:, None, :width])[:, :, 0]
        beyond = torch.arange(width, device=scores.device)[None, :] >= pages[:, None]
        return scores.masked_fill(beyond[:, None, :], float("-inf"))

    def segment_bytes(self) -> torch.Tensor:
        """long [S]: bytes of each segment's metadata (a min and a max vector per page)."""
        return self.pages() * 2 * self.mins.shape[-1] * self.mins.element_size()


def pages_to_attend(pages: torch.Tensor, budgets: torch.Tensor, settings: PageSettings) -> torch.Tensor:
    """long [S]: K per segment, min(max(page_min_count, floor(budget / S)), pages)."""
    wanted = torch.clamp(budgets // settings.size, min=settings.min_count)
    return torch.minimum(wanted, pages)


def choose_pages(scores: torch.Tensor, pages: torch.Tensor, count: torch.Tensor,
                 keep_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top count[s] pages of each row by score, ties to the later page.

    scores: [S, r, P] (-inf beyond a segment's pages); pages, count: long [S]. Returns (chosen [S, r, K]
    page indices, best first; valid [S, r, K] bool), K = max(count)."""
    if keep_last:  # the page of the newest token is always attended and counts in K
        scores = scores.clone()
        last = (pages - 1)[:, None, None].expand(-1, scores.shape[1], 1)
        scores.scatter_(-1, last, float("inf"))
    width = scores.shape[-1]
    k = int(count.max())
    # A stable descending sort keeps equal scores in input order; flipping first puts the later page ahead.
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = width - 1 - order
    rank = torch.arange(k, device=scores.device)
    valid = rank[None, None, :] < count[:, None, None]
    return chosen, valid


def page_tokens(chosen: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor,
                size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held indices of the chosen pages' tokens: (tokens [S, r, K * size], visible [S, r, K * size] bool:
    False for pages not chosen and past a partial last page)."""
    offsets = torch.arange(size, device=chosen.device)
    tokens = (chosen[..., None] * size + offsets).flatten(-2)
    visible = (valid[..., None].expand(*valid.shape, size).flatten(-2)) & (tokens < counts[:, None, None])
    return tokens, visible


def tokens_read(chosen: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, size: int) -> torch.Tensor:
    """long [S]: tokens in the union of the pages chosen by a segment's rows (what attention reads)."""
    segments, _, _ = chosen.shape
    width = int(((counts + size - 1) // size).max())
    taken = torch.zeros(segments, width + 1, dtype=torch.bool, device=chosen.device)
    taken.scatter_(1, torch.where(valid, chosen, width).flatten(1), True)
    taken = taken[:, :width]
    starts = torch.arange(width, device=chosen.device)[None, :] * size
    lengths = (counts[:, None] - starts).clamp(0, size)
    return (lengths * taken).sum(dim=1)
