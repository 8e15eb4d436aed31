"""Dynamic MIG in the ResourceSlices: which MIG devices a rendering holds, in which order, and
their counter sets (the rule and the counters: :mod:`agent.dra.migslots`).

**What is published** (:func:`mig_devices`), in this order: the slots chosen for the current
layout (best first, :func:`agent.dra.migslots.chosen_slots`); the slots prepared claims hold
that meet another published device (:meth:`MigRendering.lone_held`: one on a GPU whose full
GPU is withdrawn, in no set, and overlapped by no MIG device published, is left out by the
renderer where the node's devices fit one device slice, so that every view of the pool has
one publication's devices: no device of the slices needs its counters, nothing can be
allocated beside it that its counters would stop, and the scheduler would convert it on
every Filter for nothing; on an unhealthy GPU it stays, carrying the GPU's taint); then the slots in the pool
now that neither chose nor a claim holds, which a claim the agent has not heard of yet may
hold: where the API server keeps taints and a grace is set, they stay with the withdrawal
taint ``<driver>/withdrawn`` (no new claim gets them, the scheduler still counts them) until
it has been out for ``dra.gpuSetWithdrawalGraceSeconds``, as a GPU set leaving does
(:mod:`agent.dra.withdrawal`); without a grace, one stays untainted while no held device
overlaps it (then none can hold it: the counters kept them apart) and goes when one does. A
MIG instance on a GPU offering placements that no prepared claim holds (made by hand) is
never published: its slices are taken (:func:`agent.dra.migslots.layouts`). A MIG device of
an unhealthy GPU carries its GPU's taint, or is left out where the server keeps no taints
(:mod:`agent.dra.taints`); no new slot is chosen on such a GPU. The full GPU of a GPU a
prepared claim holds a MIG device on (:func:`cut_gpus`) is withdrawn
(:func:`agent.dra.slices.render_slices`): nobody can get it while the instance is held.

**Counters only where devices meet** (:meth:`MigRendering.meeting`), where all the node's
devices fit one device slice: the scheduler compares every counter of the pool for each
device it reserves and validates every consumption on every Filter, and a counter matters
only between two devices that could be allocated together. Two devices of a GPU *conflict*
where they overlap or together need more of an engine than the GPU has; a group of them may
be allocated together exactly when no two conflict, and the counters say exactly that:

- **One weighted counter** where the conflicts allow it (a *threshold graph*:
  :func:`_weights`): where two or more published devices stand for a GPU (its full GPU, sets
  holding it, its MIG devices: :attr:`MigRendering.sized`), each MIG device consumes a weight
  of the GPU's counter ``gpu-<i>`` in the sets' counter set, the full GPU and a set all of it.
  On an intact GPU at one placement a profile (1g at 6, 2g at 4, 3g at 4, 4g at 0, 7g, full)
  each device then consumes one counter.
- **A weighted counter per group of conflicting devices** (:func:`_apart`) where only MIG
  devices stand for the GPU (a GPU already cut: its full GPU withdrawn, no set holding it),
  in the GPU's counter set, named ``memory-slice-<i>`` after the group's lowest slice; a
  device conflicting with none consumes nothing.
- **Otherwise** (:func:`_meeting_counters`), a memory slice counter for each distinct largest
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

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Mapping, Sequence

from agent.dra.counters import counter_set_name as gpus_counter_set
from agent.dra.device_values import Device, gpu_attributes, make_device
from agent.dra.gpusets import clique_ids, island_ids
from agent.dra.migslots import (
    SLOTS_PER_PROFILE,
    MigSlot,
    blocked,
    chosen_slots,
    counter_set_name,
    dynamic_gpus,
    gpu_counters,
    instance_slots,
    layouts,
    slots_named,
)
from agent.dra.taints import MAX_TAINTS, HealthMarks
from agent.dra.withdrawal import withdrawal_taint
from agent.records import MigGeometry
from agent.topology.model import Topology

__all__ = ["MigRendering", "counter_slices", "cut_gpus", "mig_devices"]

#: ResourceSliceMaxCounterSets: a counter slice holds at most this many counter sets.
_SETS_PER_SLICE = 8
#: What a memory slice is worth of a dynamic GPU's set counter ``gpu-<i>`` (worth the GPU's
#: memory slices times this, in every rendering: module docstring).
SCALE = 16


@dataclass(frozen=True)
class MigRendering:
    """The dynamic MIG part of a rendering: the GPUs offering placements (index -> geometry)
    and their MIG devices in publication order, each on its slot; ``declared``: each GPU's
    counters as its counter set declares them (None: all of :func:`gpu_counters`)."""

    geometries: Mapping[int, MigGeometry]
    devices: list[Device]
    gpus: list[int]  # the GPU of each device
    slots: list[MigSlot] = field(default_factory=list)  # the slot of each device
    declared: Mapping[int, Mapping[str, int]] | None = None
    #: GPUs whose devices also consume their weight or size of the GPU's set counter
    #: (``gpu-<i>``, worth :meth:`worth`; :meth:`meeting`): their full GPU consumes none of its
    #: counter set
    sized: frozenset[int] = frozenset()
    #: device name -> what it consumes of its GPU's set counter where that counter alone keeps
    #: the GPU's devices apart (:func:`_weights`; elsewhere its size times :data:`SCALE`)
    weight: Mapping[str, int] = field(default_factory=dict)

    def counters(self, gpu: int) -> Mapping[str, int]:
        """What GPU ``gpu``'s counter set declares (empty: no counter set)."""
        if self.declared is None:
            return _worth_slices(gpu_counters(self.geometries[gpu]), self.geometries[gpu])
        return self.declared.get(gpu, {})

    def sharing(self, gpus: Collection[int], weights: Mapping[int, int]) -> list[Device]:
        """The devices, those on ``gpus`` also consuming their :attr:`weight` (else their
        placement's size times :data:`SCALE`) of their GPU's set counter (worth ``weights``:
        :meth:`worth`), so a set holding the GPU and a MIG device on it exclude each other
        (:mod:`agent.dra.counters`)."""
        def share(name: str, g: int, s: MigSlot) -> tuple[str, tuple[tuple[str, int], ...]]:
            weight = self.weight.get(name, s.placement.size * SCALE)
            return gpus_counter_set(g), ((f"gpu-{g}", min(weight, weights[g])),)

        return [replace(d, shares=(*d.shares, share(d.name, g, s))) if g in gpus else d
                for d, g, s in zip(self.devices, self.gpus, self.slots)]

    def worth(self, gpu: int) -> int:
        """What the GPU's set counter ``gpu-<i>`` is worth, in every rendering alike: its memory
        slices times :data:`SCALE` (module docstring)."""
        return _worth(self.geometries[gpu])

    def leaving_out(self, names: Collection[str]) -> MigRendering:
        """This rendering without the devices ``names``."""
        keep = [i for i, d in enumerate(self.devices) if d.name not in names]
        return replace(self, devices=[self.devices[i] for i in keep], gpus=[self.gpus[i] for i in keep],
                       slots=[self.slots[i] for i in keep])

    def lone_held(self, held: Collection[str], standing: Collection[int], unhealthy: Collection[int]) -> set[str]:
        """The devices of ``held`` (prepared claims hold them) that meet no other published
        device: on a GPU no device of ``standing`` (the GPUs the full GPUs and the sets
        published stand for) holds and not ``unhealthy``, and overlapping no other MIG device
        published (module docstring: they are left out)."""
        out: set[str] = set()
        for d, g, s in zip(self.devices, self.gpus, self.slots):
            if d.name not in held or g in standing or g in unhealthy:
                continue
            if not any(o.name != d.name and og == g and set(os_.placement.slices) & set(s.placement.slices)
                       for o, og, os_ in zip(self.devices, self.gpus, self.slots)):
                out.add(d.name)
        return out

    def gpu_share(self, gpu: int) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
        """What a full GPU consumes of its counter set: all of it (nothing where none is
        declared, or where the GPU is :attr:`sized`: its set counter keeps it apart)."""
        declared = {} if gpu in self.sized else self.counters(gpu)
        return ((counter_set_name(gpu), tuple(declared.items())),) if declared else ()

    def meeting(self, full: Collection[int], sized: Collection[int] = (), alone: Collection[int] = ()) -> MigRendering:
        """This rendering with counters only where two devices meet (the devices of one device
        slice: module docstring). ``full``: the GPUs whose full GPU is published beside;
        ``sized``: the GPUs whose devices consume their size of the GPU's set counter too
        (the renderer makes them: :attr:`sized`); ``alone``: those of them only MIG devices
        stand for (no full GPU, no set), whose devices :func:`_apart` may keep apart instead."""
        declared: dict[int, dict[str, int]] = {}
        uses: dict[str, dict[str, int]] = {}
        weight: dict[str, int] = {}
        apart: set[int] = set()
        for gpu, geo in self.geometries.items():
            mine = [(d.name, s) for d, g, s in zip(self.devices, self.gpus, self.slots) if g == gpu]
            if gpu in alone and (parts := _apart(geo, mine)) is not None:
                kept, consumed = parts
                apart.add(gpu)
            elif gpu in sized and (one := _weights(geo, mine)) is not None:
                weight.update(one)
                continue
            else:
                kept, consumed = _meeting_counters(geo, mine, gpu in full, gpu in sized)
            if kept:
                declared[gpu] = kept
            uses.update(consumed)
        devices = [replace(d, shares=((counter_set_name(g), tuple(uses[d.name].items())),) if uses.get(d.name) else ())
                   for d, g in zip(self.devices, self.gpus)]
        return replace(self, devices=devices, declared=declared, sized=frozenset(sized) - apart, weight=weight)


