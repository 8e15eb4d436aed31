"""Device IDs at the edge of the allocation engine: their one natural order, a resource's table
of every ID it offers, and the one validation of a request.

The kubelet names devices by ID: GPU UUIDs, MIG device UUIDs, time-sliced replicas
``<uuid>::<n>``. A :class:`DeviceTable` is built once per resource (its IDs never change while
it is served) and gives every ID a *rank*, its position in the order (GPU index, natural
order). :meth:`DeviceTable.request` checks a preferred-allocation request once and maps it to
ranks (a :class:`DeviceRequest`); :meth:`DeviceTable.lookup` does the same for an Allocate
list. Below this edge the engine works on ranks and never checks them again (the compiled
kernel keeps its own argument guards, which a valid request never trips). On a table of whole
GPUs (one device per GPU), :meth:`DeviceTable.gpu_masks` is the same check with the answer as
GPU bitmasks: what the engine's search takes, without the rank lists in between (the
device plugin's GetPreferredAllocation for ``nvidia.com/gpu`` takes this path).

Each kind of mistake has one message, whichever call makes it (GetPreferredAllocation,
Allocate, the ``allocate`` command); ``LIST`` names the list (``available``,
``must-include``, ``devices``) and untrusted values are shortened:

- ``LIST: malformed device ID 'x': expected a GPU or MIG UUID, optionally with ::<replica>``
- ``LIST: unknown device ID 'GPU-..' for resource nvidia.com/gpu``
- ``LIST: device ID 'GPU-..' given twice``
- ``LIST: empty device list``
- ``must-include: device ID 'GPU-..' is not in the available list``
- ``size must be at least 1, got 0``
- ``size 9 is more than the 8 available devices``
- ``3 must-include devices do not fit in size 2``
"""

from __future__ import annotations

import re
from bisect import bisect_left
from typing import NamedTuple, NoReturn, Sequence

from agent.errors import AllocationError, shorten

#: GPU and MIG UUIDs (including the old ``MIG-GPU-<uuid>/<gi>/<ci>`` form), optionally with a
#: replica suffix: what tells a malformed ID from an unknown one.
DEVICE_ID_PATTERN = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/-]+(::[0-9]+)?$")


def natural_key(device_id: str) -> tuple[str, int, str]:
    """The one natural order of device IDs: ``<uuid>::2`` before ``<uuid>::10`` (replica
    numbers as numbers), every other ID by its text."""
    head, sep, tail = device_id.rpartition("::")
    if sep and tail.isdigit():
        return (head, int(tail), "")
    return (device_id, -1, device_id)


class DeviceRequest(NamedTuple):
    """A valid request in the ranks of one :class:`DeviceTable`: what the engine takes."""

    available: list[int]  #: distinct ranks, ascending (the must-include ones among them)
    required: list[int]  #: the must-include ranks, distinct, ascending
    size: int  #: max(1, len(required)) <= size <= len(available)


