"""Reads the facts NVML does not give us from sysfs, and writes realistic fake sysfs trees.

The reader takes a root path (``"/sys"`` on a node, a temp dir or ``tests/fixtures/sysfs``
in tests), as ``prometheus_client``'s ``ProcessCollector`` takes ``proc=``. It never raises
on a missing or unreadable file: a missing fact is ``None`` (or an empty collection).

Kernel layout the reader relies on (and the writer produces):

- ``bus/pci/devices/<bdf>`` is a relative symlink to the device's real directory, e.g.
  ``../../../devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0``:
  host bridge, root port, then one (upstream port, downstream port) pair per PCIe switch,
  then the device. The real path is the device's place in the PCIe tree.
- ``<device>/numa_node`` holds ``0\\n`` or ``-1\\n`` (firmware gave no proximity);
  ``<device>/local_cpulist`` holds e.g. ``0-19,40-59\\n``.
- ``devices/system/node/node<N>/cpulist`` and ``.../distance`` (``10 21\\n``).
- ``class/infiniband/<name>`` links to ``<device>/infiniband/<name>``, whose ``device``
  links back to the PCI device directory.
- ``class/dmi/id/product_name`` (``DGX H100\\n``).

Bus ids come in two spellings: NVML's ``00000000:3B:00.0`` (8-digit domain, upper case) and
sysfs's ``0000:3b:00.0`` (4-digit domain, lower case). Every reader method accepts both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.formats import (
    BusIdError,
    format_cpulist,
    nvml_to_sysfs_bus_id,
    parse_cpulist,
    sysfs_to_nvml_bus_id,
)
from agent.formats import parse_bus_id as _parse_bus_id
from agent.formats import sysfs_spelling as _sysfs_spelling
from agent.records import PcieLevel

__all__ = [
    "BusIdError",
    "NumaNode",
    "PciDeviceSpec",
    "RdmaNic",
    "SysfsReader",
    "SysfsTreeSpec",
    "format_cpulist",
    "nvml_to_sysfs_bus_id",
    "parse_cpulist",
    "sysfs_to_nvml_bus_id",
    "write_tree",
]


# PCI bus ids and cpulists live in agent.formats (one definition each)
#: a host bridge directory under devices/: "pci0000:17"
_HOST_BRIDGE_RE = re.compile(r"^pci(?P<domain>[0-9a-f]{4,8}):(?P<bus>[0-9a-f]{2})$")


def _try_sysfs_bus_id(bus_id: str) -> str | None:
    try:
        return nvml_to_sysfs_bus_id(bus_id)
    except BusIdError:
        return None


def _format_cpumask(cpus: Iterable[int]) -> str:
    """The kernel's ``cpumap``/``local_cpus`` spelling: comma-separated 32-bit hex words,
    most significant first (``"00000000,0000ffff"``)."""
    mask = 0
    top = 0
    for c in cpus:
        mask |= 1 << c
        top = max(top, c)
    words = max(1, top // 32 + 1)
    return ",".join(f"{(mask >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


# --------------------------------------------------------------------------- reader
@dataclass(frozen=True)
class NumaNode:
    """A NUMA node: its CPUs (a cpulist, ``""`` for a memory-only node) and its row of the
    SLIT distance matrix (``()`` if unknown)."""

    id: int
    cpulist: str
    distances: tuple[int, ...]


@dataclass(frozen=True)
class RdmaNic:
    """An RDMA device under ``class/infiniband``. ``pci_bus_id`` is in sysfs spelling, None
    for a software device (rxe, siw) without a PCI parent."""

    name: str
    pci_bus_id: str | None
    numa_node: int | None


class SysfsReader:
    """Reads PCI, NUMA, RDMA and DMI facts under ``root``. No method raises on a missing or
    unreadable file: missing facts are ``None`` / empty. Bus ids may be given in either
    spelling; a malformed bus id is treated as a missing device."""

    def __init__(self, root: str = "/sys") -> None:
        self.root = root

    # ------------------------------------------------------------------ helpers
    def _read(self, *parts: str) -> str | None:
        try:
            with open(os.path.join(self.root, *parts), encoding="utf-8", errors="replace") as f:
                return f.read()
        except (OSError, ValueError):
            return None

    def _pci_dir(self, bus_id: str) -> str | None:
        bdf = _try_sysfs_bus_id(bus_id)
        if bdf is None:
            return None
        return os.path.join(self.root, "bus", "pci", "devices", bdf)

    def _pci_path(self, bus_id: str) -> tuple[str, ...] | None:
        """The device's place in the PCIe tree: the components of its real path from the
        host bridge down, ``("pci0000:17", "0000:17:01.0", ..., "0000:1a:00.0")``; None if
        the link is missing or does not land under ``devices/`` below a host bridge.

        Host bridges need not sit at the top of ``devices/``: Hyper-V guests have them under
        ``LNXSYSTM:00/.../VMBUS:00/<guid>/``, some arm64 servers under ``platform/<name>/``.
        """
        d = self._pci_dir(bus_id)
        if d is None or not os.path.isdir(d):
            return None
        try:
            real = os.path.realpath(d)
            devices = os.path.realpath(os.path.join(self.root, "devices"))
            rel = os.path.relpath(real, devices)
        except (OSError, ValueError):
            return None
        parts = rel.split(os.sep)
        if parts[0] == "..":
            return None
        for i, part in enumerate(parts):
            if _HOST_BRIDGE_RE.match(part):
                # the prefix above the host bridge keeps bridges of different VMBus
                # channels (same "pci" name in different domains) apart
                return ("/".join(parts[: i + 1]), *parts[i + 1 :])
        return None

    def pcie_root(self, bus_id: str) -> str | None:
        """The host bridge (root complex) the device hangs from, as Kubernetes names it for
        ``resource.kubernetes.io/pcieRoot``: ``"pci0000:17"``; None if unknown."""
        path = self._pci_path(bus_id)
        return path[0].rsplit("/", 1)[-1] if path else None

    @staticmethod
    def _parse_int(text: str | None) -> int | None:
        if text is None:
            return None
        try:
            return int(text.strip())
        except ValueError:
            return None

    # ------------------------------------------------------------------ PCI
    def pci_numa_node(self, bus_id: str) -> int | None:
        """The device's NUMA node; None when the file says -1 (no proximity info) or is
        missing."""
        d = self._pci_dir(bus_id)
        if d is None:
            return None
        node = self._parse_int(self._read(d, "numa_node"))
        return node if node is not None and node >= 0 else None

    def pci_local_cpulist(self, bus_id: str) -> str | None:
        """The device's ``local_cpulist`` without the newline; None if missing or empty."""
        d = self._pci_dir(bus_id)
        if d is None:
            return None
        text = self._read(d, "local_cpulist")
        return (text.strip() or None) if text is not None else None

    def pci_class(self, bus_id: str) -> int | None:
        """The device's PCI class code (``class``: ``0x030200`` a 3D controller, ``0x030000``
        a VGA controller); None if missing or unreadable."""
        d = self._pci_dir(bus_id)
        text = self._read(d, "class") if d is not None else None
        try:
            return int(text.strip(), 16) if text is not None else None
        except ValueError:
            return None

    def pcie_level(self, bus_id_a: str, bus_id_b: str) -> PcieLevel | None:
        """How devices ``a`` and ``b`` are connected, from their real paths in the PCIe tree.

        Under one host bridge the deepest common ancestor decides: the host bridge itself
        -> PHB; a root port (functions of one device) -> PIX; inside switches -> PIX when the
        path between them crosses one switch, PXB when it crosses several. Switches are
        counted as (upstream, downstream) port pairs below the root port. Under different
        host bridges: NODE when both devices report the same NUMA node, SYS when they
        report different ones; when either reports none (-1), NODE if the machine has at
        most one NUMA node, else None. None also when either device is unknown, when they
        are the same device, or when one is a bridge above the other.
        """
        pa, pb = self._pci_path(bus_id_a), self._pci_path(bus_id_b)
        if pa is None or pb is None or pa == pb:
            return None
        common = 0
        for x, y in zip(pa, pb):
            if x != y:
                break
            common += 1
        if common == 0:
            return self._cross_host_bridge_level(bus_id_a, bus_id_b)
        if common == len(pa) or common == len(pb):
            return None  # one is an ancestor (a bridge) of the other
        ancestor = common - 1  # index of the deepest common component
        if ancestor == 0:
            return PcieLevel.PHB
        if ancestor == 1:
            return PcieLevel.PIX

        def switch_of(index: int) -> int:
            # components 2,3 are switch 0's (upstream, downstream) ports, 4,5 switch 1's ...
            return (index - 2) // 2

        first = switch_of(ancestor)
        crossed_a = switch_of(len(pa) - 2) - first + 1  # len-1 is the device itself
        crossed_b = switch_of(len(pb) - 2) - first + 1
        crossed = crossed_a + crossed_b - 1  # the ancestor's switch is on both sides
        return PcieLevel.PIX if crossed <= 1 else PcieLevel.PXB

    def _cross_host_bridge_level(self, bus_id_a: str, bus_id_b: str) -> PcieLevel | None:
        na, nb = self.pci_numa_node(bus_id_a), self.pci_numa_node(bus_id_b)
        if na is not None and nb is not None:
            return PcieLevel.NODE if na == nb else PcieLevel.SYS
        # A machine with one NUMA node (or a kernel without NUMA) has no SMP link to cross.
        return PcieLevel.NODE if len(self.numa_nodes()) <= 1 else None

    # ------------------------------------------------------------------ NUMA
    def numa_nodes(self) -> dict[int, NumaNode]:
        """Every ``devices/system/node/node<N>``, by id. A missing ``cpulist`` reads as
        ``""``, a missing or garbled ``distance`` as ``()``. Empty if there is no node dir."""
        base = os.path.join(self.root, "devices", "system", "node")
        try:
            names = os.listdir(base)
        except OSError:
            return {}
        nodes: dict[int, NumaNode] = {}
        for name in names:
            m = re.fullmatch(r"node(\d+)", name)
            if m is None:
                continue
            node_id = int(m[1])
            cpulist = (self._read(base, name, "cpulist") or "").strip()
            try:
                distances = tuple(
                    int(x) for x in (self._read(base, name, "distance") or "").split()
                )
            except ValueError:
                distances = ()
            nodes[node_id] = NumaNode(node_id, cpulist, distances)
        return dict(sorted(nodes.items()))

    # ------------------------------------------------------------------ RDMA
    def rdma_nics(self) -> list[RdmaNic]:
        """Every entry of ``class/infiniband``, sorted by name, with its PCI device (from the
        ``device`` link) and that device's NUMA node."""
        base = os.path.join(self.root, "class", "infiniband")
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        nics: list[RdmaNic] = []
        for name in names:
            bdf: str | None = None
            link = os.path.join(base, name, "device")
            if os.path.isdir(link):
                bdf = _try_sysfs_bus_id(os.path.basename(os.path.realpath(link)))
            nics.append(RdmaNic(name, bdf, self.pci_numa_node(bdf) if bdf else None))
        return nics

    # ------------------------------------------------------------------ DMI
    def product_name(self) -> str | None:
        """``class/dmi/id/product_name`` without the newline; None if missing or empty."""
        text = self._read("class", "dmi", "id", "product_name")
        return (text.strip() or None) if text is not None else None


