"""Dynamic MIG: the MIG devices a node publishes (a profile on a placement of a GPU, cut at
prepare), the counters that keep them apart, and the best-fit order they come in.

**Which GPUs** (:func:`dynamic_gpus`): a GPU whose MIG geometry is known (``Gpu.mig_geometry``),
not lost, and either in MIG mode with every MIG instance on it on a known placement of a known
profile, or Hopper and newer with MIG mode off (prepare switches it on; an Ampere GPU needs a
reset for that, so it offers placements only where MIG is already on). A GPU in MIG mode with
an instance discovery cannot place keeps its static MIG devices instead. On a dynamic GPU no
instance is a static device (:class:`agent.dra.devices.DeviceRefs`): one a prepared claim
holds is its slot device (published, consuming its slices); any other (made by hand, never
touched) only takes its slices (:func:`layouts`): nothing overlapping it is offered.

**Counters** (NVIDIA's DynamicMIG names, kubernetes-sigs/dra-driver-nvidia-gpu): one counter
set per GPU, ``gpu-<index>-counter-set``, holding ``memory-slice-<i>`` (value 1 each,
``i`` = 0 .. memory slices - 1) and the compute resources a profile uses, ``multiprocessors``,
``copy-engines``, ``decoders``, ``encoders``, ``jpeg-engines``, ``ofa-engines``, each worth
the most any profile of the GPU uses, where placements on disjoint memory slices could use
more of it than that (on the H100: ``ofa-engines``, which holds the ``+me`` profiles to one
a GPU); a compute counter the memory slices alone keep from over-committing is left out, as
is NVIDIA's ``memory`` counter (the memory slices say the same): the scheduler compares every
counter of the pool for every device it reserves. A MIG device consumes the
memory slices of its placement and its profile's compute counts; the full GPU consumes all
of them, so a whole-GPU claim and a MIG claim never share a GPU. These are the GPU's own
counts (:func:`gpu_counters`, what the layouts here add up); the slices declare each memory
slice worth more, and consume fewer counters where they can (:mod:`agent.dra.mig_publish`).

**Best fit** (:func:`slot_order`): the scheduler takes the first device that fits, so the
order is the placement. A candidate (profile, GPU, placement) free in the GPU's current
layout (MIG devices prepared claims hold; a GPU held whole has none) is ranked by what it
costs the GPU's *room*, the number of instances of each profile that could still be cut
there, compared largest profile first (7g, then 4g, 3g, ...): the least loss of room for
large profiles first, so a GPU already cut is preferred to an intact one (which would lose
its 7g) and, on a GPU, the placement that splits no free aligned block a 3g or 4g needs;
then the fullest GPU (fewest free memory slices after it: best fit); then GPU index and
placement. Per profile the node publishes ``dra.migPlacementsPerProfile`` (default
:data:`SLOTS_PER_PROFILE`) such candidates, each chosen as if the ones before it were taken
(so claims allocated before the next re-publication find disjoint placements), not every
placement of every profile: the scheduler pays for every device it walks. docs/dra/mig.md
shows the rule on the bench.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping

from agent.config import Config
from agent.dra.devices import match_slot, mig_slot_name, parse_mig_slot_name
from agent.records import MigDevice, MigGeometry, MigPlacement, MigProfile
from agent.topology.model import Topology

__all__ = [
    "COMPUTE_COUNTERS", "SLOTS_PER_PROFILE", "GpuLayout", "MigSlot", "chosen_slots", "counter_set_name",
    "by_size", "dynamic_gpus", "gpu_counters", "instance_slots", "layouts", "resolve_slot", "slot_order",
]

#: How many placements of each profile the node publishes for its current layout, by default
#: (``dra.migPlacementsPerProfile``'s default).
SLOTS_PER_PROFILE: int = Config.mig_placements_per_profile
#: NVIDIA's compute counters (the names of kubernetes-sigs/dra-driver-nvidia-gpu) and the
#: :class:`~agent.records.MigProfile` field each counts.
COMPUTE_COUNTERS = (
    ("multiprocessors", "multiprocessors"), ("copy-engines", "copy_engines"), ("decoders", "decoders"),
    ("encoders", "encoders"), ("jpeg-engines", "jpegs"), ("ofa-engines", "ofas"),
)
_FIRST_MIG_ARCHITECTURE_SWITCHED = 9  # Hopper: MIG mode changes without a GPU reset


def counter_set_name(gpu_index: int) -> str:
    """The GPU's MIG counter set, as NVIDIA's driver names it."""
    return f"gpu-{gpu_index}-counter-set"


def gpu_counters(geometry: MigGeometry) -> dict[str, int]:
    """The counters of a GPU's counter set and their values (what its full GPU consumes)."""
    return dict(_shape(geometry).capacity)


