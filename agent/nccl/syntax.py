"""The text side of NCCL topology files: reads the XML dialect NCCL reads (``NCCL_TOPO_FILE``)
into :class:`XmlElement` trees, by NCCL's own rules, and the one error every unreadable file
raises (:class:`NcclTopologyError`); the class and bus-ID values both the reader and the
writer use. What the tree states becomes :class:`NodeFacts` in :mod:`agent.nccl.node_file`.

NCCL's reader is not an XML parser; it is ``src/graph/xml.cc`` (``ncclTopoGetXmlFromFile``,
``xmlGetNode``, ``xmlLoadSub``, NCCL 2.29, read at NVIDIA/nccl 5067397c). This module follows
it, so a file we accept is a file NCCL accepts:

- Between tags only space, ``\\n`` and ``\\r`` may appear (a tab or any text is
  "expected '<'"); ``<!-- ... -->`` comments are skipped; there is no ``<?xml ...?>``
  prolog (NCCL fails on it: "expected '>', got '?'"), no entities, no CDATA.
- A tag is on one line: its name ends at a space, ``>``, ``/`` or a line break, and each
  attribute follows one space; a line break inside a tag is "expected '>'".
- Attribute values are quoted (``"`` or ``'``, the same quote closing); names and values
  hold at most 253 characters (``MAX_STR_LEN`` 255 with the terminator); attributes after
  the 16th (``MAX_ATTR_COUNT``) are ignored, as NCCL ignores them.
- A closing tag must close the open element (``XML Mismatch``); end of file inside an
  element is "unterminated"; at most 640 children per element (``MAX_SUBS``) and 256
  elements per file (``NCCL_TOPO_XML_MAX_NODES``), counting the elements NCCL keeps.
- Which children NCCL keeps (its handlers): the top level ``system``; ``system``: ``cpu``;
  ``cpu``: ``pci``, ``nic``; ``pci``: ``pci``, ``gpu``, ``nic``, ``pcilink``; ``gpu``:
  ``nvlink``, ``c2c``; ``nic``: ``net``. Any other element is read (it must be well formed)
  and ignored, as NCCL ignores it ("Ignoring element"); :attr:`XmlReader.ignored` lists them.
- ``<system>`` needs ``version="1"`` (NCCL: "XML Topology has wrong version").

Where we refuse what NCCL lets pass, because the file would then say nothing: a file
without a ``<system>`` element (NCCL ignores an unknown root and detects the node
itself), more than one ``<system>``, and a stray closing tag at the top level.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.errors import InputFormatError

#: NCCL's PCI class of an NVSwitch (``kvDictPciClass``) and of a CPU as an NVLink target
NVSWITCH_CLASS = "0x068000"
CPU_CLASS = "0x068001"
#: NCCL's bus ID of an NVLink peer a VM cannot see (it assumes an NVSwitch)
HIDDEN_PEER = "fffffff:ffff:ff"

#: NCCL's limits (src/graph/xml.h, src/graph/topo.h)
MAX_STR_LEN = 255
MAX_VALUE_CHARS = MAX_STR_LEN - 2  # the terminator and the slot the closing quote takes
MAX_ATTR_COUNT = 16
MAX_SUBS = 640
MAX_NODES = 256

#: The children NCCL's handlers keep, by parent ("" is the top level).
HANDLERS: dict[str, frozenset[str]] = {
    "": frozenset({"system"}),
    "system": frozenset({"cpu"}),
    "cpu": frozenset({"pci", "nic"}),
    "pci": frozenset({"pci", "gpu", "nic", "pcilink"}),
    "gpu": frozenset({"nvlink", "c2c"}),
    "nic": frozenset({"net"}),
}

_BLANK = " \n\r"
_NAME_END = " >/\n\r"


@dataclass(frozen=True)
class XmlElement:
    """One element of an NCCL topology file as read: its tag, its attributes in file order,
    its children and the 1-based line it starts on."""

    name: str
    attrs: tuple[tuple[str, str], ...] = ()
    children: tuple["XmlElement", ...] = ()
    line: int = 0

    def get(self, key: str) -> str | None:
        """The value of attribute ``key`` (the first one, as NCCL looks it up), or None."""
        for k, v in self.attrs:
            if k == key:
                return v
        return None


class NcclTopologyError(InputFormatError):
    """An NCCL topology file cannot be read. One line: ``<file>: line <n>: <reason>``."""

    def __init__(self, reason: str, *, source: str, line: int | None = None) -> None:
        self.reason = reason
        self.source = source
        self.line = line
        where = f"{source}: line {line}: " if line is not None else f"{source}: "
        super().__init__(where + reason)


class _Tag:
    __slots__ = ("name", "attrs", "kind", "line")

    def __init__(self, name: str, attrs: list[tuple[str, str]], kind: str, line: int) -> None:
        self.name, self.attrs, self.kind, self.line = name, attrs, kind, line


class XmlReader:
    """One pass over the text of an NCCL topology file, character by character as
    ``xmlGetNode`` reads it. :meth:`read` returns the ``<system>`` element."""

    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.pos = 0
        self.line = 1
        self.kept = 0
        self.ignored: list[tuple[str, int]] = []  # (tag, line) of elements NCCL ignores

    # ------------------------------------------------------------------ characters
    def _fail(self, reason: str, line: int | None = None) -> NcclTopologyError:
        return NcclTopologyError(reason, source=self.source, line=line or self.line)

    def _char(self, inside: str) -> str:
        if self.pos >= len(self.text):
            raise self._fail(f"unexpected end of file {inside}")
        c = self.text[self.pos]
        self.pos += 1
        if c == "\n":
            self.line += 1
        return c

    def _token(self, what: str) -> tuple[str, str, bool]:
        """A name up to a space, '>', '/' or line break (which is returned), or up to '='
        (then ``has_value``)."""
        out: list[str] = []
        while True:
            c = self._char(f"in a {what}")
            if c == "=":
                return "".join(out), c, True
            if c in _NAME_END:
                return "".join(out), c, False
            out.append(c)
            if len(out) > MAX_VALUE_CHARS:
                raise self._fail(f"{what} {''.join(out)[:40]}... longer than {MAX_VALUE_CHARS} characters")

    def _value(self, key: str) -> tuple[str, str]:
        quote = self._char(f"in the value of {key}")
        if quote not in "\"'":
            raise self._fail(f"expected a quoted value for attribute {key}, got {quote!r}")
        out: list[str] = []
        while True:
            c = self._char(f"in the value of {key} (no closing quote)")
            if c == quote:
                break
            out.append(c)
            if len(out) > MAX_VALUE_CHARS:
                raise self._fail(f"value of {key} longer than {MAX_VALUE_CHARS} characters")
        return "".join(out), self._char(f"after the value of {key}")

    def _skip_comment(self, start: int) -> None:
        """Skip to the end of a comment whose ``<!--`` ends at ``start``; the tag-name read
        stops at the first space or '>', so the first ``-->`` is never behind us."""
        end = self.text.find("-->", start)
        if end < 0:
            raise self._fail("unterminated comment (no -->)")
        self.line += self.text.count("\n", self.pos, end + 3)
        self.pos = max(self.pos, end + 3)

    # ------------------------------------------------------------------ tags
    def _tag(self) -> _Tag | None:
        """The next tag, or None at the end of the text (``xmlGetNode``)."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _BLANK:
                self._char("")
            if self.pos >= len(self.text):
                return None
            line = self.line
            c = self._char("")
            if c != "<":
                raise self._fail(f"expected '<', got {c!r} (NCCL reads no text or tabs between tags)")
            start = self.pos
            name, c, has_value = self._token("tag name")
            if name.startswith("!--"):
                self._skip_comment(start + 3)
                continue
            if has_value:
                raise self._fail(f"unexpected '=' in tag name {name!r}")
            if name == "" and c == "/":
                name, c, _ = self._token("closing tag")
                if c != ">":
                    raise self._fail(f"expected '>' to end </{name}, got {c!r}")
                return _Tag(name, [], "close", line)
            return self._attributes(name, c, line)

    def _attributes(self, name: str, c: str, line: int) -> _Tag:
        attrs: list[tuple[str, str]] = []
        while c == " ":
            key, c, has_value = self._token("attribute name")
            value = ""
            if has_value:
                value, c = self._value(key)
            if key and len(attrs) < MAX_ATTR_COUNT:  # NCCL ignores the ones after the 16th
                attrs.append((key, value))
        kind = "open"
        if c == "/":
            kind = "single"
            _, c, _ = self._token("tag end")
        if c != ">":
            raise self._fail(
                f"expected '>' to end <{name}>, got {c!r} (NCCL wants each tag on one line, "
                "attributes after single spaces)",
                line,
            )
        return _Tag(name, attrs, kind, line)

    # ------------------------------------------------------------------ elements
    def _children(self, head: _Tag | None, keep: bool) -> list[XmlElement]:
        """The children of ``head`` up to its closing tag (``xmlLoadSub``); those NCCL
        ignores are read and dropped."""
        handlers = HANDLERS.get(head.name if head else "", frozenset()) if keep else frozenset()
        out: list[XmlElement] = []
        while True:
            tag = self._tag()
            if tag is None:
                if head is not None:
                    raise self._fail(f"unterminated <{head.name}> (opened on line {head.line})")
                return out
            if tag.kind == "close":
                if head is None:
                    raise self._fail(f"unexpected </{tag.name}> with no open element", tag.line)
                if tag.name != head.name:
                    raise self._fail(f"</{tag.name}> closes <{head.name}> (opened on line {head.line})", tag.line)
                return out
            if tag.name not in handlers:
                if keep:
                    self.ignored.append((tag.name, tag.line))
                if tag.kind == "open":
                    self._children(tag, False)
                continue
            self.kept += 1
            if self.kept > MAX_NODES:
                raise self._fail(f"more than {MAX_NODES} elements (NCCL's limit per file)", tag.line)
            if len(out) == MAX_SUBS:
                raise self._fail(f"more than {MAX_SUBS} children in one element (NCCL's limit)", tag.line)
            subs = self._children(tag, True) if tag.kind == "open" else []
            out.append(XmlElement(tag.name, tuple(tag.attrs), tuple(subs), tag.line))

    def read(self) -> XmlElement:
        """The file's ``<system>`` element; NcclTopologyError for anything NCCL would
        refuse and for a file that states no topology (module docstring)."""
        top = self._children(None, True)
        if not top:
            found = ", ".join(f"<{n}> (line {ln})" for n, ln in self.ignored[:3])
            raise self._fail(
                "no <system> element: expected an NCCL topology file, whose root is "
                '<system version="1">' + (f"; found {found}" if found else ""),
                self.ignored[0][1] if self.ignored else 1,
            )
        if len(top) > 1:
            raise self._fail("more than one <system> element", top[1].line)
        system = top[0]
        version = system.get("version")
        if version is None or not _c_int(version) == 1:
            raise self._fail(
                f'<system> has version={version!r}; NCCL reads version="1" only', system.line
            )
        return system


