"""A container's NCCL topology file: the part of the node's topology a set of GPUs uses, in
the XML NCCL reads (``NCCL_TOPO_FILE``), as a pure function of the :class:`Topology` and,
where there is one, the node's own NCCL file (:class:`NodeFile`, kept beside the model).

Public API::

    nearest_nics(topology, gpus) -> tuple[Nic, ...]
    nccl_topology_xml(topology, gpus, nics=None, node_file=None) -> str

What the file holds: exactly the given GPUs, their nearest NICs (:func:`nearest_nics`), the
PCIe switches between them, the NVLinks among them, and their CPUs (NUMA nodes). Two ways:

- With the node's NCCL topology file (``node_file``) holding every one of the GPUs by bus
  ID: the file is the matching part of that file (the same elements and attributes, in the
  same order, the GPUs under the switch they share with their NICs whatever their PCI
  domains), less what does not belong to a container: the ``dev`` and ``rank`` of each
  ``<gpu>`` (NCCL numbers the GPUs a container sees from 0 and fills ``dev`` from NVML when
  it is missing; a node-wide ``dev`` would name the wrong GPU) and NVLinks to GPUs the
  container does not hold.
- Otherwise (no node file, or one that does not hold these GPUs) it is built from the
  facts: a ``<cpu numaid>`` per NUMA node (``affinity`` from its cpulist where known);
  PCIe switches grouped from the levels (devices ``PIX`` to each other share a switch,
  ``PXB`` an upper one), named ``ffff:SS:00.0`` because the facts hold no switch bus IDs
  (Azure's files name their virtual switches the same way);
  ``<pci busid class>`` for each GPU and NIC; ``<gpu><nvlink .../></gpu>`` where the GPUs
  have NVLinks among them (through NVSwitches: NCCL's ``fffffff:ffff:ff`` target, class
  ``0x068000``).

Only facts are written. What the topology does not know (link speeds and widths, CPU
vendor and model, PCI vendor and device IDs) is left out, and NCCL fills it from the
container's NVML and sysfs, as it does for every element a file lacks
(``ncclTopoGetXmlFromSys``, ``ncclTopoGetXmlFromCpu``: only missing attributes are filled).

Written so NCCL's reader (``src/graph/xml.cc``) takes it: one tag per line, attributes
after single spaces, values quoted, no prolog, at most 256 elements. When the NVLinks
would take the file past 256 elements, the ``<gpu>`` elements are left out and NCCL
detects the NVLinks through NVML (it does whenever a ``<gpu>`` has no ``<nvlink>``).
"""

from __future__ import annotations

from collections.abc import Sequence

# NCCL spells bus IDs as sysfs does (int64ToBusId: lower case, a 4-digit domain)
from agent.formats import BusIdError
from agent.formats import nvml_to_sysfs_bus_id as nccl_bus_id
from agent.nccl.node_file import NodeFile
from agent.nccl.syntax import HIDDEN_PEER, MAX_NODES, NVSWITCH_CLASS, XmlElement
from agent.records import Nic, PcieLevel
from agent.topology.model import Topology
from agent.unionfind import UnionFind

__all__ = ["nccl_topology_xml", "nearest_nics"]

_SWITCH_LEVELS = (PcieLevel.BOARD, PcieLevel.PIX, PcieLevel.PXB)


def nearest_nics(topology: Topology, gpus: Sequence[int]) -> tuple[Nic, ...]:
    """The NICs nearest to ``gpus`` (indices), in the node's NIC order: for each GPU, those
    on its PCIe switch (the closest level, ``PIX`` before ``PXB``), else on its PCIe root
    complex (``pcie_root``, or ``PHB``), else on its NUMA node; none where none is known."""
    nics: tuple[Nic, ...] = topology.nics
    by_index = {g.index: g for g in topology.gpus}
    chosen: set[int] = set()
    for i in gpus:
        gpu = by_index[i]
        levels = [(k, n.levels[i] if i < len(n.levels) else None) for k, n in enumerate(nics)]
        switch = [lv for _, lv in levels if lv in _SWITCH_LEVELS]
        if switch:
            best = min(switch)
            chosen.update(k for k, lv in levels if lv is not None and lv <= best)
            continue
        root = {k for k, lv in levels if lv == PcieLevel.PHB}
        root |= {k for k, n in enumerate(nics) if gpu.pcie_root is not None and n.pcie_root == gpu.pcie_root}
        if root:
            chosen.update(root)
            continue
        if gpu.numa_node is not None:
            chosen.update(k for k, n in enumerate(nics) if n.numa_node == gpu.numa_node)
    return tuple(n for k, n in enumerate(nics) if k in chosen)


# ----------------------------------------------------------------------------- from a file
def _file_bus_id(text: str) -> str:
    """A bus ID of the node's file as NCCL spells it; text the reader never looked at (under
    an NVSwitch) and that is no bus ID, unchanged."""
    try:
        return nccl_bus_id(text)
    except BusIdError:
        return text


