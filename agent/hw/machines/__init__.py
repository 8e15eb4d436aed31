"""Simulated machines: built-in machine specs, spec files and pasted ``nvidia-smi topo -m``
output, opened as a fake NVML plus a fake sysfs tree.

``MACHINE`` (the ``--simulate`` argument) is one of:

* a built-in name (:data:`BUILTIN_MACHINES`; the specs are the ``*.yaml`` files next to this
  module, format in :func:`agent.hw.fake.machine_spec_from_dict`);
* a machine spec file (``.yaml``/``.yml``/``.json``, or any file holding a YAML mapping);
* a file holding ``nvidia-smi topo -m`` output as a user pasted it (recognised by its
  ``GPU0`` header). :func:`load_topology` reads it with the topo-matrix reader;
  :func:`open_simulated` turns it into a spec with :func:`spec_from_topology` so the whole
  agent can run on it.

Public API::

    BUILTIN_MACHINES: tuple[str, ...]
    open_simulated(machine: str) -> SimulatedMachine
    load_topology(machine: str) -> Topology
    load_spec(machine: str) -> MachineSpec
    spec_from_topology(topology: Topology, name: str = "pasted") -> MachineSpec
    sysfs_tree_spec(spec: MachineSpec) -> SysfsTreeSpec
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

from agent.errors import InputFormatError
from agent.hw.fake import (
    GPU_MODELS,
    FakeNvml,
    FaultSpec,
    GpuModel,
    GpuSpec,
    MachineSpec,
    NicSpec,
    NvSwitchSpec,
    load_machine_spec,
    machine_spec_from_dict,
    nvml_bus_id,
    synthetic_gpu_uuid,
)
from agent.topology.model import PcieLevel, Topology

if TYPE_CHECKING:  # pragma: no cover
    from agent.hw.nvml import NvmlBackend
    from agent.hw.sysfs import SysfsTreeSpec

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The machines shipped with the package (``agent/hw/machines/<name>.yaml``).
BUILTIN_MACHINES: tuple[str, ...] = (
    "dgx1-v100",
    "dgx2",
    "dgx-a100",
    "dgx-h100",
    "pcie-pairs",
    "pcie-4gpu",
    "gb200-tray",
    "a100-mig",
    "single-gpu",
)

_SPEC_SUFFIXES = (".yaml", ".yml", ".json")
_TOPO_HEADER = re.compile(r"^\s*GPU0(\s|$)", re.MULTILINE)


def _unknown(machine: str) -> InputFormatError:
    return InputFormatError(
        f"unknown machine {machine!r}: not a built-in machine ({', '.join(BUILTIN_MACHINES)}) "
        "and not a readable file"
    )


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        raise InputFormatError(f"cannot read {path}: {exc.strerror or exc}") from None


def _is_topo_matrix(path: str) -> bool:
    if path.lower().endswith(_SPEC_SUFFIXES):
        return False
    return _TOPO_HEADER.search(_read_text(path)) is not None


def load_spec(machine: str) -> MachineSpec:
    """The :class:`MachineSpec` of a built-in name, a spec file or a pasted topo matrix
    file. InputFormatError (exit 2) for an unknown name or an unreadable/invalid file."""
    if machine in BUILTIN_MACHINES:
        return load_machine_spec(os.path.join(_HERE, f"{machine}.yaml"))
    if not machine or not os.path.isfile(machine):
        raise _unknown(machine)
    if _is_topo_matrix(machine):
        from agent.hw.topo_matrix import read_topo_matrix

        name = os.path.splitext(os.path.basename(machine))[0] or "pasted"
        return spec_from_topology(read_topo_matrix(machine), name=name)
    return load_machine_spec(machine)


def sysfs_tree_spec(spec: MachineSpec) -> SysfsTreeSpec:
    """The fake sysfs tree of a machine: DMI name, NUMA nodes, GPUs and RDMA NICs where
    the spec's PCIe tree puts them."""
    from agent.hw.sysfs import PciDeviceSpec, SysfsTreeSpec

    devices = [
        PciDeviceSpec(
            bus_id=g.bus_id,
            numa_node=g.numa_node,
            local_cpulist=g.cpulist,
            host_bridge=g.host_bridge,
            switches=g.switches,
        )
        for g in spec.gpus
    ]
    for nic in spec.nics:
        cpus = (
            spec.numa_nodes[nic.numa_node][0]
            if nic.numa_node is not None and nic.numa_node in spec.numa_nodes
            else None
        )
        devices.append(
            PciDeviceSpec(
                bus_id=nic.bus_id,
                numa_node=nic.numa_node,
                local_cpulist=cpus or None,
                host_bridge=nic.host_bridge,
                switches=nic.switches,
                rdma_name=nic.name,
            )
        )
    return SysfsTreeSpec(
        product_name=spec.product_name, numa_nodes=dict(spec.numa_nodes), devices=devices
    )