def _c_int(text: str) -> int | None:
    """``strtol(text, NULL, 0)`` for the values NCCL reads as numbers: decimal, ``0x``
    hex or ``0`` octal; None where there is no number at all."""
    t = text.strip()
    sign = -1 if t.startswith("-") else 1
    t = t.lstrip("+-")
    base, digits = 10, t
    if t[:2].lower() == "0x":
        base, digits = 16, t[2:]
    elif t.startswith("0") and len(t) > 1:
        base, digits = 8, t[1:]
    valid = "0123456789abcdef"[:base]
    n = 0
    used = 0
    for ch in digits.lower():
        if ch not in valid:
            break
        n = n * base + valid.index(ch)
        used += 1
    if used == 0 and not (base == 8 or t == "0"):
        return None
    return sign * n


def c_int(text: str | None) -> int | None:
    """A numeric attribute read as NCCL reads it (``strtol`` base 0), or None."""
    return None if text is None else _c_int(text)


def parse_nccl_xml(text: str, source: str) -> tuple[XmlElement, list[tuple[str, int]]]:
    """The ``<system>`` element of an NCCL topology file's text and the (tag, line) of the
    elements NCCL would ignore. Raises :class:`NcclTopologyError` (module docstring)."""
    reader = XmlReader(text, source)
    return reader.read(), reader.ignored
