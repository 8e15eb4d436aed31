"""Picks the topology engine: the Cython extension ``agent._topo``, or its pure-Python
twin ``agent.topology._pure`` when ``AGENT_PUREPYTHON=1`` is set or the extension is not
built. Callers import functions from here, never from either implementation directly.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, cast

log = logging.getLogger(__name__)


#: What both implementations provide; an extension built from an older ``ext/_topo.pyx``
#: lacks some of it and is not used.
API = ("EXACT_MAX_GPUS", "MAX_GPUS", "nvlink_islands", "maximal_cliques", "AllocationSolver",
       "mask_indices")
SOLVER_API = ("set_score", "partition_value", "best_score", "rank", "best_mask", "replica_ranks")


def _select() -> tuple[ModuleType, str]:
    from agent.topology import _pure

    if os.environ.get("AGENT_PUREPYTHON", "") not in ("", "0"):
        return _pure, "python"
    try:
        from agent import _topo  # type: ignore[attr-defined]
    except ModuleNotFoundError as exc:  # an unbuilt source checkout (a broken build raises)
        if exc.name != "agent._topo":
            raise
        log.warning("Cython topology engine not built (%s); using the pure-Python twin", exc)
        return _pure, "python"
    missing = [name for name in API if not hasattr(_topo, name)]
    solver = getattr(_topo, "AllocationSolver", None)
    missing += [f"AllocationSolver.{m}" for m in SOLVER_API if not hasattr(solver, m)]
    if missing:
        log.warning(
            "the built Cython topology engine is stale (no %s): using the pure-Python twin; "
            "rebuild with `pip install -e .`", ", ".join(missing)
        )
        return _pure, "python"
    return _topo, "cython"


impl, IMPLEMENTATION = _select()
#: Largest number of available GPUs for which allocation is exact (bitmask DP). Defined once,
#: in the kernel (a compile-time constant of the extension; the twin states the same number,
#: which tests/test_engine_parity.py checks); read from the implementation in use.
EXACT_MAX_GPUS: int = impl.EXACT_MAX_GPUS


def nvlink_islands(adjacency: list[int]) -> list[list[int]]:
    return cast("list[list[int]]", impl.nvlink_islands(adjacency))


def maximal_cliques(adjacency: list[int]) -> list[list[int]]:
    return cast("list[list[int]]", impl.maximal_cliques(adjacency))


def allocation_solver(scores: list[list[int]], numa: list[int]) -> Any:  # impl.AllocationSolver
    """A solver of the issue-3 objective on the current implementation.

    ``scores`` is the pair-score matrix, ``numa[i]`` a small id (0..63) of GPU i's NUMA node.
    The solver memoises partition tables across calls; keep one per topology. See
    ``agent.topology._pure.solver.AllocationSolver`` for the contract of ``rank``, ``best_mask``,
    ``best_score``, ``partition_value``, ``set_score`` and ``replica_ranks`` (masks are int
    bitmasks over GPU indices; bad arguments raise TypeError/ValueError, the same on both).
    """
    return impl.AllocationSolver(scores, numa)


def mask_indices(mask: int) -> list[int]:
    """Set bits of ``mask``, ascending."""
    return cast("list[int]", impl.mask_indices(mask))
