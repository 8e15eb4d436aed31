"""The frozen topology model every other layer reads.

A :class:`Topology` is built once from a backend (NVML + sysfs, the fake, or a pasted
``nvidia-smi topo -m``), never mutated, and shared between threads. Derived facts (NVLink
islands, cliques, NUMA groups, pair scores) are computed once at construction by the engine
(``agent._topo`` or its pure-Python twin).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence


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
    """The anchor-compatible score of one GPU pair: PCIe level + 100 per NVLink."""
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


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as discovered."""

    index: int
    uuid: str
    name: str
    memory_mib: int | None = None
    pci_bus_id: str = ""  # NVML spelling: "00000000:3B:00.0"
    pci_class: int | None = None  # from sysfs: 0x030200 3D controller (compute), 0x0300xx VGA
    minor_number: int | None = None
    compute_capability: tuple[int, int] | None = None
    mig_enabled: bool = False
    mig_capable: bool | None = None  # NVML answers GetMigMode (None: not known, e.g. a pasted matrix)
    mig_devices: tuple[MigDevice, ...] = ()
    numa_node: int | None = None
    cpu_affinity: str | None = None  # a cpulist, "0-19,40-59"
    numa_affinity: str | None = None  # the NUMA node list as reported, "0,3-9" (numa_node = lowest)
    memory_numa_node: int | None = None  # the GPU's own memory as a NUMA node (Grace systems)
    fabric_cluster_uuid: str | None = None
    fabric_clique_id: int | None = None
    lost: bool = False  # NVML answered GPU_IS_LOST while reading it


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


@dataclass(frozen=True)
class Topology:
    """A node's GPU topology, immutable.

    Build it with :meth:`Topology.build`, which validates and computes the derived facts.
    ``links`` holds one :class:`Link` per unordered pair ``a < b`` in (a, b) order.
    """

    gpus: tuple[Gpu, ...]
    links: tuple[Link, ...]
    nics: tuple[Nic, ...] = ()
    numa_distances: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    numa_cpulists: Mapping[int, str] = field(default_factory=dict)
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.4"
    machine: str | None = None  # DMI product name, e.g. "DGX H100"
    source: str = ""  # "nvml", "simulated:dgx-h100", "topo-matrix:/path"
    notes: tuple[str, ...] = ()  # what was inferred rather than read
    # derived, filled by build()
    nvlink_islands: tuple[tuple[int, ...], ...] = ()
    nvlink_cliques: tuple[tuple[int, ...], ...] = ()
    numa_groups: Mapping[int | None, tuple[int, ...]] = field(default_factory=dict)
    scores: tuple[tuple[int, ...], ...] = ()  # pair score matrix, 0 on the diagonal

    # ---------------------------------------------------------------- construction
    @classmethod
    def build(
        cls,
        gpus: Sequence[Gpu],
        links: Iterable[Link],
        **kwargs: object,
    ) -> "Topology":
        """Validate inputs, fill missing pairs with an unknown link, derive islands,
        cliques, NUMA groups and pair scores."""
        from agent.topology import engine

        gpus = tuple(sorted(gpus, key=lambda g: g.index))
        n = len(gpus)
        if [g.index for g in gpus] != list(range(n)):
            raise ValueError(f"GPU indices must be 0..{n - 1}, got {[g.index for g in gpus]}")
        by_pair: dict[tuple[int, int], Link] = {}
        for link in links:
            a, b = min(link.a, link.b), max(link.a, link.b)
            if a == b or not (0 <= a < n and 0 <= b < n):
                raise ValueError(f"link {link.a}-{link.b} does not join two distinct GPUs of {n}")
            if (a, b) in by_pair:
                raise ValueError(f"link {a}-{b} given twice")
            by_pair[(a, b)] = Link(a, b, link.nvlinks, link.pcie, link.nvswitch)
        all_links = tuple(
            by_pair.get((a, b), Link(a, b)) for a in range(n) for b in range(a + 1, n)
        )
        scores = [[0] * n for _ in range(n)]
        adjacency = [0] * n
        for link in all_links:
            scores[link.a][link.b] = scores[link.b][link.a] = link.score
            if link.nvlinks > 0:
                adjacency[link.a] |= 1 << link.b
                adjacency[link.b] |= 1 << link.a
        islands = tuple(tuple(c) for c in engine.nvlink_islands(adjacency))
        cliques = tuple(tuple(c) for c in engine.maximal_cliques(adjacency))
        groups: dict[int | None, list[int]] = {}
        for g in gpus:
            groups.setdefault(g.numa_node, []).append(g.index)
        numa_groups = {k: tuple(v) for k, v in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))}
        return cls(
            gpus=gpus,
            links=all_links,
            nvlink_islands=islands,
            nvlink_cliques=cliques,
            numa_groups=numa_groups,
            scores=tuple(tuple(r) for r in scores),
            **kwargs,  # type: ignore[arg-type]
        )

    # ---------------------------------------------------------------- queries
    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def link(self, a: int, b: int) -> Link:
        """The link between GPUs ``a`` and ``b`` (order does not matter)."""
        if a == b:
            raise ValueError("a GPU has no link to itself")
        a, b = min(a, b), max(a, b)
        n = len(self.gpus)
        # links are stored row-major over a < b
        return self.links[a * n - a * (a + 1) // 2 + (b - a - 1)]

    def pair_score(self, a: int, b: int) -> int:
        return self.scores[a][b]

    def set_score(self, indices: Iterable[int]) -> int:
        idx = list(indices)
        return sum(self.scores[x][y] for i, x in enumerate(idx) for y in idx[i + 1 :])

    def nvlink_matrix(self) -> list[list[int]]:
        n = len(self.gpus)
        m = [[0] * n for _ in range(n)]
        for link in self.links:
            m[link.a][link.b] = m[link.b][link.a] = link.nvlinks
        return m

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        return None
