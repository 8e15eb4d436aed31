"""The frozen topology model every other layer reads.

A :class:`Topology` is built once from what a backend read (:class:`NodeFacts`; NVML +
sysfs, or the simulator), never mutated, and shared between threads. It is those facts
(a ``NodeFacts`` subclass: each fact is declared once, in ``agent.records``, and carried
over here without being named) plus the derived ones (NVLink islands, cliques, NUMA groups,
pair scores), computed once at construction by the engine (``agent._topo`` or its
pure-Python twin). What a file format needs beside the facts (the node's NCCL topology
file) is kept beside the model, by the room that reads it (``agent.nccl``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

from agent.records import (
    NVLINK_SCORE,
    PCIE_SCORE,
    Gpu,
    Link,
    MigDevice,
    Nic,
    NodeFacts,
    PcieLevel,
    pair_score,
)

__all__ = [
    "NVLINK_SCORE", "PCIE_SCORE", "Gpu", "Link", "MigDevice", "Nic", "NodeFacts", "PcieLevel",
    "Topology",
    "pair_score",
]

_FACTS = tuple(f.name for f in fields(NodeFacts))


@dataclass(frozen=True)
class Topology(NodeFacts):
    """A node's GPU topology, immutable: the :class:`NodeFacts` it was built from
    (normalised: GPUs in index order, one :class:`Link` per unordered pair ``a < b`` in
    (a, b) order, an unknown link where the input gave none) and the facts derived from them.

    Build it with :meth:`Topology.from_facts` (or :meth:`Topology.build`, the same from
    the facts given as arguments), which validates and computes the derived facts.
    """

    # derived, filled by from_facts()
    nvlink_islands: tuple[tuple[int, ...], ...] = ()
    nvlink_cliques: tuple[tuple[int, ...], ...] = ()
    numa_groups: Mapping[int | None, tuple[int, ...]] = field(default_factory=dict)
    scores: tuple[tuple[int, ...], ...] = ()  # pair score matrix, 0 on the diagonal

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_facts(cls, facts: NodeFacts) -> Topology:
        """The topology of what a hardware reader found (:class:`NodeFacts`): the one way
        from any input (NVML + sysfs, a simulated machine, a pasted ``nvidia-smi topo -m``)
        to the model. Validates the GPUs and links, fills missing pairs with an unknown link,
        derives islands, cliques, NUMA groups and pair scores; collections are copied (the
        model is frozen), every other fact is carried over as it is."""
        from agent.topology import kernel

        gpus = tuple(sorted(facts.gpus, key=lambda g: g.index))
        n = len(gpus)
        all_links = _all_links(gpus, facts.links)
        scores = [[0] * n for _ in range(n)]
        adjacency = [0] * n
        for link in all_links:
            scores[link.a][link.b] = scores[link.b][link.a] = link.score
            if link.nvlinks > 0:
                adjacency[link.a] |= 1 << link.b
                adjacency[link.b] |= 1 << link.a
        groups: dict[int | None, list[int]] = {}
        for g in gpus:
            groups.setdefault(g.numa_node, []).append(g.index)
        carried: dict[str, Any] = {name: getattr(facts, name) for name in _FACTS}
        carried.update(
            gpus=gpus,
            links=all_links,
            nics=tuple(facts.nics),
            numa_distances={k: tuple(v) for k, v in (facts.numa_distances or {}).items()},
            numa_cpulists=dict(facts.numa_cpulists or {}),
            notes=tuple(facts.notes),
        )
        return cls(
            **carried,
            nvlink_islands=tuple(tuple(c) for c in kernel.nvlink_islands(adjacency)),
            nvlink_cliques=tuple(tuple(c) for c in kernel.maximal_cliques(adjacency)),
            # NUMA nodes in order, the unknown (None) group last
            numa_groups={k: tuple(v) for k, v in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
            scores=tuple(tuple(r) for r in scores),
        )

    @classmethod
    def build(cls, gpus: Iterable[Gpu], links: Iterable[Link], **facts: Any) -> Topology:
        """:meth:`from_facts` of ``NodeFacts(gpus, links, **facts)`` (keyword arguments are
        :class:`NodeFacts` fields)."""
        return cls.from_facts(NodeFacts(gpus=tuple(gpus), links=tuple(links), **facts))

    @property
    def facts(self) -> NodeFacts:
        """The facts this topology was built from (as normalised), without the derived ones."""
        return NodeFacts(**{name: getattr(self, name) for name in _FACTS})

    # ---------------------------------------------------------------- queries
    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def link(self, a: int, b: int) -> Link:
        """The link between GPUs ``a`` and ``b`` (order does not matter)."""
        if a == b:
            raise ValueError("a GPU has no link to itself")
        a, b = min(a, b), max(a, b)
        n = len(self.gpus)
        # links are stored row-major over a < b
        return self.links[a * n - a * (a + 1) // 2 + (b - a - 1)]

    def pair_score(self, a: int, b: int) -> int:
        return self.scores[a][b]

    def set_score(self, indices: Iterable[int]) -> int:
        idx = list(indices)
        return sum(self.scores[x][y] for i, x in enumerate(idx) for y in idx[i + 1 :])

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        return None


def _all_links(gpus: tuple[Gpu, ...], links: Iterable[Link]) -> tuple[Link, ...]:
    """One link per pair ``a < b`` in row-major order, an unknown link where none is given;
    ValueError for GPU indices other than 0..n-1, a link to a GPU not there or given twice."""
    n = len(gpus)
    if [g.index for g in gpus] != list(range(n)):
        raise ValueError(f"GPU indices must be 0..{n - 1}, got {[g.index for g in gpus]}")
    by_pair: dict[tuple[int, int], Link] = {}
    for link in links:
        a, b = min(link.a, link.b), max(link.a, link.b)
        if a == b or not (0 <= a < n and 0 <= b < n):
            raise ValueError(f"link {link.a}-{link.b} does not join two distinct GPUs of {n}")
        if (a, b) in by_pair:
            raise ValueError(f"link {a}-{b} given twice")
        by_pair[(a, b)] = Link(a, b, link.nvlinks, link.pcie, link.nvswitch)
    return tuple(by_pair.get((a, b), Link(a, b)) for a in range(n) for b in range(a + 1, n))
