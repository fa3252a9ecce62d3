"""Shared-prefix layout of one micro-batch (issue 38): every token prefix that several of its
sequences share is computed once.

The sequences of a micro-batch form a tree of shared token prefixes (the batch-wide system + tools
block -> each group's task prompt -> each sample's own turns).  ``build_layout`` finds it (a radix
tree over the token ids, any depth) and lays it out as *segments*: each shared prefix once, then
each sequence's remaining tokens, a segment continuing its parent's chain (positions go on from the
chain's length).  A prefix shorter than ``min_shared`` tokens is not worth a segment of its own
(one more attention call per layer): its tokens stay in each child, which is exact too.  Sequences
that share nothing are a segment each, as in ordinary packing.

The micro-batch itself keeps its ordinary (logical) layout: ``token_ids``, ``chunk_ids``,
``rollout_logp`` ... over the T packed tokens, so the objectives see the same tensors as without
sharing.  The layout maps between the two: packed token t is computed at ``src[t]``, and the
logprob of packed token t + 1 comes from head row ``head_row[t]`` (one row per distinct
(computed position, next token) pair: a shared prefix's rows once; the last token of a prefix gets
one row per distinct next token).  Gathering the rows back over the packed tokens sums, in backward,
the gradients of every sequence that shares a row: exactly the unshared step's gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

MIN_SHARED = 16  # shortest prefix laid out once (shorter ones are repeated in every child)


@dataclass
class PrefixLayout:
    token_ids: torch.Tensor  # [C] int64, the computed tokens: each shared prefix once
    position_ids: torch.Tensor  # [C] int64, a segment's positions continue its parent chain's
    seg_bounds: torch.Tensor  # [S+1] int64, segment s is computed tokens seg_bounds[s]:seg_bounds[s+1]
    seg_parent: torch.Tensor  # [S] int64, the segment it continues (-1: none); a parent precedes its children
    src: torch.Tensor  # [T] int64, computed position of each packed token
    head_src: torch.Tensor  # [R] int64, computed position of each head row
    head_tgt: torch.Tensor  # [R] int64, the token each head row predicts
    head_row: torch.Tensor  # [T] int64, head row predicting packed token t + 1 from t (-1: last of its sequence)
    head_first: torch.Tensor  # [R] int64, the first packed token t whose head_row is the row (increasing)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward computes (T minus what sharing saves)."""
        return int(self.token_ids.numel())

    @property
    def num_segments(self) -> int:
        return int(self.seg_parent.numel())

    def chains(self) -> list:
        """Per segment, the computed positions its queries attend to besides its own (its ancestors',
        root first) as a list of (start, end) ranges."""
        bounds, parent = self.seg_bounds.tolist(), self.seg_parent.tolist()
        out = []
        for s, p in enumerate(parent):
            out.append(([] if p < 0 else out[p] + [(bounds[p], bounds[p + 1])]))
        return out


def _lcp(seqs: Sequence[np.ndarray], members: list, start: int) -> int:
    """Length of the common prefix of ``members`` from ``start``."""
    first = seqs[members[0]]
    n = min(len(seqs[i]) for i in members) - start
    for i in members[1:]:
        diff = np.flatnonzero(seqs[i][start:start + n] != first[start:start + n])
        if diff.size:
            n = int(diff[0])
    return n


def _segments(seqs: Sequence[np.ndarray], min_shared: int):
    """(segments as (parent, depth, tokens), chain of segment ids per sequence, any shared?)."""
    segs, chain, shared_any = [], [None] * len(seqs), False
    seg_chain: list = []  # segment id -> its chain (ids, root first)

    def add(parent: int, depth: int, tokens: np.ndarray) -> int:
        segs.append((parent, depth, tokens))
        seg_chain.append((seg_chain[parent] if parent >= 0 else []) + [len(segs) - 1])
        return len(segs) - 1

    # (members, seg_start, start, parent): members share tokens [0, start); [seg_start, start) is not
    # laid out yet; every member is longer than start
    stack = [(list(range(len(seqs))), 0, 0, -1)]
    while stack:
        members, seg_start, start, parent = stack.pop()
        if len(members) == 1:
            i = members[0]
            chain[i] = seg_chain[add(parent, seg_start, seqs[i][seg_start:])]
            continue
        end = start + _lcp(seqs, members, start)
        if end - seg_start >= min_shared:
            parent = add(parent, seg_start, seqs[members[0]][seg_start:end])
            seg_start, shared_any = end, True
        parts: dict = {}
        for i in members:
            if len(seqs[i]) == end:  # the whole sequence is common to the others
                own = parent if seg_start == end else add(parent, seg_start, seqs[i][seg_start:])
                chain[i] = seg_chain[own]
            else:
                parts.setdefault(int(seqs[i][end]), []).append(i)
        for part in reversed(list(parts.values())):
            stack.append((part, seg_start, end, parent))
    return segs, chain, shared_any


