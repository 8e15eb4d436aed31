"""Device IDs of shared GPUs (time-sliced replicas ``<uuid>::<n>``, MIG devices): their one
natural order, and a resource's table of every ID it can offer.

A :class:`DeviceTable` is built once per device-plugin resource (its IDs never change while
the resource is served). It gives every ID a *rank*: its position in the order (GPU index,
natural order), so a request's IDs become small ints with one dict lookup each, and sorting,
grouping by GPU and picking a GPU's lowest IDs are int operations at C level
(:meth:`agent.topology.allocator.AllocationEngine.replicas_in`).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from agent.errors import AllocationError

_NATURAL_KEYS: dict[str, tuple[str, int, str]] = {}
_HEADS: dict[str, str] = {}  # one string object per head: tuple keys then compare by identity


def natural_key(device_id: str) -> tuple[str, int, str]:
    """The one natural order of device IDs: ``<uuid>::2`` before ``<uuid>::10`` (replica
    numbers as numbers), every other ID by its text. Cached: the same IDs come back on every
    kubelet request."""
    key = _NATURAL_KEYS.get(device_id)
    if key is None:
        head, sep, tail = device_id.rpartition("::")
        if len(_NATURAL_KEYS) > 100_000:  # bound the caches on a node whose IDs churn
            _NATURAL_KEYS.clear()
            _HEADS.clear()
        if sep and tail.isdigit():
            key = (_HEADS.setdefault(head, head), int(tail), "")
        else:
            key = (device_id, -1, device_id)
        _NATURAL_KEYS[device_id] = key
    return key


def natural_sorted(ids: Sequence[str]) -> list[str]:
    """``ids`` in :func:`natural_key` order (the cached keys looked up at C level)."""
    try:
        return sorted(ids, key=_NATURAL_KEYS.__getitem__)
    except KeyError:
        return sorted(ids, key=natural_key)


def natural_lowest(ids: Sequence[str], count: int) -> list[str]:
    """The first ``count`` of ``natural_sorted(ids)``."""
    if count == 1 and ids:
        try:
            return [min(ids, key=_NATURAL_KEYS.__getitem__)]
        except KeyError:
            return [min(ids, key=natural_key)]
    return natural_sorted(ids)[:count]


class DeviceTable:
    """Every device ID one resource can offer, with its GPU index, ranked by (GPU index,
    natural order, then the ID's text where two IDs have the same natural key, such as
    ``x::1`` and ``x::01``).

    ``ids[r]`` is the ID of rank r, ``gpu[r]`` its GPU, ``rank[id]`` its rank, and the ranks of
    GPU g are ``start[g]`` up to ``start[g + 1]``."""

    def __init__(self, devices: Sequence[tuple[str, int]], gpu_count: int) -> None:
        """``devices`` pairs each device ID with its GPU index (0 to ``gpu_count - 1``);
        AllocationError on a duplicate ID or an index outside the node."""
        seen: set[str] = set()
        for device_id, gpu in devices:
            if type(device_id) is not str or not device_id:
                raise AllocationError(f"device table: {device_id!r} is not a device ID")
            if type(gpu) is not int or not 0 <= gpu < gpu_count:
                raise AllocationError(
                    f"device table: {device_id}: {gpu!r} is not a GPU index of this node "
                    f"(0-{gpu_count - 1})"
                )
            if device_id in seen:
                raise AllocationError(f"device table: duplicate device ID {device_id}")
            seen.add(device_id)
        order = sorted(devices, key=lambda p: (p[1], natural_key(p[0]), p[0]))
        self.ids: list[str] = [d for d, _ in order]
        self.gpu: list[int] = [g for _, g in order]
        self.rank: dict[str, int] = {d: r for r, d in enumerate(self.ids)}
        self.start: list[int] = [bisect_left(self.gpu, g) for g in range(gpu_count + 1)]

    def pairs(self, ids: Sequence[str], what: str) -> list[tuple[str, int]]:
        """``ids`` as (device ID, GPU index) pairs, else AllocationError naming the first ID
        that is not in the table (``what`` names the list)."""
        out: list[tuple[str, int]] = []
        for device_id in ids:
            r = self.rank.get(device_id) if isinstance(device_id, str) else None
            if r is None:
                raise AllocationError(f"{what}: {device_id!r} is not a device of this resource")
            out.append((device_id, self.gpu[r]))
        return out


def fill_mig(free: dict[int, list[str]], used: list[int], need: int, parents: list[int]) -> list[str]:
    """``need`` MIG devices from ``parents``: parents already in the request (``used``)
    first, best fit among them; then the parent with the fewest free instances that can
    take the rest, else the one with the most."""
    counts = {p: len(free.get(p, [])) for p in parents}
    out: list[str] = []
    remaining = need
    order = sorted((p for p in used if p in counts), key=lambda p: (counts[p], p))
    pool = [p for p in parents if p not in used]
    for p in order:
        n_take = min(remaining, counts[p])
        out.extend(free.get(p, [])[:n_take])
        remaining -= n_take
    while remaining > 0:
        fitting = [p for p in pool if counts[p] >= remaining]
        if fitting:
            p = min(fitting, key=lambda q: (counts[q], q))
        else:
            p = min(pool, key=lambda q: (-counts[q], q))
        pool.remove(p)
        n_take = min(remaining, counts[p])
        out.extend(free.get(p, [])[:n_take])
        remaining -= n_take
    return out
