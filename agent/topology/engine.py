"""Picks the topology engine: the Cython extension ``agent._topo``, or its pure-Python
twin ``agent.topology._pure`` when ``AGENT_PUREPYTHON=1`` is set or the extension is not
built. Callers import functions from here, never from either implementation directly.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)


#: What both implementations provide; an extension built from an older ``ext/_topo.pyx``
#: lacks some of it and is not used.
API = (
    "nvlink_islands", "maximal_cliques", "AllocationSolver", "request_masks", "mask_indices",
    "group_devices", "choose", "select_replicas",
)


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
    if missing:
        log.warning(
            "the built Cython topology engine is stale (no %s): using the pure-Python twin; "
            "rebuild with `pip install -e .`", ", ".join(missing)
        )
        return _pure, "python"
    return _topo, "cython"


impl, IMPLEMENTATION = _select()


def use(name: str) -> None:
    """Switch implementation at run time ("cython" or "python"); for tests and benchmarks."""
    global impl, IMPLEMENTATION
    from agent.topology import _pure

    if name == "python":
        impl, IMPLEMENTATION = _pure, "python"
    elif name == "cython":
        from agent import _topo  # type: ignore[attr-defined]

        impl, IMPLEMENTATION = _topo, "cython"
    else:
        raise ValueError(f"unknown engine {name!r}: expected 'cython' or 'python'")


def nvlink_islands(adjacency: list[int]) -> list[list[int]]:
    return impl.nvlink_islands(adjacency)


def maximal_cliques(adjacency: list[int]) -> list[list[int]]:
    return impl.maximal_cliques(adjacency)


#: Largest number of available GPUs for which allocation is exact (bitmask DP).
EXACT_MAX_GPUS = 16


def allocation_solver(scores: list[list[int]], numa: list[int]):  # -> impl.AllocationSolver
    """A solver of the issue-3 objective on the current implementation.

    ``scores`` is the pair-score matrix, ``numa[i]`` a small id (0..63) of GPU i's NUMA node.
    The solver memoises partition tables across calls; keep one per topology. See
    ``agent.topology._pure.AllocationSolver`` for the contract of ``rank``, ``best_score``,
    ``partition_value`` and ``set_score`` (masks are int bitmasks over GPU indices).
    """
    return impl.AllocationSolver(scores, numa)


def request_masks(available, must_include, n: int) -> tuple[int, int, int, int]:
    """GPU index lists -> (available mask, must-include mask, counts); ValueError when an
    entry is not an int in 0..n-1 or repeats. See ``_pure.request_masks``."""
    return impl.request_masks(available, must_include, n)


def mask_indices(mask: int) -> list[int]:
    """Set bits of ``mask``, ascending."""
    return impl.mask_indices(mask)


def group_devices(parent: dict, n: int) -> dict[int, list[str]]:
    """``{device ID: gpu}`` -> ``{gpu: [device IDs]}``; ValueError on a bad entry."""
    return impl.group_devices(parent, n)


def choose(solver, available, must_include, size) -> list[int] | None:
    """``AllocationEngine.best_set`` in one engine call; None when the request is not a
    plain valid one. See ``_pure.choose``."""
    return impl.choose(solver, available, must_include, size)


def select_replicas(solver, available, must_include, size, packed, per_gpu) -> list[str] | None:
    """``AllocationEngine.replicas`` in one engine call; None when the request is not a plain
    valid one (the extension also declines a few unusual valid ones). See
    ``_pure.select_replicas``."""
    return impl.select_replicas(solver, available, must_include, size, packed, per_gpu)


def select_replicas_twin(solver, available, must_include, size, packed, per_gpu):
    """The pure-Python ``select_replicas`` on any solver: it takes every valid request,
    including those the extension declines."""
    from agent.topology import _pure

    return _pure.select_replicas(solver, available, must_include, size, packed, per_gpu)
