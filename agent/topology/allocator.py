"""Preferred allocation: which GPUs (replicas, MIG devices) a container should get.

The policy (``best-effort``, issue 3) chooses k GPUs G with R ⊆ G ⊆ A (A available,
R must-include) maximising, in this order:

1. the anchor's criterion, computed exactly: ``score(G) + P_k(A \\ G)``, where ``P_k(S)`` is
   the best total set score of splitting S into ``|S| // k`` groups of k GPUs plus, when
   ``r = |S| mod k`` is not 0, exactly one group of the remaining r GPUs. (go-gpuallocator
   pads A with empty slots to a multiple of k; a padded group holds either no padding or
   all of it, so it is exactly this one smaller group, and padding scores 0.) Because
   ``|G| = k``, r is ``|A| mod k`` for every candidate;
2. ``score(G)``;
3. fewer distinct NUMA nodes in G (an unknown node counts as one node, "unknown");
4. the smaller cut, the total pair score between G and A \\ G (best fit: take GPUs whose
   partners are gone, leave intact pairs and cliques for later);
5. the lexicographically smallest sorted index list.

Pair and set scores are the anchor's (``agent.topology.model.pair_score``). The result is
always k distinct real GPUs. Exact when at most 16 GPUs are available; above that (up to 64)
a bounded greedy search (one candidate grown from each available GPU, the rest partitioned
greedily) answers in O(n^3) pair look-ups: well under 100 ms compiled, but not exact.

One :class:`AllocationEngine` per topology: it memoises partition tables across calls and
serialises calls with a lock, so one instance may be shared by gRPC worker threads. Memory on
a 16-GPU node: a 512 KiB set-score table plus 512 KiB per request size k seen. Without the
compiled extension the pure-Python twin gives the same answers, 10x to 2000x slower
(``bench/README.md``).
"""

from __future__ import annotations

import itertools
import operator
import threading
from bisect import bisect_left
from dataclasses import dataclass
from typing import Mapping, Sequence

from agent.errors import AllocationError
from agent.records import MAX_GPUS, REPLICA_POLICIES
from agent.topology import engine
from agent.topology.deviceids import (
    DeviceTable,
    fill_mig,
    natural_key,
    natural_lowest,
    natural_sorted,
)
from agent.topology.model import Topology

#: What separated a runner-up from the winner, by the index of the first differing criterion.
CRITERIA: tuple[str, ...] = (
    "anchor criterion (set score + best split of the rest into groups of the same size)",
    "set score",
    "NUMA nodes spanned",
    "cut to the GPUs left free",
    "lowest indices",
)

@dataclass(frozen=True)
class Candidate:
    """One candidate set and its values under criteria 1-4 (5 is ``indices`` itself)."""

    indices: tuple[int, ...]
    anchor_score: int  # criterion 1: score + best partition of the rest
    score: int  # criterion 2
    numa_nodes: int  # criterion 3
    cut: int  # criterion 4

    def key(self) -> tuple[int, int, int, int]:
        return (self.anchor_score, self.score, -self.numa_nodes, -self.cut)


@dataclass(frozen=True)
class Explanation:
    """The winning set, the runners-up (best first) and, for each runner-up, the criterion
    (an index into :data:`CRITERIA`) that ranked it below the winner."""

    chosen: Candidate
    runners_up: tuple[tuple[Candidate, int], ...]
    exact: bool
    implementation: str

    def lines(self) -> list[str]:
        """A human-readable account, one line per item."""
        c = self.chosen
        out = [
            f"chosen {list(c.indices)}: anchor criterion {c.anchor_score}, set score {c.score}, "
            f"NUMA nodes {c.numa_nodes}, cut {c.cut}",
            f"search: {'exact' if self.exact else f'bounded (not exact, more than {engine.EXACT_MAX_GPUS} available)'}"
            f", engine {self.implementation}",
        ]
        if not self.runners_up:
            out.append("no other candidate: the request fixes the set")
        for r, criterion in self.runners_up:
            out.append(
                f"runner-up {list(r.indices)}: anchor criterion {r.anchor_score}, set score "
                f"{r.score}, NUMA nodes {r.numa_nodes}, cut {r.cut}; lost on {CRITERIA[criterion]}"
            )
        return out


