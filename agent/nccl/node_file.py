"""The node's NCCL topology file (``NCCL_TOPO_FILE``, the format ``NCCL_TOPO_DUMP_FILE``
writes): read into the facts it states, kept beside them as read (:class:`NodeFile`, whose
tree a container's file echoes), and laid over the facts NVML and sysfs read on a node whose
hypervisor hides the real PCIe tree.

Public API::

    read_nccl_topology(path) -> NodeFile
    parse_nccl_topology(text, source) -> NodeFile
    overlay_nccl_topology(node: NodeFacts, file: NodeFile) -> NodeFacts
    class NcclTopologyError(InputFormatError)   # "<file>: line <n>: <reason>"

The text is read by NCCL's own rules (:mod:`agent.nccl.syntax`). What the elements mean
follows NCCL's ``src/graph/topo.cc`` (``ncclTopoAddCpu``, ``ncclTopoAddPci``,
``ncclTopoAddNvLinks``; NVIDIA/nccl 5067397c):

- ``<cpu numaid>``: a NUMA node (``numaid`` is required, as NCCL requires it; -1 is NCCL's
  "unknown"); ``affinity`` (NCCL's hex mask) gives its CPUs.
- ``<pci busid class>``: the class is matched by prefix as NCCL's ``kvDictPciClass`` does:
  ``0x03`` a GPU, ``0x02`` a NIC (``0x0207`` InfiniBand, ``0x0200`` Ethernet), ``0x068000``
  an NVSwitch, anything else (``0x0604`` bridges, ``0x080100``) a PCIe switch; a ``pci``
  holding a ``<nic>`` is a NIC whatever its class (NCCL: ``type = NIC``). A switch holding
  nothing we read is dropped (NCCL trims it). Devices under one switch may sit in different
  PCI domains (Azure's virtual switches: ``0003:00:00.0`` and ``0103:00:00.0``): the file's
  bus IDs are kept as they are.
- ``<nic><net name>``: a NIC; directly under ``<cpu>`` it has no bus ID and sits on that
  NUMA node (NCCL attaches it to the CPU).
- ``<gpu sm>`` gives the compute capability; ``<nvlink target count tclass>`` an NVLink:
  to a GPU (``tclass`` 0x03...) of the file, or through NVSwitches (``0x068000``, or NCCL's
  ``fffffff:ffff:ff`` for a switch a VM cannot see): GPUs both on NVSwitches are linked by
  the smaller count. NVLinks to CPUs (``0x068001``) and to the GPU itself are not pairs.

Facts, as :class:`NodeFacts` with ``source="nccl-topology:<file>"``: GPUs in PCI bus ID
order (NVML's order), with synthetic UUIDs and ``name="unknown"`` (a file names neither);
their NUMA node and CPUs; NICs named by their first ``<net name>``, else by their bus ID
(``nic-0101-00-00.0``: a NIC's real name, ``mlx5_0``, is not in such a file; on a node
:func:`overlay_nccl_topology` takes it from sysfs),
with a PCIe level to every GPU; one link per GPU pair. PCIe levels: under the same switch
``PIX``; sharing an upper switch ``PXB``; only the same ``<cpu>`` ``NODE`` (a file cannot
say whether two devices share a host bridge, ``PHB``, so the weaker level is stated);
different ``<cpu>`` elements ``SYS``. What the file lacks (link speeds NCCL fills itself,
GPU memory, NVLinks it leaves to NVML) stays unknown; notes say what was inferred.

Size: one reader of the file's meaning (devices, levels, NVLinks) plus the overlay that
matches a file to NVML's GPUs by bus ID; they share the device walk and its error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agent.formats import (
    BusIdError,
    format_cpulist,
    nvml_to_sysfs_bus_id,
    parse_bus_id,
    sysfs_to_nvml_bus_id,
)
from agent.nccl.syntax import (
    CPU_CLASS,
    HIDDEN_PEER,
    NVSWITCH_CLASS,
    NcclTopologyError,
    XmlElement,
    c_int,
    parse_nccl_xml,
)
from agent.records import Gpu, Link, Nic, NodeFacts, PcieLevel, synthetic_gpu_uuid

__all__ = [
    "NcclTopologyError",
    "NodeFile",
    "overlay_nccl_topology",
    "parse_nccl_topology",
    "read_nccl_topology",
]


@dataclass(frozen=True)
class NodeFile:
    """The node's NCCL topology file as read: where it came from, its ``<system>`` element
    (what a container's file echoes) and the facts it states."""

    source: str
    system: XmlElement
    facts: NodeFacts


@dataclass
class _Device:
    kind: str  # "gpu" | "nic"
    bus_id: str | None  # sysfs spelling, lower case (NCCL's)
    cpu: int  # index of its <cpu> element
    numa: int | None
    switches: tuple[str, ...]  # bus IDs of the switches above it, outermost first
    element: XmlElement | None
    names: tuple[str, ...] = ()


class _Walk:
    """The devices of one ``<system>`` element, in file order."""

    def __init__(self, system: XmlElement, source: str) -> None:
        self.source = source
        self.devices: list[_Device] = []
        self.cpulists: dict[int, str] = {}
        self.seen: dict[str, int] = {}
        for ci, cpu in enumerate(c for c in system.children if c.name == "cpu"):
            numa = self._numa(cpu)
            for child in cpu.children:
                if child.name == "pci":
                    self._pci(child, ci, numa, ())
                else:  # <nic> on the CPU: one NIC per named <net>
                    for net in child.children:
                        self.devices.append(
                            _Device("nic", None, ci, numa, (), None, (net.get("name") or f"net{len(self.devices)}",))
                        )

    def fail(self, reason: str, element: XmlElement) -> NcclTopologyError:
        return NcclTopologyError(reason, source=self.source, line=element.line)

    def _numa(self, cpu: XmlElement) -> int | None:
        numa = c_int(cpu.get("numaid"))
        if numa is None:
            raise self.fail('<cpu> needs numaid="<NUMA node>" (NCCL requires it; -1 if unknown)', cpu)
        affinity = cpu.get("affinity")
        if numa >= 0 and affinity:
            cpus = _mask_cpus(affinity)
            if cpus is None:
                raise self.fail(f"<cpu affinity={affinity!r}>: expected NCCL's hex CPU mask, e.g. 00ff,ffffffff", cpu)
            self.cpulists[numa] = format_cpulist(cpus)
        return numa if numa >= 0 else None

    def _bus_id(self, pci: XmlElement) -> str:
        raw = pci.get("busid")
        if raw is None:
            raise self.fail('<pci> needs busid="DDDD:BB:DD.F"', pci)
        try:
            bus_id = nvml_to_sysfs_bus_id(raw)
        except BusIdError:
            raise self.fail(f"<pci busid={raw!r}>: expected a PCI bus ID, e.g. 0000:3b:00.0", pci) from None
        if bus_id in self.seen:
            raise self.fail(f"bus ID {bus_id} appears twice (first on line {self.seen[bus_id]})", pci)
        self.seen[bus_id] = pci.line
        return bus_id

    def _pci(self, pci: XmlElement, cpu: int, numa: int | None, path: tuple[str, ...]) -> None:
        bus_id = self._bus_id(pci)
        cls = pci.get("class")
        if cls is None:
            raise self.fail(f'<pci busid="{bus_id}"> needs class="0x......" (what the device is)', pci)
        nic = next((c for c in pci.children if c.name == "nic"), None)
        if nic is not None or cls.startswith("0x02"):
            names = tuple(n.get("name") or "" for n in (nic.children if nic else ()))
            self.devices.append(_Device("nic", bus_id, cpu, numa, path, pci, tuple(n for n in names if n)))
        elif cls.startswith("0x03"):
            self.devices.append(_Device("gpu", bus_id, cpu, numa, path, pci))
        elif not cls.startswith(NVSWITCH_CLASS) and not cls.startswith(CPU_CLASS):
            for child in pci.children:
                if child.name == "pci":
                    self._pci(child, cpu, numa, (*path, bus_id))


def _mask_cpus(mask: str) -> list[int] | None:
    """NCCL's cpumask (``ncclStrToCpuset``: comma-separated 32-bit hex words, most
    significant first) as CPU numbers."""
    try:
        value = int(mask.replace(",", ""), 16)
    except ValueError:
        return None
    return [i for i in range(value.bit_length()) if value >> i & 1]


def level(a: _Device, b: _Device) -> PcieLevel:
    """The PCIe level of two devices as the file places them (module docstring)."""
    if a.cpu != b.cpu:
        return PcieLevel.SYS
    common = 0
    for x, y in zip(a.switches, b.switches):
        if x != y:
            break
        common += 1
    if common == 0:
        return PcieLevel.NODE
    return PcieLevel.PIX if a.switches == b.switches else PcieLevel.PXB


def _nvlinks(walk: _Walk, gpus: list[_Device]) -> tuple[dict[tuple[int, int], int], set[tuple[int, int]], list[str]]:
    """NVLink counts per GPU pair (index order), the pairs linked through NVSwitches, notes."""
    index = {g.bus_id: i for i, g in enumerate(gpus)}
    direct: dict[tuple[int, int], int] = {}
    switched: dict[int, int] = {}
    notes: list[str] = []
    for i, g in enumerate(gpus):
        assert g.element is not None
        for gpu in (c for c in g.element.children if c.name == "gpu"):
            for link in (c for c in gpu.children if c.name == "nvlink"):
                count = c_int(link.get("count"))
                if count is None or count < 0:
                    raise walk.fail('<nvlink> needs count="<links>"', link)
                target, tclass = link.get("target") or "", link.get("tclass") or ""
                if tclass.startswith(NVSWITCH_CLASS) or target == HIDDEN_PEER:
                    switched[i] = max(switched.get(i, 0), count)
                    continue
                if not tclass.startswith("0x03"):
                    continue  # to a CPU (0x068001) or unknown: not a GPU pair
                try:
                    j = index.get(nvml_to_sysfs_bus_id(target))
                except BusIdError:
                    raise walk.fail(f"<nvlink target={target!r}>: expected a PCI bus ID", link) from None
                if j is None or j == i:
                    notes.append(f"NVLink of GPU {g.bus_id} to {target} (line {link.line}) names no other GPU"
                                 " of the file: not a pair")
                    continue
                key = (min(i, j), max(i, j))
                direct[key] = max(direct.get(key, 0), count)
    pairs = set()
    for i in switched:
        for j in switched:
            if i < j:
                direct[(i, j)] = direct.get((i, j), 0) + min(switched[i], switched[j])
                pairs.add((i, j))
    return direct, pairs, notes


def _compute_capability(gpu: _Device) -> tuple[int, int] | None:
    assert gpu.element is not None
    for sub in gpu.element.children:
        sm = c_int(sub.get("sm")) if sub.name == "gpu" else None
        if sm is not None and sm > 0:
            return sm // 10, sm % 10
    return None


def facts_from_tree(system: XmlElement, source: str, ignored: Sequence[tuple[str, int]] = ()) -> NodeFacts:
    """The :class:`NodeFacts` a parsed ``<system>`` element states (module docstring)."""
    walk = _Walk(system, source)
    gpus = sorted((d for d in walk.devices if d.kind == "gpu"), key=lambda d: parse_bus_id(d.bus_id or ""))
    nics = [d for d in walk.devices if d.kind == "nic"]
    name = os.path.splitext(os.path.basename(source))[0] or "nccl-topology"
    records = tuple(
        Gpu(
            index=i,
            uuid=synthetic_gpu_uuid(name, i),
            name="unknown",
            pci_bus_id=sysfs_to_nvml_bus_id(g.bus_id or ""),
            pci_class=_class_int(g.element),
            numa_node=g.numa,
            cpu_affinity=walk.cpulists.get(g.numa) if g.numa is not None else None,
            compute_capability=_compute_capability(g),
        )
        for i, g in enumerate(gpus)
    )
    nvlinks, switched, notes = _nvlinks(walk, gpus)
    links = tuple(
        Link(a, b, nvlinks.get((a, b), 0), level(gpus[a], gpus[b]), (a, b) in switched)
        for a in range(len(gpus))
        for b in range(a + 1, len(gpus))
    )
    nic_records = tuple(
        Nic(
            name=n.names[0] if n.names else _nic_name(n.bus_id, k),
            pci_bus_id=n.bus_id,
            numa_node=n.numa,
            levels=tuple(level(n, g) for g in gpus),
        )
        for k, n in enumerate(nics)
    )
    notes = [
        f"read from an NCCL topology file: GPU UUIDs are synthetic ({synthetic_gpu_uuid(name, 0)} "
        "for the first GPU), names and memory unknown; devices under one <cpu> without a shared "
        "PCIe switch are NODE (a file does not say whether they share a host bridge)",
        *notes,
        *(f"<{tag}> on line {line} ignored, as NCCL ignores it" for tag, line in ignored),
    ]
    if not any(k.nvlinks for k in links):
        notes.append("the file states no NVLinks (NCCL then detects them through NVML)")
    return NodeFacts(
        gpus=records,
        links=links,
        nics=nic_records,
        numa_cpulists=walk.cpulists,
        source=f"nccl-topology:{source}",
        notes=tuple(notes),
    )


def _nic_name(bus_id: str | None, k: int) -> str:
    """The name of a NIC the file names no ``<net>`` of: ``nic-0101-00-00.0`` from its bus
    ID (a device name holds no ':'), ``nic<k>`` without one."""
    return f"nic-{bus_id.replace(':', '-')}" if bus_id else f"nic{k}"


def _class_int(element: XmlElement | None) -> int | None:
    value = c_int(element.get("class")) if element is not None else None
    return value if value is not None and value >= 0 else None


def parse_nccl_topology(text: str, source: str = "<text>") -> NodeFile:
    """An NCCL topology file's text, read; :class:`NcclTopologyError` naming the file and
    the line for anything NCCL would refuse or that states no topology."""
    system, ignored = parse_nccl_xml(text, source)
    return NodeFile(source, system, facts_from_tree(system, source, ignored))


def read_nccl_topology(path: str | os.PathLike[str]) -> NodeFile:
    """Read the NCCL topology file ``path``; see :func:`parse_nccl_topology`."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise NcclTopologyError(f"cannot read the file: {exc.strerror or exc}", source=source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NcclTopologyError("not UTF-8 text", source=source, line=raw[: exc.start].count(b"\n") + 1) from None
    return parse_nccl_topology(text, source)


def overlay_nccl_topology(node: NodeFacts, nccl: NodeFile) -> NodeFacts:
    """``node`` (what NVML and sysfs read) with the placement ``file`` states: NUMA nodes,
    PCIe levels and NICs from the file, everything else (UUIDs, names, NVLinks NVML sees)
    from the node. GPUs are matched by PCI bus ID; NcclTopologyError naming the bus IDs
    when the file's GPUs are not the node's. NICs are matched by bus ID to the ones sysfs
    names; a NIC only the file knows keeps the file's name."""
    file, where = nccl.facts, nccl.source
    mine = {nvml_to_sysfs_bus_id(g.pci_bus_id): g for g in node.gpus if g.pci_bus_id}
    theirs = {nvml_to_sysfs_bus_id(g.pci_bus_id): g for g in file.gpus}
    if set(mine) != set(theirs) or len(mine) != len(node.gpus):
        missing = sorted(set(mine) - set(theirs)) or ["none"]
        extra = sorted(set(theirs) - set(mine)) or ["none"]
        raise NcclTopologyError(
            f"its GPUs are not this node's: NVML's GPUs missing from the file: {', '.join(missing)}; "
            f"the file's GPUs NVML does not see: {', '.join(extra)}",
            source=where,
        )
    to_file = {g.index: theirs[bus].index for bus, g in mine.items()}
    gpus = tuple(
        replace(g, numa_node=f.numa_node if f.numa_node is not None else g.numa_node,
                cpu_affinity=f.cpu_affinity or g.cpu_affinity,
                pci_class=g.pci_class if g.pci_class is not None else f.pci_class)
        for g in node.gpus
        for f in (file.gpus[to_file[g.index]],)
    )
    file_links = {(k.a, k.b): k for k in file.links}
    links = []
    for k in node.links:
        a, b = sorted((to_file[k.a], to_file[k.b]))
        theirs_link = file_links.get((a, b))
        links.append(replace(k, pcie=theirs_link.pcie if theirs_link and theirs_link.pcie is not None else k.pcie))
    sysfs_names = {nvml_to_sysfs_bus_id(n.pci_bus_id): n for n in node.nics if n.pci_bus_id}
    nics = tuple(
        replace(
            n,
            name=sysfs_names[n.pci_bus_id].name if n.pci_bus_id in sysfs_names else n.name,
            levels=tuple(n.levels[to_file[g.index]] for g in node.gpus),
        )
        for n in file.nics
    )
    return replace(
        node,
        gpus=gpus,
        links=tuple(links),
        nics=nics,
        numa_cpulists={**node.numa_cpulists, **file.numa_cpulists},
        notes=(*node.notes, f"PCIe placement, NUMA nodes and NICs from the NCCL topology file {where}"),
    )
