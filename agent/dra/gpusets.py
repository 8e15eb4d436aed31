"""Placement by publication order: which GPU sets the node publishes as DRA devices, and in
what order the single GPUs and the sets come, following the node's occupancy.

The scheduler's allocator takes the first free device in slice order, so the order is the
placement. For the **free GPUs** (whole, healthy, not lost, held by no prepared claim of this
node) the first free single GPU and the first free set of each size are the device plugin's
choice: :class:`SetPolicy` asks :class:`agent.topology.allocator.AllocationEngine`, as
``GetPreferredAllocation`` and ``gpu-topology-agent allocate --available FREE --size k`` do.

- **Sets** (:meth:`SetPolicy.sets`): sizes 2, 4, 8, 16 and every NVLink island and maximal
  clique size the node has (:func:`set_sizes`); per size the policy's choice on the free GPUs,
  then choices for claims allocated before the agent re-published, then the next disjoint
  choices, at most :data:`SETS_PER_SIZE` a size; sets the occupancy keeps
  (:mod:`agent.dra.withdrawal`) after them. Sets of one size may overlap (their counters make
  them exclusive).
- **Order**: the sets, largest size first, then the single GPUs (:meth:`SetPolicy.single_order`:
  the policy's one-GPU choices over the free GPUs one after another, then the others in the
  static order of :func:`device_order`, MIG devices in their parent's place).
- **Which Kubernetes** (:func:`gpu_sets_decision`): ``dra.gpuSets: auto`` publishes sets on an
  API server of 1.37 or newer only (before, the scheduler gathers every node's counter slices
  in every Filter); ``on`` and ``off`` decide without asking.

Never withdrawing what a claim may hold is :mod:`agent.dra.withdrawal`'s rule; the
preparer refusing a GPU another prepared claim holds (:mod:`agent.dra.prepare`) is the
defence behind it.
The safety argument: docs/design/dra-gpu-sets.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

from agent.dra.devices import set_name
from agent.topology.allocator import AllocationEngine
from agent.topology.deviceids import DeviceTable
from agent.topology.model import Topology

__all__ = ["NEWEST_KNOWN", "SETS_FROM", "SETS_PER_SIZE", "SET_SIZES", "GpuSet", "SetPolicy", "clique_ids",
           "device_order", "gpu_sets_decision", "island_ids", "set_sizes"]

#: Sizes every node is offered in (besides its NVLink island and clique sizes).
SET_SIZES = (2, 4, 8, 16)
#: The most sets of one size the policy publishes for the current occupancy (kept sets aside).
SETS_PER_SIZE = 4
#: The first Kubernetes version whose scheduler gathers a node's counter slices for that node only.
SETS_FROM = (1, 37)
#: The newest Kubernetes version this agent knows (``slices --server-version`` default).
NEWEST_KNOWN = (1, 37)


def gpu_sets_decision(setting: str, server: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether to publish GPU sets for ``dra.gpuSets`` = ``setting`` (auto, on, off) against an
    API server of version ``server`` (major, minor; None: unknown), and why, in words."""
    if setting == "on":
        return True, "dra.gpuSets is on"
    if setting == "off":
        return False, "dra.gpuSets is off"
    if server is None:
        return False, ("dra.gpuSets is auto and the API server's version is unknown: single GPUs only"
                       " (a scheduler before 1.37 gathers every node's counter slices in every Filter)")
    shown = f"{server[0]}.{server[1]}"
    if server >= SETS_FROM:
        return True, (f"dra.gpuSets is auto and the API server is Kubernetes {shown}: its scheduler reads a"
                      " node's counter slices for that node only (kubernetes#138917)")
    return False, (f"dra.gpuSets is auto and the API server is Kubernetes {shown}: before 1.37 the scheduler"
                   " gathers every node's counter slices in every Filter (quadratic in nodes), so single"
                   " GPUs only; set dra.gpuSets=on to publish sets anyway")


@dataclass(frozen=True)
class GpuSet:
    """One set device: its GPU indices, ascending. Models no upstream API: our GPU set,
    published as one ResourceSlice device."""

    members: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def name(self) -> str:
        """The DRA device name (:func:`agent.dra.devices.set_name`)."""
        return set_name(self.members)