def _worth(geometry: MigGeometry) -> int:
    """What a counter of one device slice's MIG counters is worth, in every rendering alike
    (module docstring): the GPU's set counter and its memory slice counters, each."""
    return geometry.memory_slices * SCALE


def _worth_slices(counters: Mapping[str, int], geometry: MigGeometry) -> dict[str, int]:
    """``counters`` (of :func:`agent.dra.migslots.gpu_counters` or a slot's) with each memory
    slice worth :func:`_worth`, as every rendering declares it."""
    return {k: _worth(geometry) if k.startswith("memory-slice-") else v for k, v in counters.items()}


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


def _weights(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]],
             groups_out: list[list[str]] | None = None) -> dict[str, int] | None:
    """Devices of one GPU kept apart by one counter worth :func:`_worth` (``T``): device name
    -> its weight, such that a group of the devices fits the counter exactly when no two of
    them conflict (:func:`_conflicts`) and, where ``groups_out`` is None, the group's engines
    fit the GPU (otherwise the largest groups that fit are appended to it for the caller to
    check); None where no such weights exist within ``T``.

    Weights exist exactly when the conflicts form a *threshold graph* (Chvatal and Hammer,
    1977): the devices can be taken away one by one, each conflicting with none or with all of
    those left. Built in the reverse order, an *isolated* device (conflicting with none before
    it) weighs 1 more than all isolated ones after the next *dominating* one (conflicting with
    all before it); a dominating device weighs ``T`` less the isolated ones after it. A group
    then fits exactly when it holds at most one dominating device and no isolated one before
    it (when no two conflict), provided two dominating devices exceed ``T`` (the isolated ones
    weigh less than half of it). The full GPU and a set take all of ``T``."""
    conflict = _conflicts(geometry, devices)
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
    worth = _worth(geometry)
    weight: dict[str, int] = {}
    after = at_next_dominating = 0  # the isolated weight after here, and after the next dominating device
    for n, dominating in taken:  # from the last built
        if dominating:
            weight[n] = worth - after
            at_next_dominating = after
        else:
            weight[n] = at_next_dominating + 1
            after += weight[n]
    if 2 * after >= worth:
        return None
    groups = [[n for n, d in order if not d]]  # the largest groups that fit: see above
    groups += [[n, *(m for m, d in order[i + 1 :] if not d)] for i, (n, d) in enumerate(order) if d]
    if groups_out is not None:
        groups_out += groups
    elif any(v > gpu_counters(geometry)[k] for k, v in _engine_peaks(geometry, devices, groups).items()):
        return None
    return weight


