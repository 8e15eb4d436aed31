"""Where a MIG request goes: which parent GPUs' free MIG devices to take.

Works on a resource's device ranks (:mod:`agent.topology.deviceids`): a parent's free devices
are listed lowest rank (natural order) first, and the lowest are taken. Prefers all on one
parent GPU, else on one NUMA node, else anywhere; best fit throughout: the parent (NUMA node)
with the fewest free instances that can take the rest first, parents already in the request
first.
"""

from __future__ import annotations

from typing import Mapping


def place_mig(
    free: Mapping[int, list[int]],
    used: list[int],
    need: int,
    numa_of: Mapping[int, int | None],
) -> list[int]:
    """``need`` ranks from ``free`` (parent GPU index -> its free ranks, ascending), given the
    parents already in the request (``used``, ascending) and each parent's NUMA node."""
    if need == 0:
        return []
    if len(used) <= 1:
        options = [p for p in (used or free) if len(free.get(p, [])) >= need]
        if options:
            p = min(options, key=lambda q: (len(free[q]), q))
            return free[p][:need]
    used_nodes = {numa_of[p] for p in used}
    if len(used_nodes) <= 1:
        nodes: dict[int | None, list[int]] = {}
        for p in sorted(set(free) | set(used)):
            nodes.setdefault(numa_of[p], []).append(p)

        def free_on(node: int | None) -> int:
            return sum(len(free.get(p, [])) for p in nodes[node])

        fitting = [
            node for node in nodes if (not used_nodes or node in used_nodes) and free_on(node) >= need
        ]
        if fitting:
            node = min(fitting, key=lambda u: (free_on(u), u is None, u or 0))
            return _fill(free, used, need, nodes[node])
    return _fill(free, used, need, sorted(set(free) | set(used)))


def _fill(free: Mapping[int, list[int]], used: list[int], need: int, parents: list[int]) -> list[int]:
    """``need`` ranks from ``parents``: parents already in the request first, best fit among
    them; then the parent with the fewest free instances that can take the rest, else the
    one with the most."""
    counts = {p: len(free.get(p, [])) for p in parents}
    out: list[int] = []
    remaining = need
    order = sorted((p for p in used if p in counts), key=lambda p: (counts[p], p))
    pool = [p for p in parents if p not in used]
    for p in order:
        n_take = min(remaining, counts[p])
        out.extend(free.get(p, [])[:n_take])
        remaining -= n_take
    while remaining > 0:
        fitting = [p for p in pool if counts[p] >= remaining]
        if fitting:
            p = min(fitting, key=lambda q: (counts[q], q))
        else:
            p = min(pool, key=lambda q: (-counts[q], q))
        pool.remove(p)
        n_take = min(remaining, counts[p])
        out.extend(free.get(p, [])[:n_take])
        remaining -= n_take
    return out
