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
holds and what it published (``tests/testbed/dra_publishers.py``'s publisher, the one the benches
replay). Machines: dgx-h100 (one device slice), dgx2 (16 GPUs) and 64 GPUs in 8 NVLink islands
(the sets and the single GPUs in slices of their own).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from agent.discovery import load_topology
from tests.testbed.allocation_support import synthetic_islands_topology
from tests.testbed.dra_publishers import agent_publisher, device_names
from tests.testbed.dra_views import HISTORY_STEPS, miscounted, node_history, planned_views

NODE = "node-1"
PUBLISH = agent_publisher()
MACHINES = {"dgx-h100": load_topology("dgx-h100"), "dgx2": load_topology("dgx2"),
            "synthetic-64": synthetic_islands_topology(8, 8)}


def views(stored: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return planned_views(stored, new, max(o["spec"]["pool"]["generation"] for o in stored))[1]


@pytest.mark.parametrize("machine", sorted(MACHINES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=HISTORY_STEPS)
def test_every_view_of_a_re_publication_counts_every_shared_gpu_and_is_valid(machine: str, steps) -> None:
    stored = PUBLISH(MACHINES[machine], NODE, {}, (), "1.37")
    assert miscounted(stored, NODE) is None
    for step, (held, stored, new) in enumerate(node_history(PUBLISH, MACHINES[machine], NODE, steps)):
        for i, view in enumerate(views(stored, new)):
            assert miscounted(view, NODE) is None, (steps[: step + 1], sorted(held), f"view {i}")


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
