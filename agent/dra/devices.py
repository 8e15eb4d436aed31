"""DRA device names: the one mapping between a ResourceSlice device name and the GPUs behind
it, shared by the slice publisher, the kubelet plugin and ``gpu-topology-agent slices``.

A full GPU is ``gpu-<index>``; with MIG enabled, the GPU itself is not a device and each MIG
device is ``gpu-<parent index>-mig-<MIG device index>``; a GPU set is
``gpuset-<size>-m<mask>``, the members' bitmask in lowercase hex (``gpuset-4-mf`` is GPUs
0-3, ``gpuset-2-m30`` GPUs 4 and 5; the ``m`` keeps them apart from the ``gpuset-<k>-<rank>``
names of earlier agents, which stood for other GPUs), and stands for the member GPUs its name
says, whole GPUs (MIG off). Names are DNS labels, as the API server requires, and stable: a
name never comes to mean other GPUs, whatever the occupancy or the agent generation that
published it, so the preparer needs no list of sets to resolve one. Every name is made here
(:func:`device_name`, :func:`set_name`) and read here (:func:`parse_name`,
:func:`parse_set_name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Iterable, Iterator, Mapping

from agent.containers import ContainerDevice
from agent.records import MigGeometry, MigPlacement, MigProfile
from agent.topology.model import Gpu, MigDevice, Topology

__all__ = [
    "DeviceRef", "DeviceRefs", "MigSlot", "Part", "device_name", "gpus_of", "match_slot", "mig_slot", "mig_slot_name",
    "parse_mig_slot_name", "parse_name", "parse_set_name", "profile_label", "set_name",
]

#: One part of a device: (GPU index, MIG device index, or None for the whole GPU).
Part = tuple[int, int | None]

_SET_PREFIX = "gpuset-"
_SINGLE = re.compile(r"gpu-(\d+)(?:-mig-(\d+))?")


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
    """A single GPU's or a MIG device's name."""
    if mig is None:
        return f"gpu-{gpu.index}"
    return f"gpu-{gpu.index}-mig-{mig.index}"


def set_name(members: Iterable[int]) -> str:
    """The set device's name, a DNS label: ``gpuset-<k>-m<hex bitmask of the members>``."""
    found = sorted(set(members))
    return f"{_SET_PREFIX}{len(found)}-m{sum(1 << i for i in found):x}"


_MIG_SLOT = re.compile(r"gpu-(\d+)-mig-(\d+g\d+gb(?:-[a-z]+)?)-(\d+)")


def profile_label(profile: str) -> str:
    """A MIG profile as a DNS label part: ``"3g.40gb"`` -> ``"3g40gb"``,
    ``"1g.10gb+me"`` -> ``"1g10gb-me"``."""
    return profile.lower().replace(".", "").replace("+", "-")


def mig_slot_name(gpu_index: int, profile: str, start: int) -> str:
    """A dynamic MIG device's name: profile ``profile`` at memory slice ``start`` of GPU
    ``gpu_index`` (``gpu-3-mig-3g40gb-4``); apart from a standing MIG device's
    ``gpu-<i>-mig-<n>`` by the profile part."""
    return f"gpu-{gpu_index}-mig-{profile_label(profile)}-{start}"


def parse_mig_slot_name(name: str) -> tuple[int, str, int] | None:
    """(GPU index, profile label, start slice) a dynamic MIG device name stands for; None
    for any other name. The label is matched to the GPU's profiles by :func:`profile_label`."""
    found = _MIG_SLOT.fullmatch(name)
    if found is None:
        return None
    return int(found.group(1)), found.group(2), int(found.group(3))


@dataclass(frozen=True)
class MigSlot:
    """What a dynamic MIG device name stands for on this node: ``profile`` of GPU ``gpu`` on
    ``placement`` (one of the profile's legal placements)."""

    name: str
    gpu: Gpu
    profile: MigProfile
    placement: MigPlacement


