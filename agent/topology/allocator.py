"""Preferred allocation: which GPUs (replicas, MIG devices) a container should get.

The policy (``best-effort``, issue 3) chooses k GPUs G with R ⊆ G ⊆ A (A available,
R must-include) maximising, in this order:

1. go-gpuallocator's criterion, computed exactly: ``score(G) + P_k(A \\ G)``, where ``P_k(S)`` is
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

Pair and set scores are go-gpuallocator's (``agent.topology.model.pair_score``). The result is
always k distinct real GPUs. Exact when at most 16 GPUs are available; above that (up to 64)
a bounded greedy search (one candidate grown from each available GPU, the rest partitioned
greedily) answers in O(n^3) pair look-ups: well under 100 ms compiled, but not exact.

Requests arrive checked, in the ranks of the resource's device table
(:mod:`agent.topology.deviceids`, the one validation at the edge); the engine answers in ranks
of the same table and checks nothing again. Time-sliced replicas are picked by the kernel
(``replica_ranks``), MIG devices by :mod:`agent.topology.mig`.

One :class:`AllocationEngine` per topology: it memoises partition tables across calls and
serialises calls with a lock, so one instance may be shared by gRPC worker threads. Memory on
a 16-GPU node: a 512 KiB set-score table plus 512 KiB per request size k seen. Without the
compiled extension the pure-Python twin gives the same answers, 10x to 2000x slower
(``docs/benchmarks/device-plugin.md``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from agent.errors import AllocationError
from agent.records import MAX_GPUS
from agent.topology import kernel
from agent.topology.deviceids import DeviceRequest, DeviceTable
from agent.topology.mig import place_mig
from agent.topology.model import Topology

#: What separated a runner-up from the winner, by the index of the first differing criterion.
CRITERIA: tuple[str, ...] = (
    "go-gpuallocator criterion (set score + best split of the rest into groups of the same size)",
    "set score",
    "NUMA nodes spanned",
    "cut to the GPUs left free",
    "lowest indices",
)

@dataclass(frozen=True)
class Candidate:
    """One candidate set and its values under criteria 1-4 (5 is ``indices`` itself)."""

    indices: tuple[int, ...]
    gpuallocator_score: int  # criterion 1: score + best partition of the rest
    score: int  # criterion 2
    numa_nodes: int  # criterion 3
    cut: int  # criterion 4

    def key(self) -> tuple[int, int, int, int]:
        return (self.gpuallocator_score, self.score, -self.numa_nodes, -self.cut)


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
            f"chosen {list(c.indices)}: go-gpuallocator criterion {c.gpuallocator_score}, set score {c.score}, "
            f"NUMA nodes {c.numa_nodes}, cut {c.cut}",
            f"search: {'exact' if self.exact else f'bounded (not exact, more than {kernel.EXACT_MAX_GPUS} available)'}"
            f", engine {self.implementation}",
        ]
        if not self.runners_up:
            out.append("no other candidate: the request fixes the set")
        for r, criterion in self.runners_up:
            out.append(
                f"runner-up {list(r.indices)}: go-gpuallocator criterion {r.gpuallocator_score}, set score "
                f"{r.score}, NUMA nodes {r.numa_nodes}, cut {r.cut}; lost on {CRITERIA[criterion]}"
            )
        return out


def _separating_criterion(winner: Candidate, other: Candidate) -> int:
    for i, (a, b) in enumerate(zip(winner.key(), other.key())):
        if a != b:
            return i
    return 4


class AllocationEngine:
    """The allocation policy for one topology (see the module docstring).

    Every method but :meth:`best_score_for_size` takes a request already checked and mapped
    to ranks at the edge (:meth:`agent.topology.deviceids.DeviceTable.request`) and answers
    in ranks of the same table; nothing here checks the request again."""

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
        self._solver = kernel.allocation_solver(scores, self._numa) if self._n else None
        self._mask_indices: Callable[[int], list[int]] = kernel.impl.mask_indices
        # the extension's solver serialises its own calls; the twin's needs our lock
        self._solver_locks = bool(getattr(self._solver, "thread_safe", False))
        self.implementation = kernel.IMPLEMENTATION
        self._lock = threading.Lock()
        self._best_by_size: dict[int, int] = {}

    @staticmethod
    def _masks(table: DeviceTable, request: DeviceRequest) -> tuple[int, int]:
        """The request's (available, must-include) GPU bitmasks."""
        bit = table.gpu_bit
        available = sum(map(bit.__getitem__, request.available))
        required = sum(map(bit.__getitem__, request.required)) if request.required else 0
        return available, required

    # ------------------------------------------------------------------ GPUs
    def gpus(self, table: DeviceTable, request: DeviceRequest) -> list[int]:
        """The ranks to allocate, ascending, from a table of whole GPUs (one device per GPU):
        the set of ``request.size`` GPUs the policy chooses."""
        available, required = self._masks(table, request)
        return list(map(table.start.__getitem__, self.gpu_set(available, required, request.size)))

    def gpu_set(self, available: int, required: int, size: int) -> list[int]:
        """The GPU indices to allocate, ascending, from checked GPU bitmasks
        (:meth:`agent.topology.deviceids.DeviceTable.gpu_masks`): the set of ``size`` GPUs
        the policy chooses."""
        solver = self._solver
        assert solver is not None  # a node without GPUs has no devices to request
        if self._solver_locks:
            best = solver.best_mask(available, required, size)
        else:
            with self._lock:
                best = solver.best_mask(available, required, size)
        return self._mask_indices(best)

    def explain(
        self, table: DeviceTable, request: DeviceRequest, runners_up: int = 5
    ) -> Explanation:
        """:meth:`gpus`'s winner (GPU indices) with its criterion values and the next
        ``runners_up`` candidates, each with the criterion that ranked it lower."""
        available, required = self._masks(table, request)
        assert self._solver is not None
        with self._lock:
            ranked = self._solver.rank(available, required, request.size, max(runners_up, 0) + 1)
        cands = [self._candidate(e) for e in ranked]
        winner = cands[0]
        return Explanation(
            chosen=winner,
            runners_up=tuple((c, _separating_criterion(winner, c)) for c in cands[1:]),
            exact=available.bit_count() <= kernel.EXACT_MAX_GPUS,
            implementation=self.implementation,
        )

    def _candidate(self, entry: tuple[int, int, int, int, int]) -> Candidate:
        mask, c1, score, numa_nodes, cut = entry
        return Candidate(tuple(self._mask_indices(mask)), c1, score, numa_nodes, cut)

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

    # ------------------------------------------------------------------ shared devices
    def replicas(self, table: DeviceTable, request: DeviceRequest, packed: bool) -> list[int]:
        """Time-sliced replica ranks to allocate, ascending (by GPU, then replica number).

        A GPU's load is its replicas allocated to others: those of the table neither
        available nor in the request. ``distributed`` (not ``packed``): spread over distinct
        GPUs, least-loaded first, then second replicas and so on; ``packed``: fill the
        most-loaded GPU first (GPUs already holding a must-include replica first). Among
        equally loaded GPUs the GPU policy above chooses, given the GPUs already in the
        request. Deterministic."""
        required = request.required
        free = request.available
        if required:
            taken = set(required)
            free = [r for r in free if r not in taken]
        solver = self._solver
        assert solver is not None  # a node without GPUs has no devices to request
        if self._solver_locks:
            out: list[int] = solver.replica_ranks(table.start, free, required, request.size, packed)
        else:
            with self._lock:
                out = solver.replica_ranks(table.start, free, required, request.size, packed)
        return out

    def mig(self, table: DeviceTable, request: DeviceRequest) -> list[int]:
        """MIG device ranks to allocate, ascending (by parent GPU, then ID): see
        :func:`agent.topology.mig.place_mig` for where they go."""
        gpu = table.gpu
        taken = set(request.required)
        free: dict[int, list[int]] = {}
        for r in request.available:
            if r not in taken:
                free.setdefault(gpu[r], []).append(r)
        used = sorted({gpu[r] for r in request.required})
        numa_of = {g.index: g.numa_node for g in self.topology.gpus}
        picked = place_mig(free, used, request.size - len(request.required), numa_of)
        return sorted(request.required + picked)
