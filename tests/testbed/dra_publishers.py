"""What a node publishes for the claims its agent knows of: the callable the DRA benches
replay (``bench/bench_dra_scheduler.py``, ``bench/quality_dra.py``, which import this module
as they import ``allocation_support``) and ``test_dra_safety.py`` checks.

A publisher is ``publish(topology, node_name, held, published, server_version) ->
ResourceSlice objects (v1)``: ``held`` maps each device a prepared claim of the node holds
(its name) to its GPU indices; ``published`` names the devices in the pool now, sets and
single GPUs (:func:`device_names` of the previous publication; a rule that keeps what a claim
may hold reads it); ``server_version``
is the API server's ``major.minor`` (``"1.36"``, ``"1.37"``); the keyword ``expired`` (default
None) names the published devices whose withdrawal taint has been out for the grace period
(:func:`withdrawing` of the previous publication models "at least the grace period" as "at the
next publication"), None for no grace (a set that must go goes at once: the agent where the API
server keeps no taints, or the grace is 0); ``tainted`` (default none) the published devices
that carry the withdrawal taint now. :func:`agent_publisher` is the agent's own rendering
(``agent.dra.slices.render_slices``, as ``gpu-topology-agent slices`` prints it), given
whichever of these it takes; the others ignore ``expired`` and ``tainted``.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from math import comb
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

from agent.config import DEFAULT_DRIVER_NAME as DRIVER
from agent.dra import counters as _counters
from agent.dra import gpusets as _gpusets
from agent.dra import slices as _slices
from agent.dra.device_values import quantity_mib
from agent.formats import format_cpulist
from agent.topology.allocator import AllocationEngine
from agent.topology.deviceids import DeviceTable
from agent.topology.model import Topology

Held = Mapping[str, Collection[int]]
Publisher = Callable[..., list[dict[str, Any]]]  # (topology, node, held, published, server_version, expired=None,
#                                                   tainted=(): the sets carrying the withdrawal taint now)


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
                server_version: str, expired: Collection[str] | None = None,
                tainted: Collection[str] = ()) -> list[dict[str, Any]]:
        extra: dict[str, Any] = {}
        if "occupancy" in params:
            fields = inspect.signature(_slices.Occupancy).parameters
            grace = {"expired": expired} if "expired" in fields else {}
            grace |= {"withdrawing": tuple(tainted)} if "withdrawing" in fields else {}
            sets = tuple(n for n in published if n.startswith("gpuset-"))
            grace |= {"singles": tuple(n for n in published if n not in sets)} if "singles" in fields else {}
            extra["occupancy"] = _slices.Occupancy(  # type: ignore[attr-defined]
                {name: tuple(gpus) for name, gpus in held.items()}, sets, **grace)
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
                     server_version: str, expired: Collection[str] | None = None,
                     tainted: Collection[str] = ()) -> list[dict[str, Any]]:
    """The order of an empty node, whatever is held (the static order of before issue 25)."""
    return agent_publisher()(topo, node, {}, (), server_version)


def singles_publisher(topo: Topology, node: str, held: Held, published: Collection[str],
                      server_version: str, expired: Collection[str] | None = None,
                     tainted: Collection[str] = ()) -> list[dict[str, Any]]:
    """Single GPUs only (no counters, no sets)."""
    return _slices.render_slices(topo, node_name=node, with_sets=False)


def device_names(slices: list[dict[str, Any]]) -> list[str]:
    """The devices of ``slices`` (what the next publication reads as ``published``)."""
    return [d["name"] for s in slices for d in s["spec"].get("devices", ())]


def set_names(slices: list[dict[str, Any]]) -> list[str]:
    """The set devices of ``slices``."""
    return [d["name"] for s in slices for d in s["spec"].get("devices", ()) if d["name"].startswith("gpuset-")]


def withdrawing(slices: list[dict[str, Any]]) -> list[str]:
    """The devices of ``slices`` carrying the withdrawal taint (``<driver>/withdrawn``)."""
    return [d["name"] for s in slices for d in s["spec"].get("devices", ())
            if any(t.get("key") == f"{DRIVER}/withdrawn" for t in d.get("taints") or ())]


def load_publisher(spec: str) -> Publisher:
    """``MODULE:FUNCTION``: a publisher, or a factory (no parameters) that returns one."""
    module, _, name = spec.partition(":")
    obj = getattr(importlib.import_module(module), name)
    return obj() if not inspect.signature(obj).parameters else obj  # type: ignore[no-any-return]


# ----------------------------------------------------------------------- the earlier publication
# What the agent published up to main at cc5b590 ("every good set, fixed order"): the
# publication the issue-25 measurements of the real kube-scheduler were made with (107 devices
# and 352 counter consumptions on dgx-h100). Reconstructed from cc5b590's agent/dra/gpusets.py
# (structural_units, _sub_units, _whole_unions, candidate_sets, _EmptyNode, _order_key,
# gpu_sets) and agent/dra/slices.py (render_set_devices, render_slices), our own code, copied;
# the policy's criteria are asked of today's engine (Candidate.anchor_score is now
# gpuallocator_score), so the order within a size is the one that engine gives.
_ENUMERATION_LIMIT = 256


def _structural_units(topo: Topology) -> list[tuple[int, ...]]:
    units: set[tuple[int, ...]] = {tuple(sorted(c)) for c in topo.nvlink_cliques}
    units |= {tuple(sorted(i)) for i in topo.nvlink_islands}
    units |= {tuple(sorted(g)) for g in topo.numa_groups.values()}
    roots: dict[str, list[int]] = {}
    for g in topo.gpus:
        if g.pcie_root:
            roots.setdefault(g.pcie_root, []).append(g.index)
    units |= {tuple(sorted(r)) for r in roots.values() if len(r) >= 2}
    units.add(tuple(range(topo.gpu_count)))
    return sorted(u for u in units if u)


def _sub_units(unit: tuple[int, ...], units: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]] | None:
    inside = [u for u in units if len(u) < len(unit) and set(u) <= set(unit)]
    top = [u for u in inside if not any(set(u) < set(v) for v in inside)]
    seen: set[int] = set()
    for u in top:
        if seen & set(u):
            return None
        seen |= set(u)
    return top


def _whole_unions(parts: Sequence[tuple[int, ...]], k: int) -> Iterator[tuple[int, ...]]:
    def walk(start: int, left: int, chosen: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if left == 0:
            yield tuple(sorted(chosen))
            return
        for i in range(start, len(parts)):
            if len(parts[i]) <= left:
                yield from walk(i + 1, left - len(parts[i]), chosen + parts[i])

    yield from walk(0, k, ())


def _candidate_sets(units: Sequence[tuple[int, ...]], k: int) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    for unit in units:
        if len(unit) < k:
            continue
        if comb(len(unit), k) <= _ENUMERATION_LIMIT:
            out.update(itertools.combinations(unit, k))
            continue
        parts = _sub_units(unit, units)
        if parts:
            out.update(itertools.islice(_whole_unions(parts, k), _ENUMERATION_LIMIT))
    return out


def earlier_gpu_sets(topo: Topology) -> dict[int, list[tuple[int, ...]]]:
    """cc5b590's ``gpu_sets``: per size (ascending) the sets, best first (index = rank)."""
    if topo.gpu_count < 2:
        return {}
    engine = AllocationEngine(topo)
    table = DeviceTable([(g.uuid, g.index) for g in topo.gpus], topo.gpu_count, "gpus")
    everyone = list(table.ids)

    def request(must: Sequence[int], size: int) -> Any:
        return table.request(everyone, [table.ids[i] for i in must], size)

    position = {g: i for i, g in enumerate(_gpusets.device_order(topo))}
    units = _structural_units(topo)
    out: dict[int, list[tuple[int, ...]]] = {}
    for k in _gpusets.set_sizes(topo):
        best = tuple(sorted(table.gpu[r] for r in engine.gpus(table, request((), k))))

        def key(members: tuple[int, ...], k: int = k) -> tuple[Any, ...]:
            c = engine.explain(table, request(members, len(members)), runners_up=0).chosen
            places = sorted(position[i] for i in members)
            tie = places if k <= 2 else sorted(-p for p in places)
            return (-c.gpuallocator_score, -c.score, c.numa_nodes, c.cut, tie, members)

        out[k] = [best, *sorted(_candidate_sets(units, k) - {best}, key=key)]
    return out


