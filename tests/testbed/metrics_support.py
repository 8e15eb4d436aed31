"""Helpers for the metrics tests (no tests here).

- :func:`open_node`: a simulated machine, the real ``NvmlBackend`` on its fake ``pynvml``
  (initialised) and the topology read through it. Telemetry knobs and faults are the fake's
  own (``node.lib.set_value``, ``make_unsupported``, ``fail``, ``lose_gpu``, ...).
  :func:`small_machine` is a small H100 box built from a machine spec: NVLinked pairs, two
  GPUs per NUMA node, one NIC per pair, MIG on the last GPU.
- The pod-resources server is :class:`agent.demo.kubelet.PodResourcesStub` (the demo's):
  :func:`listing` builds the ``List`` answer it serves.
- Exposition is parsed with ``prometheus_client.parser`` (:func:`families`,
  :func:`samples_of`); note that the parser names a counter's samples ``<family>_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from agent._proto import podresources_v1_pb2 as pb
from agent.attribution.holders import EMPTY_ATTRIBUTION, Attribution
from agent.demo.kubelet import PodResourcesStub  # noqa: F401  (re-exported for the tests)
from agent.discovery import read_topology
from agent.hw.nvml.backend import NvmlBackend
from agent.hw.sim.machines import SimulatedMachine, open_simulated
from agent.hw.sim.spec import machine_spec_from_dict
from agent.metrics.collector import GpuCollector, render_text
from agent.metrics.sampler import Sampler
from agent.topology.model import Topology

DRIVER = "550.54.15"
H100 = "NVIDIA H100 80GB HBM3"


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Node:
    """A simulated machine with the real NVML backend on it."""

    machine: SimulatedMachine
    backend: NvmlBackend
    topology: Topology

    @property
    def lib(self) -> Any:
        """The fake ``pynvml`` (telemetry knobs, fault injection)."""
        return self.machine.lib

    def sampler(self, clock: Callable[[], float] | None = None, **kwargs: Any) -> Sampler:
        return Sampler(self.backend.sample_source(), self.topology, interval_s=1.0,
                       clock=clock or Clock(), **kwargs)

    def close(self) -> None:
        self.backend.shutdown()
        self.machine.close()


def small_machine(n: int = 4, *, name: str = "test-box") -> SimulatedMachine:
    """``n`` H100s: NVLinked in pairs (0-1, 2-3, ...), two per NUMA node, one NIC per pair,
    the last GPU in MIG mode with one 1g.10gb; UUIDs ``GPU-0000000<i>-aaaa-...``."""
    pairs = (n + 1) // 2  # NUMA nodes and NICs: one per pair (a last odd GPU has its own)
    spec = {
        "name": name,
        "product_name": "Test Box",
        "driver_version": DRIVER,
        "cuda_driver_version": "12.4",
        "numa_nodes": {k: {"cpus": f"{16 * k}-{16 * k + 15}",
                           "distances": [10 if j == k else 21 for j in range(pairs)]}
                       for k in range(pairs)},
        "gpu_defaults": {"model": H100},
        "gpus": [
            {"bus_id": f"0000:{0x18 + 0x10 * i:02x}:00.0", "numa_node": i // 2,
             "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-000000000000",
             "host_bridge": f"pci0000:{i // 2:02x}", "switches": [f"sw-{i // 2}"],
             **({"mig": ["1g.10gb"]} if i == n - 1 and n > 1 else {})}
            for i in range(n)
        ],
        "nvlink": {"pairs": [[a, a + 1, 4] for a in range(0, n - 1, 2)]},
        "nics": [
            {"name": f"mlx5_{k}", "bus_id": f"0000:{0x80 + k:02x}:00.0", "numa_node": k,
             "host_bridge": f"pci0000:{k:02x}", "switches": [f"sw-{k}"]}
            for k in range(pairs)
        ],
    }
    return SimulatedMachine(machine_spec_from_dict(spec, source="metrics_support"))


def open_node(machine: str | SimulatedMachine) -> Node:
    """A built-in machine by name, or a :class:`SimulatedMachine`, with its backend up."""
    sim = open_simulated(machine) if isinstance(machine, str) else machine
    backend = sim.backend()
    backend.init()
    return Node(sim, backend, read_topology(backend, sim))


@contextmanager
def node_of(machine: str | SimulatedMachine) -> Iterator[Node]:
    node = open_node(machine)
    try:
        yield node
    finally:
        node.close()


def collect_text(node: Node, attribution: Attribution | None = None,
                 clock: Callable[[], float] | None = None, rounds: int = 2,
                 hostname: str = "node-a") -> str:
    """Sample ``rounds`` times, then the exposition of a GPU collector on that sampler."""
    clock = clock or Clock()
    sampler = node.sampler(clock)
    for _ in range(rounds):
        sampler.sample_once()
    registry = CollectorRegistry()
    registry.register(GpuCollector(
        node.topology, hostname=hostname, snapshot=lambda: sampler.snapshot,
        attribution=lambda: attribution or EMPTY_ATTRIBUTION, clock=clock))
    return render_text(registry).decode()


# ---------------------------------------------------------------------- exposition
def families(text: str) -> dict[str, Any]:
    """Metric families of an exposition by family name (a counter's without ``_total``)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples_of(text: str, name: str) -> list[Sample]:
    """The samples of family ``name`` (empty when the family is absent)."""
    family = families(text).get(name)
    return list(family.samples) if family is not None else []


def by_gpu(text: str, name: str) -> dict[str, float]:
    """Family ``name``'s values by ``gpu`` label (one series per GPU expected)."""
    return {s.labels["gpu"]: s.value for s in samples_of(text, name)}


# ---------------------------------------------------------------------- pod-resources
def pod(namespace: str, name: str, containers: dict[str, list[tuple[str, list[str]]]]) -> Any:
    """A ``PodResources`` message: container -> [(resource, device ids)]."""
    return pb.PodResources(
        name=name, namespace=namespace,
        containers=[
            pb.ContainerResources(
                name=c, devices=[pb.ContainerDevices(resource_name=r, device_ids=ids)
                                 for r, ids in devs])
            for c, devs in containers.items()
        ],
    )


def listing(*pods: Any) -> Any:
    """A ``ListPodResourcesResponse`` of these pods."""
    return pb.ListPodResourcesResponse(pod_resources=list(pods))

