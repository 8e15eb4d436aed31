"""Reads pasted ``nvidia-smi topo -m`` output into the facts it states (:class:`NodeFacts`).

The simulator turns them into a machine spec (``agent.hw.sim.from_facts``), so a pasted
matrix reaches the ``Topology`` by the same path as every other input.

Public API::

    parse_topo_matrix(text: str, source: str = "<text>") -> NodeFacts
    read_topo_matrix(path) -> NodeFacts
    class TopoMatrixError(InputFormatError)        # .source, .line (1-based or None), .reason
    matrix_name(source: str) -> str
    cpu_affinity_groups(facts: NodeFacts) -> dict[str, tuple[int, ...]]

What the text must hold: a header line whose first column is ``GPU0`` (then ``GPU1`` ...
``GPU<n-1>``, then NIC/other device columns, then any of ``CPU Affinity``, ``NUMA Affinity``,
``GPU NUMA ID``), followed by one row per GPU (NIC rows optional). Lines before the header
(a shell prompt, driver warnings) are ignored. The matrix ends at ``Legend:`` or at the
first line that is not a row; after it only ``NICn: <name>`` entries (the ``NIC Legend``)
are read, everything else is ignored. Blank lines between rows are allowed.

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
  (numbered in order of first appearance) and returned by :func:`cpu_affinity_groups`;
  they also decide the inferred PCIe level below.
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
from dataclasses import dataclass

from agent.errors import InputFormatError
from agent.records import Gpu, Link, Nic, NodeFacts, PcieLevel, synthetic_gpu_uuid

CPU_AFFINITY = "CPU Affinity"
NUMA_AFFINITY = "NUMA Affinity"
GPU_NUMA_ID = "GPU NUMA ID"
_KNOWN_TRAILING = (CPU_AFFINITY, NUMA_AFFINITY, GPU_NUMA_ID)

# Header tokens: the multi-word column names first, so "CPU Affinity" stays one column.
_HEADER_TOKEN = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|\S+", re.IGNORECASE)
_GPU_NAME = re.compile(r"GPU(\d+)")
_ROWLIKE_LABEL = re.compile(r"(?:GPU|NIC)\d+")
_NV_CELL = re.compile(r"NV([1-9]\d{0,3})", re.IGNORECASE)
_CPULIST = re.compile(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*")
_LEGEND_ENTRY = re.compile(r"\s*([A-Za-z][\w.-]*)\s*:\s*(\S+)\s*")
_UNKNOWN_CELLS = frozenset({"", "N/A"})
_TAB_STOP = 8  # terminals expand nvidia-smi's tabs to 8-column stops
_MAX_PAIRS_LISTED = 12  # longer pair lists in notes are summarised as a count


class TopoMatrixError(InputFormatError):
    """Pasted ``nvidia-smi topo -m`` text cannot be read. The message is one line naming
    the source and, where there is one, the line: ``<source>: line 3: <reason> (in '...')``."""

    def __init__(
        self,
        reason: str,
        *,
        source: str = "<text>",
        line: int | None = None,
        text: str | None = None,
    ) -> None:
        self.reason = reason
        self.source = source
        self.line = line
        where = f"{source}: line {line}: " if line is not None else f"{source}: "
        shown = ""
        if text is not None:
            snippet = " ".join(text.split())
            if len(snippet) > 70:
                snippet = snippet[:70] + "..."
            shown = f" (in {snippet!r})"
        super().__init__(f"{where}{reason}{shown}")


def matrix_name(source: str) -> str:
    """The machine name of a matrix read from ``source``: the file name without its
    extension (``"pasted"`` for text without one). Synthetic GPU UUIDs are made from it."""
    return os.path.splitext(os.path.basename(source))[0] or "pasted"


def cpu_affinity_groups(topology: NodeFacts) -> dict[str, tuple[int, ...]]:
    """GPUs grouped by identical ``cpu_affinity``, in order of first appearance (GPUs
    without one are left out). For a matrix without a NUMA column this is the NUMA
    grouping we can honestly give; group k of the note is the k-th entry here."""
    return _affinity_groups(topology.gpus)


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
    return _Parser(text, source).parse()


# --------------------------------------------------------------------------- internals
@dataclass(frozen=True)
class _Cell:
    """One matrix cell: kind is "self", "nv", "pcie" or "unknown"."""

    kind: str
    nvlinks: int = 0
    level: PcieLevel | None = None


_SELF = _Cell("self")
_UNKNOWN = _Cell("unknown")


def _parse_cell(text: str) -> _Cell | None:
    """The cell, or None if the text is not a matrix cell."""
    t = text.strip().upper()
    if t in _UNKNOWN_CELLS:
        return _UNKNOWN
    if t == "X":
        return _SELF
    m = _NV_CELL.fullmatch(t)
    if m:
        return _Cell("nv", nvlinks=int(m.group(1)))
    try:
        return _Cell("pcie", level=PcieLevel.parse(t))
    except KeyError:
        return None


@dataclass(frozen=True)
class _Token:
    text: str
    start: int
    end: int


@dataclass
class _Row:
    line_no: int
    text: str
    label: str
    cells: list[_Cell]  # one per device column
    trailing: dict[str, str | None]  # header trailing name -> raw value (None = blank/N/A)


def _tokens(line: str) -> list[_Token]:
    return [_Token(m.group(), m.start(), m.end()) for m in re.finditer(r"\S+", line)]


def _cells_from_tab_stops(line: str) -> list[str] | None:
    """The cells of a row whose tabs a terminal expanded to 8-column stops (counted from
    the row label), empty cells included; None if the spacing is not such an expansion."""
    tokens = _tokens(line)
    if not tokens:
        return None
    origin = tokens[0].start
    cells = [tokens[0].text]
    end = tokens[0].end - origin
    for tok in tokens[1:]:
        start = tok.start - origin
        cell_start = start - start % _TAB_STOP
        if start - cell_start > 1:  # only " X " starts a cell with a space
            return None
        gap = cell_start - (end // _TAB_STOP + 1) * _TAB_STOP  # a tab always moves on
        if gap < 0:
            return None
        cells.extend([""] * (gap // _TAB_STOP))
        cells.append(tok.text)
        end = tok.end - origin
    return cells


def _blank(value: str | None) -> bool:
    return value is None or value.strip().upper() in _UNKNOWN_CELLS


def _cpulist_min(value: str) -> int | None:
    """Lowest number of a cpulist-style list, or None if ``value`` is not one."""
    if not _CPULIST.fullmatch(value):
        return None
    lowest = None
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        if hi and int(hi) < int(lo):
            return None
        lowest = int(lo) if lowest is None else min(lowest, int(lo))
    return lowest


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.lines = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")

    def error(
        self, reason: str, line_no: int | None = None, text: str | None = None
    ) -> TopoMatrixError:
        return TopoMatrixError(reason, source=self.source, line=line_no, text=text)

    # ------------------------------------------------------------------ header
    def find_header(self) -> int:
        """Index of the header line: the first whose first token is GPU0 and that holds no
        ``X`` cell (every row has one, on its diagonal)."""
        for i, line in enumerate(self.lines):
            words = line.split()
            if not words or words[0] != "GPU0":
                continue
            if any(w.upper() == "X" for w in words):
                raise self.error(
                    "a matrix row comes before the header line (GPU0 GPU1 ...)", i + 1, line
                )
            return i
        raise self.error(
            "no `nvidia-smi topo -m` header found: expected a line listing the columns, "
            "starting with GPU0"
        )

    def parse_header(self, i: int) -> None:
        line = self.lines[i]
        names = []
        for m in _HEADER_TOKEN.finditer(line):
            name = m.group()
            for known in _KNOWN_TRAILING:  # normalise the case of the known names
                if name.lower() == known.lower():
                    name = known
            names.append(name)
        devices: list[str] = []
        trailing: list[str] = []
        for name in names:
            if trailing or name in _KNOWN_TRAILING:
                trailing.append(name)
            else:
                devices.append(name)
        n_gpus = 0
        for col in devices:
            if _GPU_NAME.fullmatch(col) is None:
                break
            if col != f"GPU{n_gpus}":
                raise self.error(
                    f"GPU columns must be GPU0, GPU1, ... in order; column {n_gpus + 1} is {col}",
                    i + 1,
                    line,
                )
            n_gpus += 1
        seen: set[str] = set()
        for j, col in enumerate(devices):
            if col in seen:
                raise self.error(f"column {col} appears twice in the header", i + 1, line)
            seen.add(col)
            if j >= n_gpus and _GPU_NAME.fullmatch(col):
                raise self.error(f"GPU column {col} comes after a non-GPU column", i + 1, line)
        self.header_line = i + 1
        self.devices = devices
        self.trailing = trailing
        self.n_gpus = n_gpus
        self.column_index = {name: j for j, name in enumerate(devices)}

    # ------------------------------------------------------------------ rows
    def cells_valid(self, label: str, texts: Sequence[str]) -> list[_Cell] | None:
        """The parsed cells if every text is a cell and X sits exactly on the diagonal."""
        own = self.column_index[label]
        cells = []
        for j, t in enumerate(texts):
            cell = _parse_cell(t)
            if cell is None or ((cell is _SELF) != (j == own)):
                return None
            cells.append(cell)
        return cells

    def explain_cells(
        self, label: str, texts: Sequence[str], line_no: int, line: str
    ) -> TopoMatrixError:
        own = self.column_index[label]
        for j, t in enumerate(texts):
            cell = _parse_cell(t)
            col = self.devices[j]
            if cell is None:
                return self.error(
                    f"cell {t.strip()!r} under {col} is not X, NV<n>, a PCIe level "
                    "(SYS NODE PHB PXB PIX SOC BOARD) or N/A",
                    line_no,
                    line,
                )
            if cell is _SELF and j != own:
                return self.error(f"X (self) under {col} in the row of {label}", line_no, line)
            if j == own and cell is not _SELF:
                return self.error(
                    f"row {label} has {t.strip()!r} under its own column, not X", line_no, line
                )
        return self.error("cannot read the row", line_no, line)

    def split_cells(
        self, label: str, parts: Sequence[str], *, pad: bool = False
    ) -> tuple[list[_Cell], list[str]] | None:
        """Read a row given as its label and cell texts (empty = blank cell): the device
        cells, then the values for the header's trailing columns. None unless the cells
        are valid and the values fit the header. ``pad``: the text can show empty cells,
        so missing last cells are empty ones that lost their whitespace in a copy."""
        n = len(self.devices)
        if not parts or parts[0] != label:
            return None
        if len(parts) - 1 < n:
            if not pad:
                return None
            parts = [*parts, *[""] * (n + 1 - len(parts))]
        cells = self.cells_valid(label, parts[1 : n + 1])
        if cells is None:
            return None
        rest = list(parts[n + 1 :])
        # nvidia-smi writes an extra empty cell before "GPU NUMA ID" and pads NIC rows with
        # empty cells: drop empties until the values fit the header, from the right.
        while len(rest) > len(self.trailing) and "" in rest:
            del rest[len(rest) - 1 - rest[::-1].index("")]
        if len(rest) > len(self.trailing):
            return None
        return cells, rest

    def parse_row(self, line_no: int, line: str, label: str) -> _Row:
        """One matrix row. Readings, most faithful first: split at tabs; rebuild the tabs
        of a terminal's 8-column expansion (finds empty cells); split at whitespace
        (cells must then be non-empty: N/A)."""
        n = len(self.devices)
        expanded = line.expandtabs(_TAB_STOP)
        words = [t.text for t in _tokens(expanded)]
        found = None
        if "\t" in line:
            # Strip only the indentation: a trailing tab ends an empty last cell.
            tab_parts = [p.strip() for p in line.lstrip().split("\t")]
            if not any(len(p.split()) > 1 for p in tab_parts):
                found = self.split_cells(label, tab_parts, pad=True)
        if found is None:
            stop_parts = _cells_from_tab_stops(expanded)
            if stop_parts is not None:
                found = self.split_cells(label, stop_parts, pad=True)
        if found is None:
            found = self.split_cells(label, words)
        if found is None:
            values = words[1:]
            if len(values) < n:
                raise self.error(
                    f"row {label} has {len(values)} cells, expected {n} (one per column "
                    f"{self.devices[0]}..{self.devices[-1]}); mark unknown cells N/A",
                    line_no,
                    line,
                )
            if self.cells_valid(label, values[:n]) is None:
                raise self.explain_cells(label, values[:n], line_no, line)
            raise self.error(
                f"row {label} has {len(values) - n} values after the matrix but the header has "
                f"{len(self.trailing)} ({', '.join(self.trailing) or 'none'})",
                line_no,
                line,
            )
        cells, rest = found
        trailing: dict[str, str | None] = {}
        for name, value in zip(self.trailing, rest):
            trailing.setdefault(name, None if _blank(value) else value)
        return _Row(line_no, line, label, cells, trailing)

    def parse_rows(self) -> tuple[dict[str, _Row], int]:
        """Rows by label, and the index of the first line after the matrix."""
        rows: dict[str, _Row] = {}
        i = self.header_line  # 0-based index of the line after the header
        while i < len(self.lines):
            line = self.lines[i]
            words = line.split()
            if not words:
                i += 1
                continue
            label = words[0]
            if label.lower().startswith("legend"):
                break
            if label not in self.column_index:
                if _ROWLIKE_LABEL.fullmatch(label):
                    raise self.error(
                        f"row {label} is not a column of the header (line {self.header_line})",
                        i + 1,
                        line,
                    )
                break
            if label in rows:
                raise self.error(
                    f"second row for {label} (first on line {rows[label].line_no})", i + 1, line
                )
            rows[label] = self.parse_row(i + 1, line, label)
            i += 1
        for g in self.devices[: self.n_gpus]:
            if g not in rows:
                raise self.error(f"no row for {g} (the header on line {self.header_line} lists it)")
        return rows, i

    # ------------------------------------------------------------------ legend
    def parse_nic_legend(self, start: int) -> dict[str, str]:
        legend: dict[str, str] = {}
        for i in range(start, len(self.lines)):
            m = _LEGEND_ENTRY.fullmatch(self.lines[i])
            if not m or m.group(1) not in self.column_index or m.group(1) in self.gpu_labels:
                continue
            col, name = m.group(1), m.group(2)
            if col in legend and legend[col] != name:
                raise self.error(
                    f"NIC legend names {col} twice ({legend[col]}, {name})", i + 1, self.lines[i]
                )
            legend[col] = name
        return legend

    # ------------------------------------------------------------------ assembly
    def resolve(self, rows: dict[str, _Row], a: str, b: str) -> _Cell:
        """The cell between device columns a and b, from a's row or else b's row; both
        rows must agree where both are known."""
        ja, jb = self.column_index[a], self.column_index[b]
        row_a, row_b = rows.get(a), rows.get(b)
        ca = row_a.cells[jb] if row_a else _UNKNOWN
        cb = row_b.cells[ja] if row_b else _UNKNOWN
        if ca is _UNKNOWN:
            return cb
        if cb is not _UNKNOWN and ca != cb:
            assert row_a is not None and row_b is not None
            second = max(row_a, row_b, key=lambda r: r.line_no)
            raise self.error(
                f"the matrix is not symmetric: {a}-{b} is {_show(ca)} on line {row_a.line_no} "
                f"but {_show(cb)} on line {row_b.line_no}",
                second.line_no,
                second.text,
            )
        return ca

    def parse(self) -> NodeFacts:
        h = self.find_header()
        self.parse_header(h)  # its first column is GPU0, so n_gpus >= 1
        self.gpu_labels = set(self.devices[: self.n_gpus])
        rows, after = self.parse_rows()
        legend = self.parse_nic_legend(after)
        n = self.n_gpus
        notes = [
            (
                "read from nvidia-smi topo -m text; GPU UUIDs are synthetic "
                f"({synthetic_gpu_uuid(matrix_name(self.source), 0)} for GPU0), names and PCI "
                "bus IDs unknown"
            )
        ]

        gpus = []
        has_numa = NUMA_AFFINITY in self.trailing
        gpu_numa_ids: list[str] = []
        multi_node: list[str] = []
        for i in range(n):
            row = rows[f"GPU{i}"]
            cpu = row.trailing.get(CPU_AFFINITY)
            if cpu is not None and _cpulist_min(cpu) is None:
                raise self.error(
                    f"CPU Affinity {cpu!r} of GPU{i} is not a CPU list like 0-23,48-71",
                    row.line_no,
                    row.text,
                )
            numa_text = row.trailing.get(NUMA_AFFINITY)
            numa = None
            if numa_text is not None:
                numa = _cpulist_min(numa_text)
                if numa is None:
                    raise self.error(
                        f"NUMA Affinity {numa_text!r} of GPU{i} is not a node number "
                        "or a list like 0,3-9",
                        row.line_no,
                        row.text,
                    )
                if not numa_text.isdigit():
                    multi_node.append(f"GPU{i} {numa_text} -> {numa}")
            gnid = row.trailing.get(GPU_NUMA_ID)
            memory_numa = None
            if gnid is not None:
                if not gnid.isdigit():
                    raise self.error(
                        f"GPU NUMA ID {gnid!r} of GPU{i} is not a number or N/A",
                        row.line_no,
                        row.text,
                    )
                memory_numa = int(gnid)
                gpu_numa_ids.append(f"GPU{i}={memory_numa}")
            gpus.append(
                Gpu(
                    index=i,
                    uuid=synthetic_gpu_uuid(matrix_name(self.source), i),
                    name="unknown",
                    numa_node=numa,
                    cpu_affinity=cpu,
                    numa_affinity=numa_text,
                    memory_numa_node=memory_numa,
                )
            )
        if multi_node:
            notes.append(
                "NUMA Affinity lists several nodes; numa_node is the lowest: "
                + ", ".join(multi_node)
            )
        if gpu_numa_ids:
            notes.append("GPU NUMA ID (the GPU's own memory NUMA node): " + ", ".join(gpu_numa_ids))

        if not has_numa:
            groups = [
                f"group {k} = GPU {','.join(map(str, members))} ({aff})"
                for k, (aff, members) in enumerate(_affinity_groups(gpus).items())
            ]
            notes.append(
                "no NUMA Affinity column: numa_node left unknown; "
                "GPUs grouped by identical CPU Affinity"
                + (": " + "; ".join(groups) if groups else " (none given)")
            )

        def same_node(x: Gpu, y: Gpu) -> bool:
            if x.numa_node is not None and y.numa_node is not None:
                return x.numa_node == y.numa_node
            if x.numa_node is None and y.numa_node is None and x.cpu_affinity is not None:
                return x.cpu_affinity == y.cpu_affinity
            return False

        links = []
        inferred: dict[PcieLevel, list[str]] = {PcieLevel.NODE: [], PcieLevel.SYS: []}
        unknown_pairs = []
        for a in range(n):
            for b in range(a + 1, n):
                cell = self.resolve(rows, f"GPU{a}", f"GPU{b}")
                if cell.kind == "nv":
                    level = PcieLevel.NODE if same_node(gpus[a], gpus[b]) else PcieLevel.SYS
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

        nics = []
        unnamed = []
        for col in self.devices[n:]:
            levels: list[PcieLevel | None] = []
            for i in range(n):
                cell = self.resolve(rows, f"GPU{i}", col)
                if cell.kind == "nv":
                    row = rows[f"GPU{i}"]
                    raise self.error(
                        f"GPU{i} shows NVLinks to {col}, which is not a GPU", row.line_no, row.text
                    )
                levels.append(cell.level)
            if col in legend:
                name = legend[col]
            else:
                name = col
                if re.fullmatch(r"NIC\d+", col):
                    unnamed.append(col)
            nics.append(Nic(name=name, levels=tuple(levels)))
        if unnamed:
            notes.append(f"no NIC Legend entry for {', '.join(unnamed)}: named as in the header")
        ignored = [c for c in self.trailing if c not in _KNOWN_TRAILING]
        if ignored:
            notes.append(f"ignored unknown columns: {', '.join(ignored)}")

        return NodeFacts(
            gpus=tuple(gpus),
            links=tuple(links),
            nics=tuple(nics),
            source=f"topo-matrix:{self.source}",
            notes=tuple(notes),
        )


def _show(cell: _Cell) -> str:
    if cell.kind == "nv":
        return f"NV{cell.nvlinks}"
    if cell.kind == "pcie":
        assert cell.level is not None
        return cell.level.name
    return "X" if cell.kind == "self" else "N/A"
