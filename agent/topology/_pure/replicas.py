"""The twin's time-sliced replica policy: how many more replicas each GPU gives a request.

Per GPU g: ``free[g]`` replicas free and not yet in the request, ``taken[g]`` already in it
(must-include), ``load[g]`` allocated to others; ``need`` more are wanted (at most the free
ones). ``spread`` (the ``distributed`` policy) and ``pack`` (``packed``) return the count per
GPU; ties among equally loaded GPUs go to the GPU policy, asked through ``best_mask`` (the
solver's, for a valid request: available mask, required mask, size) given the GPUs already
in the request. ``free`` and ``taken`` are updated as replicas move into the request.
"""

from __future__ import annotations

from typing import Callable

from agent.topology._pure.checks import bits

#: The solver's best set (a mask) for (available mask, required mask, size).
BestMask = Callable[[int, int, int], int]


def _take(free: list[int], taken: list[int], counts: list[int], gpu: int, count: int) -> None:
    """Move ``count`` replicas of ``gpu`` from free into the request."""
    free[gpu] -= count
    taken[gpu] += count
    counts[gpu] += count


def _extend(taken: list[int], tier: list[int], count: int, best_mask: BestMask) -> list[int]:
    """``count`` GPUs of ``tier`` that the GPU policy adds to those with ``taken``."""
    required = sum(1 << g for g in range(len(taken)) if taken[g])
    pool = required | sum(1 << g for g in tier)
    best = best_mask(pool, required, required.bit_count() + count)
    return bits(best & ~required)


def spread(
    free: list[int], taken: list[int], load: list[int], need: int, best_mask: BestMask
) -> list[int]:
    """Rounds in which each GPU at the lowest level of use in this request gets one more
    replica, least loaded first; a partly taken tier of equal load goes to topology."""
    n = len(free)
    counts = [0] * n
    while need > 0:
        level = min(taken[g] for g in range(n) if free[g])
        group = sorted((load[g], g) for g in range(n) if free[g] and taken[g] == level)
        start = 0
        while start < len(group) and need > 0:
            end = start + 1
            while end < len(group) and group[end][0] == group[start][0]:
                end += 1
            tier = [g for _, g in group[start:end]]
            if len(tier) <= need:
                picks = tier
            elif level > 0:
                # every tier GPU is already in the request: topology cannot tell them apart
                picks = tier[:need]
            else:
                picks = _extend(taken, tier, need, best_mask)
            for g in picks:
                _take(free, taken, counts, g, 1)
            need -= len(picks)
            start = end
    return counts


def pack(
    free: list[int], taken: list[int], load: list[int], need: int, best_mask: BestMask
) -> list[int]:
    """GPUs not in the request first, then the most loaded (counting what it already holds)
    fills up."""
    counts = [0] * len(free)
    while need > 0:
        eligible = [g for g in range(len(free)) if free[g]]
        key = {g: (0 if taken[g] else 1, -(load[g] + taken[g])) for g in eligible}
        best_key = min(key.values())
        tier = [g for g in eligible if key[g] == best_key]
        if len(tier) == 1 or best_key[0] == 0:
            # GPUs already in the request and equally loaded: topology cannot tell
            gpu = tier[0]
        else:
            (gpu,) = _extend(taken, tier, 1, best_mask)
        count = min(need, free[gpu])
        _take(free, taken, counts, gpu, count)
        need -= count
    return counts
