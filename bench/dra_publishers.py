"""What a node publishes for the GPUs its prepared claims hold: the callable the DRA benches
replay (``bench_dra_scheduler.py``, ``quality_dra.py``) and the tests' safety property.

A publisher is ``publish(topology, node_name, in_use, server_version) -> ResourceSlice
objects (v1)``: ``in_use`` the GPU indices held by prepared claims, ``server_version`` the
API server's ``major.minor`` (``"1.36"``, ``"1.37"``). :func:`agent_publisher` is the agent's
own rendering (``agent.dra.slices.render_slices``, given the held GPUs and, where it takes
one, the server version): the same function ``gpu-topology-agent slices`` prints.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.dra.slices import render_slices  # noqa: E402
from agent.topology.model import Topology  # noqa: E402

Publisher = Callable[[Topology, str, frozenset[int], str], list[dict[str, Any]]]


def agent_publisher() -> Publisher:
    """The agent's rendering for held GPUs (``render_slices``; ``in_use`` and
    ``server_version`` passed where it takes them)."""
    params = inspect.signature(render_slices).parameters

    def publish(topo: Topology, node: str, in_use: frozenset[int], server_version: str) -> list[dict[str, Any]]:
        extra: dict[str, Any] = {}
        if "in_use" in params:
            extra["in_use"] = sorted(in_use)
        if "server_version" in params:
            extra["server_version"] = server_version
        return render_slices(topo, node_name=node, **extra)

    return publish


def static_publisher(topo: Topology, node: str, in_use: frozenset[int], server_version: str) -> list[dict[str, Any]]:
    """Today's static order: the agent's slices for an empty node, whatever is held."""
    return agent_publisher()(topo, node, frozenset(), server_version)


def singles_publisher(topo: Topology, node: str, in_use: frozenset[int], server_version: str) -> list[dict[str, Any]]:
    """Single GPUs only (no counters, no sets)."""
    return render_slices(topo, node_name=node, with_sets=False)


def load_publisher(spec: str) -> Publisher:
    """``MODULE:FUNCTION``: a publisher, or a factory (no parameters) that returns one."""
    module, _, name = spec.partition(":")
    obj = getattr(importlib.import_module(module), name)
    return obj() if not inspect.signature(obj).parameters else obj  # type: ignore[no-any-return]