def match_slot(geometry: MigGeometry, label: str, start: int, index: int,
               about: str = "") -> tuple[MigProfile, MigPlacement]:
    """The profile (by :func:`profile_label`) and placement a slot name's ``label`` and
    ``start`` stand for in GPU ``index``'s ``geometry``; ValueError saying why none (``about``:
    more on the GPU for the message, `` (uuid, name)``).
    The one match every reader of slot names uses (:func:`mig_slot`,
    :func:`agent.dra.migslots.resolve_slot`)."""
    profile = next((p for p in geometry.profiles if profile_label(p.name) == label), None)
    if profile is None:
        known = ", ".join(profile_label(p.name) for p in geometry.profiles)
        raise ValueError(f"GPU {index}{about} has no MIG profile {label} (it has {known})")
    placement = next((p for p in profile.placements if p.start == start), None)
    if placement is None:
        starts = ", ".join(str(p.start) for p in profile.placements)
        raise ValueError(f"MIG profile {profile.name} of GPU {index} cannot start at memory slice {start}"
                         f" (it starts at {starts or 'none'})")
    return profile, placement


def mig_slot(topology: Topology, name: str) -> MigSlot:
    """The slot a dynamic MIG device name (:func:`mig_slot_name`) stands for on
    ``topology``; ValueError saying why it stands for none (not such a name, no such GPU, no
    MIG geometry, no such profile, a placement the profile cannot take)."""
    parsed = parse_mig_slot_name(name)
    if parsed is None:
        raise ValueError("not a dynamic MIG device name (gpu-<index>-mig-<profile>-<start slice>)")
    index, label, start = parsed
    if index >= topology.gpu_count:
        raise ValueError(f"this node has no GPU {index}")
    gpu = topology.gpus[index]
    geometry = gpu.mig_geometry
    if geometry is None or not geometry.profiles or gpu.mig_capable is False:
        raise ValueError(f"GPU {index} ({gpu.uuid}, {gpu.name}) offers no MIG profiles")
    profile, placement = match_slot(geometry, label, start, index, f" ({gpu.uuid}, {gpu.name})")
    return MigSlot(name, gpu, profile, placement)


def parse_set_name(name: str) -> tuple[int, ...] | None:
    """The members (ascending) a set name stands for; None when ``name`` is no canonical one."""
    if not name.startswith(_SET_PREFIX):
        return None
    size, _, mask = name[len(_SET_PREFIX):].partition("-m")
    if not size.isdigit() or not mask or mask != mask.lower() or mask.startswith("0") or len(mask) > 64:
        return None
    try:
        bits = int(mask, 16)
    except ValueError:
        return None
    members = tuple(i for i in range(bits.bit_length()) if bits >> i & 1)
    return members if len(members) == int(size) >= 2 and set_name(members) == name else None


def parse_name(name: str) -> tuple[Part, ...] | None:
    """The parts a device name stands for, read from the name alone (whatever the node has
    now): a set's members, whole; a single GPU; a MIG device. None for no name of ours."""
    members = parse_set_name(name)
    if members is not None:
        return tuple((i, None) for i in members)
    found = _SINGLE.fullmatch(name)
    if found is None:
        return None
    return ((int(found.group(1)), int(found.group(2)) if found.group(2) is not None else None),)


class DeviceRefs(Mapping[str, DeviceRef]):
    """Every device the node offers through DRA, by name. Iterating lists the GPUs and MIG
    devices in GPU index order (no static MIG device of a GPU in ``dynamic``, those offering
    dynamic MIG: :func:`agent.dra.migslots.dynamic_gpus`); a set device is found by its name (any set of whole GPUs of
    this node), since which sets are published follows the occupancy."""

    def __init__(self, topology: Topology, dynamic: Collection[int] = ()) -> None:
        self.topology = topology
        self._singles: dict[str, DeviceRef] = {}
        for gpu in topology.gpus:
            if gpu.mig_enabled:
                # a GPU offering dynamic MIG: its MIG instances are its slot devices (or foreign)
                for mig in gpu.mig_devices if gpu.index not in dynamic else ():
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

    def parts(self, name: str) -> tuple[Part, ...]:
        """The parts device ``name`` holds: as this node offers it, else as its name says (a
        device a claim was prepared with before its GPU's MIG mode changed); none for a name
        not of ours."""
        found = self.get(name)
        if found is not None:
            return tuple((p.gpu.index, p.mig.index if p.mig is not None else None) for p in found.parts)
        return parse_name(name) or ()


def gpus_of(refs: Mapping[str, DeviceRef], name: str) -> tuple[int, ...]:
    """The GPU indices behind device ``name`` (none for a name not of this node)."""
    found = refs.get(name)
    return tuple(sorted({p.gpu.index for p in found.parts})) if found is not None else ()