def _apart(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]]
           ) -> tuple[dict[str, int], dict[str, dict[str, int]]] | None:
    """One GPU's MIG devices, where nothing else stands for the GPU, kept apart by one counter
    per group of devices that conflict (a connected part of :func:`_conflicts`), weighted as
    :func:`_weights` says and named after the group's lowest memory slice; a device
    conflicting with none consumes nothing. (counter -> value, device name -> what it
    consumes), or None where a group has no such weights or the engines of the groups' largest
    fitting parts, added up, could exceed the GPU (then :func:`_meeting_counters` does it)."""
    conflict = _conflicts(geometry, devices)
    parts: list[list[tuple[str, MigSlot]]] = []
    for d in devices:
        joined = [p for p in parts if any(conflict(d[0], o) for o, _ in p)]
        parts = [p for p in parts if p not in joined] + [[x for p in joined for x in p] + [d]]
    counters: dict[str, int] = {}
    uses: dict[str, dict[str, int]] = {n: {} for n, _ in devices}
    peaks = {k: 0 for k in gpu_counters(geometry) if not k.startswith("memory-slice-")}
    for part in parts:
        groups: list[list[str]] = [[n for n, _ in part]] if len(part) == 1 else []
        if len(part) >= 2:
            found = _weights(geometry, part, groups)
            if found is None:
                return None
            name = f"memory-slice-{min(i for _, s in part for i in s.placement.slices)}"
            counters[name] = _worth(geometry)
            for n, w in found.items():
                uses[n][name] = w
        for k, v in _engine_peaks(geometry, part, groups).items():
            peaks[k] += v
    if any(v > gpu_counters(geometry)[k] for k, v in peaks.items()):
        return None
    return dict(sorted(counters.items(), key=lambda kv: _natural(kv[0]))), uses