class SimulatedMachine:
    """A fake NVML (:attr:`lib`) and a fake sysfs tree under :attr:`sysfs_root` for one
    machine spec. The tree lives in a temp dir removed by :meth:`close` (or at garbage
    collection / exit). Usable as a context manager."""

    def __init__(self, spec: MachineSpec, sysfs_root: str | None = None) -> None:
        from agent.hw.sysfs import write_tree

        self.spec = spec
        self.name = spec.name
        self.lib = FakeNvml(spec)
        owned = sysfs_root is None
        self.sysfs_root = sysfs_root or tempfile.mkdtemp(prefix=f"gta-sysfs-{_safe(spec.name)}-")
        self._finalizer = (
            weakref.finalize(self, shutil.rmtree, self.sysfs_root, True) if owned else None
        )
        try:
            write_tree(self.sysfs_root, sysfs_tree_spec(spec))
        except ValueError as exc:
            self.close()
            raise InputFormatError(f"machine {spec.name}: impossible PCIe tree: {exc}") from None

    def backend(self) -> NvmlBackend:
        """A new :class:`NvmlBackend` on this machine's fake NVML and sysfs (not yet
        initialised)."""
        from agent.hw.nvml import NvmlBackend
        from agent.hw.sysfs import SysfsReader

        return NvmlBackend(lib=self.lib, sysfs=SysfsReader(self.sysfs_root))

    def close(self) -> None:
        """Remove the fake sysfs tree (if this object created it)."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> SimulatedMachine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        gpus = len(self.spec.gpus)
        return f"SimulatedMachine({self.name!r}, {gpus} GPUs, sysfs={self.sysfs_root!r})"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40]


def open_simulated(machine: str) -> SimulatedMachine:
    """Open ``machine`` (built-in name, spec file or pasted topo matrix file) as a
    :class:`SimulatedMachine`."""
    return SimulatedMachine(load_spec(machine))


def load_topology(machine: str) -> Topology:
    """The topology of ``machine``: a pasted topo matrix is read by the topo-matrix reader
    as is; anything else is opened with :func:`open_simulated` and discovered through
    :class:`NvmlBackend` on the fake, source ``simulated:<name>``."""
    if (
        machine not in BUILTIN_MACHINES
        and machine
        and os.path.isfile(machine)
        and _is_topo_matrix(machine)
    ):
        from agent.hw.topo_matrix import read_topo_matrix

        return read_topo_matrix(machine)
    with open_simulated(machine) as sim:
        backend = sim.backend()
        backend.init()
        try:
            return backend.read_topology(source=f"simulated:{sim.name}")
        finally:
            backend.shutdown()


# =========================================================================== pasted matrices
class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def groups(self, members: list[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for m in members:
            out.setdefault(self.find(m), []).append(m)
        return out


def synthetic_islands_topology(islands: int = 8, size: int = 8) -> Topology:
    """A synthetic node larger than any built-in one (64 GPUs by default): ``islands``
    NVSwitch islands of ``size`` GPUs, 18 NVLinks per pair inside an island, none between;
    islands alternate between 2 NUMA nodes. For the engine's bounded search above 16 GPUs
    (tests and ``bench/bench_allocate.py``); a topology only, no simulated NVML."""
    from agent.topology.model import Gpu, Link

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


def spec_from_topology(topology: Topology, name: str = "pasted") -> MachineSpec:
    """A machine spec that reproduces ``topology`` (typically read from a pasted
    ``nvidia-smi topo -m``) on the fake NVML + sysfs.

    Reproduced exactly: GPU count, UUIDs, names, NVLink counts per pair, the PCIe level of
    every GPU pair whose level is known (as explicit ``pcie_levels``), NUMA nodes of the GPUs
    where known. Synthesised: PCI bus ids, a PCIe tree (host bridges and switches grouped
    from the GPU-GPU and GPU-NIC levels) that gives the NICs their levels, NUMA nodes of
    GPUs without one (grouped by non-SYS levels), NUMA cpulists where unknown. An NVLink
    island where every pair has the same count ``c`` and ``c * (size - 1)`` exceeds
    ``NVML_NVLINK_MAX_LINKS`` is wired through NVSwitches (``links_per_gpu = c``): no GPU
    has that many ports. InputFormatError if the NVLinks cannot be wired otherwise.
    """
    gpus_in = topology.gpus
    n = len(gpus_in)
    nics_in = topology.nics
    max_links = FakeNvml.NVML_NVLINK_MAX_LINKS  # type: ignore[attr-defined]
    close_levels = (PcieLevel.BOARD, PcieLevel.PIX, PcieLevel.PXB, PcieLevel.PHB)

    # --- NUMA nodes: known ones, then groups of GPUs joined by non-SYS levels
    numa_of: list[int | None] = [g.numa_node for g in gpus_in]
    if any(x is None for x in numa_of):
        uf = _UnionFind(n)
        for link in topology.links:
            if link.pcie is not None and link.pcie != PcieLevel.SYS:
                uf.union(link.a, link.b)
        next_id = (
            max([x for x in numa_of if x is not None] + list(topology.numa_cpulists) + [-1]) + 1
        )
        group_ids: dict[int, int] = {}
        for i in range(n):
            if numa_of[i] is None:
                root = uf.find(i)
                known = next(
                    (numa_of[j] for j in range(n) if uf.find(j) == root and numa_of[j] is not None),
                    None,
                )
                if known is None:
                    if root not in group_ids:
                        group_ids[root] = next_id
                        next_id += 1
                    known = group_ids[root]
                numa_of[i] = known
    # --- NIC NUMA nodes: that of a GPU it reaches without crossing sockets
    nic_numa: list[int | None] = []
    for nic in nics_in:
        near = [
            numa_of[g]
            for g, lv in enumerate(nic.levels)
            if lv is not None and lv != PcieLevel.SYS and g < n
        ]
        nic_numa.append(nic.numa_node if nic.numa_node is not None else (near[0] if near else None))
    all_ids = sorted({x for x in numa_of + nic_numa if x is not None} | set(topology.numa_cpulists))
    # a NIC SYS to every GPU sits on a node of its own (as a NIC behind another socket does)
    for k, nic in enumerate(nics_in):
        if nic_numa[k] is None and any(lv == PcieLevel.SYS for lv in nic.levels):
            gpu_nodes = {x for x in numa_of if x is not None}
            spare = next((x for x in all_ids if x not in gpu_nodes), None)
            if spare is None:
                spare = (max(all_ids) + 1) if all_ids else 0
                all_ids.append(spare)
            nic_numa[k] = spare

    numa_nodes: dict[int, tuple[str, tuple[int, ...]]] = {}
    for node in sorted(set(all_ids)):
        cpus = topology.numa_cpulists.get(node)
        if cpus is None:
            affinities = sorted(
                {
                    g.cpu_affinity
                    for g, x in zip(gpus_in, numa_of, strict=True)
                    if x == node and g.cpu_affinity
                }
            )
            cpus = affinities[0] if len(affinities) == 1 else ""
        distances = topology.numa_distances.get(node)
        numa_nodes[node] = (cpus, tuple(distances) if distances else ())
    ids = sorted(numa_nodes)
    numa_nodes = {
        k: (c, d if len(d) == len(ids) else tuple(10 if j == k else 21 for j in ids))
        for k, (c, d) in numa_nodes.items()
    }

    # --- PCIe tree over GPUs (0..n-1) and NICs (n..): host bridges, outer and inner switches
    total = n + len(nics_in)
    pair_levels: list[tuple[int, int, PcieLevel]] = [
        (link.a, link.b, link.pcie) for link in topology.links if link.pcie is not None
    ]
    for k, nic in enumerate(nics_in):
        pair_levels += [
            (g, n + k, lv) for g, lv in enumerate(nic.levels) if lv is not None and g < n
        ]
    numa_all = numa_of + nic_numa
    hb_uf, outer_uf, inner_uf = _UnionFind(total), _UnionFind(total), _UnionFind(total)
    for a, b, lv in pair_levels:
        if numa_all[a] != numa_all[b]:
            continue
        if lv in close_levels:
            hb_uf.union(a, b)
        if lv in (PcieLevel.BOARD, PcieLevel.PIX, PcieLevel.PXB):
            outer_uf.union(a, b)
        if lv in (PcieLevel.BOARD, PcieLevel.PIX):
            inner_uf.union(a, b)
    hb_groups = sorted(hb_uf.groups(list(range(total))).values())
    if len(hb_groups) > 15:
        raise InputFormatError(f"{topology.source or name}: too many PCIe host bridges to simulate")
    bus_of: dict[int, str] = {}
    place: dict[int, tuple[str, tuple[str, ...]]] = {}
    for h, members in enumerate(hb_groups):
        root_bus = 0x10 * h
        host_bridge = f"pci0000:{root_bus:02x}"
        for pos, m in enumerate(sorted(members)):
            if pos >= 15:
                raise InputFormatError(
                    f"{topology.source or name}: too many devices under one host bridge"
                )
            bus_of[m] = f"0000:{root_bus + 1 + pos:02x}:00.0"
            if len(members) == 1:
                place[m] = (host_bridge, ())
            else:
                outer = f"hb{h}-sw{outer_uf.find(m)}"
                place[m] = (host_bridge, (outer, f"{outer}-{inner_uf.find(m)}"))

    # --- NVLinks: NVSwitch for over-subscribed uniform cliques, direct pairs otherwise
    nv_pairs = [(link.a, link.b, link.nvlinks) for link in topology.links if link.nvlinks > 0]
    switch: NvSwitchSpec | None = None
    for island in topology.nvlink_islands:
        counts = {c for a, b, c in nv_pairs if a in island and b in island}
        pairs_in = [(a, b) for a, b, _ in nv_pairs if a in island and b in island]
        size = len(island)
        if (
            len(counts) == 1
            and len(pairs_in) == size * (size - 1) // 2
            and counts.pop() * (size - 1) > max_links
        ):
            per_gpu = next(c for a, b, c in nv_pairs if a in island)
            if switch is not None:
                raise InputFormatError(
                    f"{topology.source or name}: more than one NVSwitch domain cannot be simulated"
                )
            switch = NvSwitchSpec(
                per_gpu, tuple(f"00000000:{0xE0 + k:02X}:00.0" for k in range(4)), tuple(island)
            )
    switched = (switch.gpus or ()) if switch is not None else ()
    direct = [p for p in nv_pairs if not (p[0] in switched and p[1] in switched)]
    ports = [0] * n
    for a, b, c in direct:
        ports[a] += c
        ports[b] += c
    if switch is not None:
        for i in switch.gpus or ():
            ports[i] += switch.links_per_gpu
    for i, used in enumerate(ports):
        if used > max_links:
            raise InputFormatError(
                f"{topology.source or name}: GPU{i} would need {used} NVLink ports"
                f" (at most {max_links})"
            )

    gpus: list[GpuSpec] = []
    for i, g in enumerate(gpus_in):
        catalogued = GPU_MODELS.get(g.name)
        model = catalogued or GpuModel(
            g.name or "unknown",
            g.memory_mib or 16384,
            g.compute_capability or (8, 0),
            "ampere",
            0,
            hbm=False,
        )
        if model.nvlinks < ports[i]:
            model = replace(model, nvlinks=ports[i])
        host_bridge, switches = place[i]
        gpu_node = numa_of[i]
        gpus.append(
            GpuSpec(
                index=i,
                model=model,
                bus_id=nvml_bus_id(bus_of[i]),
                uuid=g.uuid or synthetic_gpu_uuid(name, i),
                numa_node=gpu_node,
                cpulist=g.cpu_affinity
                or (
                    numa_nodes[gpu_node][0]
                    if gpu_node is not None and gpu_node in numa_nodes
                    else None
                )
                or None,
                host_bridge=host_bridge,
                switches=switches,
                minor_number=g.minor_number if g.minor_number is not None else i,
                fabric_cluster_uuid=g.fabric_cluster_uuid,
                fabric_clique_id=g.fabric_clique_id,
            )
        )
    nics = [
        NicSpec(nic.name, bus_of[n + k], nic_numa[k], place[n + k][0], place[n + k][1])
        for k, nic in enumerate(nics_in)
    ]
    levels = {(link.a, link.b): int(link.pcie) for link in topology.links if link.pcie is not None}
    return MachineSpec(
        name=name,
        gpus=tuple(gpus),
        numa_nodes=numa_nodes,
        nics=tuple(nics),
        nvlink_pairs=tuple(direct),
        nvswitch=switch,
        pcie_levels=levels,
        product_name=topology.machine,
        driver_version=topology.driver_version or "550.54.15",
        cuda_driver_version=_cuda_int(topology.cuda_driver_version),
        faults=FaultSpec(),
        description=f"synthesised from {topology.source or 'a topology'}",
    )


def _cuda_int(version: str | None) -> int:
    m = re.fullmatch(r"(\d+)\.(\d+)", version or "")
    return int(m[1]) * 1000 + int(m[2]) * 10 if m else 12040


__all__ = [
    "BUILTIN_MACHINES",
    "SimulatedMachine",
    "load_spec",
    "load_topology",
    "machine_spec_from_dict",
    "open_simulated",
    "spec_from_topology",
    "sysfs_tree_spec",
]
