"""Dynamic MIG's counters in one device slice: which counters keep one GPU's published MIG
devices apart, and what each device consumes (:meth:`agent.dra.mig_publish.MigRendering.meeting`
applies them; the devices and their order: :mod:`agent.dra.mig_publish`).

**Counters only where devices meet**, where all the node's devices fit one device slice: the
scheduler compares every counter of the pool for each device it reserves and validates every
consumption on every Filter, and a counter matters only between two devices that could be
allocated together. Two devices of a GPU *conflict*
where they overlap or together need more of an engine than the GPU has; a group of them may
be allocated together exactly when no two conflict, and the counters say exactly that:

- **One weighted counter** where the conflicts allow it (a *threshold graph*:
  :func:`weights`, :func:`_threshold`): where two or more published devices stand for a GPU (its full GPU, sets
  holding it, its MIG devices: ``MigRendering.sized``), each MIG device consumes a weight of
  the GPU's counter ``gpu-<i>`` in the sets' counter set, the full GPU and a set all of it.
  On an intact GPU at one placement a profile (1g at 6, 2g at 4, 3g at 4, 4g at 0, 7g, full)
  each device then consumes one counter.
- **A weighted counter per group of conflicting devices** (:func:`apart`) where only MIG
  devices stand for the GPU (a GPU already cut: its full GPU withdrawn, no set holding it),
  in the GPU's counter set, named ``memory-slice-<i>`` after the group's lowest slice; a
  device conflicting with none consumes nothing.
- **Otherwise** (:func:`meeting_counters`), a memory slice counter for each distinct largest
  group of published devices (the full GPU among them) covering one slice, consumed by that
  group, a compute counter only where its MIG devices could together exceed the GPU, and,
  where two or more devices stand for the GPU, each MIG device's size of ``gpu-<i>``: two
  devices whose sizes add up to more than the GPU never share a memory slice counter.

**Every counter is worth the same in every rendering**: ``gpu-<i>`` and each memory slice
counter of a GPU offering placements its memory slices times :data:`SCALE` (128 on an H100),
a device taking all of a memory slice counter where it consumes one without a weight. The
publisher rewrites a slice in place where no device moves (:mod:`agent.dra.pool_writes`), so
the scheduler may join the devices of one rendering to the counters of the one before: the
weights of a rendering are safe only beside a counter worth what they were made for. Safe as
:mod:`agent.dra.counters` says for the GPU counters: the scheduler looks an allocated device
up in the slices it sees now, and in one device slice any two devices that conflict together
take more of a counter than it is worth. Above one device slice every device consumes all of
its counters (a memory slice's worth of each slice it covers).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from agent.dra.migslots import MigSlot, gpu_counters
from agent.records import MigGeometry

__all__ = ["SCALE", "apart", "meeting_counters", "weights", "worth", "worth_slices"]

#: What a memory slice is worth of a dynamic GPU's set counter ``gpu-<i>`` and of each of its
#: memory slice counters (worth the GPU's memory slices times this, in every rendering: module
#: docstring).
SCALE = 16


def worth(geometry: MigGeometry) -> int:
    """What a counter of one device slice's MIG counters is worth, in every rendering alike
    (module docstring): the GPU's set counter and its memory slice counters, each."""
    return geometry.memory_slices * SCALE


def worth_slices(counters: Mapping[str, int], geometry: MigGeometry) -> dict[str, int]:
    """``counters`` (of :func:`agent.dra.migslots.gpu_counters` or a slot's) with each memory
    slice worth :func:`worth`, as every rendering declares it."""
    return {k: worth(geometry) if k.startswith("memory-slice-") else v for k, v in counters.items()}


def _conflicts(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]]) -> Callable[[str, str], bool]:
    """``conflict(a, b)``: whether two of ``devices`` (on one GPU) can never be cut together:
    they overlap, or together use more of an engine counter than the GPU has."""
    cap = gpu_counters(geometry)
    engines = [k for k in cap if not k.startswith("memory-slice-")]
    uses = {n: s.uses(geometry) for n, s in devices}
    on = {n: set(s.placement.slices) for n, s in devices}

    def conflict(a: str, b: str) -> bool:
        return bool(on[a] & on[b]) or any(uses[a].get(k, 0) + uses[b].get(k, 0) > cap[k] for k in engines)

    return conflict