def _meeting_counters(geometry: MigGeometry, devices: Sequence[tuple[str, MigSlot]],
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
    counters = {f"memory-slice-{i}": _worth(geometry) for i in sorted(largest.values())}
    uses: dict[str, dict[str, int]] = {n: {} for n, _ in devices}
    for c, i in largest.items():
        for n in c - {""}:
            uses[n][f"memory-slice-{i}"] = _worth(geometry)
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


def mig_devices(topology: Topology, driver: str, marks: HealthMarks, held: Mapping[str, Collection[int]],
                in_pool: Collection[str] | None, expired: Collection[str] | None, graced: bool,
                per_profile: int = SLOTS_PER_PROFILE) -> MigRendering:
    """The MIG devices to publish (module docstring). ``held``: every device prepared claims
    hold (name -> GPU indices); ``in_pool``: the devices in the pool now (None: not known);
    ``expired``: those whose withdrawal taint has been out for the grace (None: no grace);
    ``graced``: the API server keeps taints; ``per_profile``: the placements chosen for each
    profile (``dra.migPlacementsPerProfile``)."""
    geometries = dynamic_gpus(topology)
    if not geometries:
        return MigRendering(geometries, [], [])
    lay = layouts(geometries, held, instance_slots(topology, geometries))
    chosen = chosen_slots(lay, avoid=set(marks.reasons), per_profile=per_profile)
    mine = slots_named(held, geometries)
    names = {s.name for s in [*chosen, *mine]}
    others = [s for s in slots_named(sorted(in_pool or ()), geometries) if s.name not in names]
    withdrawing: list[MigSlot] = []
    if graced and expired is not None:
        withdrawing = [s for s in others if s.name not in expired]
        others = []
    else:
        others = [s for s in others if not blocked(s, lay[s.gpu])]
    islands, cliques = island_ids(topology), clique_ids(topology)
    out: list[Device] = []
    on: list[int] = []
    slots: list[MigSlot] = []
    seen: set[str] = set()
    for slot in [*chosen, *mine, *others, *withdrawing]:
        if slot.name in seen:
            continue
        seen.add(slot.name)
        shown, taints = marks.device(driver, slot.name, (slot.gpu,))
        if not shown:
            continue
        if slot in withdrawing:
            taints = [withdrawal_taint(driver), *taints][:MAX_TAINTS]
        gpu = topology.gpus[slot.gpu]
        attributes: dict[str, Any] = {
            "type": {"string": "mig"},
            "profile": {"string": slot.profile.name},
            "parentUUID": {"string": gpu.uuid} if gpu.uuid else None,
            "parentIndex": {"int": gpu.index},
            "placementStart": {"int": slot.placement.start},
            "placementSize": {"int": slot.placement.size},
        }
        share = (counter_set_name(slot.gpu),
                 tuple(_worth_slices(slot.counters(geometries[slot.gpu]), geometries[slot.gpu]).items()))
        out.append(make_device(driver, slot.name,
                               attributes | gpu_attributes(topology, gpu, islands[gpu.index], cliques[gpu.index]),
                               slot.profile.memory_mib, taints=taints, shares=(share,)))
        on.append(slot.gpu)
        slots.append(slot)
    return MigRendering(geometries, out, on, slots)


def cut_gpus(held: Collection[str], geometries: Mapping[int, MigGeometry]) -> set[int]:
    """The GPUs offering placements where a prepared claim holds a MIG device (``held``:
    device names): their full GPU is withdrawn (:func:`agent.dra.slices.render_slices`)."""
    return {s.gpu for s in slots_named(held, geometries)}


def counter_slices(rendering: MigRendering) -> list[dict[str, Any]]:
    """The counter slices' bodies for the GPUs offering placements: one counter set a GPU
    that declares counters, eight a slice."""
    sets = [{"name": counter_set_name(i), "counters": {k: {"value": str(v)} for k, v in counters.items()}}
            for i in sorted(rendering.geometries) if (counters := rendering.counters(i))]
    return [{"sharedCounters": sets[i : i + _SETS_PER_SLICE]} for i in range(0, len(sets), _SETS_PER_SLICE)]