def build_layout(seqs: Sequence[np.ndarray], min_shared: int = MIN_SHARED,
                 trained: Optional[Sequence[np.ndarray]] = None) -> Optional[PrefixLayout]:
    """The shared-prefix layout of sequences packed in this order, or None when no prefix of
    ``min_shared`` or more tokens is shared (then ordinary packing computes the same tokens).
    ``trained``: per sequence, a bool per token whose logprob the loss trains: such a token's head
    row is its own even where another sequence has the same one (the loss's per-token gradient
    plan then maps one-to-one onto the head rows)."""
    if min_shared < 1:
        raise ValueError(f"min_shared={min_shared}: must be >= 1")
    seqs = [np.asarray(s, dtype=np.int64) for s in seqs]
    if not seqs or min(len(s) for s in seqs) < 1:
        raise ValueError("build_layout: needs one or more non-empty sequences")
    segs, chain, shared_any = _segments(seqs, min_shared)
    if not shared_any:
        return None
    lens = np.array([len(t) for _, _, t in segs], dtype=np.int64)
    bounds = np.zeros(len(segs) + 1, dtype=np.int64)
    np.cumsum(lens, out=bounds[1:])
    tokens = np.concatenate([t for _, _, t in segs])
    pos = np.concatenate([d + np.arange(len(t)) for _, d, t in segs])
    src = np.concatenate([np.concatenate([np.arange(bounds[s], bounds[s + 1]) for s in c]) for c in chain])
    packed = np.concatenate(seqs)
    # head rows: distinct (computed position, next token) over the packed tokens that have a next one
    last = np.cumsum([len(s) for s in seqs]) - 1
    has_next = np.ones(len(packed), dtype=bool)
    has_next[last] = False
    t = np.flatnonzero(has_next)
    width = int(packed.max()) + 1
    keys = src[t] * width + packed[t + 1]
    if trained is not None:
        own = np.concatenate([np.asarray(m, dtype=bool) for m in trained])[t + 1]
        keys[own] = len(tokens) * width + t[own]  # past every shared key: one row each
    _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    # rows in the packed order of their first use: a sequence's own rows stay contiguous (the
    # grad-in-forward head keeps each loss segment in one tile)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    first = t[first[order]]
    head_row = np.full(len(packed), -1, dtype=np.int64)
    head_row[t] = rank[inv.reshape(-1)]
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return PrefixLayout(token_ids=as_t(tokens), position_ids=as_t(pos), seg_bounds=as_t(bounds),
                        seg_parent=as_t([p for p, _, _ in segs]), src=as_t(src), head_src=as_t(src[first]),
                        head_tgt=as_t(packed[first + 1]), head_row=as_t(head_row), head_first=as_t(first))


def computed_tokens(seqs: Sequence[np.ndarray], min_shared: int = MIN_SHARED) -> int:
    """Tokens the forward computes for these sequences in one micro-batch."""
    layout = build_layout(seqs, min_shared)
    return int(sum(len(s) for s in seqs)) if layout is None else layout.num_tokens


def layout_compute(layout: PrefixLayout, attn_coef: float) -> float:
    """The packer's estimated compute of the layout: a segment of l tokens after P ancestor tokens
    costs l + attn_coef * (l**2 + 2 l P), so an unshared sequence costs L + attn_coef * L**2 as in
    ``estimated_compute`` and a tree costs what its sequences cost minus what it shares."""
    bounds = layout.seg_bounds.numpy()
    lens = (bounds[1:] - bounds[:-1]).astype(np.float64)
    depth = layout.position_ids.numpy()[bounds[:-1]].astype(np.float64)
    return float((lens + attn_coef * (lens * lens + 2 * lens * depth)).sum())
