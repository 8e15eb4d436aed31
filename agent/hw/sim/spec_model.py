"""The machine spec's model: everything the fake NVML and the fake sysfs tree of one machine
are built from. :mod:`agent.hw.sim.spec` reads a spec file into it (the one schema);
:mod:`agent.hw.sim.from_facts` builds one from facts read elsewhere (a pasted matrix).

A fact a spec does not state stays unknown (``None``): the fake NVML answers ``NotSupported``
for it, the fake sysfs writes ``-1`` or leaves the file out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.hw.sim.catalogue import GpuModel
from agent.hw.sim.processes import ProcessSpec
from agent.records import MigPlacement


@dataclass(frozen=True)
class MigDeviceSpec:
    """One MIG device: ``profile`` like ``"3g.40gb"`` or ``"1c.3g.40gb"``; ``placement``
    where its GPU instance sits (None: the GPU's model has no known MIG geometry)."""

    profile: str
    gi_slices: int
    ci_slices: int
    memory_gb: int
    placement: MigPlacement | None = None

    @property
    def gi_profile(self) -> str:
        """The GPU instance's profile: ``"3g.40gb"`` of ``"1c.3g.40gb"``."""
        return self.profile.split(".", 1)[1] if self.profile.count(".") == 2 else self.profile


@dataclass(frozen=True)
class GpuSpec:
    index: int
    model: GpuModel
    bus_id: str  # NVML spelling
    uuid: str
    numa_node: int | None = None
    cpulist: str | None = None
    host_bridge: str = "pci0000:00"
    switches: tuple[str, ...] = ()
    minor_number: int | None = None
    mig_enabled: bool = False
    mig_devices: tuple[MigDeviceSpec, ...] = ()
    fabric_cluster_uuid: str | None = None
    fabric_clique_id: int | None = None
    gpu_numa_id: int | None = None  # nvmlDeviceGetNumaNodeId (GPU memory node on Grace)
    board: str | None = None  # GPUs on one multi-GPU board are NVML_TOPOLOGY_INTERNAL
    compute_mode: str = "Default"  # nvmlDeviceGetComputeMode, as nvidia-smi names it
    processes: tuple[ProcessSpec, ...] = ()  # what runs on it (agent.hw.sim.processes)


@dataclass(frozen=True)
class NicSpec:
    name: str
    bus_id: str  # any spelling
    numa_node: int | None = None
    host_bridge: str = "pci0000:00"
    switches: tuple[str, ...] = ()
    cpulist: str | None = None  # local CPUs (sysfs local_cpulist); None: its NUMA node's


@dataclass(frozen=True)
class NvSwitchSpec:
    links_per_gpu: int
    bus_ids: tuple[str, ...]  # NVML spelling; links are spread over them
    gpus: tuple[int, ...] | None = None  # None: every GPU


@dataclass(frozen=True)
class FaultSpec:
    """Faults the fake NVML injects from the start (:mod:`agent.hw.sim.nvml_core`)."""

    lost_gpus: tuple[int, ...] = ()
    unsupported: tuple[tuple[str, int | None], ...] = ()
    init_error: str | None = None  # an NVML_ERROR_* suffix: "library_not_found"
    #: (gpu, xid): a GPU that keeps raising this XID (a failing GPU repeats its XID: 79
    #: fallen off the bus, 48 double-bit ECC, 94/95 contained/uncontained ECC): it is raised
    #: again each time an event set registers for its XID events, so every watcher sees it
    xids: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class MachineSpec:
    """Everything the fake NVML and the fake sysfs tree of one machine are built from."""

    name: str
    gpus: tuple[GpuSpec, ...]
    numa_nodes: Mapping[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    nics: tuple[NicSpec, ...] = ()
    nvlink_pairs: tuple[tuple[int, int, int], ...] = ()
    nvswitch: NvSwitchSpec | None = None
    pcie_levels: Mapping[tuple[int, int], int] = field(default_factory=dict)  # NVML values
    product_name: str | None = None
    driver_version: str | None = None  # None: not stated (NVML answers NotSupported)
    cuda_driver_version: int | None = None  # NVML's integer, 12040 for 12.4; None: not stated
    faults: FaultSpec = FaultSpec()
    description: str = ""
    notes: tuple[str, ...] = ()  # what the simulation inferred or synthesised (a pasted matrix)
    #: the NCCL topology file the spec was synthesised from ("" none): the reader lays it over
    #: what the fake NVML and sysfs say, as on a VM whose node names the file
    nccl_file: str = ""
