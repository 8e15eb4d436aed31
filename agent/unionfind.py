"""Union-find over the positions ``0..n-1``: which devices end up in one group (one PCIe
switch, one host bridge, one NVLink island) from pairwise facts. Used by the simulator's
PCIe tree (:mod:`agent.hw.sim.from_facts`) and the containers' NCCL files
(:mod:`agent.nccl.container_file`)."""

from __future__ import annotations

from collections.abc import Iterable


class UnionFind:
    """Groups of ``0..n-1``; a group is named by its smallest member."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def groups(self, members: Iterable[int]) -> list[list[int]]:
        """The groups of ``members``, each in the order given, ordered by their first member."""
        out: dict[int, list[int]] = {}
        for m in members:
            out.setdefault(self.find(m), []).append(m)
        return sorted(out.values())
