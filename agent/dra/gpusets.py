"""Placement by publication order, following the node's occupancy: which GPU sets the node
publishes as DRA devices, and in what order the single GPUs and the sets come.

The scheduler's allocator has no scoring: it takes the first free device in pool, slice and
device order (slices sorted by name). A claim for one *set device* of k GPUs therefore gets
the first published set of that size whose GPUs are all free (the counters of
``agent.dra.slices`` make a set busy as soon as one member is). So the agent publishes, for
the GPUs free now, the device plugin's own choices first, and re-publishes at every
NodePrepareResources and NodeUnprepareResources (:class:`agent.dra.publisher.SlicePublisher`).

**Free GPUs** are the whole (MIG off), healthy, not lost GPUs that no prepared claim of this
node holds. The **policy** is the device plugin's (:class:`SetPolicy`, over
:class:`agent.topology.allocator.AllocationEngine`, built once per topology): its choice of
k GPUs among the free ones is what ``GetPreferredAllocation`` and
``gpu-topology-agent allocate --available <free> --size k`` give.

**Single GPUs** (:meth:`SetPolicy.sequence` with k = 1): the policy's choice of one free GPU,
then its choice among the free GPUs left, and so on (the device plugin's answers to a run of
one-GPU requests); then the GPUs that are not free, in the static order of
:func:`device_order` (MIG devices in their parent's place).

**Order: the sets first, largest size first, then the single GPUs.** The allocator walks the
devices in slice order and runs a request's selectors on each until one fits; a multi-GPU
claim tries its set first (the example claims' ``[set of k -> k singles]``). With the single
GPUs first, every such claim evaluated its class on every single GPU before reaching a set
(CEL evaluations per pod 2.7x single GPUs' at 8 GPUs, 11.5x at 64; ``bench/bench_dra_scheduler.py``).
Sets first moves that cost to the one-GPU claims (one evaluation per published set), and
largest first suits the pod mix the bench replays (a claim of k walks the sets larger than
k; the larger sizes have the fewest sets): at 100 and 500 nodes CEL 2.2x (8 GPUs), 2.3-2.5x
(16), 6.4x (64), against 2.4x, 2.7-2.8x, 4.0x smallest first (bench/README.md). Where all
devices share one slice, the first single GPU (the device plugin's answer for one GPU) leads,
before the sets: a one-GPU claim takes it at the first device it walks, and a multi-GPU claim
walks one device more (est. CPU 1.41-2.17x -> 1.33-2.09x at 100 x 8, bench/README.md). Only
the order between classes changes: each claim still gets the first free device of its class,
so the placement is the same.

**Sets.** Sizes 2, 4, 8 and 16, and the size of every NVLink island and maximal NVLink clique
of two or more GPUs, as far as the node has GPUs (:func:`set_sizes`). Per size first the
policy's choice of k free GPUs: the first free set of each size is exactly the device plugin's
answer. Then for claims allocated before the agent re-publishes (the scheduler runs ahead of the
kubelet; such a claim most likely took the first single GPU or the first set of its size, P):
the policy's choices on the free GPUs less P, one P of each size, added one at a time where they
make the first set not overlapping P the policy's choice without P for the most P
(:meth:`SetPolicy.sets_by_size`); then its disjoint next choices (:meth:`SetPolicy.sequence`).
At most :data:`SETS_PER_SIZE` a size, and in all no more than the disjoint choices would be.
Sets of one size may overlap: their counters make them exclusive, names are unique per member
set, and the keep rule below does not assume disjoint sets. Where the device plugin's choice
changes although the first set stays free (it packs next to a GPU that became busy), first fit
cannot follow it. Since the first set of each size is there wherever that many GPUs are free,
a claim for one set alone fits exactly the nodes its k single GPUs fit, once the agent has
re-rendered (``tests/test_dra_set_alone.py``); only while the scheduler's view lags does it find
no set where singles would fit: a prioritized list then falls back to single GPUs, a set alone
waits for the next rendering.

**Never withdraw what a claim may hold** (:func:`agent.dra.withdrawal.sets_to_keep`,
:func:`agent.dra.withdrawal.sets_to_withdraw`). The
scheduler allocates before the agent hears of it (the kubelet prepares after the pod is
bound), and counts an allocated device's counters by finding it in the slices it sees now
(``checkAvailableCounters``): a set withdrawn while a claim holds it would let its GPUs be
handed out again. A set published once stays published until one of its member GPUs is held
by a prepared claim through another device (it is *due*); then it goes **in two steps**: it
stays published with the taint ``<driver>/withdrawn`` (``NoSchedule``, :mod:`agent.dra.withdrawal`),
which makes the scheduler give it to no new claim (``taintPreventsAllocation``) while it still
counts its counters for a claim that has it; it leaves at a re-publication at least the grace
period G (``dra.gpuSetWithdrawalGraceSeconds``, 60 s) after the taint was first published,
unless a prepared claim holds it then. Once tainted it stays tainted until it goes, even with
its GPUs free again (the other claim ended), unless the policy chooses it again (then it is an
ordinary set): what lagging claims find is what withdrawing at once would leave.

*Why that is safe*, assuming the scheduler sees a write less than L after the agent stamps it
(so L includes the write's own latency), a
claim allocated is prepared (or deallocated) less than P after, and G > L + P. Let set D leave
at write W2 while claim C may hold it. D carried the taint in every write from W1 to W2, W2 at
least G after W1. C was allocated D from a view where D was published untainted (no claim
tolerates the taint): a view older than W1, so C was allocated before W1 + L and prepared before
W1 + L + P < W2. Rendering W2, the agent knew C held D (prepared, not unprepared: its pod may
run), so D was held through itself and kept, not left out. A contradiction: no claim whose pod
may run holds a set when it leaves. And no claim gets D after the scheduler sees W2: D is gone.
**A single GPU held through a set** goes the same way (:func:`agent.dra.withdrawal.singles_to_withdraw`):
the set's counters keep it from being allocated while the set is held, so no claim holds it,
but a write leaving it out may reach the scheduler after the set's claim ended and after it
handed the single out from the pool it still saw (``tests/test_dra_safety.py``, RACE_SINGLE);
so it is published tainted (and ``heldBySet: true``, which the shipped GPU class refuses before
any counter is compared) for the grace, then left out while its GPU stays held through a set,
and published again, an ordinary device, once the GPU is free. The argument above holds with
the single for D. Every other single GPU is always published. Kept and tainted sets come after
the policy's sets of their size, so first fit still finds the policy's answer first; in one
slice, the sets being withdrawn go after the single GPUs (no class selects them: a claim that
finds its device first never walks them). The agent recovers what it
published, and when each taint was added, from its own slices in the API server after a
restart. The cost: a due set costs the scheduler its conversion and counters on every Filter
for G more (``bench/quality_dra.py`` counts the set devices of each rendering, the grace
modelled as "at the next rendering").

**Where the sets go at once, and the defence.** Where the API server keeps no taints
(``DRADeviceTaints`` off, found by reading back) or G is 0 (said in one log line at start), a
due set leaves at once, the rule of before the grace. Its argument (if D is left out while C2
may hold it, some member g is held by prepared C3 through E != D; whichever of D and E the
scheduler allocated second, it counted the first's counters) holds for the slices the
scheduler counts with, but its view may lag the agent's writes: a withdrawal decided while a
member was held through another device (safe then) can reach the scheduler only after that
claim ended and after the scheduler allocated the set from the pool it still saw; the set's
counters then go uncounted and a member can be handed out again (``tests/test_dra_safety.py``,
RACE, a strict xfail there; with the grace it passes). A claim that tolerates every taint (a
toleration without a key) defeats the taint, and so does a scheduler run without the
``DRADeviceTaints`` gate (its allocator checks taints only with it, ``allocator_incubating.go``;
reading back shows the API server's gate, not the scheduler's); the ``healthy: false`` a set
being withdrawn shows (below) still keeps the shipped classes off it. Whatever the
lag, NodePrepareResources refuses a claim while another prepared claim holds one of its GPUs
(:mod:`agent.dra.prepare`), so at worst a pod fails to start (the kubelet retries it until
the other claim is unprepared), never two pods on one GPU. The allocator (v0.36.2 and
v0.37.0-alpha.2) reserves a device's counters before checking its taints and keeps them when
a taint rejects it (kubernetes#140436): a tainted set whose counters are free (freed within
the grace) would block its members for the rest of a claim's search. So a set being withdrawn
also shows ``healthy: false``: the shipped classes select healthy sets only (selectors come
before counters), so none of them ever reserves its counters; a class of one's own should
select on ``healthy`` too.
Two cases fall outside the rule: an agent started with sets off (``dra.gpuSets``, or an API
server that drops the counters) withdraws every set, and an upgrade from agents that named
sets by rank (``gpuset-4-0``) withdraws those: change either on a node without pending set
claims.

**Which Kubernetes** (:func:`gpu_sets_decision`). Sets need counters, and the scheduler's
``GatherPools`` (``k8s.io/dynamic-resource-allocation``, ``structured/internal/incubating``)
reads counter slices differently by version: up to 1.36 every slice holding
``sharedCounters`` is gathered for every node it filters ("needed to use a pool regardless
of their node selector"), so each Filter converts and validates every node's devices:
scheduling becomes quadratic in the node count. 1.37 (kubernetes#138917) gathers a counter
slice with ``nodeName`` for that node only. ``dra.gpuSets: auto`` therefore publishes sets on
an API server of 1.37 or newer and single GPUs only before (or when the version is unknown);
``on`` and ``off`` decide without asking. The scheduler may be one minor version older than
the API server during an upgrade: ``off`` until it is upgraded too, where that matters.

**Names** say the members: ``gpuset-<k>-m<mask>``, the members' bitmask in lowercase hex
(``gpuset-4-mf`` is GPUs 0-3, ``gpuset-2-m30`` GPUs 4 and 5; the ``m`` keeps them apart from
the ``gpuset-<k>-<rank>`` names of earlier agents, which stood for other GPUs; :func:`set_name`,
:func:`parse_set_name`), so a name means the same GPUs whatever the occupancy, whichever
agent generation published it, and the preparer needs no list of sets to resolve one.

**Single GPUs' static order** (:func:`device_order`): grouped by NUMA node (unknown last),
then by NVLink island (lowest index first), and inside a group a greedy walk where each next
GPU is the one best linked (pair score) to the one before, ties broken by its links to the
whole group so far, then by the lower index.
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


def device_order(topology: Topology) -> list[int]:
    """GPU indices in the static order (see the module docstring): the single GPUs' order
    after those the policy would hand out first."""
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
    """The set sizes the node publishes, ascending (see the module docstring)."""
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
        """Size -> the sets of that size to publish for ``free``, in order (module docstring,
        "Sets"): the policy's choice on ``free``; then, one at a time, the conditional choice
        (:meth:`conditional`) that adds the most cases where a claim finds it as its first free
        set; then the next disjoint choices of :meth:`sequence`. Per size at most
        :data:`SETS_PER_SIZE`; in all no more sets than the disjoint choices of :meth:`sequence`
        (at most :data:`SETS_PER_SIZE` a size) would be."""
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
        """The set devices to publish, largest size first (module docstring, "Order"): per
        size the policy's choices over ``free`` (:meth:`sets_by_size`; ``chosen``: what this
        gave with no ``kept`` for the same ``free``, to save computing it again), then the
        ``kept`` sets of that size not among them."""
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