# ----------------------------------------------------------------------- single GPUs
def island_ids(topology: Topology) -> dict[int, int]:
    """GPU index -> NVLink island id (lowest GPU index of its island; alone: itself)."""
    out = {g.index: g.index for g in topology.gpus}
    for island in topology.nvlink_islands:
        for i in island:
            out[i] = min(island)
    return out


def clique_ids(topology: Topology) -> dict[int, int]:
    """GPU index -> NVLink clique id: the position, in sorted order, of the largest NVLink
    clique holding the GPU, the first of equal ones (a GPU in none is a clique of its own)."""
    cliques = [tuple(sorted(c)) for c in topology.nvlink_cliques]
    covered = {i for c in cliques for i in c}
    cliques += [(g.index,) for g in topology.gpus if g.index not in covered]
    cliques.sort()
    out: dict[int, int] = {}
    for g in topology.gpus:
        mine = [(-len(c), pos) for pos, c in enumerate(cliques) if g.index in c]
        out[g.index] = min(mine)[1]
    return out


def device_order(topology: Topology) -> list[int]:
    """GPU indices in the static order, the single GPUs' order after those the policy would
    hand out first: grouped by NUMA node (unknown last), then by NVLink island (lowest index
    first); inside a group a greedy walk where each next GPU is the one best linked (pair
    score) to the one before, ties broken by its links to the whole group so far, then by the
    lower index."""
    islands = island_ids(topology)
    groups: dict[tuple[bool, int, int], list[int]] = {}
    for g in topology.gpus:
        key = (g.numa_node is None, g.numa_node if g.numa_node is not None else 0, islands[g.index])
        groups.setdefault(key, []).append(g.index)
    order: list[int] = []
    for key in sorted(groups):
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
    """The set sizes the node publishes, ascending: :data:`SET_SIZES` and the size of every
    NVLink island and maximal clique of two or more GPUs, as far as the node has GPUs."""
    n = topology.gpu_count
    sizes = {k for k in SET_SIZES if k <= n}
    sizes |= {len(g) for g in (*topology.nvlink_islands, *topology.nvlink_cliques) if len(g) >= 2}
    return sorted(k for k in sizes if 2 <= k <= n)


