"""A stand-in for NCCL's topology file reader, for checking the files the agent writes.

Follows NCCL's ``src/graph/xml.cc`` and ``src/graph/topo.cc`` (NVIDIA/nccl 5067397c), written
apart from the agent's own reader so the two check each other:

- ``xmlGetNode``: between tags only ' ', '\\n', '\\r'; a tag's name ends at ' ', '>', '/',
  '\\n' or '\\r'; attributes follow single spaces, values quoted; a line break inside a
  tag, an unquoted value or text between tags fail; ``<!-- -->`` is skipped.
- ``MAX_STR_LEN`` 255 (253 characters of name or value), ``MAX_ATTR_COUNT`` 16 (more are
  dropped), ``MAX_SUBS`` 640 children, ``NCCL_TOPO_XML_MAX_NODES`` 256 elements kept.
- ``xmlLoadSub``'s handlers: top ``system``; ``system``: ``cpu``; ``cpu``: ``pci``, ``nic``;
  ``pci``: ``pci``, ``gpu``, ``nic``, ``pcilink``; ``gpu``: ``nvlink``, ``c2c``; ``nic``:
  ``net``; anything else ignored.
- ``ncclTopoXmlLoadSystem``: ``version`` must be 1.
- What ``ncclTopoGetSystemFromXml`` then needs of a file whose gaps NCCL fills from the
  container (``ncclTopoGetXmlFromSys``/``FromCpu``/``FromGpu`` fill only missing
  attributes): ``cpu numaid``; ``pci busid`` and ``class``; ``nvlink count`` and
  ``tclass``. A GPU's bus ID must be spelled as ``int64ToBusId`` spells it (lower case,
  4-digit domain), or ``xmlFindTagKv`` (``strcmp``) never finds it; a ``<gpu>`` must not
  carry ``dev`` (NCCL would keep a node-wide CUDA index in a container that numbers its
  GPUs from 0) nor ``rank``.

:func:`load` returns what NCCL would build: GPUs and NICs with their CPU and switch path,
and the NVLinks; :class:`Refused` is what NCCL would fail on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

HANDLERS = {
    "": {"system"}, "system": {"cpu"}, "cpu": {"pci", "nic"},
    "pci": {"pci", "gpu", "nic", "pcilink"}, "gpu": {"nvlink", "c2c"}, "nic": {"net"},
}
NCCL_BUS_ID = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class Refused(Exception):
    pass


@dataclass
class Node:
    name: str
    attrs: dict[str, str]
    subs: list["Node"] = field(default_factory=list)


class _Text:
    def __init__(self, text: str) -> None:
        self.text, self.i, self.kept = text, 0, 0

    def char(self) -> str:
        if self.i >= len(self.text):
            raise Refused("XML Parse : Unexpected EOF")
        self.i += 1
        return self.text[self.i - 1]

    def token(self) -> tuple[str, str]:
        out = ""
        while True:
            c = self.char()
            if c == "=" or c in " >/\n\r":
                return out, c
            out += c
            if len(out) >= 254:
                raise Refused("name too long")

    def node(self) -> tuple[str, str, dict[str, str]] | None:
        while self.i < len(self.text) and self.text[self.i] in " \n\r":
            self.i += 1
        if self.i >= len(self.text):
            return None
        if self.char() != "<":
            raise Refused("XML Parse error : expecting '<'")
        name, c = self.token()
        if name.startswith("!--"):
            end = self.text.find("-->", self.i - len(name) + 2)
            if end < 0:
                raise Refused("unterminated comment")
            self.i = max(self.i, end + 3)
            return self.node()
        if name == "" and c == "/":
            name, c = self.token()
            if c != ">":
                raise Refused("unexpected trailing char in closing tag")
            return "close", name, {}
        attrs: dict[str, str] = {}
        while c == " ":
            key, c = self.token()
            if c == "=":
                quote = self.char()
                if quote not in "\"'":
                    raise Refused("Expected (double) quote.")
                end = self.text.find(quote, self.i)
                if end < 0 or end - self.i >= 254:
                    raise Refused("value too long or unterminated")
                value, self.i = self.text[self.i:end], end + 1
                c = self.char()
                if len(attrs) < 16:
                    attrs.setdefault(key, value)
        kind = "open"
        if c == "/":
            kind = "single"
            _, c = self.token()
        if c != ">":
            raise Refused(f"XML Parse : expected >, got {c!r}")
        return kind, name, attrs

    def load(self, head: Node | None, kind: str, keep: bool) -> None:
        if kind == "single":
            return
        while True:
            got = self.node()
            if got is None:
                if head is not None:
                    raise Refused(f"unterminated {head.name}")
                return
            kind_, name, attrs = got
            if kind_ == "close":
                if head is None or name != head.name:
                    raise Refused("XML Mismatch")
                return
            if keep and name in HANDLERS.get(head.name if head else "", set()):
                self.kept += 1
                if self.kept > 256:
                    raise Refused("XML parser is limited to 256 nodes")
                node = Node(name, attrs)
                if head is not None:
                    if len(head.subs) == 640:
                        raise Refused("limited to 640 subnodes")
                    head.subs.append(node)
                else:
                    self.top.append(node)
                self.load(node, kind_, True)
            else:
                self.load(Node(name, attrs), kind_, False)


@dataclass
class System:
    gpus: dict[str, tuple[str, tuple[str, ...]]]  # bus ID -> (cpu numaid, switch path)
    nics: dict[str, tuple[str, tuple[str, ...]]]  # bus ID or net name -> (numaid, path)
    nvlinks: dict[str, dict[str, int]]  # GPU bus ID -> target -> count


def load(text: str) -> System:
    """Parse ``text`` as NCCL would and return what it describes; Refused where NCCL fails."""
    reader = _Text(text)
    reader.top: list[Node] = []  # type: ignore[misc]
    reader.load(None, "open", True)
    systems = [n for n in reader.top if n.name == "system"]
    if len(systems) != 1 or systems[0].attrs.get("version") != "1":
        raise Refused("XML Topology has wrong version")
    out = System({}, {}, {})
    for cpu in systems[0].subs:
        if not re.fullmatch(r"-?\d+", cpu.attrs.get("numaid", "")):
            raise Refused("Attribute numaid of node cpu not found")
        for sub in cpu.subs:
            _walk(sub, cpu.attrs["numaid"], (), out)
    return out


def _walk(node: Node, numa: str, path: tuple[str, ...], out: System) -> None:
    if node.name == "nic":
        for net in node.subs:
            out.nics[net.attrs.get("name", "")] = (numa, path)
        return
    bus, cls = node.attrs.get("busid"), node.attrs.get("class")
    if bus is None or cls is None:
        raise Refused("Attribute busid/class of node pci not found")
    if cls.startswith("0x03"):
        if not NCCL_BUS_ID.match(bus):
            raise Refused(f"GPU bus ID {bus} is not NCCL's spelling: NCCL would never find it")
        out.gpus[bus] = (numa, path)
        links: dict[str, int] = {}
        for gpu in (s for s in node.subs if s.name == "gpu"):
            if "dev" in gpu.attrs or "rank" in gpu.attrs:
                raise Refused("a <gpu> with dev/rank: a node-wide CUDA index in a container")
            for link in gpu.subs:
                if link.name == "nvlink":
                    if not link.attrs.get("count", "").isdigit() or "tclass" not in link.attrs:
                        raise Refused("Attribute count/tclass of node nvlink not found")
                    links[link.attrs.get("target", "")] = int(link.attrs["count"])
        out.nvlinks[bus] = links
    elif cls.startswith("0x02") or any(s.name == "nic" for s in node.subs):
        out.nics[bus] = (numa, path)
    else:
        for sub in node.subs:
            if sub.name == "pci":
                _walk(sub, numa, (*path, bus), out)
