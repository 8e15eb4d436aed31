"""Small parsers and spellings shared by every layer: one definition each.

A leaf module (it imports only :mod:`agent.errors`): kernel cpulists, PCI bus ids in NVML's
and sysfs's spellings, the GPU resource names, ``HOST:PORT`` addresses, Kubernetes
quantities, and YAML/JSON documents read from a file.
"""

from __future__ import annotations

import decimal
import json
import re
from typing import Any, Iterable

import yaml

from agent.errors import InputFormatError, shorten


# --------------------------------------------------------------------------- PCI bus ids
class BusIdError(InputFormatError, ValueError):
    """A PCI bus id that is neither NVML's nor sysfs's spelling (exit code 2)."""


# domain:bus:device.function; the domain may be longer than 4 digits (VMD domains are
# 0x10000 and up) and NVML pads it to 8.
_BUS_ID_RE = re.compile(
    r"^(?P<domain>[0-9a-fA-F]{1,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
    r"\.(?P<fn>[0-7])$"
)



def parse_bus_id(bus_id: str) -> tuple[int, int, int, int]:
    """``(domain, bus, device, function)`` of either spelling; :class:`BusIdError` if not
    a bus id."""
    m = _BUS_ID_RE.match(bus_id.strip()) if isinstance(bus_id, str) else None
    if m is None:
        raise BusIdError(
            f"not a PCI bus id: {bus_id!r} (expected e.g. '00000000:3B:00.0' or '0000:3b:00.0')"
        )
    dev = int(m["dev"], 16)
    if dev > 0x1F:
        raise BusIdError(f"not a PCI bus id: {bus_id!r} (device number {dev:#x} > 0x1f)")
    return int(m["domain"], 16), int(m["bus"], 16), dev, int(m["fn"])


def sysfs_spelling(domain: int, bus: int, dev: int, fn: int) -> str:
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"


def nvml_to_sysfs_bus_id(bus_id: str) -> str:
    """``"00000000:3B:00.0"`` -> ``"0000:3b:00.0"``. Accepts either spelling (idempotent);
    raises :class:`BusIdError` for anything else."""
    return sysfs_spelling(*parse_bus_id(bus_id))


def sysfs_to_nvml_bus_id(bus_id: str) -> str:
    """``"0000:3b:00.0"`` -> ``"00000000:3B:00.0"``. Accepts either spelling (idempotent);
    raises :class:`BusIdError` for anything else."""
    domain, bus, dev, fn = parse_bus_id(bus_id)
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}"


# --------------------------------------------------------------------------- cpulists
def parse_cpulist(text: str) -> list[int]:
    """The CPUs of a kernel cpulist, sorted and unique: ``"0-3,8\\n"`` -> ``[0, 1, 2, 3, 8]``.

    Accepts the kernel's list syntax including strided groups (``"0-15:2/4"``: of each
    group of 4 starting at 0, the first 2). ``""`` is the empty list (a memory-only NUMA
    node). Raises ``ValueError`` naming the bad part otherwise.
    """
    cpus: set[int] = set()
    stripped = text.strip()
    if not stripped:
        return []
    for part in stripped.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?\s*", part)
        if m is None:
            raise ValueError(f"bad cpulist part {part!r} in {text.strip()!r}")
        first = int(m[1])
        last = int(m[2]) if m[2] is not None else first
        if last < first:
            raise ValueError(f"bad cpulist range {part!r} in {text.strip()!r}")
        if m[3] is not None:
            used, group = int(m[3]), int(m[4])
            if group == 0 or used == 0 or used > group:
                raise ValueError(f"bad cpulist stride {part!r} in {text.strip()!r}")
            cpus.update(c for c in range(first, last + 1) if (c - first) % group < used)
        else:
            cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The kernel's spelling of a CPU set: ``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (no newline)."""
    ordered = sorted(set(cpus))
    if ordered and ordered[0] < 0:
        raise ValueError(f"negative CPU number {ordered[0]}")
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


# --------------------------------------------------------------------------- resource names
#: The extended resource of whole GPUs, NVIDIA's name (kept: pods and quotas ask for it).
GPU_RESOURCE = "nvidia.com/gpu"
#: The resources of MIG devices under ``migStrategy: mixed``: this prefix and the profile,
#: ``nvidia.com/mig-1g.10gb``.
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


