"""The values of ResourceSlice devices (:mod:`agent.dra.slices` documents the attributes): the
version-neutral :class:`Device`, the typed attribute values, a GPU's topology attributes, and
a device as one ``resource.k8s.io`` version writes it. Shared by the renderings of the single
GPUs and sets (:mod:`agent.dra.slices`) and of dynamic MIG devices (:mod:`agent.dra.mig_publish`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from agent.dra.counters import consumes_counters
from agent.formats import BusIdError, nvml_to_sysfs_bus_id
from agent.kube import RESOURCE_VERSIONS
from agent.topology.model import Gpu, Topology

__all__ = [
    "API_VERSIONS", "MAX_ATTRIBUTES_AND_CAPACITIES", "MAX_DEVICES_PER_SLICE", "MAX_DEVICES_WITH_COUNTERS",
    "NUMA_NODE_ATTRIBUTE", "PCIE_ROOT_ATTRIBUTE", "SETS_API_VERSIONS", "Device", "architecture",
    "gpu_attributes", "make_device", "quantity_mib", "render_device", "semver", "string_attribute",
]

API_VERSIONS = RESOURCE_VERSIONS
#: Versions the GPU sets (counters, partitionable devices) are rendered in.
SETS_API_VERSIONS = ("v1",)
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
NUMA_NODE_ATTRIBUTE = "resource.kubernetes.io/numaNode"
# API limits (k8s.io/api/resource/v1/types.go, v0.36)
MAX_DEVICES_PER_SLICE = 128  # ResourceSliceMaxDevices
MAX_DEVICES_WITH_COUNTERS = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_ATTRIBUTE_STRING = 64  # DeviceAttributeMaxValueLength
MAX_NAME = 253  # object names are DNS subdomains

_ARCHITECTURE = {7: "Volta", 8: "Ampere", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}


def architecture(cc: tuple[int, int] | None) -> str | None:
    """NVIDIA's architecture name for a CUDA compute capability; None if not known."""
    if cc is None:
        return None
    if cc[0] == 7 and cc[1] >= 5:
        return "Turing"
    if cc[0] == 8 and cc[1] >= 9:
        return "Ada Lovelace"
    return _ARCHITECTURE.get(cc[0])


@dataclass(frozen=True)
class Device:
    """One device of the slice, version-neutral: ``attributes`` maps a qualified name to one
    typed value (``{"int": 3}``, ``{"string": ...}``, ``{"version": ...}``); ``consumes``:
    the GPU indices whose counters the device consumes (empty: none); ``taints``: its device
    taints (:mod:`agent.dra.taints`). Models ``resource.k8s.io`` ``Device`` of a ResourceSlice."""

    name: str
    attributes: Mapping[str, Mapping[str, Any]]
    capacity: Mapping[str, str]  # name -> quantity
    consumes: tuple[int, ...] = ()
    taints: tuple[Mapping[str, Any], ...] = ()
    #: further consumptions, (counter set, ((counter, amount), ...)): a dynamic MIG GPU's
    #: counters (:mod:`agent.dra.migslots`), and a MIG device's share of its GPU's counter
    shares: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()


# ----------------------------------------------------------------------- values
def semver(text: str | None) -> str | None:
    """``"12.4"`` -> ``"12.4.0"``, ``"535.104.05"`` -> ``"535.104.5"``; None when ``text``
    is not one to three dot-separated numbers."""
    if not text:
        return None
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return ".".join(str(n) for n in nums)


def _sysfs_bus_id(bus_id: str) -> str | None:
    """The sysfs spelling (``0000:1b:00.0``, as Kubernetes' pciBusID attribute wants it);
    None for a value that is no PCI bus id (never guessed)."""
    try:
        return nvml_to_sysfs_bus_id(bus_id)
    except BusIdError:
        return None


def quantity_mib(mib: int) -> str:
    """Canonical Kubernetes quantity for ``mib`` MiB (``80Gi``, ``81559Mi``)."""
    for suffix, unit in (("Ti", 1024 * 1024), ("Gi", 1024)):
        if mib and mib % unit == 0:
            return f"{mib // unit}{suffix}"
    return f"{mib}Mi"


def string_attribute(value: str | None) -> dict[str, Any] | None:
    if not value or len(value) > MAX_ATTRIBUTE_STRING:
        return None
    return {"string": value}


def _version(value: str | None) -> dict[str, Any] | None:
    v = semver(value)
    return {"version": v} if v else None


def _int(value: int | None) -> dict[str, Any] | None:
    return {"int": value} if value is not None else None


def gpu_attributes(topology: Topology, gpu: Gpu, island: int, clique: int) -> dict[str, Any]:
    cc = gpu.compute_capability
    return {
        "productName": string_attribute(gpu.name if gpu.name != "unknown" else None),
        "brand": string_attribute(gpu.brand),
        "architecture": string_attribute(architecture(cc)),
        "cudaComputeCapability": _version(f"{cc[0]}.{cc[1]}" if cc else None),
        "driverVersion": _version(topology.driver_version),
        "cudaDriverVersion": _version(topology.cuda_driver_version),
        "pciBusID": string_attribute(_sysfs_bus_id(gpu.pci_bus_id) if gpu.pci_bus_id else None),
        "numaNode": _int(gpu.numa_node),
        "nvlinkIsland": {"int": island},
        "nvlinkClique": {"int": clique},
        PCIE_ROOT_ATTRIBUTE: string_attribute(gpu.pcie_root),
        NUMA_NODE_ATTRIBUTE: _int(gpu.numa_node),
    }


def make_device(driver: str, name: str, attributes: Mapping[str, Any], memory_mib: int | None,
                consumes: tuple[int, ...] = (), taints: Iterable[Mapping[str, Any]] = (),
                shares: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()) -> Device:
    qualified = {
        (key if "/" in key else f"{driver}/{key}"): value
        for key, value in attributes.items()
        if value is not None
    }
    capacity = {"memory": quantity_mib(memory_mib)} if memory_mib else {}
    if len(qualified) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise ValueError(f"device {name}: more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities")
    return Device(name, dict(sorted(qualified.items())), capacity, consumes, tuple(taints), shares)


def render_device(device: Device, api_version: str, weights: Mapping[int, int] | None = None) -> dict[str, Any]:
    """``device`` as ``resource.k8s.io/<api_version>`` writes it; ``weights``: the value of
    each GPU's counter where it is not 1 (:func:`agent.dra.counters.consumes_counters`)."""
    body: dict[str, Any] = {"attributes": {k: dict(v) for k, v in device.attributes.items()}}
    if device.capacity:
        body["capacity"] = {k: {"value": v} for k, v in device.capacity.items()}
    uses = consumes_counters(device.consumes, weights or {}) if device.consumes else []
    for counter_set, amounts in device.shares:
        found = next((u for u in uses if u["counterSet"] == counter_set), None)
        if found is None:
            found = {"counterSet": counter_set, "counters": {}}
            uses.append(found)
        found["counters"].update({k: {"value": str(v)} for k, v in amounts})
    if uses:
        body["consumesCounters"] = uses
    if device.taints:
        body["taints"] = [dict(t) for t in device.taints]
    if api_version == "v1beta1":
        return {"name": device.name, "basic": body}
    return {"name": device.name, **body}