class _Shape:
    """What one geometry's counters are, computed once: the counter set's values, the
    profiles largest first, and what each (profile, start) consumes."""

    def __init__(self, geometry: MigGeometry) -> None:
        cap = {f"memory-slice-{i}": 1 for i in range(geometry.memory_slices)}
        peaks = _peaks(geometry)
        for name, attr in COMPUTE_COUNTERS:
            most = max((int(getattr(p, attr)) for p in geometry.profiles), default=0)
            if 0 < most < peaks[attr]:  # only where the memory slices alone let it over-commit
                cap[name] = most
        self.capacity = cap
        size = {p.name: max((pl.size for pl in p.placements), default=0) for p in geometry.profiles}
        self.by_size = sorted(geometry.profiles, key=lambda p: (-size[p.name], -p.compute_slices, p.name))
        self.uses: dict[tuple[str, int], dict[str, int]] = {}
        for p in geometry.profiles:
            compute = {n: int(getattr(p, a)) for n, a in COMPUTE_COUNTERS if n in cap and getattr(p, a)}
            for pl in p.placements:
                self.uses[(p.name, pl.start)] = {**{f"memory-slice-{i}": 1 for i in pl.slices}, **compute}


def _peaks(geometry: MigGeometry) -> dict[str, int]:
    """Per compute field, the most any set of placements on disjoint memory slices adds up to."""
    options = sorted(((p, pl) for p in geometry.profiles for pl in p.placements), key=lambda o: o[1].start)
    peaks = {attr: 0 for _, attr in COMPUTE_COUNTERS}

    def walk(i: int, taken: int, sums: dict[str, int]) -> None:
        for attr, v in sums.items():
            peaks[attr] = max(peaks[attr], v)
        for j in range(i, len(options)):
            p, pl = options[j]
            bits = sum(1 << k for k in pl.slices)
            if not bits & taken:
                walk(j + 1, taken | bits, {a: v + int(getattr(p, a)) for a, v in sums.items()})

    walk(0, 0, dict(peaks))
    return peaks


_SHAPES: dict[int, tuple[MigGeometry, _Shape]] = {}


def _shape(geometry: MigGeometry) -> _Shape:
    found = _SHAPES.get(id(geometry))
    if found is None or found[0] is not geometry:
        found = _SHAPES[id(geometry)] = (geometry, _Shape(geometry))
    return found[1]


@dataclass(frozen=True)
class MigSlot:
    """One MIG device dynamic MIG may publish: ``profile`` on ``placement`` of GPU ``gpu``."""

    gpu: int
    profile: MigProfile
    placement: MigPlacement

    @property
    def name(self) -> str:
        return mig_slot_name(self.gpu, self.profile.name, self.placement.start)

    def counters(self, geometry: MigGeometry) -> dict[str, int]:
        """What it consumes of its GPU's counter set."""
        return dict(self.uses(geometry))

    def uses(self, geometry: MigGeometry) -> Mapping[str, int]:
        return _shape(geometry).uses[(self.profile.name, self.placement.start)]


def dynamic_gpus(topology: Topology) -> dict[int, MigGeometry]:
    """GPU index -> geometry of every GPU that offers MIG placements (module docstring)."""
    out: dict[int, MigGeometry] = {}
    for g in topology.gpus:
        geo = g.mig_geometry
        if geo is None or not geo.profiles or g.lost:
            continue
        cc = g.compute_capability
        if g.mig_enabled and all(_instance_slot(g.index, geo, m) is not None for m in g.mig_devices):
            out[g.index] = geo
        elif not g.mig_enabled and cc is not None and cc[0] >= _FIRST_MIG_ARCHITECTURE_SWITCHED:
            out[g.index] = geo
    return out


