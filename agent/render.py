"""The topology as people and programs read it: the ``nvidia-smi topo -m``-like table and the
DESIGN.md JSON of ``discover``.

``discover`` prints these and the demo shows them; both import this module, never each other.
The JSON follows the contract in DESIGN.md: one object with ``gpus`` (index, uuid, name,
pci_bus_id, numa_node), ``links`` (a, b, nvlinks, pcie), ``nvlink_islands``,
``nvlink_cliques`` and ``nics``, plus a few extra keys.
"""

from __future__ import annotations

import textwrap
from typing import Any

from agent.topology.model import Gpu, Link, Nic, PcieLevel, Topology


def _level_name(level: PcieLevel | None) -> str | None:
    return level.name if level is not None else None


def _gpu_json(g: Gpu) -> dict[str, Any]:
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "pci_bus_id": g.pci_bus_id,
        "numa_node": g.numa_node,
        "memory_mib": g.memory_mib,
        "minor_number": g.minor_number,
        "compute_capability": (
            f"{g.compute_capability[0]}.{g.compute_capability[1]}"
            if g.compute_capability
            else None
        ),
        "cpu_affinity": g.cpu_affinity,
        "numa_affinity": g.numa_affinity,
        "memory_numa_node": g.memory_numa_node,
        "mig_capable": g.mig_capable,
        "mig_enabled": g.mig_enabled,
        "mig_devices": [
            {"uuid": m.uuid, "profile": m.profile, "memory_mib": m.memory_mib}
            for m in g.mig_devices
        ],
        "fabric_cluster_uuid": g.fabric_cluster_uuid,
        "fabric_clique_id": g.fabric_clique_id,
        "lost": g.lost,
    }


def topology_to_json(t: Topology) -> dict[str, Any]:
    """The DESIGN.md ``discover --format json`` contract (and a few extra keys)."""
    return {
        "source": t.source,
        "machine": t.machine,
        "driver_version": t.driver_version,
        "cuda_driver_version": t.cuda_driver_version,
        "gpus": [_gpu_json(g) for g in t.gpus],
        "links": [
            {
                "a": link.a,
                "b": link.b,
                "nvlinks": link.nvlinks,
                "pcie": _level_name(link.pcie),
                "nvswitch": link.nvswitch,
                "score": link.score,
            }
            for link in t.links
        ],
        "nvlink_islands": [list(i) for i in t.nvlink_islands],
        "nvlink_cliques": [list(c) for c in t.nvlink_cliques],
        "numa_groups": [
            {"numa_node": node, "gpus": list(gpus)} for node, gpus in t.numa_groups.items()
        ],
        "nics": [
            {
                "name": nic.name,
                "pci_bus_id": nic.pci_bus_id,
                "numa_node": nic.numa_node,
                "levels": [_level_name(level) for level in nic.levels],
            }
            for nic in t.nics
        ],
        "notes": list(t.notes),
    }


def _cell(link: Link) -> str:
    if link.nvlinks:
        return f"NV{link.nvlinks}"
    return link.pcie.name if link.pcie is not None else "?"


def _column_width(heads: list[str]) -> int:
    return max([5] + [len(h) + 1 for h in heads])


def _fit_columns(t: Topology, max_columns: int | None) -> tuple[list[str], list[Nic], bool]:
    """The matrix's column heads, its NIC columns and whether it shows CPU affinity, narrowed
    to ``max_columns``: NIC columns go first, then the CPU affinity column, then the GPU
    heads shrink to bare indices."""
    n = t.gpu_count

    def line_length(heads: list[str], affinity: bool) -> int:
        return 8 + _column_width(heads) * len(heads) + (16 if affinity else 0) + 4

    nic_columns = list(t.nics)
    show_affinity = True
    heads = [f"GPU{i}" for i in range(n)] + [nic.name for nic in nic_columns]
    if max_columns is not None and line_length(heads, True) > max_columns:
        nic_columns = []
        heads = [f"GPU{i}" for i in range(n)]
        show_affinity = line_length(heads, True) <= max_columns
        if line_length(heads, False) > max_columns:
            heads = [str(i) for i in range(n)]  # 16 GPUs: bare indices keep it narrow
    return heads, nic_columns, show_affinity


