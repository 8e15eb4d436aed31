"""Plain immutable records shared by the hardware readers and the topology model.

A leaf module: it imports nothing of ours, so ``agent.hw`` (which produces these records)
and ``agent.topology`` (which derives islands, cliques and scores from them) can both use it.
"""

from __future__ import annotations

import enum
import uuid as uuid_mod
from dataclasses import dataclass, field
from typing import Mapping


class PcieLevel(enum.IntEnum):
    """Common-ancestor level of two PCIe devices, best (closest) first.

    Values are NVML's ``NVML_TOPOLOGY_*`` constants; names are ``nvidia-smi topo -m``'s.
    """

    BOARD = 0  # NVML_TOPOLOGY_INTERNAL: same board (multi-GPU boards)
    PIX = 10  # NVML_TOPOLOGY_SINGLE: at most one PCIe switch
    PXB = 20  # NVML_TOPOLOGY_MULTIPLE: several switches, no host bridge
    PHB = 30  # NVML_TOPOLOGY_HOSTBRIDGE: through a host bridge
    NODE = 40  # NVML_TOPOLOGY_NODE: between host bridges of one NUMA node
    SYS = 50  # NVML_TOPOLOGY_SYSTEM: across the SMP interconnect (sockets)

    @classmethod
    def parse(cls, text: str) -> "PcieLevel":
        """``'PIX'`` -> PIX; the legacy ``SOC`` and ``CPU`` legends map to SYS and NODE."""
        t = text.strip().upper()
        alias = {"SOC": "SYS", "CPU": "NODE"}
        return cls[alias.get(t, t)]


#: Most GPUs per node: the topology engine works on 64-bit GPU masks. The one definition in
#: Python (the simulator refuses bigger machines, the allocator bigger topologies, the
#: pure-Python twin bigger inputs); the Cython kernel compiles the same number in as its
#: array bound, and the parity suite checks the kernel against the twin.
MAX_GPUS = 64

#: Pair score by PCIe level, as go-gpuallocator scores links.
PCIE_SCORE: Mapping[PcieLevel, int] = {
    PcieLevel.SYS: 10,
    PcieLevel.NODE: 20,
    PcieLevel.PHB: 30,
    PcieLevel.PXB: 40,
    PcieLevel.PIX: 50,
    PcieLevel.BOARD: 60,
}
#: Pair score per NVLink between two GPUs.
NVLINK_SCORE = 100


def pair_score(nvlinks: int, pcie: PcieLevel | None) -> int:
    """The go-gpuallocator-compatible score of one GPU pair: PCIe level + 100 per NVLink."""
    return (PCIE_SCORE[pcie] if pcie is not None else 0) + NVLINK_SCORE * nvlinks


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (GPU instance + compute instance) on a parent GPU."""

    uuid: str  # "MIG-..."
    parent_index: int
    index: int  # NVML's MIG device index within the parent
    profile: str  # e.g. "1g.10gb", "3g.40gb"
    memory_mib: int
    gi_id: int | None = None
    ci_id: int | None = None
    #: where its GPU instance sits, and that instance's NVML profile id
    #: (:attr:`MigProfile.profile_id`); None where NVML does not say
    placement: MigPlacement | None = None
    profile_id: int | None = None


@dataclass(frozen=True)
class MigPlacement:
    """Where a GPU instance may sit: NVML's ``nvmlGpuInstancePlacement_t``, in memory slices
    (``start`` .. ``start + size - 1``)."""

    start: int
    size: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a MIG-capable GPU, as NVML's
    ``nvmlDeviceGetGpuInstanceProfileInfo`` and ``nvmlDeviceGetGpuInstancePossiblePlacements``
    give it (one compute instance spanning the whole GPU instance)."""

    name: str  # "3g.40gb", "1g.10gb+me" (nvidia-smi's name without "MIG ")
    nvml_profile: int  # the NVML_GPU_INSTANCE_PROFILE_* value it is queried with
    profile_id: int  # NVML's info.id, nvidia-smi mig -lgip's "ID"
    compute_slices: int  # info.sliceCount
    memory_mib: int  # info.memorySizeMB
    instance_count: int  # info.instanceCount: most instances of it on one GPU
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpegs: int = 0
    ofas: int = 0
    placements: tuple[MigPlacement, ...] = ()


