"""Number partitioning and bin filling used by the packer.

``karmarkar_karp`` splits weighted items into k sets of near-equal sum (largest differencing
method: repeatedly merge the two partial partitions whose spread is largest, pairing the heaviest
set of one with the lightest of the other).  Its worst case is 4/3 - 1/(3(k-1)) of optimal; on many
items of bounded size the spread it leaves is a small fraction of the smallest item.

``fill_bins`` puts items into exactly ``m`` bins of a capacity, best-fit in decreasing size, so
items of similar size land in the same bin (the bucketing) and only the last bins mix sizes.
"""
from __future__ import annotations

import heapq
from typing import Optional, Sequence


def karmarkar_karp(weights: Sequence[float], k: int, order: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` lists of near-equal weight sum.

    ``order`` (a permutation of the indices) fixes how ties are broken, so a seeded order gives a
    deterministic but seed-dependent result.  Lists come back heaviest first.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    order = range(len(weights)) if order is None else order
    heap: list = []
    for tie, i in enumerate(order):
        sets = [(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
        # key: largest spread first; tie: insertion order (deterministic)
        heapq.heappush(heap, (-float(weights[i]), tie, sets))
    tie = len(heap)
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # heaviest of a with lightest of b: the two spreads cancel as much as they can
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [members for _, members in heap[0][2]]


def fill_bins(sizes: Sequence[int], order: Sequence[int], m: int, capacity: int) -> Optional[list[list[int]]]:
    """Items (indices into ``sizes``, visited in ``order``, which should be by decreasing size) put
    into exactly ``m`` bins of ``capacity``: each item goes to the fullest bin it fits in.  None when
    some item fits nowhere.  Afterwards an empty bin takes the smallest item of a bin holding two or
    more, so bins are empty only when there are fewer items than bins."""
    load = [0] * m
    bins: list[list[int]] = [[] for _ in range(m)]
    for i in order:
        s = sizes[i]
        best = -1
        for b in range(m):
            if load[b] + s <= capacity and (best < 0 or load[b] > load[best]):
                best = b
        if best < 0:
            return None
        load[best] += s
        bins[best].append(i)
    for b in range(m):
        if bins[b]:
            continue
        donor = max(range(m), key=lambda j: (len(bins[j]), -j))
        if len(bins[donor]) < 2:
            break
        bins[b].append(bins[donor].pop())  # the last placed is the donor's smallest
    return bins