class SetPolicy:
    """The device plugin's policy on one topology's whole GPUs, asked in GPU indices (the
    request goes down the same path as a GetPreferredAllocation for the whole-GPU resource).
    Built once per topology; thread-safe as the engine is."""

    def __init__(self, topology: Topology, engine: AllocationEngine | None = None) -> None:
        self.topology = topology
        self.engine = engine or AllocationEngine(topology)
        self.table = DeviceTable([(g.uuid, g.index) for g in topology.gpus], topology.gpu_count, "gpus")
        self.sizes = set_sizes(topology)
        self.static_order = device_order(topology)

    def choose(self, free: Collection[int], size: int) -> tuple[int, ...]:
        """The policy's choice of ``size`` GPUs among ``free`` (indices), ascending."""
        ids = self.table.ids
        request = self.table.request([ids[self.table.start[i]] for i in free], [], size)
        return tuple(sorted(self.table.gpu[r] for r in self.engine.gpus(self.table, request)))

    def sequence(self, free: Collection[int], size: int, limit: int) -> list[tuple[int, ...]]:
        """The policy's choice of ``size`` among ``free``, then among the free GPUs left, ...:
        at most ``limit`` disjoint choices."""
        left = set(free)
        out: list[tuple[int, ...]] = []
        while len(out) < limit and len(left) >= size:
            chosen = self.choose(sorted(left), size)
            out.append(chosen)
            left -= set(chosen)
        return out

    def sets_by_size(self, free: Sequence[int]) -> dict[int, list[tuple[int, ...]]]:
        """Size -> the sets of that size to publish for ``free``, in order: the policy's choice
        on ``free``; then, one at a time, the conditional choice (:meth:`conditional`) that adds
        the most cases where a claim finds it as its first free set; then the next disjoint
        choices of :meth:`sequence`. Per size at most :data:`SETS_PER_SIZE`; in all no more
        sets than the disjoint choices of :meth:`sequence` (at most :data:`SETS_PER_SIZE` a
        size) would be."""
        firsts = {k: self.choose(free, k) for k in (1, *self.sizes) if k <= len(free)}
        room = {k: min(SETS_PER_SIZE, len(free) // k) for k in self.sizes if k in firsts}
        budget = sum(room.values())
        cases = {k: self.conditional(free, k, firsts.values()) for k in room}
        lists = {k: [firsts[k]] for k in room}
        while sum(map(len, lists.values())) < budget:
            gains = [(_hits(cases[k], [*lists[k], c]) - _hits(cases[k], lists[k]), k, -i, c) for k in room
                     if len(lists[k]) < SETS_PER_SIZE
                     for i, c in enumerate(dict.fromkeys(want for _, want in cases[k])) if c not in lists[k]]
            if not gains or max(gains)[0] <= 0:
                break
            _, k, _, chosen = max(gains)
            lists[k].append(chosen)
        for k in sorted(room, reverse=True):
            for chosen in self.sequence(free, k, room[k]):
                if len(lists[k]) < room[k] and sum(map(len, lists.values())) < budget and chosen not in lists[k]:
                    lists[k].append(chosen)
        return lists

    def conditional(self, free: Sequence[int], size: int,
                    taken: Iterable[tuple[int, ...]]) -> list[tuple[frozenset[int], tuple[int, ...]]]:
        """For each of the sets ``taken`` (GPUs a claim the agent has not heard of may hold)
        that leaves ``size`` GPUs of ``free``: those GPUs and the policy's choice on the rest."""
        out = []
        for gone in map(frozenset, taken):
            left = [g for g in free if g not in gone]
            if len(left) >= size:
                out.append((gone, self.choose(left, size)))
        return out

    def free_gpus(self, held: Collection[int], unhealthy: Collection[int] = ()) -> list[int]:
        """The GPUs a set may hold: whole, healthy, not lost, not in ``held``."""
        return [g.index for g in self.topology.gpus
                if not g.mig_enabled and not g.lost and g.index not in held and g.index not in unhealthy]

    def single_order(self, free: Collection[int]) -> list[int]:
        """Every GPU index in slice order: the policy's run over ``free``, then the others in
        the static order."""
        first = [c[0] for c in self.sequence(free, 1, len(free))]
        return first + [i for i in self.static_order if i not in set(first)]

    def sets(self, free: Collection[int], kept: Iterable[GpuSet] = (),
             chosen: Iterable[GpuSet] | None = None) -> list[GpuSet]:
        """The set devices to publish, largest size first: per size the policy's choices over
        ``free`` (:meth:`sets_by_size`; ``chosen``: what this gave with no ``kept`` for the
        same ``free``, to save computing it again), then the ``kept`` sets of that size not
        among them."""
        kept_by_size: dict[int, dict[str, GpuSet]] = {}
        for s in kept:
            kept_by_size.setdefault(s.size, {})[s.name] = s
        out: list[GpuSet] = []
        lists: dict[int, list[tuple[int, ...]]] = {}
        if chosen is None:
            lists = self.sets_by_size(sorted(free))
        else:
            for s in chosen:
                lists.setdefault(s.size, []).append(s.members)
        for k in sorted(set(self.sizes) | set(kept_by_size), reverse=True):
            chosen_k = [GpuSet(m) for m in lists.get(k, ())]
            names = {s.name for s in chosen_k}
            out += chosen_k + sorted((s for s in kept_by_size.get(k, {}).values() if s.name not in names),
                                   key=lambda s: s.members)
        return out


def _hits(cases: list[tuple[frozenset[int], tuple[int, ...]]], order: list[tuple[int, ...]]) -> int:
    """Of ``cases`` (GPUs taken, the policy's choice on the rest), those where the first set of
    ``order`` that avoids the GPUs taken is that choice (the scheduler's first fit)."""
    return sum(next((c == want for c in order if gone.isdisjoint(c)), False) for gone, want in cases)