# --------------------------------------------------------------------------- writer
@dataclass(frozen=True)
class PciDeviceSpec:
    """One endpoint device of a fake tree.

    ``host_bridge`` is the ``pciDDDD:BB`` directory it hangs from (its domain must match
    the bus id's). ``switches`` names the PCIe switches between the root port and the
    device, outermost first; ``()`` puts the device directly on a root port of its own, or
    directly on the host bridge (no root port, as in VMs) when its bus is the host
    bridge's root bus. Devices on one bus are functions of one device and share their port.
    A switch name must always have the same parent (host bridge and outer switches).
    ``rdma_name`` makes it an RDMA NIC listed under ``class/infiniband``; otherwise it is
    written as an NVIDIA GPU.
    """

    bus_id: str
    numa_node: int | None = None
    local_cpulist: str | None = None
    host_bridge: str = "pci0000:00"
    switches: tuple[str, ...] = ()
    rdma_name: str | None = None


@dataclass(frozen=True)
class SysfsTreeSpec:
    """A whole fake tree: DMI product name, NUMA nodes ``id -> (cpulist, distances)`` and
    PCI endpoint devices."""

    product_name: str | None = None
    numa_nodes: Mapping[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    devices: Sequence[PciDeviceSpec] = field(default_factory=list)


# decorative identity of the fake devices (vendor, device, class)
_ROOT_PORT_ID = ("0x8086", "0x352a", "0x060400")  # Intel Sapphire Rapids root port
_SWITCH_UP_ID = ("0x1000", "0xc030", "0x060400")  # Broadcom PEX890xx upstream port
_SWITCH_DOWN_ID = ("0x1000", "0xc030", "0x060400")  # and its downstream ports
_GPU_ID = ("0x10de", "0x2330", "0x030200")  # NVIDIA H100 SXM5, 3D controller
_NIC_ID = ("0x15b3", "0x1021", "0x020700")  # Mellanox ConnectX-7, InfiniBand controller


class _Node:
    """A directory of the fake PCIe tree being laid out."""

    def __init__(self, name: str, ident: tuple[str, str, str] | None) -> None:
        self.name = name  # "pci0000:17" or a sysfs bdf
        self.ident = ident  # None for the host bridge
        self.children: dict[object, _Node] = {}
        self.secondary_bus: int | None = None
        self.spec: PciDeviceSpec | None = None


def write_tree(root: str, spec: SysfsTreeSpec) -> None:
    """Write a fake sysfs tree for ``spec`` under ``root`` (created if needed; files and
    links already there are replaced), with the kernel's file names, contents and relative
    symlinks, so that :class:`SysfsReader` reads back what the spec says.

    Bridges (root ports, switch upstream/downstream ports) get bus numbers not used by any
    device of the spec. Raises ``ValueError`` for a spec no PCIe tree can have (duplicate
    bus ids or RDMA names, a switch with two parents, functions of one device placed
    apart, a bus id outside its host bridge's domain, no bus numbers left, a malformed bus
    id or cpulist) before writing anything.
    """
    host_bridges = _layout(spec.devices)
    for cpulist, _ in spec.numa_nodes.values():
        parse_cpulist(cpulist)
    for dev in spec.devices:
        parse_cpulist(dev.local_cpulist or "")
    os.makedirs(root, exist_ok=True)
    _write_dmi(root, spec.product_name)
    _write_numa(root, spec.numa_nodes)
    _write_pci(root, host_bridges)


def _write_file(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _symlink(target: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)


def _write_dmi(root: str, product_name: str | None) -> None:
    if product_name is None:
        return
    _write_file(
        os.path.join(root, "devices", "virtual", "dmi", "id", "product_name"), product_name + "\n"
    )
    _symlink("../../devices/virtual/dmi/id", os.path.join(root, "class", "dmi", "id"))


def _write_numa(root: str, numa_nodes: Mapping[int, tuple[str, tuple[int, ...]]]) -> None:
    if not numa_nodes:
        return
    base = os.path.join(root, "devices", "system", "node")
    for node_id, (cpulist, distances) in numa_nodes.items():
        cpus = parse_cpulist(cpulist)
        d = os.path.join(base, f"node{node_id}")
        _write_file(os.path.join(d, "cpulist"), format_cpulist(cpus) + "\n")
        _write_file(os.path.join(d, "cpumap"), _format_cpumask(cpus) + "\n")
        _write_file(os.path.join(d, "distance"), " ".join(str(x) for x in distances) + "\n")
    ids = format_cpulist(numa_nodes)
    for name in ("online", "possible", "has_memory"):
        _write_file(os.path.join(base, name), ids + "\n")
    with_cpus = [n for n, (cpulist, _) in numa_nodes.items() if parse_cpulist(cpulist)]
    _write_file(os.path.join(base, "has_cpu"), format_cpulist(with_cpus) + "\n")


def _layout(devices: Sequence[PciDeviceSpec]) -> dict[str, _Node]:
    """The PCIe tree for ``devices``: host bridge name -> its node."""
    parsed: list[tuple[PciDeviceSpec, tuple[int, int, int, int], int, int]] = []
    seen_bdf: set[str] = set()
    seen_rdma: set[str] = set()
    used_buses: dict[int, set[int]] = {}  # domain -> buses taken by devices / root buses
    used_bdfs: set[str] = set()
    for dev in devices:
        addr = _parse_bus_id(dev.bus_id)
        bdf = _sysfs_spelling(*addr)
        if bdf in seen_bdf:
            raise ValueError(f"bus id {bdf} given twice")
        seen_bdf.add(bdf)
        if dev.rdma_name is not None:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", dev.rdma_name) or dev.rdma_name in seen_rdma:
                raise ValueError(f"RDMA name {dev.rdma_name!r} is invalid or given twice")
            seen_rdma.add(dev.rdma_name)
        m = _HOST_BRIDGE_RE.match(dev.host_bridge)
        if m is None:
            raise ValueError(f"host bridge {dev.host_bridge!r} is not like 'pci0000:17'")
        hb_domain, hb_bus = int(m["domain"], 16), int(m["bus"], 16)
        if hb_domain != addr[0]:
            raise ValueError(f"{bdf} is not in the domain of host bridge {dev.host_bridge}")
        if len(set(dev.switches)) != len(dev.switches):
            raise ValueError(f"{bdf}: a switch appears twice in {dev.switches}")
        used_buses.setdefault(addr[0], set()).update({addr[1], hb_bus})
        used_bdfs.add(bdf)
        parsed.append((dev, addr, hb_domain, hb_bus))

    def fresh_bus(domain: int, root_bus: int) -> int:
        """The first bus number above the host bridge's root bus that nothing uses (as the
        kernel numbers buses upward from the root bus), wrapping around if need be."""
        for bus in [*range(root_bus + 1, 0x100), *range(1, root_bus)]:
            if bus not in used_buses[domain]:
                used_buses[domain].add(bus)
                return bus
        raise ValueError(f"no PCI bus numbers left in domain {domain:04x}")

    def fresh_port(domain: int, bus: int, first_slot: int, ident: tuple[str, str, str]) -> _Node:
        """A bridge on ``bus`` at the next free device number."""
        for slot in range(first_slot, 0x20):
            bdf = _sysfs_spelling(domain, bus, slot, 0)
            if bdf not in used_bdfs:
                used_bdfs.add(bdf)
                return _Node(bdf, ident)
        raise ValueError(f"no free device numbers on bus {domain:04x}:{bus:02x}")

    def switch_below(port: _Node, domain: int, root_bus: int) -> _Node:
        """The upstream port of the switch hanging from ``port`` (made on first use)."""
        if ("up",) not in port.children:
            port.secondary_bus = fresh_bus(domain, root_bus)
            up = _Node(_sysfs_spelling(domain, port.secondary_bus, 0, 0), _SWITCH_UP_ID)
            used_bdfs.add(up.name)
            up.secondary_bus = fresh_bus(domain, root_bus)
            port.children[("up",)] = up
        return port.children[("up",)]

    host_bridges: dict[str, _Node] = {}
    switch_parent: dict[str, tuple[str, tuple[str, ...]]] = {}
    bus_position: dict[tuple[int, int], tuple[str, tuple[str, ...]]] = {}
    for dev, addr, domain, hb_bus in parsed:
        hb = host_bridges.setdefault(dev.host_bridge, _Node(dev.host_bridge, None))
        hb.secondary_bus = hb_bus
        position = (dev.host_bridge, dev.switches)
        if bus_position.setdefault((addr[0], addr[1]), position) != position:
            raise ValueError(
                f"{_sysfs_spelling(*addr)} shares bus {addr[1]:02x} with a device placed"
                " elsewhere: devices on one bus must share host bridge and switches"
            )
        for k, sw in enumerate(dev.switches):
            parent = (dev.host_bridge, dev.switches[:k])
            if switch_parent.setdefault(sw, parent) != parent:
                raise ValueError(f"switch {sw!r} has two parents: {switch_parent[sw]} and {parent}")
        # keys of a port's child: the next switch, or the bus of the device(s) behind it
        chain: list[object] = [("sw", sw) for sw in dev.switches] + [("bus", addr[1])]
        if not dev.switches and addr[1] == hb_bus:
            node = hb  # directly on the host bridge's root bus, as in VMs
        else:
            if chain[0] not in hb.children:
                hb.children[chain[0]] = fresh_port(domain, hb_bus, 1, _ROOT_PORT_ID)
            node = hb.children[chain[0]]  # the root port
            for child_key in chain[1:]:
                up = switch_below(node, domain, hb_bus)
                assert up.secondary_bus is not None
                if child_key not in up.children:
                    up.children[child_key] = fresh_port(
                        domain, up.secondary_bus, 0, _SWITCH_DOWN_ID
                    )
                node = up.children[child_key]  # a downstream port
            node.secondary_bus = addr[1]
        leaf = _Node(_sysfs_spelling(*addr), _NIC_ID if dev.rdma_name else _GPU_ID)
        leaf.spec = dev
        node.children[("dev", addr)] = leaf
    return host_bridges


def _write_pci(root: str, host_bridges: Mapping[str, _Node]) -> None:
    devices_dir = os.path.join(root, "devices")
    bus_dir = os.path.join(root, "bus", "pci", "devices")

    def subtree_max_bus(node: _Node) -> int:
        below = [subtree_max_bus(c) for c in node.children.values()]
        return max([node.secondary_bus or 0, *below])

    def walk(node: _Node, rel: str, numa: int) -> None:
        path = os.path.join(devices_dir, rel)
        os.makedirs(path, exist_ok=True)
        if node.ident is not None:
            vendor, device, cls = node.ident
            _write_file(os.path.join(path, "vendor"), vendor + "\n")
            _write_file(os.path.join(path, "device"), device + "\n")
            _write_file(os.path.join(path, "class"), cls + "\n")
            _symlink("../../../devices/" + rel, os.path.join(bus_dir, node.name))
            spec = node.spec
            node_numa = (
                numa if spec is None else (spec.numa_node if spec.numa_node is not None else -1)
            )
            _write_file(os.path.join(path, "numa_node"), f"{node_numa}\n")
            if spec is not None and spec.local_cpulist is not None:
                cpus = parse_cpulist(spec.local_cpulist)
                _write_file(os.path.join(path, "local_cpulist"), format_cpulist(cpus) + "\n")
                _write_file(os.path.join(path, "local_cpus"), _format_cpumask(cpus) + "\n")
            if spec is None:
                assert node.secondary_bus is not None
                _write_file(os.path.join(path, "secondary_bus_number"), f"{node.secondary_bus}\n")
                _write_file(
                    os.path.join(path, "subordinate_bus_number"), f"{subtree_max_bus(node)}\n"
                )
            if spec is not None and spec.rdma_name is not None:
                ib = os.path.join(path, "infiniband", spec.rdma_name)
                _symlink("../../../" + node.name, os.path.join(ib, "device"))
                _write_file(os.path.join(ib, "node_type"), "1: CA\n")
                _symlink(
                    "../../devices/" + rel + "/infiniband/" + spec.rdma_name,
                    os.path.join(root, "class", "infiniband", spec.rdma_name),
                )
        for child in node.children.values():
            walk(child, rel + "/" + child.name, numa)

    for name, hb in host_bridges.items():
        numas = [
            n.spec.numa_node
            for n in _leaves(hb)
            if n.spec is not None and n.spec.numa_node is not None
        ]
        walk(hb, name, numas[0] if numas else -1)


def _leaves(node: _Node) -> list[_Node]:
    if not node.children:
        return [node]
    return [leaf for c in node.children.values() for leaf in _leaves(c)]