def _prune(element: XmlElement, gpus: set[str], nics: set[str], nets: set[str]) -> XmlElement | None:
    """``element`` with only what leads to the chosen GPUs and NICs (bus IDs and names)."""
    if element.name == "pci":
        bus = _file_bus_id(element.get("busid") or "")
        named = {f"nic-{bus.replace(':', '-')}"} | {n.get("name") or "" for c in element.children for n in c.children}
        if bus in nics or named & nets:  # by bus ID, or by the name the reader gave it
            return element
        if bus in gpus:
            return XmlElement("pci", element.attrs, tuple(_gpu(c, gpus) for c in element.children), element.line)
        cls = element.get("class") or ""
        if cls.startswith(("0x02", "0x03")) or any(c.name in ("gpu", "nic") for c in element.children):
            return None  # a GPU or NIC the container does not get
    if element.name == "nic" and element.children and all(c.name == "net" for c in element.children):
        kept = tuple(c for c in element.children if (c.get("name") or "") in nets)
        return XmlElement("nic", element.attrs, kept, element.line) if kept else None
    children = tuple(c for c in (_prune(c, gpus, nics, nets) for c in element.children) if c is not None)
    if element.name in ("pci", "cpu") and not children:
        return None  # NCCL trims these too
    return XmlElement(element.name, element.attrs, children, element.line)


def _gpu(element: XmlElement, gpus: set[str]) -> XmlElement:
    if element.name != "gpu":
        return element
    attrs = tuple((k, v) for k, v in element.attrs if k not in ("dev", "rank"))
    links = tuple(
        c for c in element.children
        if c.name != "nvlink" or not (c.get("tclass") or "").startswith("0x03")
        or _file_bus_id(c.get("target") or "") in gpus
    )
    return XmlElement("gpu", attrs, links, element.line)


