"""Reads the facts NVML does not give us from sysfs (the fake trees are written by
:mod:`agent.hw.sim.sysfs_tree`).

The reader takes a root path (``"/sys"`` on a node, a temp dir or ``tests/fixtures/sysfs``
in tests), as ``prometheus_client``'s ``ProcessCollector`` takes ``proc=``. It never raises
on a missing or unreadable file: a missing fact is ``None`` (or an empty collection).

Kernel layout the reader relies on (and the simulator's writer produces):

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
from dataclasses import dataclass

from agent.formats import BusIdError, nvml_to_sysfs_bus_id, parse_cpulist
from agent.hw.pcie import PciePlace, pcie_level
from agent.records import PcieLevel

__all__ = ["HOST_BRIDGE_RE", "NumaNode", "RdmaNic", "SysfsReader"]


#: a host bridge directory under devices/: "pci0000:17"
HOST_BRIDGE_RE = re.compile(r"^pci(?P<domain>[0-9a-f]{4,8}):(?P<bus>[0-9a-f]{2})$")


def _try_sysfs_bus_id(bus_id: str) -> str | None:
    try:
        return nvml_to_sysfs_bus_id(bus_id)
    except BusIdError:
        return None


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
            if HOST_BRIDGE_RE.match(part):
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

    def nvidia_gpus(self) -> list[str]:
        """The sysfs bus ids (``0000:3b:00.0``) of the NVIDIA display and 3D controllers
        (``vendor`` 0x10de, ``class`` 0x03xxxx) sysfs lists, sorted: what the PCI bus holds,
        whether NVML answers for them or not (a GPU fallen off the bus may still be listed).
        Left out, as NVML never lists them: virtual functions (a ``physfn`` link: vGPU
        SR-IOV) and devices bound to another driver than ``nvidia`` (``vfio-pci``: given to
        a VM); a device bound to no driver is counted (the driver failed to take it)."""
        base = os.path.join(self.root, "bus", "pci", "devices")
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        out = []
        for bdf in names:
            vendor = self._read("bus", "pci", "devices", bdf, "vendor")
            cls = self._read("bus", "pci", "devices", bdf, "class")
            if vendor is None or cls is None or vendor.strip().lower() != "0x10de" \
                    or not cls.strip().lower().startswith("0x03"):
                continue
            d = os.path.join(base, bdf)
            if os.path.lexists(os.path.join(d, "physfn")):
                continue
            driver = os.path.join(d, "driver")
            if os.path.lexists(driver) and os.path.basename(os.path.realpath(driver)) != "nvidia":
                continue
            out.append(bdf)
        return out

    def pcie_level(self, bus_id_a: str, bus_id_b: str) -> PcieLevel | None:
        """How devices ``a`` and ``b`` are connected, from their real paths in the PCIe tree,
        their NUMA nodes and local CPUs: the rule of :func:`agent.hw.pcie.pcie_level`. None
        also when either device is unknown."""
        pa, pb = self._pcie_place(bus_id_a), self._pcie_place(bus_id_b)
        if pa is None or pb is None:
            return None
        return pcie_level(pa, pb, len(self.numa_nodes()))

    def _pcie_place(self, bus_id: str) -> PciePlace | None:
        path = self._pci_path(bus_id)
        if path is None:
            return None
        cpulist = self.pci_local_cpulist(bus_id)
        try:
            cpus = frozenset(parse_cpulist(cpulist)) if cpulist is not None else None
        except ValueError:
            cpus = None
        return PciePlace(path, self.pci_numa_node(bus_id), cpus)

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