def _matrix_lines(t: Topology, heads: list[str], nic_columns: list[Nic], show_affinity: bool) -> list[str]:
    width = _column_width(heads)
    out = [
        " " * 8
        + "".join(h.ljust(width) for h in heads)
        + ("CPU Affinity".ljust(16) if show_affinity else "")
        + "NUMA"
    ]
    for g in t.gpus:
        cells = []
        for j in range(t.gpu_count):
            cells.append(" X" if j == g.index else _cell(t.link(g.index, j)))
        for nic in nic_columns:
            lvl = nic.levels[g.index] if g.index < len(nic.levels) else None
            cells.append(lvl.name if lvl is not None else "?")
        numa = "N/A" if g.numa_node is None else str(g.numa_node)
        out.append(
            f"GPU{g.index}".ljust(8)
            + "".join(c.ljust(width) for c in cells)
            + ((g.cpu_affinity or "N/A").ljust(16) if show_affinity else "")
            + numa
        )
    return out


def _gpu_lines(t: Topology) -> list[str]:
    out = []
    for g in t.gpus:
        extra = []
        if g.mig_enabled:
            extra.append(f"MIG: {', '.join(m.profile for m in g.mig_devices) or 'no instances'}")
        if g.fabric_clique_id is not None:
            extra.append(f"clique {g.fabric_clique_id}")
        if g.lost:
            extra.append("LOST")
        mem = f"{g.memory_mib} MiB" if g.memory_mib else "? MiB"
        out.append(
            f"  GPU{g.index}  {g.name}  {mem}  {g.pci_bus_id or '-'}  {g.uuid}"
            + (f"  [{'; '.join(extra)}]" if extra else "")
        )
    return out


def _group_lines(t: Topology) -> list[str]:
    """Islands, cliques, NUMA groups, NICs and notes."""

    def groups(items: tuple[tuple[int, ...], ...]) -> str:
        return " ".join("{" + ",".join(map(str, g)) + "}" for g in items) or "none"

    out = [f"NVLink islands: {groups(t.nvlink_islands)}", f"NVLink cliques: {groups(t.nvlink_cliques)}"]
    numa = ", ".join(
        f"{'?' if node is None else node}: {{{','.join(map(str, gpus))}}}"
        for node, gpus in t.numa_groups.items()
    )
    out.append(f"NUMA groups:    {numa or 'none'}")
    if t.nics:
        out.append("NICs:")
        for nic in t.nics:
            near = [
                i
                for i, lvl in enumerate(nic.levels)
                if lvl is not None and lvl <= PcieLevel.PXB
            ]
            out.append(
                f"  {nic.name}  {nic.pci_bus_id or '-'}  numa {nic.numa_node if nic.numa_node is not None else '?'}"
                + (f"  near GPU {','.join(map(str, near))}" if near else "")
            )
    else:
        out.append("NICs:           none")
    for note in t.notes:
        out.append(f"note: {note}")
    return out


def render_table(t: Topology, max_columns: int | None = None) -> str:
    """A matrix like ``nvidia-smi topo -m``, then islands, cliques, NUMA groups and NICs.

    With ``max_columns`` the matrix is narrowed to fit: NIC columns go first (the NIC list
    below still says which GPUs each NIC is near), then the CPU affinity column."""
    heads, nic_columns, show_affinity = _fit_columns(t, max_columns)
    narrowed = max_columns is not None and (len(nic_columns) < len(t.nics) or not show_affinity)
    title = t.machine or t.source or "this node"
    out = [f"{title}: {t.gpu_count} GPU(s)" + (f", driver {t.driver_version}" if t.driver_version else ""), ""]
    out += _matrix_lines(t, heads, nic_columns, show_affinity)
    out.append("")
    out += _gpu_lines(t)
    out.append("")
    out += _group_lines(t)
    out.append("")
    if narrowed:
        left_out = [w for w, gone in (("NIC columns", len(nic_columns) < len(t.nics)),
                                      ("CPU affinity", not show_affinity)) if gone]
        out.append(f"({' and '.join(left_out)} left out to fit {max_columns} columns; --wide shows them)")
    out.append("Legend: X self; NV# bonded NVLinks; PIX one PCIe switch; PXB several switches;")
    out.append("        PHB host bridge; NODE across host bridges in a NUMA node; SYS across sockets")
    if max_columns is not None:
        out = [
            wrapped
            for line in out
            for wrapped in (
                textwrap.wrap(line, max_columns, subsequent_indent="      ", break_on_hyphens=False)
                if len(line) > max_columns
                else [line]
            )
        ]
    return "\n".join(out) + "\n"
