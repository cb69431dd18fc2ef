"""ZeRO-1's partition of the parameters over the data-parallel ranks (kiln/parallel/zero1.py), in
plain Python so that kiln plan (kiln/plan/memory.py `zero1_fullest_share`) predicts the fullest
rank with the very rule the optimizer runs. kiln's own: torch's ZeroRedundancyOptimizer gives whole
tensors to ranks group by group; this is Megatron-LM's even split where the update allows it."""

from __future__ import annotations

import heapq
import math


def partition(sizes: list[int], cuttable: list[bool], ranks: int,
              even: list[bool] | None = None) -> list[list[tuple[int, int, int]]]:
    """Each tensor's runs `(start, end, rank)` over its flat elements. The `even` ones (cuttable
    tensors that other partitions must cut alike: zero1.py) first, each in `ranks` equal runs,
    run r to rank r; the tensors that are not `cuttable` go whole, largest first, each to the rank
    holding the fewest elements so far (ties to the lowest rank); the other cuttable ones, in their
    order, are one flat sequence cut to bring the emptiest ranks up to one level (rank order). With
    every tensor cuttable rank r holds elements [r T / n, (r + 1) T / n) of the concatenation
    (within one element). kiln/plan/memory.py `zero1_fullest_share` predicts the fullest rank from
    the same rule."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in sizes]
    held = [0] * ranks
    for i in [i for i, e in enumerate(even or []) if e and cuttable[i]]:
        bounds = [sizes[i] * r // ranks for r in range(ranks + 1)]
        out[i] = [(a, b, r) for r, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a] or [(0, 0, 0)]
        for a, b, r in out[i]:
            held[r] += b - a
    heap = [(h, rank) for rank, h in enumerate(held)]
    heapq.heapify(heap)
    for i in sorted((i for i, c in enumerate(cuttable) if not c), key=lambda i: -sizes[i]):  # stable
        elements, rank = heapq.heappop(heap)
        heapq.heappush(heap, (elements + sizes[i], rank))
        held[rank] += sizes[i]
        out[i] = [(0, sizes[i], rank)]
    rest = [i for i, c in enumerate(cuttable) if c and not out[i]]
    room = _room_to_level(held, sum(sizes[i] for i in rest))
    rank = 0
    for i in rest:
        start = 0
        while start < sizes[i]:
            while room[rank] == 0:
                rank += 1
            take = min(room[rank], sizes[i] - start)
            out[i].append((start, start + take, rank))
            room[rank] -= take
            start += take
        if sizes[i] == 0:
            out[i] = [(0, 0, 0)]
    return out


def _room_to_level(held: list[int], total: int) -> list[int]:
    """Elements per rank, `total` in all, that bring the ranks holding fewest up to one level
    (water filling); the remainder of an uneven division goes one each to the lowest ranks."""
    if total == 0:
        return [0] * len(held)
    order, below = sorted(held), 0
    for k in range(1, len(order) + 1):  # the k emptiest ranks are filled, up to `level`
        below += order[k - 1]
        level = (total + below) / k
        if k == len(order) or level <= order[k]:
            break
    room = [max(0, math.floor(level) - h) for h in held]
    short = total - sum(room)
    for rank, h in enumerate(held):
        if short and h < level:
            room[rank] += 1
            short -= 1
    return room
