"""DRA device names: the one mapping between a ResourceSlice device name and the GPUs behind
it, shared by the slice publisher and the kubelet plugin.

A full GPU is ``gpu-<index>``; with MIG enabled, the GPU itself is not a device and each MIG
device is ``gpu-<parent index>-mig-<MIG device index>``; a GPU set is
``gpuset-<size>-m<mask>`` (:func:`agent.dra.gpusets.set_name`) and stands for the member GPUs
its name says, whole GPUs (MIG off). Names are DNS labels, as the API server requires, and
stable for a given topology: a name never comes to mean other GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from agent.containers import ContainerDevice
from agent.dra.gpusets import parse_set_name
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


class DeviceRefs(Mapping[str, DeviceRef]):
    """Every device the node offers through DRA, by name. Iterating lists the GPUs and MIG
    devices in GPU index order; a set device is found by its name (any set of whole GPUs of
    this node), since which sets are published follows the occupancy."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._singles: dict[str, DeviceRef] = {}
        for gpu in topology.gpus:
            if gpu.mig_enabled:
                for mig in gpu.mig_devices:
                    name = device_name(gpu, mig)
                    self._singles[name] = DeviceRef(name, (ContainerDevice(gpu, mig),))
            else:
                self._singles[device_name(gpu)] = DeviceRef(device_name(gpu), (ContainerDevice(gpu),))

    def __getitem__(self, name: str) -> DeviceRef:
        found = self._singles.get(name)
        if found is not None:
            return found
        members = parse_set_name(name)
        gpus = self.topology.gpus
        if members is None or members[-1] >= len(gpus) or any(gpus[i].mig_enabled for i in members):
            raise KeyError(name)
        return DeviceRef(name, tuple(ContainerDevice(gpus[i]) for i in members))

    def __iter__(self) -> Iterator[str]:
        return iter(self._singles)

    def __len__(self) -> int:
        return len(self._singles)


def gpus_of(refs: Mapping[str, DeviceRef], name: str) -> tuple[int, ...]:
    """The GPU indices behind device ``name`` (none for a name not of this node)."""
    found = refs.get(name)
    return tuple(sorted({p.gpu.index for p in found.parts})) if found is not None else ()
