"""The twin's NVLink graph functions: islands (connected components) and maximal cliques of
an adjacency given as int bitmasks, ``adjacency[i]`` having bit ``j`` set when GPUs i and j
share at least one NVLink."""

from __future__ import annotations

from typing import Sequence

from agent.topology._pure.checks import MAX_GPUS, gpu_mask


def _adjacency(adjacency: Sequence[int]) -> int:
    """The GPU count of a valid adjacency (at most MAX_GPUS masks of GPUs 0..n-1)."""
    n = len(adjacency)
    if n > MAX_GPUS:
        raise ValueError(f"at most {MAX_GPUS} GPUs, got {n}")
    for i in range(n):
        gpu_mask(adjacency[i], f"adjacency[{i}]", n)
    return n


def nvlink_islands(adjacency: list[int]) -> list[list[int]]:
    """Connected components of the NVLink graph with two or more GPUs, each sorted,
    ordered by their lowest GPU."""
    n = _adjacency(adjacency)
    seen = 0
    islands: list[list[int]] = []
    for start in range(n):
        if seen >> start & 1:
            continue
        component = 1 << start
        frontier = 1 << start
        while frontier:
            low = frontier & -frontier
            frontier ^= low
            i = low.bit_length() - 1
            new = adjacency[i] & ~component
            component |= new
            frontier |= new
        seen |= component
        members = [i for i in range(n) if component >> i & 1]
        if len(members) >= 2:
            islands.append(members)
    return islands


def maximal_cliques(adjacency: list[int]) -> list[list[int]]:
    """Maximal cliques (every pair NVLinked) of two or more GPUs, each sorted, the list
    sorted lexicographically. Bron-Kerbosch with pivoting on bitmasks."""
    n = _adjacency(adjacency)
    found: list[list[int]] = []

    def expand(r: int, p: int, x: int) -> None:
        if p == 0 and x == 0:
            if r & (r - 1):  # at least two members
                found.append([i for i in range(n) if r >> i & 1])
            return
        # pivot: the vertex of p|x with most neighbours in p
        best, pivot = -1, 0
        px = p | x
        while px:
            low = px & -px
            px ^= low
            u = low.bit_length() - 1
            c = bin(p & adjacency[u]).count("1")
            if c > best:
                best, pivot = c, u
        candidates = p & ~adjacency[pivot]
        while candidates:
            low = candidates & -candidates
            candidates ^= low
            v = low.bit_length() - 1
            expand(r | low, p & adjacency[v], x & adjacency[v])
            p &= ~low
            x |= low

    expand(0, (1 << n) - 1, 0)
    found.sort()
    return found
