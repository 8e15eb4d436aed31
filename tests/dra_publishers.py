"""What a node publishes for the claims its agent knows of: the callable the DRA benches
replay (``bench/bench_dra_scheduler.py``, ``bench/quality_dra.py``, which import this module
as they import ``allocation_support``) and ``test_dra_safety.py`` checks.

A publisher is ``publish(topology, node_name, held, published, server_version) ->
ResourceSlice objects (v1)``: ``held`` maps each device a prepared claim of the node holds
(its name) to its GPU indices; ``published`` names the set devices in the pool now (the
previous publication; a rule that keeps what a claim may hold reads it); ``server_version``
is the API server's ``major.minor`` (``"1.36"``, ``"1.37"``). :func:`agent_publisher` is the
agent's own rendering (``agent.dra.slices.render_slices``, as ``gpu-topology-agent slices``
prints it), given whichever of these it takes.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Collection, Mapping

from agent.dra import slices as _slices
from agent.topology.model import Topology

Held = Mapping[str, Collection[int]]
Publisher = Callable[[Topology, str, Held, Collection[str], str], list[dict[str, Any]]]


def gpus_of(held: Held) -> list[int]:
    return sorted({g for gpus in held.values() for g in gpus})


def single_gpus(gpus: Collection[int]) -> dict[str, tuple[int, ...]]:
    """GPUs held one by one (``slices --in-use``)."""
    return {f"gpu-{i}": (i,) for i in gpus}


def agent_publisher() -> Publisher:
    """The agent's rendering: ``render_slices`` with what it takes of the occupancy (an
    ``Occupancy`` of held devices and published sets, or the GPUs in use) and of the server
    version (the sets decision of ``dra.gpuSets: auto``, where the agent has one)."""
    params = inspect.signature(_slices.render_slices).parameters
    gpusets = importlib.import_module("agent.dra.gpusets")
    decide = getattr(gpusets, "gpu_sets_decision", None)
    policies: dict[int, tuple[Topology, Any]] = {}  # the agent builds its SetPolicy once per topology

    def publish(topo: Topology, node: str, held: Held, published: Collection[str],
                server_version: str) -> list[dict[str, Any]]:
        extra: dict[str, Any] = {}
        if "occupancy" in params:
            extra["occupancy"] = _slices.Occupancy(  # type: ignore[attr-defined]
                {name: tuple(gpus) for name, gpus in held.items()}, tuple(published))
        elif "in_use" in params:
            extra["in_use"] = gpus_of(held)
        if "policy" in params and hasattr(gpusets, "SetPolicy"):
            if id(topo) not in policies:
                policies[id(topo)] = (topo, gpusets.SetPolicy(topo))
            extra["policy"] = policies[id(topo)][1]
        if "server_version" in params:
            extra["server_version"] = server_version
        elif decide is not None:
            extra["with_sets"] = _decide_sets(decide, server_version)
        return _slices.render_slices(topo, node_name=node, **extra)

    return publish


def _decide_sets(decide: Callable[..., Any], server_version: str) -> bool:
    major, minor = (int(x) for x in server_version.split("."))
    for version in ((major, minor), server_version, f"v{server_version}.0"):
        try:
            return bool(decide("auto", version)[0])
        except (TypeError, ValueError, AttributeError):
            continue
    raise RuntimeError(f"cannot ask agent.dra.gpusets.gpu_sets_decision about {server_version}")


def static_publisher(topo: Topology, node: str, held: Held, published: Collection[str],
                     server_version: str) -> list[dict[str, Any]]:
    """The order of an empty node, whatever is held (the static order of before issue 25)."""
    return agent_publisher()(topo, node, {}, (), server_version)


def singles_publisher(topo: Topology, node: str, held: Held, published: Collection[str],
                      server_version: str) -> list[dict[str, Any]]:
    """Single GPUs only (no counters, no sets)."""
    return _slices.render_slices(topo, node_name=node, with_sets=False)


def set_names(slices: list[dict[str, Any]]) -> list[str]:
    """The set devices of ``slices`` (what the next publication reads as ``published``)."""
    return [d["name"] for s in slices for d in s["spec"].get("devices", ()) if d["name"].startswith("gpuset-")]


def load_publisher(spec: str) -> Publisher:
    """``MODULE:FUNCTION``: a publisher, or a factory (no parameters) that returns one."""
    module, _, name = spec.partition(":")
    obj = getattr(importlib.import_module(module), name)
    return obj() if not inspect.signature(obj).parameters else obj  # type: ignore[no-any-return]
