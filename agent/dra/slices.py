"""ResourceSlices: the node's GPUs as DRA devices, a pure function of the topology.

One pool per node (pool name = node name), owned by the Node object. Each device carries
attributes qualified by the driver name (``gpu.gpu-agent.io/<id>``) and capacity ``memory``;
a fact the topology does not hold is left out, never guessed.

Attributes (``<driver>/`` omitted):

==========================  ========  =====================================================
``type``                    string    ``gpu`` (a full GPU) or ``mig`` (a MIG device)
``index``                   int       NVML index of the GPU; of a MIG device, its MIG index
                                      within the parent
``uuid``                    string    ``GPU-...`` / ``MIG-...``
``productName``             string    NVML's name, e.g. ``NVIDIA H100 80GB HBM3``
``brand``                   string    NVML's product brand as nvidia-smi spells it (``NVIDIA``, ``Tesla``)
``architecture``            string    from the compute capability: Volta, Turing, Ampere,
                                      Ada Lovelace, Hopper, Blackwell
``cudaComputeCapability``   version   ``9.0`` -> ``9.0.0``
``driverVersion``           version   kernel driver, ``550.54.15`` (leading zeros dropped)
``cudaDriverVersion``       version   ``12.4`` -> ``12.4.0``
``pciBusID``                string    ``0000:1b:00.0`` (sysfs spelling)
``numaNode``                int       the GPU's NUMA node, when known
``nvlinkIsland``            int       id of the GPU's NVLink island (connected component of
                                      the NVLink graph): its lowest GPU index. A GPU with no
                                      NVLink peer is an island of its own.
``nvlinkClique``            int       id of the GPU's NVLink clique (a set of GPUs linked
                                      pairwise): the clique's position in the sorted list of
                                      maximal cliques (GPUs without NVLink peer count as
                                      cliques of one). A GPU in several maximal cliques gets
                                      the largest, then the first in that list; so every GPU
                                      sharing a value is NVLinked to every other.
``heldBySet``               bool      full GPUs, with sets: true while a prepared claim holds
                                      the GPU through a set (the GPU class refuses it before
                                      any counter is compared; withdrawn after the grace)
``profile``, ``parentUUID``,
``parentIndex``             MIG only  ``1g.10gb``, the parent GPU's UUID and index
==========================  ========  =====================================================

plus the standard ``resource.kubernetes.io/pcieRoot`` (the PCIe root complex,
``pci0000:17``, when known), so a claim can align a GPU with a NIC of another driver, and the
standard ``resource.kubernetes.io/numaNode`` (KEP-6072, an int, left out where unknown). A
MIG device carries its parent's topology attributes; its capacity ``memory`` is the slice's.

**GPU sets** (``resource.k8s.io/v1`` only): the sets of :mod:`agent.dra.gpusets` as devices
of their own, with partitionable devices (KEP-4815), and a counter per GPU
(:mod:`agent.dra.counters`): two devices standing for the same GPU consume its counter, so
allocating a set blocks its members and every overlapping set, and allocating a single
blocks every set that contains it. Where the sets and the single GPUs share one slice (up
to 64 devices), a device consumes a GPU's counter only while another published device
stands for that GPU too (a single GPU while a set holds it, a set's member while a single
or another set holds it), and the counter slice declares only the counters consumed: the
scheduler compares every declared counter for every device it reserves, on every Filter.
:mod:`agent.dra.counters` says why that is safe and how the publisher orders its writes.
Above one slice, every set consumes all its members' counters, and a single GPU its own while
a set of this publication or of the one before holds it. MIG-enabled GPUs
are in no set (a GPU in MIG mode cannot serve as a whole GPU), so MIG devices consume no
counter and a MIG device never competes with a set. Which sets, in what order, and when a
published set may go: :mod:`agent.dra.gpusets`. Set device attributes (only what the device
classes select on; the name says the members, ``gpuset-4-mf`` is GPUs 0-3):

==========================  ========  =====================================================
``type``                    string    ``gpuset``
``gpuCount``                int       number of GPUs in the set
``healthy``                 bool      false while a member is unhealthy (the set is tainted
                                      then too); the set classes select healthy sets only,
                                      so the allocator never reserves a tainted set's
                                      counters (kubernetes#140436 keeps a taint-rejected
                                      device's counters for the rest of its search)
==========================  ========  =====================================================

**Health.** A device holding an unhealthy or lost GPU stays, with a device taint saying
why, or is left out where the API server keeps no taints (:mod:`agent.dra.taints`).

**Slices.** Devices in publication order (:mod:`agent.dra.gpusets`, for the occupancy
given): the sets, largest first, then the single GPUs (MIG devices in their parent's place),
then the dynamic MIG devices, then, in one slice, the sets being withdrawn; in one slice the
first single GPU leads, then the dynamic MIG devices, before the sets; at most 128 devices a
slice, 64 when any consumes counters or has a taint (the API's limit for slices using partitionable devices or
taints); above one slice, the singles start a slice of their own, so a re-publication moves
no single GPU between slices. Slice names are
``<node>-<driver>-<nnn>`` with a zero-padded number, so they sort in publication order (the
allocator walks slices by name); the counter slice is number 0. ``v1beta1`` and ``v1beta2``
render single GPUs only (no counters, no sets).

Size: above 400 lines because this docstring is the attribute reference users read (about a
hundred lines of tables); the code is one rendering pass, attributes to devices to slices.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, Collection, Iterable, Mapping, Sequence

from agent.config import DEFAULT_DRIVER_NAME
from agent.dra.counters import declared_counter_sets, meeting_gpus
from agent.dra.device_values import (
    API_VERSIONS,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_WITH_COUNTERS,
    MAX_NAME,
    NUMA_NODE_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    SETS_API_VERSIONS,
    Device,
    gpu_attributes,
    make_device,
    render_device,
    semver,
    string_attribute,
)
from agent.dra.devices import device_name, parse_name, parse_set_name
from agent.dra.gpusets import (
    GpuSet,
    SetPolicy,
    clique_ids,
    device_order,
    island_ids,
)
from agent.dra.mig_publish import MigRendering, counter_slices, cut_gpus, mig_devices
from agent.dra.migslots import SLOTS_PER_PROFILE
from agent.dra.occupancy import NOTHING_HELD, Occupancy
from agent.dra.taints import MAX_TAINTS, HealthMarks
from agent.dra.withdrawal import withdrawal_taint
from agent.health import LOST_REASON
from agent.kube import RESOURCE_GROUP
from agent.records import MigGeometry
from agent.topology.model import Gpu, MigDevice, Topology

__all__ = [
    "API_VERSIONS", "MAX_DEVICES_PER_SLICE", "MAX_DEVICES_WITH_COUNTERS",
    "NUMA_NODE_ATTRIBUTE", "PCIE_ROOT_ATTRIBUTE", "SETS_API_VERSIONS", "Device", "Occupancy",
    "render_devices", "render_set_devices", "health_marks", "render_slices", "semver",
]

# ----------------------------------------------------------------------- devices
def health_marks(topology: Topology, unhealthy: Collection[int] | Mapping[int, str] = (),
                 taint_effect: str | None = "NoSchedule", keep: Collection[str] = ()) -> HealthMarks:
    """How the unhealthy GPUs show (:class:`agent.dra.taints.HealthMarks`): ``unhealthy`` maps
    a GPU index to its reason (indices alone: reason unknown), lost GPUs of the topology are
    unhealthy too; ``taint_effect`` None leaves their devices out, but those named in ``keep``."""
    reasons = dict(unhealthy) if isinstance(unhealthy, Mapping) else {i: "unhealthy" for i in unhealthy}
    for g in topology.gpus:
        if g.lost:
            reasons.setdefault(g.index, LOST_REASON)
    return HealthMarks(reasons, taint_effect, frozenset(keep))


def render_devices(topology: Topology, driver: str = DEFAULT_DRIVER_NAME,
                   marks: HealthMarks | None = None, order: Sequence[int] | None = None,
                   counters: Collection[int] = (), held_by_set: Collection[int] | None = None,
                   dynamic: Collection[int] = ()) -> list[Device]:
    """The node's single devices (full GPUs, MIG devices) in slice order (``order``: GPU
    indices, default :func:`agent.dra.gpusets.device_order`); a device of an unhealthy GPU
    is tainted, or left out, as ``marks`` says (default: the lost GPUs tainted
    ``NoSchedule``). ``counters``: the GPU indices whose full GPU consumes its own counter.
    ``held_by_set``: where given (a rendering with sets), every full GPU carries ``heldBySet``,
    true for the GPU indices named. ``dynamic``: the GPUs offering dynamic MIG, whose MIG
    instances are no static devices (:mod:`agent.dra.mig_publish` publishes them)."""
    marks = marks if marks is not None else health_marks(topology)
    islands = island_ids(topology)
    cliques = clique_ids(topology)
    out: list[Device] = []
    for index in order if order is not None else device_order(topology):
        gpu = topology.gpus[index]
        common = gpu_attributes(topology, gpu, islands[index], cliques[index])
        if gpu.mig_enabled:
            for mig in sorted(gpu.mig_devices, key=lambda m: m.index) if index not in dynamic else ():
                name = device_name(gpu, mig)
                shown, taints = marks.device(driver, name, (index,))
                if shown:
                    out.append(make_device(driver, name, _mig_attributes(gpu, mig) | common, mig.memory_mib,
                                       taints=taints))
        else:
            shown, taints = marks.device(driver, device_name(gpu), (index,))
            own = {"type": {"string": "gpu"}, "index": {"int": gpu.index}, "uuid": string_attribute(gpu.uuid)}
            if held_by_set is not None:
                own["heldBySet"] = {"bool": index in held_by_set}
            if shown:
                out.append(make_device(driver, device_name(gpu), own | common, gpu.memory_mib,
                                   (index,) if index in counters else (), taints))
    return out


def render_set_devices(topology: Topology, sets: Iterable[GpuSet], driver: str = DEFAULT_DRIVER_NAME,
                       marks: HealthMarks | None = None, withdrawing: Collection[str] = ()) -> list[Device]:
    """``sets`` as devices, in the given order, with only the attributes the device classes
    select on (``type``, ``gpuCount``, ``healthy``); a set with an unhealthy member is
    tainted (or left out) as ``marks`` says, one with a MIG-enabled member left out; a set
    named in ``withdrawing`` carries the withdrawal taint (:mod:`agent.dra.withdrawal`) and
    ``healthy: false``."""
    marks = marks if marks is not None else health_marks(topology)
    out: list[Device] = []
    for s in sets:
        shown, taints = marks.device(driver, s.name, s.members)
        if not shown or any(topology.gpus[i].mig_enabled for i in s.members):
            continue
        if s.name in withdrawing:
            taints = [withdrawal_taint(driver), *taints][:MAX_TAINTS]
        attributes = {
            "type": {"string": "gpuset"},
            "gpuCount": {"int": s.size},
            # a set being withdrawn shows unhealthy too: the shipped classes then never select
            # it, so no allocator reserves (and, kubernetes#140436, keeps) its counters
            "healthy": {"bool": not any(i in marks.reasons for i in s.members) and s.name not in withdrawing},
        }
        out.append(make_device(driver, s.name, attributes, None, s.members, taints))
    return out


def _mig_attributes(gpu: Gpu, mig: MigDevice) -> dict[str, Any]:
    return {
        "type": {"string": "mig"},
        "index": {"int": mig.index},
        "uuid": string_attribute(mig.uuid),
        "profile": string_attribute(mig.profile),
        "parentUUID": string_attribute(gpu.uuid),
        "parentIndex": {"int": gpu.index},
    }


# ----------------------------------------------------------------------- slices
def slice_name(node_name: str, driver: str, number: int, width: int = 3) -> str:
    """``<node>-<driver>-<nnn>`` (zero-padded to ``width``, so names sort in number order),
    a DNS subdomain of at most 253 characters (a long name is cut and made unique with a
    hash)."""
    name = f"{node_name}-{driver}-{number:0{width}d}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(f"{node_name}/{driver}".encode()).hexdigest()[:10]
    keep = MAX_NAME - len(driver) - 13 - width
    return f"{node_name[:keep]}-{digest}-{driver}-{number:0{width}d}".replace("..", ".")


def render_slices(
    topology: Topology,
    *,
    node_name: str,
    driver: str = DEFAULT_DRIVER_NAME,
    api_version: str = "v1",
    generation: int = 1,
    node_uid: str | None = None,
    unhealthy: Collection[int] | Mapping[int, str] = (),
    occupancy: Occupancy = NOTHING_HELD,
    with_sets: bool = True,
    taint_effect: str | None = "NoSchedule",
    keep: Collection[str] = (),
    policy: SetPolicy | None = None,
    dynamic_mig: bool = False,
    mig_placements: int = SLOTS_PER_PROFILE,
) -> list[dict[str, Any]]:
    """The node's ResourceSlice objects for ``resource.k8s.io/<api_version>``: one pool named
    after the node, owned by the Node when its UID is known. With ``with_sets`` (the default)
    and an ``api_version`` of :data:`SETS_API_VERSIONS`, and at least one set to publish: a
    counter slice, then the sets and the single GPUs consuming counters; otherwise the single
    GPUs only. 64 devices a slice where any device consumes counters or has a taint, else 128
    (module docstring). Devices of ``unhealthy`` GPUs (index -> reason) are tainted with
    ``taint_effect``, or, where it is None, left out but those named in ``keep``
    (:mod:`agent.dra.taints`). ``occupancy``: what prepared claims hold and which sets are
    published now; the single GPUs and the sets follow it (:mod:`agent.dra.gpusets`).
    ``policy``: the topology's :class:`agent.dra.gpusets.SetPolicy`, built when not given.
    ``dynamic_mig`` (``v1`` only): the MIG devices of :mod:`agent.dra.mig_publish` after the
    single GPUs, and their counter slices after the sets' (module docstring), ``mig_placements``
    of each profile."""
    if api_version not in API_VERSIONS:
        raise ValueError(f"api version {api_version!r}: expected one of {', '.join(API_VERSIONS)}")
    marks = health_marks(topology, unhealthy, taint_effect, keep)
    policy = policy or SetPolicy(topology)
    free = policy.free_gpus(occupancy.held_gpus, marks.reasons)
    sets: list[Device] = []
    if with_sets and api_version in SETS_API_VERSIONS and topology.gpu_count >= 2:
        sets = _set_devices(topology, policy, occupancy, free, driver, marks, graced=taint_effect is not None)
    mig = (mig_devices(topology, driver, marks, occupancy.held, occupancy.singles, occupancy.expired,
                       graced=taint_effect is not None, per_profile=mig_placements)
           if dynamic_mig and api_version in SETS_API_VERSIONS else MigRendering({}, [], []))
    singles = _singles(topology, driver, marks, policy.single_order(free), sets, occupancy, taint_effect is not None,
                       mig.geometries)
    mig, singles = _mig_in_one_slice(mig, sets, singles, occupancy, marks)
    # the full GPU of a GPU offering placements consumes all of its counter set (no MIG device beside it)
    singles = [replace(d, shares=mig.gpu_share(g[0])) if (g := _gpu_of(d)) and g[0] in mig.geometries else d
               for d in singles]
    specs = _specs(topology, driver, api_version, sets, singles, mig, occupancy)
    return _slice_objects(specs, node_name, driver, api_version, generation, node_uid)


def _mig_in_one_slice(mig: MigRendering, sets: list[Device], singles: list[Device], occupancy: Occupancy,
                      marks: HealthMarks) -> tuple[MigRendering, list[Device]]:
    """The MIG devices and the singles where all the devices fit one slice, so that every view of
    the pool has one publication's devices (mig_publish's docstring): a MIG device a prepared
    claim holds that meets no other device left out; the MIG counters only where two devices
    meet (:mod:`agent.dra.mig_counters`): where two or more devices stand for a GPU, each MIG
    device consuming its weight or size of the GPU's set counter and the full GPU all of it,
    unless only MIG devices stand for it. Unchanged above one slice."""
    standing = {g for d in sets for g in d.consumes} | {g for d in singles for g in _gpu_of(d)}
    lone = mig.lone_held(occupancy.held, standing, marks.reasons)
    if len(sets) + len(singles) + len(mig.devices) - len(lone) <= MAX_DEVICES_WITH_COUNTERS:
        mig = mig.leaving_out(lone)
    if mig.devices and len(sets) + len(singles) + len(mig.devices) <= MAX_DEVICES_WITH_COUNTERS:
        full = {g for d in singles for g in _gpu_of(d) if g in mig.geometries}
        in_sets = [g for d in sets for g in d.consumes]
        devices_on = in_sets + list(full) + mig.gpus
        sized = {g for g in mig.geometries if devices_on.count(g) >= 2}
        mig = mig.meeting(full, sized, sized - full - set(in_sets))
        singles = [replace(d, consumes=g) if (g := _gpu_of(d)) and g[0] in mig.sized else d for d in singles]
    return mig, singles


def _specs(topology: Topology, driver: str, api_version: str, sets: list[Device], singles: list[Device],
           mig: MigRendering, occupancy: Occupancy) -> list[dict[str, Any]]:
    """The slices' bodies: the counter slices, then the devices (module docstring)."""
    devices = sets + singles + mig.devices  # sets first: a multi-GPU claim tries its set before the singles
    advanced = bool(sets) or bool(mig.devices) or any(d.taints for d in devices)
    per_slice = MAX_DEVICES_WITH_COUNTERS if advanced else MAX_DEVICES_PER_SLICE
    one = len(devices) <= per_slice
    if sets and one:  # one device slice: counters only where two devices meet
        meet = meeting_gpus([*(d.consumes for d in sets), *(_gpu_of(d) for d in singles), *((g,) for g in mig.gpus)])
        sets = [replace(d, consumes=tuple(g for g in d.consumes if g in meet)) for d in sets]
    # above one slice every set consumes all its members' counters (_singles says the singles'), and a
    # MIG device its share of its GPU's wherever its full GPU would
    held = {g for d in sets for g in d.consumes}
    held |= set() if one else {g for name in occupancy.published for g in parse_set_name(name) or ()}
    weights = {g: mig.worth(g) for g in mig.geometries}
    migs = mig.sharing(held | mig.sized, weights)
    consumed = {g for d in [*sets, *singles] for g in d.consumes} | (held & set(mig.gpus)) | mig.sized
    specs: list[dict[str, Any]] = (
        [{"sharedCounters": declared_counter_sets(consumed or {topology.gpus[0].index}, weights)}]
        if sets or mig.sized else [])
    specs += counter_slices(mig)
    # above one slice, the singles start a slice of their own: a re-publication with as many slices of
    # sets moves no device between slices (the publisher rewrites in place then); in one slice, the first
    # single GPU leads (a one-GPU claim takes it without walking the sets), the MIG devices follow (a MIG
    # claim walks no set and no other GPU: on a node offering dynamic MIG most claims are MIG claims;
    # a set claim walks them instead), and the sets being withdrawn go last: no class selects them, and
    # a claim that finds a device first never walks them. The order among the sets, among the singles
    # and among the MIG devices is what decides the allocator's first fit, and it is kept.
    key = withdrawal_taint(driver)["key"]
    going = [any(t.get("key") == key for t in d.taints) for d in sets]
    groups = ([[*singles[:1], *migs, *(d for d, g in zip(sets, going) if not g), *singles[1:],
                *(d for d, g in zip(sets, going) if g)]]
              if one else [sets, singles + migs])
    specs += [{"devices": [render_device(d, api_version, weights) for d in group[i : i + per_slice]]}
              for group in groups for i in range(0, len(group), per_slice)]
    specs += [] if devices else [{"devices": []}]  # an empty pool is published too: "no devices here now"
    return specs