def _engine_peaks(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]],
                  groups: Sequence[Sequence[str]]) -> dict[str, int]:
    """Per engine counter, the most any of ``groups`` uses."""
    uses = {n: s.uses(geometry) for n, s in devices}
    engines = [k for k in gpu_counters(geometry) if not k.startswith("memory-slice-")]
    return {k: max((sum(uses[n].get(k, 0) for n in g) for g in groups), default=0) for k in engines}


def weights(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]]) -> dict[str, int] | None:
    """Devices of one GPU kept apart by one counter worth :func:`worth` (``T``): device name
    -> its weight, such that a group of the devices fits the counter exactly when no two of
    them conflict (:func:`_conflicts`) and the group's engines fit the GPU; None where no such
    weights exist within ``T`` (:func:`_threshold`) or some group that fits would take more of
    an engine than the GPU has."""
    found = _threshold(geometry, devices, _conflicts(geometry, devices))
    if found is None:
        return None
    weight, groups = found
    cap = gpu_counters(geometry)
    return None if any(v > cap[k] for k, v in _engine_peaks(geometry, devices, groups).items()) else weight


def _threshold(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]], conflict: Callable[[str, str], bool]
               ) -> tuple[dict[str, int], list[list[str]]] | None:
    """(device name -> weight, the largest groups that fit) for one counter worth ``T``
    (:func:`worth`) that a group of ``devices`` fits exactly when no two of them ``conflict``;
    None where no such weights exist within ``T``.

    Weights exist exactly when the conflicts form a *threshold graph* (Chvatal and Hammer,
    1977): the devices can be taken away one by one, each conflicting with none or with all of
    those left. Built in the reverse order, an *isolated* device (conflicting with none before
    it) weighs 1 more than all isolated ones after the next *dominating* one (conflicting with
    all before it); a dominating device weighs ``T`` less the isolated ones after it. A group
    then fits exactly when it holds at most one dominating device and no isolated one before
    it (when no two conflict), provided two dominating devices exceed ``T`` (the isolated ones
    weigh less than half of it). The full GPU and a set take all of ``T``."""
    left, taken = [n for n, _ in devices], []  # taken: (name, dominating), first taken first
    while left:
        for n in left:
            degree = sum(conflict(n, o) for o in left if o != n)
            if degree in (0, len(left) - 1):
                taken.append((n, degree > 0))
                left.remove(n)
                break
        else:
            return None
    order = taken[::-1]  # as built: each isolated or dominating among those before it
    total = worth(geometry)
    weight: dict[str, int] = {}
    after = at_next_dominating = 0  # the isolated weight after here, and after the next dominating device
    for n, dominating in taken:  # from the last built
        if dominating:
            weight[n] = total - after
            at_next_dominating = after
        else:
            weight[n] = at_next_dominating + 1
            after += weight[n]
    if 2 * after >= total:
        return None
    groups = [[n for n, d in order if not d]]  # the largest groups that fit: see above
    groups += [[n, *(m for m, d in order[i + 1 :] if not d)] for i, (n, d) in enumerate(order) if d]
    return weight, groups


