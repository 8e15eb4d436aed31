"""The PCIe common-ancestor rule: one definition, used by the sysfs reader
(:meth:`agent.hw.sysfs.SysfsReader.pcie_level`) and by the fake NVML's
``nvmlDeviceGetTopologyCommonAncestor`` (:mod:`agent.hw.sim.nvml`), so a simulated machine
answers NVML and sysfs alike.

A device's place is its path in the PCIe tree, host bridge first and the device last:
``(host bridge, root port, switch upstream port, switch downstream port, ..., device)``;
a device directly on the host bridge's root bus (as in VMs) is ``(host bridge, device)``.
The components only need to compare equal where the tree is shared: the sysfs reader uses
the directory names of the device's real path, the simulator the keys it lays its tree out by.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from agent.records import PcieLevel

__all__ = ["PciePlace", "pcie_level"]


@dataclass(frozen=True)
class PciePlace:
    """Where a PCIe device sits: its ``path`` in the tree (module docstring), its NUMA node
    and its local CPUs (None: not known)."""

    path: Sequence[Hashable]
    numa_node: int | None = None
    cpus: frozenset[int] | None = None


def pcie_level(a: PciePlace, b: PciePlace, numa_node_count: int) -> PcieLevel | None:
    """How devices ``a`` and ``b`` are connected (``numa_node_count``: NUMA nodes of the
    machine, 0 when it has none or they are not known).

    Under one host bridge the deepest common ancestor decides: the host bridge itself ->
    PHB; a root port (functions of one device) -> PIX; inside switches -> PIX when the path
    between them crosses one switch, PXB when it crosses several. Switches are counted as
    (upstream, downstream) port pairs below the root port.

    Under different host bridges: NODE when both are on the same NUMA node, SYS when on
    different ones. When either NUMA node is unknown: SYS when both local CPU sets are known
    and disjoint (the devices sit on different NUMA nodes, whichever they are), else NODE if
    the machine has at most one NUMA node, else None.

    None also when the devices are the same or one is a bridge above the other.
    """
    pa, pb = tuple(a.path), tuple(b.path)
    if not pa or not pb or pa == pb:
        return None
    common = 0
    for x, y in zip(pa, pb):
        if x != y:
            break
        common += 1
    if common == 0:
        return _cross_host_bridge(a, b, numa_node_count)
    if common == len(pa) or common == len(pb):
        return None  # one is an ancestor (a bridge) of the other
    ancestor = common - 1  # index of the deepest common component
    if ancestor == 0:
        return PcieLevel.PHB
    if ancestor == 1:
        return PcieLevel.PIX
    first = _switch_of(ancestor)
    crossed_a = _switch_of(len(pa) - 2) - first + 1  # len-1 is the device itself
    crossed_b = _switch_of(len(pb) - 2) - first + 1
    crossed = crossed_a + crossed_b - 1  # the ancestor's switch is on both sides
    return PcieLevel.PIX if crossed <= 1 else PcieLevel.PXB


def _switch_of(index: int) -> int:
    # path components 2,3 are switch 0's (upstream, downstream) ports, 4,5 switch 1's ...
    return (index - 2) // 2


def _cross_host_bridge(a: PciePlace, b: PciePlace, numa_node_count: int) -> PcieLevel | None:
    if a.numa_node is not None and b.numa_node is not None:
        return PcieLevel.NODE if a.numa_node == b.numa_node else PcieLevel.SYS
    # Local CPUs follow the NUMA node: disjoint sets are different nodes even where the
    # firmware gave no node id (and how a pasted matrix's sockets are simulated).
    if a.cpus and b.cpus and not a.cpus & b.cpus:
        return PcieLevel.SYS
    # A machine with one NUMA node (or a kernel without NUMA) has no SMP link to cross.
    return PcieLevel.NODE if numa_node_count <= 1 else None