# ----------------------------------------------------------------------------- from facts
def _mask(cpulist: str) -> str | None:
    """A cpulist (``0-3,8``) as NCCL's hex CPU mask (32-bit words, most significant first)."""
    value = 0
    for part in cpulist.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        for cpu in range(int(lo), int(hi or lo) + 1):
            value |= 1 << cpu
    if value == 0:
        return None
    words = max(1, (value.bit_length() + 31) // 32)
    return ",".join(f"{(value >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


class _Builder:
    """The elements of one file built from the facts (module docstring)."""

    def __init__(self, topology: Topology, gpus: Sequence[int], nics: Sequence[Nic]) -> None:
        self.topology = topology
        self.gpus = [g for g in topology.gpus if g.index in set(gpus)]
        self.nics = [n for n in nics if n.pci_bus_id]
        self.switches = 0
        self.with_nvlinks = True

    def level(self, a: int, b: int) -> PcieLevel | None:
        """The level between devices ``a`` and ``b`` (GPUs first, then NICs)."""
        n = len(self.gpus)
        if a >= n and b >= n:
            return None
        if a >= n:
            a, b = b, a
        gpu = self.gpus[a].index
        if b >= n:
            levels = self.nics[b - n].levels
            return levels[gpu] if gpu < len(levels) else None
        return self.topology.link(gpu, self.gpus[b].index).pcie

    def device(self, k: int) -> XmlElement:
        n = len(self.gpus)
        if k >= n:
            nic = self.nics[k - n]
            return XmlElement("pci", (("busid", nccl_bus_id(nic.pci_bus_id or "")), ("class", "0x028000")))
        gpu = self.gpus[k]
        cls = f"0x{gpu.pci_class:06x}" if gpu.pci_class is not None else "0x038000"
        links = self.nvlinks(gpu.index) if self.with_nvlinks else ()
        children = (XmlElement("gpu", (), links),) if links else ()
        return XmlElement("pci", (("busid", nccl_bus_id(gpu.pci_bus_id)), ("class", cls)), children)

    def nvlinks(self, index: int) -> tuple[XmlElement, ...]:
        out: list[XmlElement] = []
        switched = 0
        for other in self.gpus:
            if other.index == index:
                continue
            link = self.topology.link(index, other.index)
            if link.nvlinks and link.nvswitch:
                switched = max(switched, link.nvlinks)
            elif link.nvlinks:
                attrs = (("target", nccl_bus_id(other.pci_bus_id)), ("count", str(link.nvlinks)),
                         ("tclass", f"0x{other.pci_class:06x}" if other.pci_class is not None else "0x038000"))
                out.append(XmlElement("nvlink", attrs))
        if switched:
            attrs = (("target", HIDDEN_PEER), ("count", str(switched)), ("tclass", NVSWITCH_CLASS))
            out.append(XmlElement("nvlink", attrs))
        return tuple(out)

    def switch(self, children: list[XmlElement]) -> XmlElement:
        self.switches += 1
        return XmlElement("pci", (("busid", f"ffff:{self.switches:02x}:00.0"), ("class", "0x060400")), tuple(children))

    def cpu(self, numa: int | None, members: list[int]) -> XmlElement:
        outer, inner = UnionFind(len(self.gpus) + len(self.nics)), UnionFind(len(self.gpus) + len(self.nics))
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                lv = self.level(a, b)
                if lv in _SWITCH_LEVELS:
                    outer.union(a, b)
                if lv in (PcieLevel.BOARD, PcieLevel.PIX):
                    inner.union(a, b)
        children: list[XmlElement] = []
        for root in dict.fromkeys(outer.find(m) for m in members):
            group = [m for m in members if outer.find(m) == root]
            if len(group) == 1:
                children.append(self.device(group[0]))
                continue
            leaves: list[XmlElement] = []
            inner_roots = list(dict.fromkeys(inner.find(m) for m in group))
            for leaf in inner_roots:
                devices = [self.device(m) for m in group if inner.find(m) == leaf]
                # under an upper switch, each group of PIX devices has its own switch
                leaves.extend([self.switch(devices)] if len(inner_roots) > 1 else devices)
            children.append(self.switch(leaves))
        cpulists = self.topology.numa_cpulists
        mask = _mask(cpulists[numa]) if numa is not None and numa in cpulists else None
        attrs = (("numaid", str(numa if numa is not None else -1)),) + ((("affinity", mask),) if mask else ())
        return XmlElement("cpu", attrs, tuple(children))

    def system(self) -> XmlElement:
        devices = [g.numa_node for g in self.gpus] + [n.numa_node for n in self.nics]
        order = list(dict.fromkeys(sorted(devices, key=lambda x: (x is None, x or 0))))
        cpus = [self.cpu(numa, [k for k, d in enumerate(devices) if d == numa]) for numa in order]
        return XmlElement("system", (("version", "1"),), tuple(cpus))


def _count(element: XmlElement) -> int:
    return 1 + sum(_count(c) for c in element.children)


def nccl_topology_xml(
    topology: Topology, gpus: Sequence[int], nics: Sequence[Nic] | None = None, node_file: NodeFile | None = None
) -> str:
    """The NCCL topology file of the GPUs ``gpus`` (indices) of ``topology``: those GPUs, the
    NICs ``nics`` (default: :func:`nearest_nics`), the path between them, their NVLinks and
    CPUs; the matching part of ``node_file`` where it holds those GPUs (module docstring).
    A pure function of its arguments."""
    chosen = nearest_nics(topology, gpus) if nics is None else tuple(nics)
    system = _from_node_file(node_file, topology, gpus, chosen) if node_file is not None else None
    if system is None:
        builder = _Builder(topology, gpus, chosen)
        system = builder.system()
        if _count(system) > MAX_NODES:
            builder.with_nvlinks, builder.switches = False, 0
            system = builder.system()
    return "".join(_lines(system, 0))


def _from_node_file(
    node_file: NodeFile, topology: Topology, gpus: Sequence[int], nics: Sequence[Nic]
) -> XmlElement | None:
    """The part of the node's file for ``gpus`` and ``nics``; None when the file does not
    hold every one of those GPUs (it was not written for these bus IDs), so that a container
    never gets a file without its GPUs (NCCL would place them from the flattened sysfs)."""
    by_index = {g.index: g for g in topology.gpus}
    gpu_ids = {nccl_bus_id(by_index[i].pci_bus_id) for i in gpus}
    if not gpu_ids <= _gpu_bus_ids(node_file.system):
        return None
    nic_ids = {nccl_bus_id(n.pci_bus_id) for n in nics if n.pci_bus_id}
    tree = node_file.system
    return _prune(tree, gpu_ids, nic_ids, {n.name for n in nics}) or XmlElement("system", tree.attrs)


def _gpu_bus_ids(element: XmlElement) -> set[str]:
    """The bus IDs of the GPUs (``<pci class="0x03...">``) in ``element``, NCCL-spelled."""
    out: set[str] = set()
    for child in element.children:
        if child.name == "pci" and (child.get("class") or "").startswith("0x03"):
            out.add(_file_bus_id(child.get("busid") or ""))
        out |= _gpu_bus_ids(child)
    return out


def _lines(element: XmlElement, depth: int) -> list[str]:
    attrs = "".join(f" {k}={_quote(v)}" for k, v in element.attrs)
    pad = "  " * depth
    if not element.children:
        return [f"{pad}<{element.name}{attrs}/>\n"]
    inner = [line for c in element.children for line in _lines(c, depth + 1)]
    return [f"{pad}<{element.name}{attrs}>\n", *inner, f"{pad}</{element.name}>\n"]


def _quote(value: str) -> str:
    """NCCL reads no entities: a value is quoted with the quote it does not hold."""
    return f"'{value}'" if '"' in value else f'"{value}"'