# --------------------------------------------------------------------------- HOST:PORT
def parse_host_port(address: str, what: str = "address") -> tuple[str, int]:
    """``"127.0.0.1:9400"`` -> ("127.0.0.1", 9400); ``":9400"`` -> ("", 9400) (all
    interfaces); ``"[::1]:9400"`` -> ("::1", 9400). ``ValueError`` naming ``what`` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} {shorten(repr(address))}: expected HOST:PORT or :PORT (port 0-65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


# --------------------------------------------------------------------------- quantities
#: Kubernetes' ``resource.Quantity`` syntax (k8s.io/apimachinery/pkg/api/resource): a signed
#: decimal number, then a binary suffix (Ki..Ei), a decimal one (m, k, M..E) or an exponent.
_QUANTITY_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[mkMGTPE]|)$")
_QUANTITY_SUFFIX = {
    **{s: decimal.Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    "m": decimal.Decimal("0.001"), "": decimal.Decimal(1),
    **{s: decimal.Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}


def parse_quantity(text: str) -> decimal.Decimal:
    """A Kubernetes quantity (``"10Gi"``, ``"1.5G"``, ``"2e9"``, ``"512"``) as its exact
    value; ``ValueError`` when ``text`` is not one."""
    match = _QUANTITY_RE.match(text) if len(text) <= 64 else None
    if match is None:
        raise ValueError(f"{shorten(repr(text))} is not a quantity (a number with an optional suffix:"
                         " Ki, Mi, Gi, Ti, Pi, Ei, m, k, M, G, T, P, E, or an exponent)")
    number, suffix = match.groups()
    # 60 digits: exact for every quantity Kubernetes takes (up to 2^63 with 3 decimals)
    with decimal.localcontext(decimal.Context(prec=60)):
        if suffix[:1] in ("e", "E"):
            if abs(int(suffix[1:])) > 30:  # Kubernetes' range ends at 2^63 anyway
                raise ValueError(f"{shorten(repr(text))} is out of range (exponent beyond 30)")
            return decimal.Decimal(number).scaleb(int(suffix[1:]))
        return decimal.Decimal(number) * _QUANTITY_SUFFIX[suffix]


# --------------------------------------------------------------------------- files
#: What a YAML or JSON document read here may be. A config file or a machine spec is a few
#: KiB holding hundreds of values; parsing YAML costs about 0.7 KiB of memory per value
#: (measured: 500,000 values, 340 MiB), so these bounds keep a bad file far inside the
#: agent's 256 MiB limit. Values are counted with YAML aliases expanded (as every reader of
#: the result sees them): a 242-byte "billion laughs" alias bomb is refused, not walked.
MAX_DOCUMENT_BYTES = 1 << 20
MAX_DOCUMENT_VALUES = 50_000
MAX_DOCUMENT_DEPTH = 100


class _TooLarge(Exception):
    """A document past one of the bounds above; the message says which."""


class _BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no stubs here
    """``yaml.SafeLoader`` that stops composing past :data:`MAX_DOCUMENT_VALUES` values or
    :data:`MAX_DOCUMENT_DEPTH` levels, and refuses a document whose aliases expand past the
    value bound (or into themselves) before anything is constructed from it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._values = 0
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):  # the anchored node again: counted when expanded
            return super().compose_node(parent, index)
        self._values += 1
        if self._values > MAX_DOCUMENT_VALUES:
            raise _TooLarge(f"more than {MAX_DOCUMENT_VALUES} values")
        self._depth += 1
        try:
            if self._depth > MAX_DOCUMENT_DEPTH:
                raise _TooLarge(f"nested deeper than {MAX_DOCUMENT_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _check_expanded(node)
        return node


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expanded(root: Any) -> None:
    """Raise :class:`_TooLarge` when ``root`` holds more than MAX_DOCUMENT_VALUES values with
    every alias counted as a copy, or an alias inside the value it names. Each node is sized
    once (a depth-first walk with memory), so a bomb costs as little as its text."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # entered, not yet sized: the ancestors of the current node
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > MAX_DOCUMENT_VALUES:
                raise _TooLarge(f"more than {MAX_DOCUMENT_VALUES} values once its aliases are expanded")
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise _TooLarge("an alias inside the value it names")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def read_document(path: str, what: str = "file") -> Any:
    """The YAML or JSON document in ``path`` (JSON when the name ends in ``.json``: json gives
    better messages for JSON files). Raises :class:`InputFormatError` naming the file when it
    cannot be read, is larger than :data:`MAX_DOCUMENT_BYTES`, is not UTF-8 text, or does not
    parse within the bounds above."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise InputFormatError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise InputFormatError(f"{path}: {what} is larger than {MAX_DOCUMENT_BYTES} bytes (1 MiB)")
    return parse_document(raw, path, what)


def decode_text(raw: bytes, source: str, what: str = "file", fix: str = "save it as UTF-8") -> str:
    """``raw`` as UTF-8 text; :class:`InputFormatError` naming ``source``, the first bad byte
    and its offset (and a UTF-16 byte-order mark, the usual culprit) otherwise."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        hint = " (it starts with a UTF-16 byte-order mark)" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise InputFormatError(
            f"{source}: {what} is not UTF-8 text: byte {raw[exc.start]:#04x} at offset "
            f"{exc.start}{hint}; {fix}"
        ) from None


def parse_document(raw: bytes | str, source: str, what: str = "file") -> Any:
    """Like :func:`read_document` for bytes already read (``source`` names them)."""
    text = decode_text(raw, source, what) if isinstance(raw, bytes) else raw
    text = text.removeprefix("\ufeff")
    as_json = source.endswith(".json")
    try:
        return json.loads(text) if as_json else yaml.load(text, Loader=_BoundedLoader)
    except _TooLarge as exc:
        raise InputFormatError(f"{source}: {what} refused: {exc}") from None
    except RecursionError:  # json's nesting (YAML's stops at MAX_DOCUMENT_DEPTH)
        raise InputFormatError(f"{source}: {what} refused: nested too deeply") from None
    except (ValueError, yaml.YAMLError) as exc:
        detail = shorten(" ".join(str(exc).split()) or type(exc).__name__, 400)
        raise InputFormatError(f"{source}: not valid {'JSON' if as_json else 'YAML'}: {detail}") from None
