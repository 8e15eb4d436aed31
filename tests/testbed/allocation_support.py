"""Helpers the allocation tests and the benchmarks share (``bench/`` imports this module as it
imports ``kubelet_stub``): a synthetic node larger than any built-in machine, and the
engine's requests as the device plugin makes them, from GPU indices or device IDs.

The requests go through the edge the device plugin uses (a resource's
:class:`~agent.topology.deviceids.DeviceTable` checks them and maps them to ranks), so a
test of the engine runs the same path as a kubelet request.
"""

from __future__ import annotations

from typing import Sequence

from agent.records import Gpu, Link, PcieLevel
from agent.topology.allocator import AllocationEngine, Explanation
from agent.topology.deviceids import DeviceTable
from agent.topology.model import Topology


def synthetic_islands_topology(islands: int = 8, size: int = 8) -> Topology:
    """``islands`` NVSwitch islands of ``size`` GPUs (64 GPUs by default), 18 NVLinks per
    pair inside an island, none between; islands alternate between 2 NUMA nodes: for the
    engine's bounded search above 16 GPUs (a topology only, no simulated NVML)."""
    n = islands * size
    gpus = [Gpu(i, f"GPU-synthetic-{i}", "synthetic", numa_node=(i // size) % 2) for i in range(n)]
    links = [
        Link(
            a,
            b,
            18 if a // size == b // size else 0,
            PcieLevel.NODE if (a // size) % 2 == (b // size) % 2 else PcieLevel.SYS,
            nvswitch=a // size == b // size,
        )
        for a in range(n)
        for b in range(a + 1, n)
    ]
    return Topology.build(gpus, links, source=f"synthetic:{n}-gpu-islands")


def gpu_table(topology: Topology) -> DeviceTable:
    """The whole-GPU resource of a node: one device per GPU, named by its UUID."""
    return DeviceTable([(g.uuid, g.index) for g in topology.gpus], topology.gpu_count, "nvidia.com/gpu")


def best_set(
    engine: AllocationEngine, available: Sequence[int], must_include: Sequence[int], size: int
) -> list[int]:
    """The GPU indices the engine chooses for a request given in GPU indices."""
    table = gpu_table(engine.topology)
    request = table.request(
        [table.ids[i] for i in available], [table.ids[i] for i in must_include], size
    )
    return [table.gpu[r] for r in engine.gpus(table, request)]


def explain(
    engine: AllocationEngine,
    available: Sequence[int],
    must_include: Sequence[int],
    size: int,
    runners_up: int = 5,
) -> Explanation:
    table = gpu_table(engine.topology)
    request = table.request(
        [table.ids[i] for i in available], [table.ids[i] for i in must_include], size
    )
    return engine.explain(table, request, runners_up)


def shared(
    engine: AllocationEngine,
    devices: Sequence[tuple[str, int]],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: str = "distributed",
) -> list[str]:
    """The device IDs the engine chooses out of ``available`` for a resource offering
    ``devices`` ((ID, GPU index) pairs): MIG devices when ``policy`` is ``"mig"``, else
    time-sliced replicas by that policy."""
    table = DeviceTable(devices, engine.topology.gpu_count, "test")
    request = table.request(available, must_include, size)
    if policy == "mig":
        ranks = engine.mig(table, request)
    else:
        ranks = engine.replicas(table, request, policy == "packed")
    return [table.ids[r] for r in ranks]