def _instance_slot(gpu: int, geometry: MigGeometry, mig: MigDevice) -> MigSlot | None:
    """The slot a MIG instance on GPU ``gpu`` sits on (None: its placement or profile unknown)."""
    if mig.placement is None:
        return None
    found = resolve_slot(mig_slot_name(gpu, mig.profile, mig.placement.start), {gpu: geometry})
    return found if found is not None and found.placement == mig.placement else None


def instance_slots(topology: Topology, geometries: Mapping[int, MigGeometry]) -> list[MigSlot]:
    """The slots the MIG instances of the GPUs in ``geometries`` sit on now (cut for a
    prepared claim, or made by hand)."""
    return [s for i in sorted(geometries) for m in topology.gpus[i].mig_devices
            if (s := _instance_slot(i, geometries[i], m)) is not None]


def resolve_slot(name: str, geometries: Mapping[int, MigGeometry]) -> MigSlot | None:
    """The slot a dynamic MIG device name stands for on this node; None where the name is
    none (another device, a GPU without placements, a placement its profile does not have)."""
    parsed = parse_mig_slot_name(name)
    if parsed is None or parsed[0] not in geometries:
        return None
    gpu, label, start = parsed
    try:
        return MigSlot(gpu, *match_slot(geometries[gpu], label, start, gpu))
    except ValueError:
        return None