class DeviceTable:
    """Every device ID one resource offers, with its GPU index, ranked by (GPU index, natural
    order, then the ID's text where two IDs have the same natural key, such as ``x::1`` and
    ``x::01``).

    ``ids[r]`` is the ID of rank r, ``gpu[r]`` its GPU and ``gpu_bit[r]`` that GPU's bit,
    ``rank[id]`` the rank of an ID, and the ranks of GPU g are ``start[g]`` up to
    ``start[g + 1]`` (so on a resource of whole GPUs, GPU g's device has rank ``start[g]``).
    On a table of whole GPUs (one device per GPU) ``id_of_gpu[g]`` is GPU g's device ID (""
    for a GPU the table does not hold)."""

    def __init__(self, devices: Sequence[tuple[str, int]], gpu_count: int, resource: str) -> None:
        """``devices`` pairs each device ID (distinct) with its GPU index (0 to
        ``gpu_count - 1``); ``resource`` is the resource's name, for messages."""
        order = sorted(devices, key=lambda p: (p[1], natural_key(p[0]), p[0]))
        self.resource = resource
        self.ids: list[str] = [d for d, _ in order]
        self.gpu: list[int] = [g for _, g in order]
        self.gpu_bit: list[int] = [1 << g for g in self.gpu]
        self.rank: dict[str, int] = {d: r for r, d in enumerate(self.ids)}
        self.start: list[int] = [bisect_left(self.gpu, g) for g in range(gpu_count + 1)]
        if len(self.rank) != len(self.ids):
            raise ValueError(f"{resource}: the device table lists an ID twice")
        self._bit = dict(zip(self.ids, self.gpu_bit))
        self.id_of_gpu: list[str] = [""] * gpu_count
        for device_id, g in zip(self.ids, self.gpu):
            self.id_of_gpu[g] = device_id

    def request(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> DeviceRequest:
        """The request in ranks, else AllocationError naming its first mistake (the module
        docstring lists them). This runs on every kubelet request: one dict lookup per ID,
        then checks on the ranks at C level; only a request with a mistake takes the pass
        that names it."""
        rank = self.rank
        try:
            ranks = sorted(map(rank.__getitem__, available))
            required = sorted(map(rank.__getitem__, must_include)) if must_include else []
        except (KeyError, TypeError):  # an ID not in the table (or not a str)
            self._explain(available, must_include, size)
        distinct = set(ranks)
        if (
            1 <= size <= len(ranks)
            and len(required) <= size
            and len(distinct) == len(ranks)
            and (not required or (len(set(required)) == len(required) and distinct.issuperset(required)))
        ):
            return DeviceRequest(ranks, required, size)
        self._explain(available, must_include, size)

    def gpu_masks(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> tuple[int, int]:
        """:meth:`request` for a table of whole GPUs (one device per GPU): the same checks and
        messages, answered as the (available, must-include) GPU bitmasks. Two integers
        carry the checks: a sum of distinct bits has one bit per ID, a repeated ID carries."""
        bit = self._bit
        try:
            avail = sum(map(bit.__getitem__, available))
            required = sum(map(bit.__getitem__, must_include)) if must_include else 0
        except (KeyError, TypeError):  # an ID not in the table (or not a str)
            self._explain(available, must_include, size)
        n = len(available)
        if (
            avail.bit_count() == n
            and 1 <= size <= n
            and required.bit_count() == len(must_include) <= size
            and not required & ~avail
        ):
            return avail, required
        self._explain(available, must_include, size)

    def lookup(self, ids: Sequence[str], what: str) -> list[int]:
        """The ranks of ``ids`` (a list of devices for one container), in order, else
        AllocationError naming the first unknown, malformed or repeated ID; ``what`` names
        the list."""
        if not ids:
            raise AllocationError(f"{what}: empty device list")
        out: list[int] = []
        seen: set[int] = set()
        for device_id in ids:
            r = self.rank.get(device_id) if type(device_id) is str else None
            if r is None:
                raise AllocationError(self._not_a_device(device_id, what))
            if r in seen:
                raise AllocationError(f"{what}: device ID {_quote(device_id)} given twice")
            seen.add(r)
            out.append(r)
        return out

    def _not_a_device(self, device_id: object, what: str) -> str:
        if type(device_id) is not str or not DEVICE_ID_PATTERN.match(device_id):
            return (
                f"{what}: malformed device ID {_quote(device_id)}: expected a GPU or MIG UUID,"
                f" optionally with ::<replica>"
            )
        return f"{what}: unknown device ID {_quote(device_id)} for resource {self.resource}"

    def _explain(self, available: Sequence[str], must_include: Sequence[str], size: int) -> NoReturn:
        """Raise AllocationError for the first mistake of a request (IDs of available, of
        must-include, must-include outside available, then the size)."""
        avail = self.lookup(available, "available") if available else []
        required = self.lookup(must_include, "must-include") if must_include else []
        outside = sorted(set(required).difference(avail), key=required.index)
        if outside:
            device_id = _quote(self.ids[outside[0]])
            raise AllocationError(f"must-include: device ID {device_id} is not in the available list")
        if size < 1:
            raise AllocationError(f"size must be at least 1, got {size}")
        if size > len(avail):
            raise AllocationError(f"size {size} is more than the {len(avail)} available devices")
        if len(required) > size:
            raise AllocationError(f"{len(required)} must-include devices do not fit in size {size}")
        raise AssertionError("a valid request was refused")  # pragma: no cover


def _quote(value: object) -> str:
    """An untrusted ID for a message: quoted, and shortened when long."""
    return repr(shorten(value)) if isinstance(value, str) else shorten(repr(value))
