"""A machine spec from facts read elsewhere (a pasted ``nvidia-smi topo -m``), so the
simulator can run the whole agent on it: input -> :class:`MachineSpec` -> fake NVML + fake
sysfs -> the real backend -> the one ``Topology``.

Reproduced exactly: GPU count, UUIDs, names, NVLink counts per pair, the PCIe level of every
GPU pair whose level is known (as explicit ``pcie_levels``), NUMA nodes and CPU affinities
where known. A fact the input does not give stays unknown (no model, memory, driver, NUMA
node is made up). Synthesised, because a simulated device needs them to exist: PCI bus ids
and a PCIe tree (host bridges and switches grouped from the GPU-GPU and GPU-NIC levels) that
gives the NICs their levels; a note says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from agent.errors import InputFormatError
from agent.formats import nvml_to_sysfs_bus_id, parse_cpulist, sysfs_to_nvml_bus_id
from agent.hw.sim.catalogue import GPU_MODELS, unknown_model
from agent.hw.sim.nvml_types import CONSTANTS
from agent.hw.sim.spec_model import GpuSpec, MachineSpec, NicSpec, NvSwitchSpec
from agent.records import NodeFacts, PcieLevel
from agent.unionfind import UnionFind

_MAX_LINKS = CONSTANTS["NVML_NVLINK_MAX_LINKS"]
_CLOSE = (PcieLevel.BOARD, PcieLevel.PIX, PcieLevel.PXB, PcieLevel.PHB)
_Placement = tuple[str, tuple[str, ...]]  # host bridge, switches


def spec_from_facts(facts: NodeFacts, name: str = "pasted") -> MachineSpec:
    """A machine spec that reproduces ``facts`` on the fake NVML + sysfs (module docstring).
    InputFormatError if the PCIe tree or the NVLinks cannot be simulated."""
    where = facts.source or name
    n = len(facts.gpus)
    gpu_numa = [g.numa_node for g in facts.gpus]
    nic_numa = _nic_numa_nodes(facts)
    bus_of, place = _pcie_tree(facts, gpu_numa + nic_numa, where)
    direct, switch = _nvlinks(facts, where)
    ports = _ports(n, direct, switch, where)
    gpus = tuple(_gpu_spec(facts, i, ports[i], bus_of[i], place[i]) for i in range(n))
    nic_cpus, cpu_notes = _nic_cpulists(facts, nic_numa)
    nics = tuple(
        NicSpec(nic.name, bus_of[n + k], nic_numa[k], *place[n + k], cpulist=nic_cpus[k])
        for k, nic in enumerate(facts.nics)
    )
    return MachineSpec(
        name=name,
        gpus=gpus,
        numa_nodes=_numa_nodes(facts, gpu_numa + nic_numa),
        nics=nics,
        nvlink_pairs=tuple(direct),
        nvswitch=switch,
        pcie_levels={(k.a, k.b): int(k.pcie) for k in facts.links if k.pcie is not None},
        product_name=facts.machine,
        driver_version=facts.driver_version,
        cuda_driver_version=_cuda_int(facts.cuda_driver_version),
        description=f"synthesised from {where}",
        notes=(
            *facts.notes,
            "PCI bus IDs the input does not give and the PCIe tree are synthetic (simulated machine)",
            *cpu_notes,
        ),
    )


def _cuda_int(version: str | None) -> int | None:
    major, _, minor = (version or "").partition(".")
    if major.isdigit() and minor.isdigit():
        return int(major) * 1000 + int(minor) * 10
    return None


def _nic_numa_nodes(facts: NodeFacts) -> list[int | None]:
    """A NIC's NUMA node where given, else that of a GPU it reaches without crossing
    sockets (when that GPU's is known)."""
    out: list[int | None] = []
    for nic in facts.nics:
        near = [
            facts.gpus[g].numa_node
            for g, level in enumerate(nic.levels)
            if level is not None and level != PcieLevel.SYS and g < len(facts.gpus)
        ]
        known = [x for x in near if x is not None]
        out.append(nic.numa_node if nic.numa_node is not None else (known[0] if known else None))
    return out


def _nic_cpulists(
    facts: NodeFacts, nic_numa: Sequence[int | None]
) -> tuple[list[str | None], list[str]]:
    """Local CPUs for the NICs whose NUMA node is unknown, so the fake sysfs tells sockets
    apart without NUMA ids the input never gave (:func:`agent.hw.pcie.pcie_level`: disjoint
    local CPUs are SYS): a GPU's CPU affinity where the NIC is closer than SYS to it, else,
    for a NIC SYS to every GPU with a known affinity, CPUs of no GPU. And the note that says
    which NICs got such CPUs."""
    affinities = [g.cpu_affinity for g in facts.gpus]
    known = [parse_cpulist(a) for a in affinities if a]
    spare = str(max((max(c) for c in known if c), default=-1) + 1)
    out: list[str | None] = []
    apart: list[str] = []
    for nic, numa in zip(facts.nics, nic_numa):
        levels = list(enumerate(nic.levels))[: len(affinities)]
        near = [affinities[g] for g, lv in levels if lv not in (None, PcieLevel.SYS)]
        far = [affinities[g] for g, lv in levels if lv == PcieLevel.SYS and affinities[g]]
        if numa is not None:
            out.append(None)  # its NUMA node's CPUs
        elif any(near):
            out.append(next(a for a in near if a))
        elif far and not near:
            out.append(spare)
            apart.append(nic.name)
        else:
            out.append(None)
    notes = (
        [f"NICs SYS to every GPU sit on synthetic CPU {spare} in the fake sysfs: {', '.join(apart)}"]
        if apart
        else []
    )
    return out, notes


def _numa_nodes(
    facts: NodeFacts, device_numa: Sequence[int | None]
) -> dict[int, tuple[str, tuple[int, ...]]]:
    """The NUMA nodes the facts name, with their cpulists (given, else the one CPU affinity
    all their GPUs share) and distances where given."""
    ids = sorted({x for x in device_numa if x is not None} | set(facts.numa_cpulists))
    nodes: dict[int, tuple[str, tuple[int, ...]]] = {}
    for node in ids:
        cpus = facts.numa_cpulists.get(node)
        if cpus is None:
            affinities = {g.cpu_affinity for g in facts.gpus if g.numa_node == node}
            cpus = next(iter(affinities)) if len(affinities) == 1 else None
        distances = tuple(facts.numa_distances.get(node, ()))
        nodes[node] = (cpus or "", distances if len(distances) == len(ids) else ())
    return nodes


def _pair_levels(facts: NodeFacts) -> list[tuple[int, int, PcieLevel]]:
    """Known PCIe levels over devices 0..n-1 (GPUs) and n.. (NICs)."""
    n = len(facts.gpus)
    pairs = [(k.a, k.b, k.pcie) for k in facts.links if k.pcie is not None]
    for j, nic in enumerate(facts.nics):
        pairs += [(g, n + j, lv) for g, lv in enumerate(nic.levels) if lv is not None and g < n]
    return pairs


def _pcie_tree(
    facts: NodeFacts, numa: Sequence[int | None], where: str
) -> tuple[dict[int, str], dict[int, _Placement]]:
    """Bus ids and places (host bridge, switches) of every device: devices closer than
    NODE share a host bridge, PXB or closer an outer switch, PIX or closer an inner one."""
    total = len(numa)
    given = _given_bus_ids(facts)
    hb, outer, inner = UnionFind(total), UnionFind(total), UnionFind(total)
    for a, b, level in _pair_levels(facts):
        if numa[a] != numa[b]:
            continue
        if level in _CLOSE:
            hb.union(a, b)
        if level in (PcieLevel.BOARD, PcieLevel.PIX, PcieLevel.PXB):
            outer.union(a, b)
        if level in (PcieLevel.BOARD, PcieLevel.PIX):
            inner.union(a, b)
    groups = hb.groups(range(total))
    if len(groups) > 15:
        raise InputFormatError(f"{where}: too many PCIe host bridges to simulate")
    bus_of: dict[int, str] = {}
    place: dict[int, _Placement] = {}
    bridges: set[str] = set()
    taken = set(given.values())
    for h, members in enumerate(groups):
        if len(members) > 15:
            raise InputFormatError(f"{where}: too many devices under one host bridge")
        # a device keeps the bus ID the input gives; the others get synthetic ones in the
        # domain of the group's GPUs. Devices of one group in different domains (a VM's
        # virtual switch) cannot share a host bridge in sysfs: each domain gets its own, as
        # the VM shows them, and the input's levels are laid over what sysfs then says
        gpus = [m for m in members if m < len(facts.gpus)] or members
        domains = {given[m].split(":")[0] for m in gpus if m in given}
        main = domains.pop() if len(domains) == 1 else "0000"
        by_domain: dict[str, list[int]] = {}
        for m in members:
            by_domain.setdefault(given[m].split(":")[0] if m in given else main, []).append(m)
        for domain, part in by_domain.items():
            alone = len(part) == 1 and part[0] in given
            host_bridge = _free_bridge(domain, [int(given[part[0]].split(":")[1], 16)] if alone else [], h, bridges)
            for pos, m in enumerate(part):
                bus_of[m] = given.get(m) or _free_bus_id(domain, 0x10 * h + 1 + pos, taken)
                switch = f"hb{h}-{domain}-sw{outer.find(m)}"
                place[m] = (
                    host_bridge,
                    () if len(part) == 1 else (switch, f"{switch}-{inner.find(m)}"),
                )
    return bus_of, place


def _free_bridge(domain: str, preferred: list[int], h: int, bridges: set[str]) -> str:
    """A host bridge ``pciDDDD:BB`` no other group has: on the device's own bus for a device
    alone in its domain (directly on the root bus, as in VMs), else ``0x10 * h``."""
    for bus in [*preferred, *range(0x10 * h, 0x100), *range(0, 0x10 * h)]:
        name = f"pci{domain}:{bus:02x}"
        if name not in bridges:
            bridges.add(name)
            return name
    raise InputFormatError(f"no PCI bus left for a host bridge in domain {domain}")


def _free_bus_id(domain: str, bus: int, taken: set[str]) -> str:
    """A synthetic bus ID in ``domain``, on ``bus`` or the next free one."""
    for b in [*range(bus, 0x100), *range(1, bus)]:
        bus_id = f"{domain}:{b:02x}:00.0"
        if bus_id not in taken:
            taken.add(bus_id)
            return bus_id
    raise InputFormatError(f"no PCI bus left in domain {domain}")


def _given_bus_ids(facts: NodeFacts) -> dict[int, str]:
    """The bus IDs the input gives (an NCCL topology file does; devices 0..n-1 are GPUs,
    n.. NICs), in sysfs spelling; none when two are the same."""
    n = len(facts.gpus)
    given = {i: g.pci_bus_id for i, g in enumerate(facts.gpus) if g.pci_bus_id}
    given.update({n + k: nic.pci_bus_id for k, nic in enumerate(facts.nics) if nic.pci_bus_id})
    out = {m: nvml_to_sysfs_bus_id(b) for m, b in given.items()}
    if len(set(out.values())) != len(out):
        return {}
    return out


def _islands(n: int, pairs: Sequence[tuple[int, int, int]]) -> list[list[int]]:
    uf = UnionFind(n)
    for a, b, _ in pairs:
        uf.union(a, b)
    return [g for g in uf.groups(range(n)) if len(g) > 1]


def _nvlinks(
    facts: NodeFacts, where: str
) -> tuple[list[tuple[int, int, int]], NvSwitchSpec | None]:
    """Direct NVLink pairs, and an NVSwitch for an island where every pair has the same
    count ``c`` and ``c * (size - 1)`` exceeds the ports a GPU has."""
    pairs = [(k.a, k.b, k.nvlinks) for k in facts.links if k.nvlinks > 0]
    switch: NvSwitchSpec | None = None
    for island in _islands(len(facts.gpus), pairs):
        inside = [p for p in pairs if p[0] in island and p[1] in island]
        counts = {c for _, _, c in inside}
        size = len(island)
        if len(counts) != 1 or len(inside) != size * (size - 1) // 2:
            continue
        per_gpu = counts.pop()
        if per_gpu * (size - 1) <= _MAX_LINKS:
            continue
        if switch is not None:
            raise InputFormatError(f"{where}: more than one NVSwitch domain cannot be simulated")
        bus_ids = tuple(f"00000000:{0xE0 + k:02X}:00.0" for k in range(4))
        switch = NvSwitchSpec(per_gpu, bus_ids, tuple(island))
    switched = set(switch.gpus or ()) if switch is not None else set()
    direct = [p for p in pairs if not (p[0] in switched and p[1] in switched)]
    return direct, switch


def _ports(
    n: int, direct: Sequence[tuple[int, int, int]], switch: NvSwitchSpec | None, where: str
) -> list[int]:
    ports = [0] * n
    for a, b, c in direct:
        ports[a] += c
        ports[b] += c
    if switch is not None:
        for i in switch.gpus or ():
            ports[i] += switch.links_per_gpu
    for i, used in enumerate(ports):
        if used > _MAX_LINKS:
            raise InputFormatError(
                f"{where}: GPU{i} would need {used} NVLink ports (at most {_MAX_LINKS})"
            )
    return ports


def _gpu_spec(facts: NodeFacts, i: int, ports: int, bus_id: str, place: _Placement) -> GpuSpec:
    g = facts.gpus[i]
    known = g.name and g.name != "unknown"
    model = GPU_MODELS.get(g.name) if known else None
    if model is None:
        model = replace(
            unknown_model(g.name if known else None),
            memory_mib=g.memory_mib,
            compute_capability=g.compute_capability,
            mig=g.mig_capable,
        )
    if model.nvlinks < ports:
        model = replace(model, nvlinks=ports)
    return GpuSpec(
        index=i,
        model=model,
        bus_id=sysfs_to_nvml_bus_id(bus_id),
        uuid=g.uuid,
        numa_node=g.numa_node,
        cpulist=g.cpu_affinity or None,
        host_bridge=place[0],
        switches=place[1],
        minor_number=g.minor_number,
        fabric_cluster_uuid=g.fabric_cluster_uuid,
        fabric_clique_id=g.fabric_clique_id,
        gpu_numa_id=g.memory_numa_node,
        compute_mode=g.compute_mode or "Default",
    )