@dataclass
class GpuLayout:
    """What one GPU's counters hold now: the slots taken and whether the GPU is held whole."""

    index: int
    geometry: MigGeometry
    whole: bool = False
    slots: list[MigSlot] = field(default_factory=list)
    #: the names of ``slots`` that are MIG instances no prepared claim holds (made by hand):
    #: taken, never published
    foreign: set[str] = field(default_factory=set)

    def used(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slots:
            for k, v in s.uses(self.geometry).items():
                out[k] = out.get(k, 0) + v
        return out

    def fits(self, slot: MigSlot, used: Mapping[str, int] | None = None) -> bool:
        """Whether the counters left hold ``slot`` (as the scheduler checks them)."""
        if self.whole:
            return False
        used = self.used() if used is None else used
        cap = _shape(self.geometry).capacity
        return all(used.get(k, 0) + v <= cap.get(k, 0) for k, v in slot.uses(self.geometry).items())

    def free_slices(self) -> int:
        return 0 if self.whole else self.geometry.memory_slices - sum(s.placement.size for s in self.slots)

    def room(self) -> tuple[int, ...]:
        """Per profile, largest first (:func:`_by_size`), how many instances could still be cut:
        the free placements (a profile's placements are disjoint) within the counters left."""
        if self.whole:
            return tuple(0 for _ in self.geometry.profiles)
        shape = _shape(self.geometry)
        used, cap = self.used(), shape.capacity
        out = []
        for p in shape.by_size:
            n = sum(all(used.get(k, 0) + v <= cap[k] for k, v in shape.uses[(p.name, pl.start)].items())
                    for pl in p.placements)
            need = shape.uses[(p.name, p.placements[0].start)] if p.placements else {}
            for k, v in need.items():
                if not k.startswith("memory-slice-"):
                    n = min(n, (cap.get(k, 0) - used.get(k, 0)) // v)
            out.append(max(n, 0))
        return tuple(out)


def by_size(geometry: MigGeometry) -> list[MigProfile]:
    """The profiles, largest first: memory slices, then compute slices, then name."""
    return list(_shape(geometry).by_size)


def layouts(geometries: Mapping[int, MigGeometry], held: Mapping[str, Collection[int]],
            instances: Iterable[MigSlot] = ()) -> dict[int, GpuLayout]:
    """The layout of every GPU offering placements, from what prepared claims hold (device
    name -> GPU indices): a dynamic MIG device takes its slot, any other device its GPUs whole;
    and from the MIG instances there now (``instances``: :func:`instance_slots`), each one no
    held device names foreign (its slot taken, never published)."""
    out = {i: GpuLayout(i, geo) for i, geo in geometries.items()}
    for name, gpus in held.items():
        slot = resolve_slot(name, geometries)
        if slot is not None:
            out[slot.gpu].slots.append(slot)
            continue
        for g in gpus:
            if g in out:
                out[g].whole = True
    for slot in instances:
        if slot.name not in held and slot.gpu in out:
            out[slot.gpu].slots.append(slot)
            out[slot.gpu].foreign.add(slot.name)
    return out


def _rank(layout: GpuLayout, slot: MigSlot, before: tuple[int, ...]) -> tuple[tuple[int, ...], int, int, int]:
    layout.slots.append(slot)
    after, free = layout.room(), layout.free_slices()
    layout.slots.pop()
    return tuple(b - a for b, a in zip(before, after)), free, layout.index, slot.placement.start


def slot_order(layout_by_gpu: Mapping[int, GpuLayout], profile: str, avoid: Collection[int] = ()) -> list[MigSlot]:
    """Every free slot of ``profile`` on the GPUs not in ``avoid``, best first (module docstring)."""
    ranked = []
    for i in sorted(layout_by_gpu):
        layout = layout_by_gpu[i]
        p = layout.geometry.profile(profile)
        if p is None or i in avoid:
            continue
        used, before = layout.used(), layout.room()
        for pl in p.placements:
            slot = MigSlot(i, p, pl)
            if layout.fits(slot, used):
                ranked.append((_rank(layout, slot, before), slot))
    ranked.sort(key=lambda r: r[0])
    return [s for _, s in ranked]


def chosen_slots(layout_by_gpu: Mapping[int, GpuLayout], avoid: Collection[int] = (),
                 per_profile: int = SLOTS_PER_PROFILE) -> list[MigSlot]:
    """The slots to publish for the current layouts, in publication order (smallest profile
    first, :func:`_publication_key`; chosen largest profile first): in round one per
    profile the best :func:`slot_order` gives; in each further round (at most
    ``per_profile``) the best with every slot of the rounds before taken, of every profile (the
    scheduler may place claims of several profiles before the next rendering: a profile's
    next slot then stays free of the others' first ones), else the best with only that
    profile's own taken; none on the GPUs in ``avoid`` (unhealthy)."""
    names: dict[str, MigProfile] = {}
    for layout in layout_by_gpu.values():
        for p in by_size(layout.geometry):
            names.setdefault(p.name, p)

    def trial_with(slots: Iterable[MigSlot]) -> dict[int, GpuLayout]:
        trial = {i: GpuLayout(i, lay.geometry, lay.whole, list(lay.slots), lay.foreign)
                 for i, lay in layout_by_gpu.items()}
        for slot in slots:
            trial[slot.gpu].slots.append(slot)
        return trial

    by_profile: dict[str, list[MigSlot]] = {name: [] for name in names}
    for _ in range(per_profile):
        everyone = trial_with(s for chosen in by_profile.values() for s in chosen)
        for name, chosen in by_profile.items():
            best = slot_order(everyone, name, avoid) or slot_order(trial_with(chosen), name, avoid)
            best = [b for b in best if b not in chosen]
            if best:
                chosen.append(best[0])
    return [s for p in sorted(names.values(), key=_publication_key) for s in by_profile[p.name]]


def _publication_key(profile: MigProfile) -> tuple[int, int, bool, str]:
    """Profiles in publication order: smallest first (a GPU holds more small instances than
    large ones, so more claims ask for them, and the allocator evaluates a MIG claim's
    selectors on every MIG device it walks), a media-extension variant after its plain
    profile. The order among one profile's slots, which decides the placement, is the best fit."""
    size = max((pl.size for pl in profile.placements), default=0)
    return size, profile.compute_slices, "+" in profile.name, profile.name


def blocked(slot: MigSlot, layout: GpuLayout) -> bool:
    """Whether a held device overlaps ``slot`` (its counters could never be free with it)."""
    return layout.whole or any(set(s.placement.slices) & set(slot.placement.slices) for s in layout.slots
                               if s.name != slot.name or s.name in layout.foreign)


def slots_named(names: Iterable[str], geometries: Mapping[int, MigGeometry]) -> list[MigSlot]:
    """The slots of the dynamic MIG device names among ``names`` (others skipped)."""
    return [s for s in (resolve_slot(n, geometries) for n in names) if s is not None]