def apart(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]]
          ) -> tuple[dict[str, int], dict[str, dict[str, int]]] | None:
    """One GPU's MIG devices, where nothing else stands for the GPU, kept apart by one counter
    per group of devices that conflict (a connected part of :func:`_conflicts`), weighted as
    :func:`_threshold` says and named after the group's lowest memory slice; a device
    conflicting with none consumes nothing. (counter -> value, device name -> what it
    consumes), or None where a group has no such weights or the engines of the groups' largest
    fitting parts, added up, could exceed the GPU (then :func:`meeting_counters` does it)."""
    conflict = _conflicts(geometry, devices)
    parts: list[list[tuple[str, MigSlot]]] = []
    for d in devices:
        joined = [p for p in parts if any(conflict(d[0], o) for o, _ in p)]
        parts = [p for p in parts if p not in joined] + [[x for p in joined for x in p] + [d]]
    counters: dict[str, int] = {}
    uses: dict[str, dict[str, int]] = {n: {} for n, _ in devices}
    peaks = {k: 0 for k in gpu_counters(geometry) if not k.startswith("memory-slice-")}
    for part in parts:
        groups = [[n for n, _ in part]]
        if len(part) >= 2:
            found = _threshold(geometry, part, conflict)
            if found is None:
                return None
            name = f"memory-slice-{min(i for _, s in part for i in s.placement.slices)}"
            counters[name] = worth(geometry)
            for n, w in found[0].items():
                uses[n][name] = w
            groups = found[1]
        for k, v in _engine_peaks(geometry, part, groups).items():
            peaks[k] += v
    if any(v > gpu_counters(geometry)[k] for k, v in peaks.items()):
        return None
    return dict(sorted(counters.items(), key=lambda kv: _natural(kv[0]))), uses


def meeting_counters(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]],
                     full: bool, sized: bool = False) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """One GPU's counters where its published devices meet: (counter -> value, device name ->
    what it consumes). A memory slice counter per distinct largest set of devices covering one
    slice (two devices sharing a slice both consume the counter of a set holding that slice's
    devices; two on disjoint slices share none), named after its lowest slice; a compute
    counter only where the MIG devices using it could take more than the GPU has (the full
    GPU meets every MIG device on the memory slices already).

    ``sized``: every device on the GPU also consumes its memory slices of the GPU's set
    counter, worth all of them, and the full GPU (like a set holding the GPU) all of that
    counter. Then two devices whose sizes add up to more than the GPU's memory slices can
    never be allocated together, whatever else they consume: the full GPU needs no counter of
    this set, and a MIG device takes part in a slice's counter (or a compute counter) only
    with another it could otherwise be allocated beside."""
    light = _light(geometry, devices) if sized else None
    cover: dict[frozenset[str], int] = {}
    for i in range(geometry.memory_slices):
        names = frozenset(n for n, s in devices if i in s.placement.slices) | ({""} if full and not sized else set())
        if light is not None:
            names = frozenset(n for n in names if light(n, names))
        if len(names) >= 2:
            cover.setdefault(names, i)
    largest = {c: i for c, i in cover.items() if not any(c < other for other in cover)}
    counters = {f"memory-slice-{i}": worth(geometry) for i in sorted(largest.values())}
    uses: dict[str, dict[str, int]] = {n: {} for n, _ in devices}
    for c, i in largest.items():
        for n in c - {""}:
            uses[n][f"memory-slice-{i}"] = worth(geometry)
    cap = gpu_counters(geometry)
    for name in (k for k in cap if not k.startswith("memory-slice-")):
        using = [(n, s.uses(geometry).get(name, 0)) for n, s in devices if s.uses(geometry).get(name, 0)]
        if light is not None:
            users = frozenset(n for n, _ in using)
            using = [(n, v) for n, v in using if light(n, users)]
        if sum(v for _, v in using) > cap[name]:
            counters[name] = cap[name]
            for n, v in using:
                uses[n][name] = v
    return counters, {n: dict(sorted(u.items(), key=lambda kv: _natural(kv[0]))) for n, u in uses.items()}


def _light(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]]) -> Callable[[str, frozenset[str]], bool]:
    """``light(name, among)``: whether the device ``name`` could be allocated beside another of
    ``among`` as far as the GPU's set counter goes (their memory slices add up to at most the
    GPU's); one that could not is kept apart from all of them by that counter alone."""
    size = {n: s.placement.size for n, s in devices}
    total = geometry.memory_slices

    def light(name: str, among: frozenset[str]) -> bool:
        return any(size[name] + size[o] <= total for o in among if o != name)

    return light


def _natural(name: str) -> tuple[int, str]:
    return len(name), name
