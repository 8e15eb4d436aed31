"""Dynamic MIG in the ResourceSlices: which MIG devices a rendering holds, in which order, and
their counter sets (the rule and the counters: :mod:`agent.dra.migslots`).

**What is published** (:func:`mig_devices`), in this order: the slots chosen for the current
layout (best first, :func:`agent.dra.migslots.chosen_slots`); the slots prepared claims hold;
then the slots in the pool now that neither chose nor a claim holds, which a claim the agent
has not heard of yet may hold: where the API server keeps taints and a grace is set, they
stay with the withdrawal taint ``<driver>/withdrawn`` (no new claim gets them, the scheduler
still counts them) until it has been out for ``dra.gpuSetWithdrawalGraceSeconds``, as a GPU
set leaving does (:mod:`agent.dra.withdrawal`); without a grace, one stays untainted while no
held device overlaps it (then none can hold it: the counters kept them apart) and goes when
one does. A MIG instance on a GPU offering placements that no prepared claim holds (made by
hand) is never published: its slices are taken (:func:`agent.dra.migslots.layouts`). A MIG
device of an unhealthy GPU carries its GPU's taint, or is left out where the
server keeps no taints (:mod:`agent.dra.taints`); no new slot is chosen on such a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Collection, Mapping

from agent.dra.counters import counter_set_name as gpus_counter_set
from agent.dra.device_values import Device, gpu_attributes, make_device
from agent.dra.gpusets import clique_ids, island_ids
from agent.dra.migslots import (
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

__all__ = ["MigRendering", "counter_slices", "mig_devices"]

#: ResourceSliceMaxCounterSets: a counter slice holds at most this many counter sets.
_SETS_PER_SLICE = 8


@dataclass(frozen=True)
class MigRendering:
    """The dynamic MIG part of a rendering: the GPUs offering placements (index -> geometry)
    and their MIG devices in publication order."""

    geometries: Mapping[int, MigGeometry]
    devices: list[Device]
    gpus: list[int]  # the GPU of each device

    def sharing(self, gpus: Collection[int], weights: Mapping[int, int]) -> list[Device]:
        """The devices, those on ``gpus`` also consuming their placement's size of their GPU's
        set counter (worth ``weights``: its memory slices), so a set holding the GPU and a
        MIG device on it exclude each other (:mod:`agent.dra.counters`)."""
        return [replace(d, shares=(*d.shares, (gpus_counter_set(g), ((f"gpu-{g}", _size(d, weights[g])),))))
                if g in gpus else d for d, g in zip(self.devices, self.gpus)]

    def gpu_share(self, gpu: int) -> tuple[str, tuple[tuple[str, int], ...]]:
        """What a full GPU consumes of its counter set: all of it."""
        return counter_set_name(gpu), tuple(gpu_counters(self.geometries[gpu]).items())


def mig_devices(topology: Topology, driver: str, marks: HealthMarks, held: Mapping[str, Collection[int]],
                in_pool: Collection[str] | None, expired: Collection[str] | None, graced: bool) -> MigRendering:
    """The MIG devices to publish (module docstring). ``held``: every device prepared claims
    hold (name -> GPU indices); ``in_pool``: the devices in the pool now (None: not known);
    ``expired``: those whose withdrawal taint has been out for the grace (None: no grace);
    ``graced``: the API server keeps taints."""
    geometries = dynamic_gpus(topology)
    if not geometries:
        return MigRendering(geometries, [], [])
    lay = layouts(geometries, held, instance_slots(topology, geometries))
    chosen = chosen_slots(lay, avoid=set(marks.reasons))
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
        share = (counter_set_name(slot.gpu), tuple(slot.counters(geometries[slot.gpu]).items()))
        out.append(make_device(driver, slot.name,
                               attributes | gpu_attributes(topology, gpu, islands[gpu.index], cliques[gpu.index]),
                               slot.profile.memory_mib, taints=taints, shares=(share,)))
        on.append(slot.gpu)
    return MigRendering(geometries, out, on)


def _size(device: Device, most: int) -> int:
    """The memory slices a MIG device's placement takes (at most ``most``)."""
    return min(most, sum(1 for k, _ in device.shares[0][1] if k.startswith("memory-slice-")))


def counter_slices(rendering: MigRendering) -> list[dict[str, Any]]:
    """The counter slices' bodies for the GPUs offering placements: one counter set a GPU,
    eight a slice (always all of them: a set never moves between slices)."""
    sets = [{"name": counter_set_name(i), "counters": {k: {"value": str(v)} for k, v in gpu_counters(geo).items()}}
            for i, geo in sorted(rendering.geometries.items())]
    return [{"sharedCounters": sets[i : i + _SETS_PER_SLICE]} for i in range(0, len(sets), _SETS_PER_SLICE)]
