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

**Counters** where all the node's devices fit one device slice: only where devices meet, as
few consumptions as say exactly which devices fit together, every counter worth the same in
every rendering (:mod:`agent.dra.mig_counters`). Above one device slice every device consumes
all of its counters (a memory slice's worth of each slice it covers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Collection, Mapping

from agent.dra import mig_counters
from agent.dra.counters import counter_set_name as gpus_counter_set
from agent.dra.device_values import Device, gpu_attributes, make_device
from agent.dra.gpusets import clique_ids, island_ids
from agent.dra.mig_counters import SCALE
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
    #: the GPU's devices apart (:func:`agent.dra.mig_counters.weights`; elsewhere its size
    #: times :data:`agent.dra.mig_counters.SCALE`)
    weight: Mapping[str, int] = field(default_factory=dict)

    def counters(self, gpu: int) -> Mapping[str, int]:
        """What GPU ``gpu``'s counter set declares (empty: no counter set)."""
        if self.declared is None:
            return mig_counters.worth_slices(gpu_counters(self.geometries[gpu]), self.geometries[gpu])
        return self.declared.get(gpu, {})

    def sharing(self, gpus: Collection[int], weights: Mapping[int, int]) -> list[Device]:
        """The devices, those on ``gpus`` also consuming their :attr:`weight` (else their
        placement's size times :data:`agent.dra.mig_counters.SCALE`) of their GPU's set
        counter (worth ``weights``: :meth:`worth`), so a set holding the GPU and a MIG device on
        it exclude each other (:mod:`agent.dra.counters`)."""
        def share(name: str, g: int, s: MigSlot) -> tuple[str, tuple[tuple[str, int], ...]]:
            weight = self.weight.get(name, s.placement.size * SCALE)
            return gpus_counter_set(g), ((f"gpu-{g}", min(weight, weights[g])),)

        return [replace(d, shares=(*d.shares, share(d.name, g, s))) if g in gpus else d
                for d, g, s in zip(self.devices, self.gpus, self.slots)]

    def worth(self, gpu: int) -> int:
        """What the GPU's set counter ``gpu-<i>`` is worth, in every rendering alike: its memory
        slices times :data:`agent.dra.mig_counters.SCALE` (module docstring)."""
        return mig_counters.worth(self.geometries[gpu])

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
        stand for (no full GPU, no set), whose devices :func:`agent.dra.mig_counters.apart` may
        keep apart instead."""
        declared: dict[int, dict[str, int]] = {}
        uses: dict[str, dict[str, int]] = {}
        weight: dict[str, int] = {}
        apart: set[int] = set()
        for gpu, geo in self.geometries.items():
            mine = [(d.name, s) for d, g, s in zip(self.devices, self.gpus, self.slots) if g == gpu]
            if gpu in alone and (parts := mig_counters.apart(geo, mine)) is not None:
                kept, consumed = parts
                apart.add(gpu)
            elif gpu in sized and (one := mig_counters.weights(geo, mine)) is not None:
                weight.update(one)
                continue
            else:
                kept, consumed = mig_counters.meeting_counters(geo, mine, gpu in full, gpu in sized)
            if kept:
                declared[gpu] = kept
            uses.update(consumed)
        devices = [replace(d, shares=((counter_set_name(g), tuple(uses[d.name].items())),) if uses.get(d.name) else ())
                   for d, g in zip(self.devices, self.gpus)]
        return replace(self, devices=devices, declared=declared, sized=frozenset(sized) - apart, weight=weight)


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
                 tuple(mig_counters.worth_slices(slot.counters(geometries[slot.gpu]), geometries[slot.gpu]).items()))
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
