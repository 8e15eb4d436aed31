"""Placement by publication order: the order of the single GPUs, and which multi-GPU sets
the node publishes as DRA devices, in what order.

The scheduler's allocator has no scoring: it takes the first free device in pool, slice and
device order (slices sorted by name). A claim for one *set device* of k GPUs therefore gets
the first published set of that size whose GPUs are all free (the counters of
``agent.dra.slices`` make a set busy as soon as one member is). Publishing the sets the device
plugin's policy would choose, best first, lets that first-fit search find the best free set.

**Single GPUs** (:func:`device_order`): grouped by NUMA node (unknown last), then by NVLink
island (lowest index first), and inside a group a greedy walk where each next GPU is the one
best linked (pair score) to the one before, ties broken by its links to the whole group so
far, then by the lower index. MIG devices keep their parent's place, in MIG index order.
``device_order(topology, in_use)`` is the order an agent could re-publish after every
NodePrepareResources / NodeUnprepareResources (NUMA nodes, then islands, with the fewest free
GPUs first, so that first fit approximates best fit); ``bench/quality_dra.py`` measured it
worse than the static order for single-GPU claims, so the agent publishes the static order.

**Sizes.** 2, 4, 8 and 16, and the size of every NVLink island and every maximal NVLink
clique of two or more GPUs, as far as the node has GPUs.

**Which sets (the pruning rule).** The sets of one size k come from the node's *structural
units*: every maximal NVLink clique, every NVLink island, every NUMA node (GPUs of unknown
NUMA node form one unit), every PCIe root complex shared by two or more GPUs, and the whole
node. For each unit U that can hold k GPUs:

* if U has at most :data:`ENUMERATION_LIMIT` subsets of k GPUs, every one of them;
* otherwise the unions of whole *sub-units* of U (the largest units strictly inside it, when
  they are disjoint) that hold exactly k GPUs, at most :data:`ENUMERATION_LIMIT` of them.

So a node of up to 8 GPUs publishes every set of every size (at most 99 sets on 8 GPUs),
and a larger node every set inside a small unit (a NUMA node of 8, an NVLink island of 8)
plus the sets made of whole units above that (two whole islands of one NUMA node, two NUMA
halves). A set that straddles units without being a union of whole ones is left out: a claim
that finds no published set free falls back to single GPUs (a prioritized list, see the
example claims), which on such a fragmented node choose about as well. The device plugin's
own choice on the empty node (:meth:`AllocationEngine.gpus` for the whole node) is always published.
What the pruning costs is measured by ``bench/quality_dra.py`` on 16, 32 and 64-GPU
synthetic nodes.

**Order.** Within a size, the device plugin's own choice on the empty node first (rank 0:
a set claim on an empty node gets what GetPreferredAllocation gives), then best first by the
device plugin's objective on the empty node (``AllocationEngine.explain`` with the set as
must-include): go-gpuallocator's criterion (set score plus the best split of the other GPUs into
groups of k), the set score, fewer NUMA nodes, the smaller cut to the other GPUs. Among
equals: pairs fill from the front of the single GPUs' order (:func:`device_order`, which
single GPUs also fill from the front), larger sets from its back; then the lower indices.
Two-ended filling keeps whole units free for large sets while single GPUs and pairs share
the front. (First fit cannot do the device plugin's best fit, which takes the GPUs next to
busy ones; ``bench/quality_dra.py`` measures what that costs, and what the pruning costs.)

**Names and ranks** come from the whole topology (MIG-enabled and unhealthy GPUs included):
a set's ``rank`` is its position in its size's order, 0 the best, and its device name
``gpuset-<k>-<rank>`` stays the same while GPUs fail and recover, so a claim allocated
before keeps naming the same GPUs. Sets with a MIG-enabled member are not published
(:func:`publishable`); sets with an unhealthy member are, tainted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import comb
from typing import Any, Callable, Collection, Iterator, Sequence

from agent.topology.allocator import AllocationEngine, Candidate
from agent.topology.deviceids import DeviceRequest, DeviceTable
from agent.topology.model import Topology

__all__ = ["ENUMERATION_LIMIT", "SET_SIZES", "GpuSet", "clique_ids", "device_order", "gpu_sets",
           "island_ids", "publishable", "set_sizes", "structural_units"]

#: Sizes every node is offered in (besides its NVLink island and clique sizes).
SET_SIZES = (2, 4, 8, 16)
#: Most k-subsets of one unit published whole; above, whole sub-units are combined.
ENUMERATION_LIMIT = 256

Unit = tuple[int, ...]


@dataclass(frozen=True)
class GpuSet:
    """One published set: its GPU indices (sorted) and its rank among the sets of its size.
    Models no upstream API: our GPU set, published as one ResourceSlice device."""

    members: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def name(self) -> str:
        """The DRA device name, a DNS label."""
        return f"gpuset-{self.size}-{self.rank}"


# ----------------------------------------------------------------------- single GPUs
def island_ids(topology: Topology) -> dict[int, int]:
    """GPU index -> NVLink island id (lowest GPU index of its island; alone: itself)."""
    out = {g.index: g.index for g in topology.gpus}
    for island in topology.nvlink_islands:
        for i in island:
            out[i] = min(island)
    return out


def clique_ids(topology: Topology) -> dict[int, int]:
    """GPU index -> NVLink clique id (see the module docstring for the rule)."""
    cliques = [tuple(sorted(c)) for c in topology.nvlink_cliques]
    covered = {i for c in cliques for i in c}
    cliques += [(g.index,) for g in topology.gpus if g.index not in covered]
    cliques.sort()
    out: dict[int, int] = {}
    for g in topology.gpus:
        mine = [(-len(c), pos) for pos, c in enumerate(cliques) if g.index in c]
        out[g.index] = min(mine)[1]
    return out


def device_order(topology: Topology, in_use: Collection[int] = ()) -> list[int]:
    """GPU indices in slice order (see the module docstring); ``in_use``: indices of the GPUs
    held by prepared claims (groups with fewer free GPUs come first)."""
    islands = island_ids(topology)
    groups: dict[tuple[bool, int, int], list[int]] = {}
    for g in topology.gpus:
        key = (g.numa_node is None, g.numa_node if g.numa_node is not None else 0, islands[g.index])
        groups.setdefault(key, []).append(g.index)
    used = set(in_use)
    free = {key: sum(1 for i in members if i not in used) for key, members in groups.items()}
    numa_free: dict[tuple[bool, int], int] = {}
    for key, n in free.items():
        numa_free[key[:2]] = numa_free.get(key[:2], 0) + n

    def rank(key: tuple[bool, int, int]) -> tuple[object, ...]:
        if not used:
            return key
        return (key[0], numa_free[key[:2]], key[1], free[key], key[2])

    order: list[int] = []
    for key in sorted(groups, key=rank):
        left = list(groups[key])
        walk = [left.pop(0)]
        while left:
            last = walk[-1]
            best = max(left, key=lambda i: (topology.pair_score(last, i),
                                            sum(topology.pair_score(w, i) for w in walk), -i))
            left.remove(best)
            walk.append(best)
        order.extend(walk)
    return order


# ----------------------------------------------------------------------- sets
def set_sizes(topology: Topology) -> list[int]:
    """The set sizes the node publishes, ascending (see the module docstring)."""
    n = topology.gpu_count
    sizes = {k for k in SET_SIZES if k <= n}
    sizes |= {len(g) for g in (*topology.nvlink_islands, *topology.nvlink_cliques) if len(g) >= 2}
    return sorted(k for k in sizes if 2 <= k <= n)


def structural_units(topology: Topology) -> list[Unit]:
    """Cliques, islands, NUMA nodes, shared PCIe roots and the node, each sorted, no repeats."""
    units: set[Unit] = {tuple(sorted(c)) for c in topology.nvlink_cliques}
    units |= {tuple(sorted(i)) for i in topology.nvlink_islands}
    units |= {tuple(sorted(g)) for g in topology.numa_groups.values()}
    roots: dict[str, list[int]] = {}
    for g in topology.gpus:
        if g.pcie_root:
            roots.setdefault(g.pcie_root, []).append(g.index)
    units |= {tuple(sorted(r)) for r in roots.values() if len(r) >= 2}
    units.add(tuple(range(topology.gpu_count)))
    return sorted(u for u in units if u)


def _sub_units(unit: Unit, units: Sequence[Unit]) -> list[Unit] | None:
    """The largest units strictly inside ``unit``, when they are pairwise disjoint; else None."""
    inside = [u for u in units if len(u) < len(unit) and set(u) <= set(unit)]
    top = [u for u in inside if not any(set(u) < set(v) for v in inside)]
    seen: set[int] = set()
    for u in top:
        if seen & set(u):
            return None
        seen |= set(u)
    return top


def _whole_unions(parts: Sequence[Unit], k: int) -> Iterator[Unit]:
    """Unions of whole ``parts`` holding exactly ``k`` GPUs (parts in the given order)."""
    def walk(start: int, left: int, chosen: tuple[int, ...]) -> Iterator[Unit]:
        if left == 0:
            yield tuple(sorted(chosen))
            return
        for i in range(start, len(parts)):
            if len(parts[i]) <= left:
                yield from walk(i + 1, left - len(parts[i]), chosen + parts[i])

    yield from walk(0, k, ())


def candidate_sets(topology: Topology, k: int, units: Sequence[Unit] | None = None) -> set[Unit]:
    """The k-GPU sets the pruning rule keeps (the device plugin's empty-node choice aside)."""
    units = structural_units(topology) if units is None else units
    out: set[Unit] = set()
    for unit in units:
        if len(unit) < k:
            continue
        if comb(len(unit), k) <= ENUMERATION_LIMIT:
            out.update(itertools.combinations(unit, k))
            continue
        parts = _sub_units(unit, units)
        if parts:
            out.update(itertools.islice(_whole_unions(parts, k), ENUMERATION_LIMIT))
    return out


class _EmptyNode:
    """The device plugin's policy asked about the empty node, in GPU indices: the request
    goes down the same path as a GetPreferredAllocation for the whole-GPU resource."""

    def __init__(self, topology: Topology, engine: AllocationEngine) -> None:
        self.engine = engine
        self.table = DeviceTable([(g.uuid, g.index) for g in topology.gpus], topology.gpu_count, "gpus")
        self.everyone = list(self.table.ids)

    def _request(self, must: Sequence[int], size: int) -> DeviceRequest:
        return self.table.request(self.everyone, [self.table.ids[i] for i in must], size)

    def best_set(self, size: int) -> tuple[int, ...]:
        """The policy's choice of ``size`` GPUs on the empty node."""
        return tuple(sorted(self.table.gpu[r] for r in self.engine.gpus(self.table, self._request((), size))))

    def chosen(self, members: Unit) -> Candidate:
        """``members`` as the policy ranks them (its criteria, as for its own choice)."""
        return self.engine.explain(self.table, self._request(members, len(members)), runners_up=0).chosen


def _order_key(policy: _EmptyNode, position: dict[int, int],
               from_front: bool) -> Callable[[Unit], tuple[Any, ...]]:
    def key(members: Unit) -> tuple[Any, ...]:
        c = policy.chosen(members)
        places = sorted(position[i] for i in members)
        tie = places if from_front else sorted((-p for p in places))
        return (-c.gpuallocator_score, -c.score, c.numa_nodes, c.cut, tie, members)

    return key


def gpu_sets(topology: Topology, engine: AllocationEngine | None = None) -> dict[int, list[GpuSet]]:
    """Per size (ascending), the sets to publish, best first, ranked over the whole topology
    (``engine``: the topology's policy, built when not given)."""
    if topology.gpu_count < 2:
        return {}
    policy = _EmptyNode(topology, engine or AllocationEngine(topology))
    position = {g: i for i, g in enumerate(device_order(topology))}
    units = structural_units(topology)
    out: dict[int, list[GpuSet]] = {}
    for k in set_sizes(topology):
        best = policy.best_set(k)
        rest = candidate_sets(topology, k, units) - {best}
        key = _order_key(policy, position, from_front=k <= 2)
        ordered = [best, *sorted(rest, key=key)]
        out[k] = [GpuSet(members, rank) for rank, members in enumerate(ordered)]
    return out


def publishable(topology: Topology, gpu_set: GpuSet) -> bool:
    """Whether every member is a whole GPU (MIG off). Sets with an unhealthy or lost member
    are published too, tainted (:mod:`agent.dra.taints`)."""
    return not any(topology.gpus[i].mig_enabled for i in gpu_set.members)
