"""The pool's counters (``agent.dra.counters``) in every view the scheduler can have while the
agent re-publishes: a publication is written slice by slice as ``agent.dra.pool_writes`` plans
it, and the scheduler's informer shows any prefix of those writes (it applies one watch's
events in order). In each view whose pool is complete (``checkSlicesInPool``; a new generation
is incomplete until its last slice, and the allocator skips it) the pool must be valid (no
device consuming a counter the pool does not declare: the allocator would skip it), every
device consumes only counters of GPUs it stands for, and two devices standing for one GPU both
consume its counter (else the scheduler can allocate both).

The occupancy changes as on a node: a claim takes a free device the scheduler sees (a set or a
single GPU), a claim ends, the withdrawal grace runs out; the agent re-renders from what it
holds and what it published (``tests/dra_publishers.py``'s publisher, the one the benches
replay). Machines: dgx-h100 (one device slice), dgx2 (16 GPUs) and 64 GPUs in 8 NVLink islands
(the sets and the single GPUs in slices of their own).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from allocation_support import synthetic_islands_topology
from dra_allocator_model import gather_pools
from dra_publishers import agent_publisher, device_names, withdrawing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.discovery import load_topology
from agent.dra.gpusets import parse_set_name
from agent.dra.pool_writes import plan_writes

NODE = "node-1"
PUBLISH = agent_publisher()
MACHINES = {"dgx-h100": load_topology("dgx-h100"), "dgx2": load_topology("dgx2"),
            "synthetic-64": synthetic_islands_topology(8, 8)}
_COUNTER = re.compile(r"gpu-(\d+)")


def stands_for(name: str) -> frozenset[int]:
    found = _COUNTER.fullmatch(name)
    return frozenset([int(found.group(1))]) if found else frozenset(parse_set_name(name) or ())


def miscounted(view: list[dict[str, Any]]) -> str | None:
    """What is wrong with the counters of ``view`` (None: nothing, or the pool is incomplete)."""
    (pool,) = gather_pools(view, NODE)
    if pool.incomplete:
        return None
    if pool.invalid:
        return f"invalid pool: {pool.invalid}"
    newest = max(s["spec"]["pool"]["generation"] for s in view)  # older slices are left out
    standing: dict[int, list[tuple[str, bool]]] = {}
    for d in (d for s in view if s["spec"]["pool"]["generation"] == newest for d in s["spec"].get("devices", [])):
        gpus = stands_for(d["name"])
        consumed = {int(_COUNTER.fullmatch(c).group(1))  # type: ignore[union-attr]
                    for u in d.get("consumesCounters") or () for c in u["counters"]}
        if not consumed <= gpus:
            return f"{d['name']} consumes the counters of GPUs {sorted(consumed - gpus)}"
        for g in gpus:
            standing.setdefault(g, []).append((d["name"], g in consumed))
    for g, devices in sorted(standing.items()):
        if len(devices) > 1 and not all(c for _, c in devices):
            return f"GPU {g}: {devices} (device, consumes its counter)"
    return None


def views(stored: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The pools the scheduler may see while ``new`` replaces ``stored``, in order."""
    existing = {o["metadata"]["name"]: o for o in stored}
    plan = plan_writes(existing, new, max(o["spec"]["pool"]["generation"] for o in stored))
    now, out = dict(existing), []
    for w in plan.writes:
        now[w["metadata"]["name"]] = w
        out.append(sorted(now.values(), key=lambda o: o["metadata"]["name"]))
    for name in plan.deletes:
        del now[name]
        out.append(sorted(now.values(), key=lambda o: o["metadata"]["name"]))
    return out


STEPS = st.lists(st.tuples(st.sampled_from(["take", "take", "take", "end", "expire"]), st.integers(0, 63)),
                 min_size=1, max_size=14)


@pytest.mark.parametrize("machine", sorted(MACHINES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS)
def test_every_view_of_a_re_publication_counts_every_shared_gpu_and_is_valid(machine: str, steps) -> None:
    topo = MACHINES[machine]
    stored = PUBLISH(topo, NODE, {}, (), "1.37")
    assert miscounted(stored) is None
    held: dict[str, frozenset[int]] = {}
    expired: list[str] = []
    for op, arg in steps:
        busy = {g for gpus in held.values() for g in gpus}
        free = [n for n in device_names(stored) if not stands_for(n) & busy and n not in withdrawing(stored)]
        if op == "take" and free:
            name = free[arg % len(free)]
            held[name] = stands_for(name)
        elif op == "end" and held:
            del held[sorted(held)[arg % len(held)]]
        elif op == "expire":
            expired = withdrawing(stored)
        new = PUBLISH(topo, NODE, held, device_names(stored), "1.37", expired=expired, tainted=withdrawing(stored))
        for i, view in enumerate(views(stored, new)):
            assert miscounted(view) is None, (op, arg, sorted(held), f"view {i}")
        stored = new


def test_the_64_gpu_node_has_slices_of_its_own_and_declares_only_what_is_consumed() -> None:
    """The property test above meets the two-slice layout; and there too a GPU held as a single
    with no set over it is no longer declared."""
    topo = MACHINES["synthetic-64"]
    fresh = PUBLISH(topo, NODE, {}, (), "1.37")
    assert len([s for s in fresh if "devices" in s["spec"]]) >= 2
    held = {f"gpu-{g}": frozenset([g]) for g in range(8)}  # a whole island, one GPU at a time
    busy = PUBLISH(topo, NODE, held, device_names(fresh), "1.37")
    settled = PUBLISH(topo, NODE, held, device_names(busy), "1.37")
    declared = {c for s in settled for cs in s["spec"].get("sharedCounters", ()) for c in cs["counters"]}
    assert declared and not declared & {f"gpu-{g}" for g in range(8)}
