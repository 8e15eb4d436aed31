"""The text side of reading pasted ``nvidia-smi topo -m`` output: the header, the rows and
their cells, the NIC legend (:class:`MatrixReader`), and the one error every unreadable
input raises (:class:`TopoMatrixError`). What the rows state becomes :class:`NodeFacts` in
:mod:`agent.hw.topo_matrix`, whose docstring describes the accepted text.

Size: :class:`MatrixReader` is one pass over the pasted text (header, rows, legend) whose
steps share the column positions it found; its cell and tab-stop helpers and the error
it raises read only with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from agent.errors import InputFormatError
from agent.records import PcieLevel

CPU_AFFINITY = "CPU Affinity"
NUMA_AFFINITY = "NUMA Affinity"
GPU_NUMA_ID = "GPU NUMA ID"
KNOWN_TRAILING = (CPU_AFFINITY, NUMA_AFFINITY, GPU_NUMA_ID)

# Header tokens: the multi-word column names first, so "CPU Affinity" stays one column.
_HEADER_TOKEN = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|\S+", re.IGNORECASE)
_GPU_NAME = re.compile(r"GPU(\d+)")
_ROWLIKE_LABEL = re.compile(r"(?:GPU|NIC)\d+")
_NV_CELL = re.compile(r"NV([1-9]\d{0,3})", re.IGNORECASE)
_CPULIST = re.compile(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*")
# Terminal control sequences (ECMA-48 CSI): nvidia-smi underlines the header line
# (ESC[4m ... ESC[0m) even when its output goes to a pipe or a file; they take no columns.
_CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_LEGEND_ENTRY = re.compile(r"\s*([A-Za-z][\w.-]*)\s*:\s*(\S+)\s*")
_UNKNOWN_CELLS = frozenset({"", "N/A"})
_TAB_STOP = 8  # terminals expand nvidia-smi's tabs to 8-column stops


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


@dataclass(frozen=True)
class Cell:
    """One matrix cell: kind is "self", "nv", "pcie" or "unknown"."""

    kind: str
    nvlinks: int = 0
    level: PcieLevel | None = None


_SELF = Cell("self")
_UNKNOWN = Cell("unknown")


def _parse_cell(text: str) -> Cell | None:
    """The cell, or None if the text is not a matrix cell."""
    t = text.strip().upper()
    if t in _UNKNOWN_CELLS:
        return _UNKNOWN
    if t == "X":
        return _SELF
    m = _NV_CELL.fullmatch(t)
    if m:
        return Cell("nv", nvlinks=int(m.group(1)))
    try:
        return Cell("pcie", level=PcieLevel.parse(t))
    except KeyError:
        return None


@dataclass(frozen=True)
class _Token:
    text: str
    start: int
    end: int


@dataclass
class Row:
    line_no: int
    text: str
    label: str
    cells: list[Cell]  # one per device column
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


def cpulist_min(value: str) -> int | None:
    """Lowest number of a cpulist-style list, or None if ``value`` is not one. Not
    :func:`agent.formats.parse_cpulist`: a pasted cell may hold any text, and expanding a
    range such as ``0-4000000000`` to find its lowest number would not end."""
    if not _CPULIST.fullmatch(value):
        return None
    lowest = None
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        if hi and int(hi) < int(lo):
            return None
        lowest = int(lo) if lowest is None else min(lowest, int(lo))
    return lowest


class MatrixReader:
    """Reads the text of one pasted matrix: :meth:`read` fills :attr:`devices` (the device
    columns, GPUs first), :attr:`n_gpus`, :attr:`trailing` (the columns after the matrix),
    :attr:`rows` by label and :attr:`legend` (NIC column -> name); :meth:`resolve` gives the
    cell between two columns and :meth:`error` the error naming a line."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        text = _CSI.sub("", text.lstrip("\ufeff"))
        self.lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self.rows: dict[str, Row] = {}
        self.legend: dict[str, str] = {}

    def read(self) -> None:
        """Read the header, the rows and the NIC legend; TopoMatrixError naming the line for
        anything unreadable."""
        self.parse_header(self.find_header())  # its first column is GPU0, so n_gpus >= 1
        self.gpu_labels = set(self.devices[: self.n_gpus])
        self.rows, after = self.parse_rows()
        self.legend = self.parse_nic_legend(after)

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
            for known in KNOWN_TRAILING:  # normalise the case of the known names
                if name.lower() == known.lower():
                    name = known
            names.append(name)
        devices: list[str] = []
        trailing: list[str] = []
        for name in names:
            if trailing or name in KNOWN_TRAILING:
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
    def cells_valid(self, label: str, texts: Sequence[str]) -> list[Cell] | None:
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
    ) -> tuple[list[Cell], list[str]] | None:
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

    def parse_row(self, line_no: int, line: str, label: str) -> Row:
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
        return Row(line_no, line, label, cells, trailing)

    def parse_rows(self) -> tuple[dict[str, Row], int]:
        """Rows by label, and the index of the first line after the matrix."""
        rows: dict[str, Row] = {}
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
    def resolve(self, a: str, b: str) -> Cell:
        """The cell between device columns a and b, from a's row or else b's row; both
        rows must agree where both are known."""
        ja, jb = self.column_index[a], self.column_index[b]
        row_a, row_b = self.rows.get(a), self.rows.get(b)
        ca = row_a.cells[jb] if row_a else _UNKNOWN
        cb = row_b.cells[ja] if row_b else _UNKNOWN
        if ca is _UNKNOWN:
            return cb
        if cb is not _UNKNOWN and ca != cb:
            assert row_a is not None and row_b is not None
            second = max(row_a, row_b, key=lambda r: r.line_no)
            raise self.error(
                f"the matrix is not symmetric: {a}-{b} is {show_cell(ca)} on line {row_a.line_no} "
                f"but {show_cell(cb)} on line {row_b.line_no}",
                second.line_no,
                second.text,
            )
        return ca


def show_cell(cell: Cell) -> str:
    if cell.kind == "nv":
        return f"NV{cell.nvlinks}"
    if cell.kind == "pcie":
        assert cell.level is not None
        return cell.level.name
    return "X" if cell.kind == "self" else "N/A"
