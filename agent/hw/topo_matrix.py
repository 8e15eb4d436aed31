"""Reads pasted ``nvidia-smi topo -m`` output into the facts it states (:class:`NodeFacts`).

The simulator turns them into a machine spec (``agent.hw.sim.from_facts``), so a pasted
matrix reaches the ``Topology`` by the same path as every other input.

Public API::

    parse_topo_matrix(text: str, source: str = "<text>") -> NodeFacts
    read_topo_matrix(path) -> NodeFacts
    class TopoMatrixError(InputFormatError)        # .source, .line (1-based or None), .reason
    matrix_name(source: str) -> str

What the text must hold: a header line whose first column is ``GPU0`` (then ``GPU1`` ...
``GPU<n-1>``, then NIC/other device columns, then any of ``CPU Affinity``, ``NUMA Affinity``,
``GPU NUMA ID``), followed by one row per GPU (NIC rows optional). Lines before the header
(a shell prompt, driver warnings) are ignored. The matrix ends at ``Legend:`` or at the
first line that is not a row; after it only ``NICn: <name>`` entries (the ``NIC Legend``)
are read, everything else is ignored. Blank lines between rows are allowed. Terminal control
sequences are dropped first (nvidia-smi underlines the header with ``ESC[4m`` even into a
file).

Columns may be tab-separated (what nvidia-smi writes), space-aligned (the same text after a
terminal expanded its tabs), or separated by any run of spaces; rows may be indented.

Cells: ``X`` (self), ``NV<n>`` (n bonded NVLinks), a PCIe level (``BOARD PIX PXB PHB NODE
SYS``, legacy ``SOC`` = SYS, ``CPU`` = NODE; case-insensitive), ``N/A`` or an empty cell
(unknown). A row is read, most faithful first, by splitting at tabs; by rebuilding the tabs
of a terminal's 8-column expansion (so empty cells are found in space-aligned pastes too);
or by splitting at whitespace, where an empty cell cannot be seen (it must read ``N/A``)
and missing trailing values are taken to be the last columns. Empty cells at the end of a
tab-separated or tab-aligned row may have lost their whitespace in a copy and are padded.

What is inferred rather than read is said in ``NodeFacts.notes``:

- GPUs get ``index``, a synthetic stable UUID (:func:`agent.records.synthetic_gpu_uuid` of
  :func:`matrix_name`), ``name="unknown"``,
  no PCI bus id.
- ``numa_node`` is the ``NUMA Affinity`` cell; a list such as ``0,3-9,11-17`` gives the
  lowest node (0) and the raw list is kept in a note. Without a ``NUMA Affinity`` column
  (older drivers) ``numa_node`` stays ``None`` - we do not invent node ids - and the GPUs
  are grouped by identical ``CPU Affinity`` instead: the groups are listed in a note
  (numbered in order of first appearance, each GPU keeps its ``cpu_affinity``); they also
  decide the inferred PCIe level below.
- nvidia-smi prints ``NV#`` instead of the PCIe level for NVLinked pairs. We infer ``NODE``
  when both GPUs are on the same NUMA node (or, without NUMA data, have the same CPU
  affinity) and ``SYS`` otherwise (different or unknown), and list those pairs in a note.
- The ``GPU NUMA ID`` column (the GPU's own memory node on Grace systems) goes in a note.
- ``Link.nvswitch`` is never set: the matrix cannot tell NVSwitch from direct links.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from agent.hw.topo_matrix_text import (
    CPU_AFFINITY,
    GPU_NUMA_ID,
    KNOWN_TRAILING,
    NUMA_AFFINITY,
    MatrixReader,
    Row,
    TopoMatrixError,
    cpulist_min,
)
from agent.records import Gpu, Link, Nic, NodeFacts, PcieLevel, synthetic_gpu_uuid

__all__ = [
    "TopoMatrixError",
    "matrix_name",
    "parse_topo_matrix",
    "read_topo_matrix",
]

_MAX_PAIRS_LISTED = 12  # longer pair lists in notes are summarised as a count

def matrix_name(source: str) -> str:
    """The machine name of a matrix read from ``source``: the file name without its
    extension (``"pasted"`` for text without one). Synthetic GPU UUIDs are made from it."""
    return os.path.splitext(os.path.basename(source))[0] or "pasted"


def _affinity_groups(gpus: Sequence[Gpu]) -> dict[str, tuple[int, ...]]:
    groups: dict[str, list[int]] = {}
    for gpu in gpus:
        if gpu.cpu_affinity is not None:
            groups.setdefault(gpu.cpu_affinity, []).append(gpu.index)
    return {k: tuple(v) for k, v in groups.items()}


def read_topo_matrix(path: str | os.PathLike[str]) -> NodeFacts:
    """Read a file holding ``nvidia-smi topo -m`` output; see :func:`parse_topo_matrix`.
    An unreadable file raises :class:`TopoMatrixError` too."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise TopoMatrixError(
            f"cannot read the file: {exc.strerror or exc}", source=source
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise TopoMatrixError("not UTF-8 text", source=source, line=line) from None
    return parse_topo_matrix(text, source=source)