def _shared_value(values: Iterable[Any]) -> Any:
    seen = set(values)
    return seen.pop() if len(seen) == 1 else None


def earlier_publisher() -> Publisher:
    """cc5b590's ``render_slices`` (v1, sets on, no taints): a counter slice, then the single
    GPUs in the static order, every one consuming its counter, then every set of
    :func:`earlier_gpu_sets` by size ascending, best first, with cc5b590's set attributes
    (type, gpuCount, members, rank, healthy, and nvlinkIsland, nvlinkClique, numaNode, the
    standard numaNode and pcieRoot where the members share one; capacity memory, the
    members' total); 64 devices a slice. The same whatever is held and whatever the server
    version (that agent had no version decision and never re-rendered)."""
    cache: dict[int, tuple[Topology, list[dict[str, Any]]]] = {}

    def devices(topo: Topology) -> list[dict[str, Any]]:
        # the static order: rendered as if every GPU were held (no free GPU to order by)
        everything = _slices.Occupancy({"all": tuple(range(topo.gpu_count))})
        singles = _slices.render_slices(topo, node_name="n", with_sets=False, occupancy=everything)
        out = [dict(d, consumesCounters=[{"counterSet": _counters.counter_set_name(d["attributes"][f"{DRIVER}/index"]["int"]),
                                          "counters": {f"gpu-{d['attributes'][f'{DRIVER}/index']['int']}": {"value": "1"}}}])
               for s in singles for d in s["spec"]["devices"]]
        islands, cliques = _gpusets.island_ids(topo), _gpusets.clique_ids(topo)
        for k, sets in earlier_gpu_sets(topo).items():
            for rank, members in enumerate(sets):
                gpus = [topo.gpus[i] for i in members]
                numa = _shared_value(g.numa_node for g in gpus)
                attrs = {"type": {"string": "gpuset"}, "gpuCount": {"int": k},
                         "members": {"string": format_cpulist(members)}, "rank": {"int": rank},
                         "healthy": {"bool": True}}
                for name, value in (("nvlinkIsland", _shared_value(islands[i] for i in members)),
                                    ("nvlinkClique", _shared_value(cliques[i] for i in members)),
                                    ("numaNode", numa), (_slices.NUMA_NODE_ATTRIBUTE, numa)):
                    if value is not None:
                        attrs[name] = {"int": value}
                root = _shared_value(g.pcie_root for g in gpus)
                if root:
                    attrs[_slices.PCIE_ROOT_ATTRIBUTE] = {"string": root}
                uses: dict[str, dict[str, Any]] = {}
                for i in members:
                    uses.setdefault(_counters.counter_set_name(i), {})[f"gpu-{i}"] = {"value": "1"}
                device: dict[str, Any] = {
                    "name": f"gpuset-{k}-{rank}",
                    "attributes": dict(sorted((n if "/" in n else f"{DRIVER}/{n}", v) for n, v in attrs.items())),
                    "consumesCounters": [{"counterSet": n, "counters": c} for n, c in uses.items()]}
                if all(g.memory_mib for g in gpus):
                    device["capacity"] = {"memory": {"value": quantity_mib(sum(g.memory_mib for g in gpus))}}
                out.append(device)
        return out

    def publish(topo: Topology, node: str, held: Held, published: Collection[str],
                server_version: str, expired: Collection[str] | None = None,
                tainted: Collection[str] = ()) -> list[dict[str, Any]]:
        if id(topo) not in cache:
            cache[id(topo)] = (topo, devices(topo))
        devs = cache[id(topo)][1]
        counters: dict[str, dict[str, Any]] = {}
        for g in topo.gpus:
            counters.setdefault(_counters.counter_set_name(g.index), {})[f"gpu-{g.index}"] = {"value": "1"}
        per = _slices.MAX_DEVICES_WITH_COUNTERS
        specs = [{"sharedCounters": [{"name": n, "counters": c} for n, c in counters.items()]}]
        specs += [{"devices": devs[i : i + per]} for i in range(0, len(devs), per)]
        return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                 "metadata": {"name": _slices.slice_name(node, DRIVER, n)},
                 "spec": {"driver": DRIVER, "nodeName": node,
                          "pool": {"name": node, "generation": 1, "resourceSliceCount": len(specs)}, **body}}
                for n, body in enumerate(specs)]

    return publish
