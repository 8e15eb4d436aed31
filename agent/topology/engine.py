"""Picks the topology engine: the Cython extension ``agent._topo``, or its pure-Python
twin ``agent.topology._pure`` when ``AGENT_PUREPYTHON=1`` is set or the extension is not
built. Callers import functions from here, never from either implementation directly.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)


def _select() -> tuple[ModuleType, str]:
    from agent.topology import _pure

    if os.environ.get("AGENT_PUREPYTHON", "") not in ("", "0"):
        return _pure, "python"
    try:
        from agent import _topo  # type: ignore[attr-defined]
    except ImportError as exc:  # an unbuilt source checkout
        log.warning("Cython topology engine not built (%s); using the pure-Python twin", exc)
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
