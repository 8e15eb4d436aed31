"""DRA device names: the one mapping between a ResourceSlice device name and the GPUs behind
it, shared by the slice publisher and the kubelet plugin.

A full GPU is ``gpu-<index>``; with MIG enabled, the GPU itself is not a device and each MIG
device is ``gpu-<parent index>-mig-<MIG device index>``; a GPU set is
``gpuset-<size>-<rank>`` (:mod:`agent.dra.gpusets`) and stands for all its member GPUs. Names
are DNS labels, as the API server requires, and stable for a given topology.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.containers import ContainerDevice
from agent.dra.gpusets import gpu_sets, publishable
from agent.topology.model import Gpu, MigDevice, Topology


@dataclass(frozen=True)
class DeviceRef:
    """One device of the node as DRA names it, and what a container gets for it: one GPU,
    one MIG device, or every member GPU of a set (``parts``, in index order).
    Models a ResourceSlice device's name (``gpu-0``) joined to what it stands for."""

    name: str
    parts: tuple[ContainerDevice, ...]

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple(p.gpu for p in self.parts)


def device_name(gpu: Gpu, mig: MigDevice | None = None) -> str:
    if mig is None:
        return f"gpu-{gpu.index}"
    return f"gpu-{gpu.index}-mig-{mig.index}"


def device_refs(topology: Topology) -> dict[str, DeviceRef]:
    """Every device the node offers through DRA, by name: the GPUs and MIG devices in GPU
    index order, then the GPU sets by size, best first."""
    out: dict[str, DeviceRef] = {}
    for gpu in topology.gpus:
        if gpu.mig_enabled:
            for mig in gpu.mig_devices:
                out[device_name(gpu, mig)] = DeviceRef(device_name(gpu, mig), (ContainerDevice(gpu, mig),))
        else:
            out[device_name(gpu)] = DeviceRef(device_name(gpu), (ContainerDevice(gpu),))
    for sets in gpu_sets(topology).values():
        for s in sets:
            if publishable(topology, s):
                out[s.name] = DeviceRef(s.name, tuple(ContainerDevice(topology.gpus[i]) for i in s.members))
    return out