def parse_topo_matrix(text: str, source: str = "<text>") -> NodeFacts:
    """Turn ``nvidia-smi topo -m`` output into the :class:`NodeFacts` it states, with
    ``source="topo-matrix:<source>"`` (see the module docstring for what is read and what
    is inferred). Raises :class:`TopoMatrixError` naming the line for anything unreadable;
    never any other exception for any ``str`` input."""
    reader = MatrixReader(text, source)
    reader.read()
    notes = [
        (
            "read from nvidia-smi topo -m text; GPU UUIDs are synthetic "
            f"({synthetic_gpu_uuid(matrix_name(source), 0)} for GPU0), names and PCI "
            "bus IDs unknown"
        )
    ]
    gpus = _gpus(reader, notes)
    links = _gpu_links(reader, gpus, notes)
    nics = _nics(reader, notes)
    ignored = [c for c in reader.trailing if c not in KNOWN_TRAILING]
    if ignored:
        notes.append(f"ignored unknown columns: {', '.join(ignored)}")
    return NodeFacts(
        gpus=tuple(gpus),
        links=tuple(links),
        nics=tuple(nics),
        source=f"topo-matrix:{source}",
        notes=tuple(notes),
    )


def _gpu(reader: MatrixReader, i: int, row: Row) -> Gpu:
    """GPU ``i`` as its row states it (TopoMatrixError for a malformed affinity cell)."""
    cpu = row.trailing.get(CPU_AFFINITY)
    if cpu is not None and cpulist_min(cpu) is None:
        raise reader.error(
            f"CPU Affinity {cpu!r} of GPU{i} is not a CPU list like 0-23,48-71", row.line_no, row.text
        )
    numa_text = row.trailing.get(NUMA_AFFINITY)
    numa = cpulist_min(numa_text) if numa_text is not None else None
    if numa_text is not None and numa is None:
        raise reader.error(
            f"NUMA Affinity {numa_text!r} of GPU{i} is not a node number or a list like 0,3-9",
            row.line_no,
            row.text,
        )
    gnid = row.trailing.get(GPU_NUMA_ID)
    if gnid is not None and not gnid.isdigit():
        raise reader.error(
            f"GPU NUMA ID {gnid!r} of GPU{i} is not a number or N/A", row.line_no, row.text
        )
    return Gpu(
        index=i,
        uuid=synthetic_gpu_uuid(matrix_name(reader.source), i),
        name="unknown",
        numa_node=numa,
        cpu_affinity=cpu,
        numa_affinity=numa_text,
        memory_numa_node=int(gnid) if gnid is not None else None,
    )


