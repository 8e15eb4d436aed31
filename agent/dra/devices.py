"""DRA device names: the one mapping between a ResourceSlice device name and the GPU (or
MIG device) behind it, shared by the slice publisher and the kubelet plugin.

A full GPU is ``gpu-<index>``; with MIG enabled, the GPU itself is not a device and each MIG
device is ``gpu-<parent index>-mig-<MIG device index>``. Names are DNS labels, as the API
server requires, and stable for a given topology.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.topology.model import Gpu, MigDevice, Topology


@dataclass(frozen=True)
class DeviceRef:
    """One device of the node as DRA names it, and the GPU (or MIG device) behind it."""

    name: str
    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu.uuid


def device_name(gpu: Gpu, mig: MigDevice | None = None) -> str:
    if mig is None:
        return f"gpu-{gpu.index}"
    return f"gpu-{gpu.index}-mig-{mig.index}"


def device_refs(topology: Topology) -> dict[str, DeviceRef]:
    """Every device the node offers through DRA, by name, in GPU index order."""
    out: dict[str, DeviceRef] = {}
    for gpu in topology.gpus:
        if gpu.mig_enabled:
            for mig in gpu.mig_devices:
                out[device_name(gpu, mig)] = DeviceRef(device_name(gpu, mig), gpu, mig)
        else:
            out[device_name(gpu)] = DeviceRef(device_name(gpu), gpu)
    return out
