"""A synthetic node larger than any built-in machine, for the engine's bounded search above
16 GPUs (tests and ``bench/bench_allocate.py``): a topology only, no simulated NVML."""

from __future__ import annotations

from agent.records import Gpu, Link, PcieLevel
from agent.topology.model import Topology


def synthetic_islands_topology(islands: int = 8, size: int = 8) -> Topology:
    """``islands`` NVSwitch islands of ``size`` GPUs (64 GPUs by default), 18 NVLinks per
    pair inside an island, none between; islands alternate between 2 NUMA nodes."""
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