@dataclass(frozen=True)
class MigGeometry:
    """What a MIG-capable GPU can be cut into: its slices and every profile with its legal
    placements. ``None`` on a :class:`Gpu` where it is not known (not MIG capable, a pasted
    matrix, NVML not answering)."""

    memory_slices: int  # 8 on A100/H100/H200/B200, 4 on A30
    compute_slices: int  # 7, 4 on A30
    profiles: tuple[MigProfile, ...] = ()

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.profiles if p.name == name), None)


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance (with its one compute instance) as it exists on a GPU now: what
    dynamic MIG creates at prepare and destroys at unprepare. ``ci_id`` and ``uuid`` are
    None for a GPU instance without a compute instance (a create cut short)."""

    parent_index: int
    profile: str  # "3g.40gb"
    placement: MigPlacement
    gi_id: int
    ci_id: int | None
    uuid: str | None  # "MIG-..."


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as discovered."""

    index: int
    uuid: str
    name: str
    brand: str | None = None  # NVML's product brand, "NVIDIA", "Tesla", "GeForce RTX", ...
    memory_mib: int | None = None
    pci_bus_id: str = ""  # NVML spelling: "00000000:3B:00.0"
    pci_class: int | None = None  # from sysfs: 0x030200 3D controller (compute), 0x0300xx VGA
    minor_number: int | None = None
    compute_capability: tuple[int, int] | None = None
    mig_enabled: bool = False
    mig_capable: bool | None = None  # NVML answers GetMigMode (None: not known, e.g. a pasted matrix)
    mig_devices: tuple[MigDevice, ...] = ()
    #: profiles and placements the GPU offers (dynamic MIG); None where not known
    mig_geometry: MigGeometry | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None  # a cpulist, "0-19,40-59"
    numa_affinity: str | None = None  # the NUMA node list as reported, "0,3-9" (numa_node = lowest)
    memory_numa_node: int | None = None  # the GPU's own memory as a NUMA node (Grace systems)
    fabric_cluster_uuid: str | None = None
    fabric_clique_id: int | None = None
    lost: bool = False  # NVML answered GPU_IS_LOST while reading it
    pcie_root: str | None = None  # the PCIe root complex it hangs from, "pci0000:17" (sysfs)
    #: NVML's compute mode as nvidia-smi names it: "Default", "Exclusive_Thread",
    #: "Prohibited" or "Exclusive_Process" (None: not known)
    compute_mode: str | None = None


#: NVML's ``NVML_COMPUTEMODE_*`` values as nvidia-smi names them (``nvidia-smi -c``).
COMPUTE_MODES: Mapping[int, str] = {
    0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process",
}


@dataclass(frozen=True)
class Link:
    """What connects GPUs ``a`` < ``b``."""

    a: int
    b: int
    nvlinks: int = 0
    pcie: PcieLevel | None = None
    nvswitch: bool = False  # the NVLinks go through NVSwitches

    @property
    def score(self) -> int:
        return pair_score(self.nvlinks, self.pcie)


@dataclass(frozen=True)
class Nic:
    """An RDMA NIC and its PCIe relation to each GPU (``levels[gpu_index]``)."""

    name: str  # "mlx5_0"
    pci_bus_id: str | None = None
    numa_node: int | None = None
    levels: tuple[PcieLevel | None, ...] = ()
    pcie_root: str | None = None  # the PCIe root complex it hangs from, "pci0000:17" (sysfs)


def synthetic_gpu_uuid(machine: str, index: int) -> str:
    """The stable, realistic-looking UUID given to GPU ``index`` of ``machine`` when the input
    names none (a machine spec without ``uuid``, a pasted ``nvidia-smi topo -m``): a UUIDv5
    of the machine name and the index. The one scheme for every simulated input."""
    return "GPU-" + str(
        uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"gpu-topology-agent/{machine}/{index}")
    )


@dataclass(frozen=True)
class NodeFacts:
    """What a hardware reader found on one node, as read: no derived facts (islands,
    cliques, NUMA groups and scores are the topology layer's, ``Topology.from_facts``).
    ``None`` or an empty collection is a fact the input did not give."""

    gpus: tuple[Gpu, ...]
    links: tuple[Link, ...] = ()
    nics: tuple[Nic, ...] = ()
    numa_distances: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    numa_cpulists: Mapping[int, str] = field(default_factory=dict)
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.4"
    machine: str | None = None  # DMI product name, e.g. "DGX H100"
    source: str = ""  # "nvml", "simulated:dgx-h100", "topo-matrix:/path"
    notes: tuple[str, ...] = ()  # what was inferred rather than read


#: How time-sliced replicas are placed (``flags.sharedDevicesAllocationPolicy``, the
#: allocator's ``replicas(policy=...)``): ``distributed`` spreads them over the least-loaded
#: GPUs, ``packed`` fills the most-loaded GPU first. The configuration and the allocator
#: both read this one list.
REPLICA_POLICIES: tuple[str, ...] = ("distributed", "packed")