def _gpus(reader: MatrixReader, notes: list[str]) -> list[Gpu]:
    """The GPUs, with notes on multi-node NUMA affinities, GPU NUMA ids and a missing NUMA
    column."""
    gpus = [_gpu(reader, i, reader.rows[f"GPU{i}"]) for i in range(reader.n_gpus)]
    multi_node = [
        f"GPU{g.index} {g.numa_affinity} -> {g.numa_node}"
        for g in gpus
        if g.numa_affinity is not None and not g.numa_affinity.isdigit()
    ]
    if multi_node:
        notes.append(
            "NUMA Affinity lists several nodes; numa_node is the lowest: " + ", ".join(multi_node)
        )
    gpu_numa_ids = [f"GPU{g.index}={g.memory_numa_node}" for g in gpus if g.memory_numa_node is not None]
    if gpu_numa_ids:
        notes.append("GPU NUMA ID (the GPU's own memory NUMA node): " + ", ".join(gpu_numa_ids))
    if NUMA_AFFINITY not in reader.trailing:
        groups = [
            f"group {k} = GPU {','.join(map(str, members))} ({aff})"
            for k, (aff, members) in enumerate(_affinity_groups(gpus).items())
        ]
        notes.append(
            "no NUMA Affinity column: numa_node left unknown; "
            "GPUs grouped by identical CPU Affinity"
            + (": " + "; ".join(groups) if groups else " (none given)")
        )
    return gpus


def _same_node(x: Gpu, y: Gpu) -> bool:
    if x.numa_node is not None and y.numa_node is not None:
        return x.numa_node == y.numa_node
    if x.numa_node is None and y.numa_node is None and x.cpu_affinity is not None:
        return x.cpu_affinity == y.cpu_affinity
    return False


def _gpu_links(reader: MatrixReader, gpus: Sequence[Gpu], notes: list[str]) -> list[Link]:
    """Every GPU pair; NVLinked pairs get an inferred PCIe level (said in a note)."""
    links = []
    inferred: dict[PcieLevel, list[str]] = {PcieLevel.NODE: [], PcieLevel.SYS: []}
    unknown_pairs = []
    n = len(gpus)
    for a in range(n):
        for b in range(a + 1, n):
            cell = reader.resolve(f"GPU{a}", f"GPU{b}")
            if cell.kind == "nv":
                level = PcieLevel.NODE if _same_node(gpus[a], gpus[b]) else PcieLevel.SYS
                inferred[level].append(f"{a}-{b}")
                links.append(Link(a, b, nvlinks=cell.nvlinks, pcie=level))
            elif cell.kind == "pcie":
                links.append(Link(a, b, pcie=cell.level))
            else:
                unknown_pairs.append(f"{a}-{b}")
                links.append(Link(a, b))
    if inferred[PcieLevel.NODE] or inferred[PcieLevel.SYS]:
        parts = [
            f"{level.name} for {' '.join(pairs)}"
            if len(pairs) <= _MAX_PAIRS_LISTED
            else f"{level.name} for {len(pairs)} pairs"
            for level, pairs in inferred.items()
            if pairs
        ]
        notes.append(
            "nvidia-smi shows NV# instead of the PCIe level of NVLinked pairs: inferred "
            "NODE when on the same NUMA node (or CPU affinity), SYS otherwise: "
            + "; ".join(parts)
        )
    if unknown_pairs:
        notes.append(
            "PCIe level unknown (N/A or empty cell) for GPU pairs " + " ".join(unknown_pairs)
        )
    return links


def _nics(reader: MatrixReader, notes: list[str]) -> list[Nic]:
    """The non-GPU columns as NICs, named by the NIC legend where it names them."""
    n = reader.n_gpus
    nics = []
    unnamed = []
    for col in reader.devices[n:]:
        levels: list[PcieLevel | None] = []
        for i in range(n):
            cell = reader.resolve(f"GPU{i}", col)
            if cell.kind == "nv":
                row = reader.rows[f"GPU{i}"]
                raise reader.error(
                    f"GPU{i} shows NVLinks to {col}, which is not a GPU", row.line_no, row.text
                )
            levels.append(cell.level)
        name = reader.legend.get(col, col)
        if col not in reader.legend and re.fullmatch(r"NIC\d+", col):
            unnamed.append(col)
        nics.append(Nic(name=name, levels=tuple(levels)))
    if unnamed:
        notes.append(f"no NIC Legend entry for {', '.join(unnamed)}: named as in the header")
    return nics


