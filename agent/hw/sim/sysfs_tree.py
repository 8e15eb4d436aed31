"""Writes realistic fake sysfs trees (the layout :class:`agent.hw.sysfs.SysfsReader` reads,
described in its module docstring) for simulated machines and tests."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.formats import format_cpulist, parse_cpulist
from agent.formats import parse_bus_id as _parse_bus_id
from agent.formats import sysfs_spelling as _sysfs_spelling
from agent.hw.sysfs import HOST_BRIDGE_RE

__all__ = ["PciDeviceSpec", "SysfsTreeSpec", "placement_path", "write_tree"]


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
    class_known: bool = True  # False: no ``class`` file (a device the input does not describe)


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
        self.children: dict[Hashable, _Node] = {}
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


def placement_path(host_bridge: str, switches: Sequence[str], bus_id: str) -> PciPath:
    """The path (:mod:`agent.hw.pcie`) of a device placed at ``host_bridge`` below
    ``switches`` (outermost first): the keys :func:`write_tree` lays the tree out by, so the
    fake NVML's common ancestor is the fake sysfs's. ``(host bridge, root port key, "up",
    downstream port key, ..., ("dev", address))``; ``(host bridge, ("dev", address))`` for a
    device on the host bridge's root bus."""
    addr = _parse_bus_id(bus_id)
    m = HOST_BRIDGE_RE.match(host_bridge)
    dev = ("dev", addr)
    if not switches and m is not None and addr[1] == int(m["bus"], 16):
        return (host_bridge, dev)  # directly on the host bridge's root bus, as in VMs
    # a port's child: the next switch, or the bus of the device(s) behind it
    chain: list[Hashable] = [*(("sw", sw) for sw in switches), ("bus", addr[1])]
    path: list[Hashable] = [host_bridge, chain[0]]
    for key in chain[1:]:
        path += [_UP, key]
    return (*path, dev)


_UP = ("up",)
PciPath = tuple[Hashable, ...]
_Parsed = tuple[PciDeviceSpec, tuple[int, int, int, int], int]  # spec, address, root bus


def _check_devices(devices: Sequence[PciDeviceSpec]) -> list[_Parsed]:
    """The devices with their addresses and host bridge root buses; ValueError for a
    malformed or duplicate one."""
    parsed: list[_Parsed] = []
    seen_bdf: set[str] = set()
    seen_rdma: set[str] = set()
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
        m = HOST_BRIDGE_RE.match(dev.host_bridge)
        if m is None:
            raise ValueError(f"host bridge {dev.host_bridge!r} is not like 'pci0000:17'")
        if int(m["domain"], 16) != addr[0]:
            raise ValueError(f"{bdf} is not in the domain of host bridge {dev.host_bridge}")
        if len(set(dev.switches)) != len(dev.switches):
            raise ValueError(f"{bdf}: a switch appears twice in {dev.switches}")
        parsed.append((dev, addr, int(m["bus"], 16)))
    _check_placements(parsed)
    return parsed


def _check_placements(parsed: Sequence[_Parsed]) -> None:
    """Devices on one bus share their place; a switch has one parent."""
    switch_parent: dict[str, tuple[str, tuple[str, ...]]] = {}
    bus_position: dict[tuple[int, int], tuple[str, tuple[str, ...]]] = {}
    for dev, addr, _ in parsed:
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


class _TreeBuilder:
    """Lays devices out along their :func:`placement_path`, giving the bridges (root ports,
    switch ports) bus numbers and device numbers no device of the spec uses."""

    def __init__(self, parsed: Sequence[_Parsed]) -> None:
        self.used_buses: dict[int, set[int]] = {}  # domain -> buses taken
        self.used_bdfs: set[str] = set()
        for _, addr, root_bus in parsed:
            self.used_buses.setdefault(addr[0], set()).update({addr[1], root_bus})
            self.used_bdfs.add(_sysfs_spelling(*addr))
        self.host_bridges: dict[str, _Node] = {}

    def fresh_bus(self, domain: int, root_bus: int) -> int:
        """The first bus number above the host bridge's root bus that nothing uses (as the
        kernel numbers buses upward from the root bus), wrapping around if need be."""
        for bus in itertools.chain(range(root_bus + 1, 0x100), range(1, root_bus)):
            if bus not in self.used_buses[domain]:
                self.used_buses[domain].add(bus)
                return bus
        raise ValueError(f"no PCI bus numbers left in domain {domain:04x}")

    def fresh_port(
        self, domain: int, bus: int, first_slot: int, ident: tuple[str, str, str]
    ) -> _Node:
        """A bridge on ``bus`` at the next free device number."""
        for slot in range(first_slot, 0x20):
            bdf = _sysfs_spelling(domain, bus, slot, 0)
            if bdf not in self.used_bdfs:
                self.used_bdfs.add(bdf)
                return _Node(bdf, ident)
        raise ValueError(f"no free device numbers on bus {domain:04x}:{bus:02x}")

    def child(self, parent: _Node, key: Hashable, depth: int, domain: int, root_bus: int) -> _Node:
        """The bridge below ``parent`` at path position ``depth`` (made on first use)."""
        if key in parent.children:
            return parent.children[key]
        if depth == 1:
            node = self.fresh_port(domain, root_bus, 1, _ROOT_PORT_ID)
        elif key == _UP:  # a switch's upstream port, on the secondary bus of its port
            parent.secondary_bus = self.fresh_bus(domain, root_bus)
            node = _Node(_sysfs_spelling(domain, parent.secondary_bus, 0, 0), _SWITCH_UP_ID)
            self.used_bdfs.add(node.name)
            node.secondary_bus = self.fresh_bus(domain, root_bus)
        else:  # a downstream port of the switch ``parent`` is the upstream port of
            assert parent.secondary_bus is not None
            node = self.fresh_port(domain, parent.secondary_bus, 0, _SWITCH_DOWN_ID)
        parent.children[key] = node
        return node

    def place(self, dev: PciDeviceSpec, addr: tuple[int, int, int, int], root_bus: int) -> None:
        path = placement_path(dev.host_bridge, dev.switches, dev.bus_id)
        node = self.host_bridges.setdefault(dev.host_bridge, _Node(dev.host_bridge, None))
        node.secondary_bus = root_bus
        for depth, key in enumerate(path[1:-1], start=1):
            node = self.child(node, key, depth, addr[0], root_bus)
        if len(path) > 2:
            node.secondary_bus = addr[1]  # the port the device sits behind
        leaf = _Node(_sysfs_spelling(*addr), _NIC_ID if dev.rdma_name else _GPU_ID)
        leaf.spec = dev
        node.children[path[-1]] = leaf


def _layout(devices: Sequence[PciDeviceSpec]) -> dict[str, _Node]:
    """The PCIe tree for ``devices``: host bridge name -> its node."""
    parsed = _check_devices(devices)
    builder = _TreeBuilder(parsed)
    for dev, addr, root_bus in parsed:
        builder.place(dev, addr, root_bus)
    return builder.host_bridges


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
            if node.spec is None or node.spec.class_known:
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