def _separating_criterion(winner: Candidate, other: Candidate) -> int:
    for i, (a, b) in enumerate(zip(winner.key(), other.key())):
        if a != b:
            return i
    return 4


_SEQUENCES = (list, tuple)


class AllocationEngine:
    """The allocation policy for one topology (see the module docstring)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._n = topology.gpu_count
        if self._n > MAX_GPUS:
            raise AllocationError(f"at most {MAX_GPUS} GPUs per node are supported, got {self._n}")
        known = sorted({g.numa_node for g in topology.gpus if g.numa_node is not None})
        ids = {node: i for i, node in enumerate(known)}
        unknown_id = len(known)  # "unknown" is one node of its own
        self._numa = [
            ids.get(g.numa_node, unknown_id) if g.numa_node is not None else unknown_id
            for g in topology.gpus
        ]
        scores = [list(row) for row in topology.scores] if self._n else []
        self._solver = engine.allocation_solver(scores, self._numa) if self._n else None
        self._mask_indices = engine.impl.mask_indices
        self._load_max: int = engine.impl.LOAD_MAX
        # the extension's solver serialises its own calls; the twin's needs our lock
        self._solver_locks = bool(getattr(self._solver, "thread_safe", False))
        self.implementation = engine.IMPLEMENTATION
        self._lock = threading.Lock()
        self._best_by_size: dict[int, int] = {}

    # ------------------------------------------------------------------ validation
    # Every request is checked here, once, and turned into the kernel's plain ints; the
    # kernel checks its arguments again only as a guard (a failure there is a bug here).
    def _gpu_index(self, what: str, v: object) -> int:
        """``v`` as a GPU index of this node, else AllocationError."""
        if isinstance(v, bool) or not isinstance(v, int):
            raise AllocationError(f"{what}: {v!r} is not a GPU index")
        if not 0 <= v < self._n:
            raise AllocationError(
                f"{what}: unknown GPU index {v} (this node has GPUs 0-{self._n - 1})"
                if self._n
                else f"{what}: unknown GPU index {v} (this node has no GPUs)"
            )
        return int(v)

    def _index_mask(self, what: str, values: Sequence[int]) -> int:
        """The bitmask of distinct GPU indices ``values``, else AllocationError."""
        n = self._n
        mask = 0
        for v in values:
            if type(v) is not int or not 0 <= v < n:
                v = self._gpu_index(what, v)
            bit = 1 << v
            if mask & bit:
                raise AllocationError(f"{what}: duplicate GPU index {v}")
            mask |= bit
        return mask

    @staticmethod
    def _check_size(n_available: int, n_required: int, size: object) -> int:
        if isinstance(size, bool) or not isinstance(size, int):
            raise AllocationError(f"size must be an integer, got {size!r}")
        if size < 1:
            raise AllocationError(f"size must be at least 1, got {size}")
        if size > n_available:
            raise AllocationError(f"size {size} is more than the {n_available} available devices")
        if n_required > size:
            raise AllocationError(f"{n_required} must-include devices do not fit in size {size}")
        return int(size)

    def _masks(
        self, available: Sequence[int], must_include: Sequence[int], size: int
    ) -> tuple[int, int, int]:
        """(available mask, must-include mask, size as an int) of a valid request, else
        AllocationError naming the first problem."""
        avail = self._index_mask("available", available)
        required = self._index_mask("must-include", must_include) if must_include else 0
        outside = required & ~avail
        if outside:
            first = (outside & -outside).bit_length() - 1
            raise AllocationError(f"must-include GPU {first} is not available")
        k = self._check_size(avail.bit_count(), required.bit_count(), size)
        return avail, required, k

    @staticmethod
    def _indices(mask: int) -> tuple[int, ...]:
        return tuple(i for i, bit in enumerate(reversed(bin(mask)[2:])) if bit == "1")

    def _candidate(self, entry: tuple[int, int, int, int, int]) -> Candidate:
        mask, c1, score, numa_nodes, cut = entry
        return Candidate(self._indices(mask), c1, score, numa_nodes, cut)

    # ------------------------------------------------------------------ GPUs
    def best_set(
        self, available: Sequence[int], must_include: Sequence[int], size: int
    ) -> list[int]:
        """The k = ``size`` GPU indices to allocate, sorted. Raises AllocationError on an
        invalid request (size < 1 or above |available|, must-include outside available or
        larger than size, unknown or duplicate indices)."""
        # The one validation, on its fast path: a list or tuple of distinct ints in 0..n-1
        # (exactly int: True and 1.0 are not GPU indices), no must-include, a size that fits.
        # Anything else, valid or not, goes through _masks, which names the first problem.
        avail = 0
        if not must_include and type(available) in _SEQUENCES:
            for v in available:
                if type(v) is not int or v < 0:
                    avail = -1
                    break
                avail |= 1 << v
        else:
            avail = -1
        if (
            avail >= 0
            and not avail >> self._n
            and avail.bit_count() == len(available)
            and type(size) is int
            and 1 <= size <= len(available)
        ):
            required, k = 0, size
        else:
            avail, required, k = self._masks(available, must_include, size)
        solver = self._solver
        assert solver is not None  # a node with no GPUs fails validation above
        if self._solver_locks:
            best = solver.best_mask(avail, required, k)
        else:
            with self._lock:
                best = solver.best_mask(avail, required, k)
        indices: list[int] = self._mask_indices(best)
        return indices

    def explain(
        self, available: Sequence[int], must_include: Sequence[int], size: int, runners_up: int = 5
    ) -> Explanation:
        """:meth:`best_set`'s winner with its criterion values and the next ``runners_up``
        candidates, each with the criterion that ranked it lower."""
        avail, required, k = self._masks(available, must_include, size)
        assert self._solver is not None
        with self._lock:
            ranked = self._solver.rank(avail, required, k, max(runners_up, 0) + 1)
        cands = [self._candidate(e) for e in ranked]
        winner = cands[0]
        return Explanation(
            chosen=winner,
            runners_up=tuple((c, _separating_criterion(winner, c)) for c in cands[1:]),
            exact=bin(avail).count("1") <= engine.EXACT_MAX_GPUS,
            implementation=self.implementation,
        )

    def best_score_for_size(self, size: int) -> int:
        """Best set score of any ``size`` GPUs of the node (exact up to 16 GPUs; above, the
        best the greedy search finds), the denominator of the placement-quality ratio."""
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= self._n:
            raise AllocationError(f"size must be in 1..{self._n}, got {size!r}")
        cached = self._best_by_size.get(size)
        if cached is None:
            assert self._solver is not None
            with self._lock:
                cached = self._best_by_size[size] = int(self._solver.best_score(size))
        return cached

    # ------------------------------------------------------------------ comparisons
    def partition_only_set(self, available: Sequence[int], size: int) -> list[int]:
        """What the anchor (go-gpuallocator's best-effort policy) would choose, for the demo
        and the quality benchmark (not a policy the agent serves).

        The anchor keeps the first best partition of the available GPUs into groups of
        ``size`` that its enumeration finds (groups hold the lowest remaining GPU, partners
        in index order), then the best-scoring group of that partition. Where ``size``
        divides the available count this is reproduced exactly, without enumerating: walk
        the groups in the anchor's order and keep the first one that still completes a best
        partition. Otherwise (the anchor pads the last group) the set with the best
        criterion 1, then criterion 2, then the lowest indices stands in for it."""
        avail, _, size = self._masks(available, (), size)
        if avail.bit_count() > engine.EXACT_MAX_GPUS:
            raise AllocationError(
                f"the partition-only comparison is exact for at most {engine.EXACT_MAX_GPUS} "
                f"available GPUs, got {avail.bit_count()}"
            )
        assert self._solver is not None
        solver = self._solver
        free = self._mask_indices(avail)
        with self._lock:
            if len(free) % size == 0:
                best_group, best_score, mask = 0, -1, avail
                while mask:
                    target = solver.partition_value(mask, size)
                    members = self._mask_indices(mask)
                    for combo in itertools.combinations(members[1:], size - 1):
                        g = (1 << members[0]) | sum(1 << i for i in combo)
                        score = solver.set_score(g)
                        if score + solver.partition_value(mask ^ g, size) == target:
                            break
                    if score > best_score:  # first best group of the partition
                        best_group, best_score = g, score
                    mask ^= g
                return list(self._mask_indices(best_group))
            best: list[int] = []
            best_value = (-1, -1)
            for combo in itertools.combinations(free, size):  # lexicographic: first max wins
                g = sum(1 << i for i in combo)
                score = solver.set_score(g)
                value = (score + solver.partition_value(avail ^ g, size), score)
                if value > best_value:
                    best, best_value = list(combo), value
            return best

    @staticmethod
    def naive_set(available: Sequence[int], size: int) -> list[int]:
        """The lowest ``size`` available indices: what a topology-blind plugin gives."""
        if not 1 <= size <= len(available):
            raise AllocationError(f"size must be in 1..{len(available)}, got {size}")
        return sorted(available)[:size]

    # ------------------------------------------------------------------ shared devices
    def _devices(
        self, available: Sequence[tuple[str, int]], must_include: Sequence[str], size: int
    ) -> tuple[dict[str, int], list[str], list[list[str]], int]:
        """Validated (device ID -> GPU, must-include IDs, per GPU index its available IDs
        not in must-include (input order), size as an int), else AllocationError naming the
        first problem. This runs on every kubelet request: a list or tuple of well-formed
        pairs takes one tight pass; anything else (valid or not) the checking pass."""
        n = self._n
        parent: dict[str, int] = {}
        by_gpu: list[list[str]] = [[] for _ in range(n)]
        if type(available) in _SEQUENCES:
            try:
                for device_id, gpu in available:
                    if (
                        type(gpu) is not int
                        or not 0 <= gpu < n
                        or type(device_id) is not str
                        or not device_id
                    ):
                        break
                    parent[device_id] = gpu
                    by_gpu[gpu].append(device_id)
                else:
                    if len(parent) == len(available):
                        return self._required(parent, by_gpu, len(parent), must_include, size)
            except (TypeError, ValueError):  # an entry that is not a pair
                pass
            parent.clear()
            by_gpu = [[] for _ in range(n)]
        for entry in available:
            try:
                device_id, gpu = entry
            except (TypeError, ValueError):
                raise AllocationError(
                    f"available: {entry!r} is not a (device ID, GPU index) pair"
                ) from None
            if type(device_id) is not str or not device_id:
                raise AllocationError(f"available: {device_id!r} is not a device ID")
            if type(gpu) is not int or not 0 <= gpu < n:
                gpu = self._gpu_index(f"available {device_id}", gpu)
            if device_id in parent:
                raise AllocationError(f"available: duplicate device ID {device_id}")
            parent[device_id] = gpu
            by_gpu[gpu].append(device_id)
        return self._required(parent, by_gpu, len(parent), must_include, size)

    def _required(
        self,
        parent: dict[str, int],
        by_gpu: list[list[str]],
        count: int,
        must_include: Sequence[str],
        size: int,
    ) -> tuple[dict[str, int], list[str], list[list[str]], int]:
        """:meth:`_devices` for the must-include IDs and the size."""
        required = list(must_include)
        if required:
            seen: set[str] = set()
            for device_id in required:
                if device_id not in parent:
                    raise AllocationError(f"must-include device {device_id!r} is not available")
                if device_id in seen:
                    raise AllocationError(f"must-include: duplicate device ID {device_id}")
                seen.add(device_id)
                by_gpu[parent[device_id]].remove(device_id)
        if type(size) is int and 1 <= size <= count and len(required) <= size:
            return parent, required, by_gpu, size
        return parent, required, by_gpu, self._check_size(count, len(required), size)

    def _loads(
        self,
        free: list[int],
        taken: list[int],
        per_gpu: int | Mapping[int, int] | None,
    ) -> list[int]:
        """Per GPU index, its replicas allocated to others (0 for GPUs not in the request)."""
        counts = list(map(operator.add, free, taken))  # 0: not in the request
        if per_gpu is None:
            uniform = max(counts)
            load = [uniform - c if c else 0 for c in counts]
        elif type(per_gpu) is dict or (
            not isinstance(per_gpu, int) and isinstance(per_gpu, Mapping)
        ):
            get = per_gpu.get
            load = [0] * self._n
            for g, c in enumerate(counts):
                if c:
                    v = get(g, c)
                    v = v if type(v) is int else int(v)
                    load[g] = v - c if v > c else 0
        elif isinstance(per_gpu, int):
            load = [max(per_gpu - c, 0) if c else 0 for c in counts]
        else:
            raise AllocationError(
                f"replicas_per_gpu must be a count or a mapping GPU index -> count, "
                f"got {per_gpu!r}"
            )
        if max(load) > self._load_max:
            # Only comparisons of load + taken matter, and taken differs by at most the
            # request's size: shrink every gap between distinct loads to at most that + 1.
            cap = sum(counts) + 1
            shrunk: dict[int, int] = {}
            last, prev = 0, None
            for value in sorted({load[g] for g in range(self._n) if counts[g]}):
                last = 0 if prev is None else last + min(value - prev, cap)
                shrunk[value], prev = last, value
            load = [shrunk[v] if c else 0 for v, c in zip(load, counts)]
        return load

    def _replica_counts(
        self,
        free: list[int],
        taken: list[int],
        per_gpu: int | Mapping[int, int] | None,
        need: int,
        policy: str,
    ) -> list[int]:
        """Per GPU index, how many more of its free replicas to take (the kernel's answer)."""
        load = self._loads(free, taken, per_gpu)
        solver = self._solver
        assert solver is not None  # a node with no GPUs has no valid replica request
        packed = policy == "packed"
        if self._solver_locks:
            counts: list[int] = solver.replica_counts(free, taken, load, need, packed)
        else:
            with self._lock:
                counts = solver.replica_counts(free, taken, load, need, packed)
        return counts

    def device_table(self, devices: Sequence[tuple[str, int]]) -> DeviceTable:
        """Every (device ID, GPU index) a resource offers, for :meth:`replicas_in` (once)."""
        return DeviceTable(devices, self._n)

    def replicas_in(
        self,
        table: DeviceTable,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        policy: str = "distributed",
        *,
        replicas_per_gpu: int | Mapping[int, int] | None = None,
    ) -> list[str]:
        """:meth:`replicas` for IDs of ``table`` (each ID's GPU comes from the table): the
        same answer and the same errors, with one dict lookup per ID and the grouping, sort
        and pick done on int ranks. An ID not in the table is an AllocationError."""
        if policy not in REPLICA_POLICIES:
            raise AllocationError(
                f"unknown replica policy {policy!r}: expected one of {', '.join(REPLICA_POLICIES)}"
            )
        rank = table.rank
        try:
            ranks = set(map(rank.__getitem__, available))
            req = list(map(rank.__getitem__, must_include)) if must_include else []
        except (KeyError, TypeError):  # not in the table: the checking pass names it
            ranks, req = set(), [-1]
        if (
            len(ranks) != len(available)
            or (req and (len(set(req)) != len(req) or not ranks.issuperset(req)))
            or type(size) is not int
            or not max(len(req), 1) <= size <= len(ranks)
        ):  # anything unusual, valid or not, takes the checking path (and its errors)
            pairs, per = table.pairs(available, "available"), replicas_per_gpu
            return self.replicas(pairs, must_include, size, policy, replicas_per_gpu=per)
        n = self._n
        taken = [0] * n
        if req:
            ranks.difference_update(req)
            gpu = table.gpu
            for r in req:
                taken[gpu[r]] += 1
        free_ranks = sorted(ranks)
        bounds = [bisect_left(free_ranks, s) for s in table.start]
        free = list(map(operator.sub, bounds[1:], bounds))
        counts = self._replica_counts(free, taken, replicas_per_gpu, size - len(req), policy)
        for g in range(n):
            c = counts[g]
            if c:
                lo = bounds[g]
                req += free_ranks[lo : lo + c]
        req.sort()
        return list(map(table.ids.__getitem__, req))

    def replicas(
        self,
        available: Sequence[tuple[str, int]],
        must_include: Sequence[str],
        size: int,
        policy: str = "distributed",
        *,
        replicas_per_gpu: int | Mapping[int, int] | None = None,
    ) -> list[str]:
        """Time-sliced replica IDs (``<uuid>::<n>``) to allocate; ``available`` pairs each
        free replica ID with its GPU index. Returned sorted by GPU index, then replica number.

        A GPU's load is its replicas already allocated: ``replicas_per_gpu`` (a count for
        every GPU, or per GPU index) minus its free replicas. Without it every GPU is assumed
        to have the same number of replicas (as the device plugin's time-slicing config
        gives), so load ranks GPUs by fewest free replicas.

        ``distributed``: spread over distinct GPUs, least-loaded first, then second replicas
        and so on; ``packed``: fill the most-loaded GPU first (GPUs already holding a
        must-include replica first). Among equally loaded GPUs the GPU policy above chooses,
        given the GPUs already in the request. Deterministic.
        """
        if policy not in REPLICA_POLICIES:
            raise AllocationError(
                f"unknown replica policy {policy!r}: expected one of {', '.join(REPLICA_POLICIES)}"
            )
        parent, required, by_gpu, k = self._devices(available, must_include, size)
        n = self._n
        free = list(map(len, by_gpu))
        taken = [0] * n
        for device_id in required:
            taken[parent[device_id]] += 1
        counts = self._replica_counts(free, taken, replicas_per_gpu, k - len(required), policy)
        out: list[str] = []
        for g in range(n):
            c = counts[g]
            if taken[g]:
                mine = [d for d in required if parent[d] == g]
                if c:
                    mine += natural_lowest(by_gpu[g], c)
                out += natural_sorted(mine)
            elif c:
                out += natural_lowest(by_gpu[g], c)
        return out

    def mig(
        self, available: Sequence[tuple[str, int]], must_include: Sequence[str], size: int
    ) -> list[str]:
        """MIG device IDs to allocate; ``available`` pairs each free MIG device with its
        parent GPU index. Prefers all on one parent GPU, else on one NUMA node, else
        anywhere; best fit throughout: the parent (NUMA node) with the fewest free instances
        that can take the rest first, parents already in the request first. Returned sorted
        by parent index, then ID."""
        parent, required, by_gpu, size = self._devices(available, must_include, size)
        free = {g: natural_sorted(ids) for g, ids in enumerate(by_gpu) if ids}
        need = size - len(required)
        used = sorted({parent[d] for d in required})
        numa_of = {g.index: g.numa_node for g in self.topology.gpus}

        def numa_key(node: int | None) -> tuple[bool, int]:
            return (node is None, node or 0)

        def fill(parents: list[int]) -> list[str]:
            return fill_mig(free, used, need, parents)

        picked: list[str] | None = None
        if need == 0:
            picked = []
        if picked is None and len(used) <= 1:
            options = [p for p in (used or free) if len(free.get(p, [])) >= need]
            if options:
                p = min(options, key=lambda q: (len(free[q]), q))
                picked = free[p][:need]
        if picked is None:
            used_nodes = {numa_of[p] for p in used}
            if len(used_nodes) <= 1:
                nodes: dict[int | None, list[int]] = {}
                for p in sorted(set(free) | set(used)):
                    nodes.setdefault(numa_of[p], []).append(p)
                options_n = [
                    node
                    for node, ps in nodes.items()
                    if (not used_nodes or node in used_nodes)
                    and sum(len(free.get(p, [])) for p in ps) >= need
                ]
                if options_n:
                    node = min(
                        options_n,
                        key=lambda u: (sum(len(free.get(p, [])) for p in nodes[u]), numa_key(u)),
                    )
                    picked = fill(nodes[node])
        if picked is None:
            picked = fill(sorted(set(free) | set(used)))
        return sorted(required + picked, key=lambda d: (parent[d], natural_key(d)))

