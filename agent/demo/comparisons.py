"""What other allocators would choose, for comparison: the demo shows them beside the agent's
answer, and ``bench/quality.py`` replays a busy node with each. Not policies the agent serves
(the device plugin's is :class:`agent.topology.allocator.AllocationEngine`)."""

from __future__ import annotations

import itertools
from typing import Sequence

from agent.errors import AllocationError
from agent.topology import kernel
from agent.topology.model import Topology


class GpuallocatorChoice:
    """What NVIDIA's go-gpuallocator (its best-effort policy) would choose.

    go-gpuallocator keeps the first best partition of the available GPUs into groups of the
    request size that its enumeration finds (groups hold the lowest remaining GPU, partners
    in index order), then the best-scoring group of that partition. Where the size divides
    the available count this is reproduced exactly, without enumerating: walk the groups in
    go-gpuallocator's order and keep the first one that still completes a best partition.
    Otherwise (go-gpuallocator pads the last group) the set with the best criterion 1, then
    criterion 2, then the lowest indices stands in for it. Exact for at most
    ``kernel.EXACT_MAX_GPUS`` available GPUs."""

    def __init__(self, topology: Topology) -> None:
        scores = [list(row) for row in topology.scores]
        # set scores and partition values only: the NUMA ids play no part
        self._solver = kernel.allocation_solver(scores, [0] * topology.gpu_count)

    def choose(self, available: Sequence[int], size: int) -> list[int]:
        """go-gpuallocator's ``size`` GPUs out of ``available`` (distinct GPU indices), sorted."""
        if not 1 <= size <= len(available) <= kernel.EXACT_MAX_GPUS:
            raise AllocationError(
                f"go-gpuallocator's choice is computed for 1 <= size <= available <= "
                f"{kernel.EXACT_MAX_GPUS}, got size {size} of {len(available)}"
            )
        solver = self._solver
        free = sorted(available)
        if len(free) % size:
            return self._best_by_criteria(free, size)
        best_group, best_score, mask = 0, -1, sum(1 << i for i in free)
        while mask:
            target = solver.partition_value(mask, size)
            members = kernel.mask_indices(mask)
            for combo in itertools.combinations(members[1:], size - 1):
                g = (1 << members[0]) | sum(1 << i for i in combo)
                score = solver.set_score(g)
                if score + solver.partition_value(mask ^ g, size) == target:
                    break
            if score > best_score:  # the first best group of the partition
                best_group, best_score = g, score
            mask ^= g
        return kernel.mask_indices(best_group)

    def _best_by_criteria(self, free: list[int], size: int) -> list[int]:
        solver = self._solver
        avail = sum(1 << i for i in free)
        best: list[int] = []
        best_value = (-1, -1)
        for combo in itertools.combinations(free, size):  # lexicographic: the first max wins
            g = sum(1 << i for i in combo)
            score = solver.set_score(g)
            value = (score + solver.partition_value(avail ^ g, size), score)
            if value > best_value:
                best, best_value = list(combo), value
        return best


def naive_choice(available: Sequence[int], size: int) -> list[int]:
    """The lowest ``size`` available indices: what a topology-blind plugin gives."""
    if not 1 <= size <= len(available):
        raise AllocationError(f"size must be in 1..{len(available)}, got {size}")
    return sorted(available)[:size]