def _slice_objects(specs: list[dict[str, Any]], node_name: str, driver: str, api_version: str, generation: int,
                   node_uid: str | None) -> list[dict[str, Any]]:
    """The pool's ResourceSlice objects, one per spec body (counters or devices), in order."""
    width = max(3, len(str(len(specs) - 1)))
    out = []
    for number, body in enumerate(specs):
        metadata: dict[str, Any] = {"name": slice_name(node_name, driver, number, width)}
        if node_uid:
            metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node_name,
                                            "uid": node_uid, "controller": True}]
        out.append({
            "apiVersion": f"{RESOURCE_GROUP}/{api_version}",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": {"driver": driver, "nodeName": node_name,
                     "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(specs)},
                     **body},
        })
    return out


def _singles(topology: Topology, driver: str, marks: HealthMarks, order: Sequence[int], sets: Sequence[Device],
             occupancy: Occupancy, graced: bool, dynamic: Mapping[int, MigGeometry] | None = None) -> list[Device]:
    """The single devices in ``order``; a whole GPU consumes its counter only while one of
    ``sets`` holds it, or, where the sets and the singles have slices of their own, one of the
    sets published now (``occupancy.published``: the singles' slice is written first, so the
    scheduler may see it beside the sets of the publication before; :mod:`agent.dra.counters`). With sets, every
    whole GPU says whether a prepared claim holds it through a set, and (``graced``: the server
    keeps taints) such a single is withdrawn as :class:`Occupancy` says. ``dynamic``: the GPUs
    offering dynamic MIG (no static MIG device); the full GPU of one a prepared claim holds a MIG
    device on is withdrawn the same way (at once without a grace or where the pool is not known)."""
    dynamic = dynamic or {}
    covered = {g for d in sets for g in d.consumes}
    held = occupancy.via_sets if sets else None
    singles = render_devices(topology, driver, marks, order, covered, held, dynamic)
    if sets and len(sets) + len(singles) > MAX_DEVICES_WITH_COUNTERS:  # the singles' slice is written first
        covered |= {g for name in occupancy.published for g in parse_set_name(name) or ()}
        singles = [replace(d, consumes=tuple(g for g in _gpu_of(d) if g in covered)) for d in singles]
    tainted, gone = occupancy.single_withdrawals(topology) if sets and graced else (set(), set())
    # the full GPU of a GPU a MIG device is cut from: no claim can hold it (the counters kept them apart,
    # so it goes at once without a grace) and the scheduler would walk it and its counters for nothing
    cut = {device_name(topology.gpus[g]) for g in cut_gpus(occupancy.held, dynamic)} - set(occupancy.held)
    lagging = (cut & set(occupancy.singles) - set(occupancy.expired)
               if graced and occupancy.expired is not None and occupancy.singles is not None else set())
    tainted, gone = tainted | lagging, gone | (cut - lagging)
    return [replace(d, taints=tuple([withdrawal_taint(driver), *d.taints][:MAX_TAINTS])) if d.name in tainted else d
            for d in singles if d.name not in gone]


def _set_devices(topology: Topology, policy: SetPolicy, occupancy: Occupancy, free: Collection[int],
                 driver: str, marks: HealthMarks, graced: bool) -> list[Device]:
    """The set devices :meth:`Occupancy.sets` gives, the ones being withdrawn tainted."""
    sets, withdrawing = occupancy.sets(policy, free, graced)
    return render_set_devices(topology, sets, driver, marks, withdrawing)


def _gpu_of(device: Device) -> tuple[int, ...]:
    """The whole GPU a single device stands for (none for a MIG device: no set holds a GPU in
    MIG mode, so a MIG device never meets another device)."""
    return tuple(gpu for gpu, mig in parse_name(device.name) or () if mig is None)
