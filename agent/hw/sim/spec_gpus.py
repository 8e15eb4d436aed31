"""The GPU entries of a machine spec (``gpus``, over ``gpu_defaults``): the catalogued model
and its overrides, MIG devices, fabric membership, NUMA node and CPUs, the processes
(:mod:`agent.hw.sim.processes`), read into
:class:`~agent.hw.sim.spec_model.GpuSpec` for :func:`agent.hw.sim.spec.machine_spec_from_dict`.
"""

from __future__ import annotations

import re
import uuid as uuid_mod
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from agent.hw.sim.catalogue import GPU_MODELS, GpuModel, unknown_model
from agent.hw.sim.mig_geometry import geometry_for, place_all
from agent.hw.sim.nvml_types import CONSTANTS as _C
from agent.hw.sim.processes import check_process_cgroups, read_processes
from agent.hw.sim.spec_model import GpuSpec, MigDeviceSpec
from agent.hw.sim.spec_reader import SpecReader
from agent.records import COMPUTE_MODES, synthetic_gpu_uuid

_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+me)?$")


def parse_mig_profile(profile: str) -> MigDeviceSpec:
    """``"1g.10gb"`` / ``"1c.3g.40gb"`` -> :class:`MigDeviceSpec`; ValueError otherwise."""
    m = _PROFILE_RE.match(profile.strip())
    if m is None:
        raise ValueError(
            f"not a MIG profile: {profile!r} (expected e.g. '3g.40gb' or '1c.3g.40gb')"
        )
    gi = int(m[2])
    ci = int(m[1]) if m[1] else gi
    if not (1 <= ci <= gi <= 8):
        raise ValueError(f"MIG profile {profile!r}: slices out of range")
    return MigDeviceSpec(profile.strip(), gi, ci, int(m[3]))


_MAX_LINKS = _C["NVML_NVLINK_MAX_LINKS"]

_GPU_KEYS = frozenset(
    {
        "model",
        "name",
        "bus_id",
        "uuid",
        "numa_node",
        "cpus",
        "host_bridge",
        "switches",
        "minor_number",
        "memory_mib",
        "compute_capability",
        "nvlinks",
        "mig",
        "mig_capable",
        "fabric",
        "gpu_numa_id",
        "board",
        "compute_mode",
        "processes",
    }
)


def read_gpus(
    r: SpecReader,
    data: Mapping[str, Any],
    machine: str,
    numa: Mapping[int, tuple[str, tuple[int, ...]]],
) -> tuple[GpuSpec, ...]:
    """The ``gpus`` entries (each over ``gpu_defaults``), in index order; a bus id given
    twice, or one PID with two cgroups, is an error."""
    defaults = r.mapping(data.get("gpu_defaults"), "gpu_defaults", _GPU_KEYS)
    raw_gpus = r.seq(data.get("gpus"), "gpus")
    if not raw_gpus:
        raise r.fail("gpus", "a machine needs at least one GPU")
    gpus = tuple(
        _read_gpu(r, {**defaults, **r.mapping(raw, f"gpus[{i}]", _GPU_KEYS)}, i, machine, numa)
        for i, raw in enumerate(raw_gpus)
    )
    seen: set[str] = set()
    for g in gpus:
        if g.bus_id in seen:
            raise r.fail(f"gpus[{g.index}].bus_id", f"{g.bus_id} given twice")
        seen.add(g.bus_id)
    check_process_cgroups(((g.index, g.processes) for g in gpus), r.source)
    return gpus


def _read_model(r: SpecReader, entry: Mapping[str, Any], where: str) -> GpuModel:
    """The catalogued model named by ``model`` (or ``name``), with the entry's overrides; a
    name the catalogue does not know states nothing but itself."""
    raw_name = entry.get("model", entry.get("name"))
    model_name = r.str_(raw_name, f"{where}.model") if raw_name is not None else None
    model = GPU_MODELS.get(model_name or "") or unknown_model(model_name)
    overrides: dict[str, Any] = {}
    if "memory_mib" in entry:
        overrides["memory_mib"] = r.int_(entry["memory_mib"], f"{where}.memory_mib", minimum=1)
    if "compute_capability" in entry:
        cc = r.seq(entry["compute_capability"], f"{where}.compute_capability")
        if len(cc) != 2:
            raise r.fail(f"{where}.compute_capability", "expected [major, minor]")
        overrides["compute_capability"] = tuple(
            r.int_(x, f"{where}.compute_capability", minimum=0) for x in cc
        )
    if "nvlinks" in entry:
        ports = r.int_(entry["nvlinks"], f"{where}.nvlinks", minimum=0)
        if ports > _MAX_LINKS:
            raise r.fail(f"{where}.nvlinks", f"at most {_MAX_LINKS} NVLinks per GPU")
        overrides["nvlinks"] = ports
    if entry.get("mig_capable") is not None:
        overrides["mig"] = r.bool_(entry["mig_capable"], f"{where}.mig_capable")
    return replace(model, **overrides) if overrides else model


def _read_mig(
    r: SpecReader, entry: Mapping[str, Any], model: GpuModel, where: str
) -> tuple[MigDeviceSpec, ...] | None:
    """The MIG devices (None: MIG disabled)."""
    if entry.get("mig") is None:
        return None
    if model.mig is False:
        raise r.fail(f"{where}.mig", f"{model.name} is not MIG capable")
    mig: list[MigDeviceSpec] = []
    for j, prof in enumerate(r.seq(entry["mig"], f"{where}.mig")):
        try:
            mig.append(parse_mig_profile(r.str_(prof, f"{where}.mig[{j}]")))
        except ValueError as exc:
            raise r.fail(f"{where}.mig[{j}]", str(exc)) from None
    if sum(d.gi_slices for d in mig) > 7 or len(mig) > 7:
        raise r.fail(f"{where}.mig", "more than 7 compute slices / devices on one GPU")
    return _placed(r, mig, model, where)


def _placed(
    r: SpecReader, mig: list[MigDeviceSpec], model: GpuModel, where: str
) -> tuple[MigDeviceSpec, ...]:
    """The MIG devices on legal placements of the model's geometry, in spec order
    (:func:`agent.hw.sim.mig_geometry.place_all`); unchanged for a model the geometry table
    does not know. A profile the model lacks, or a layout that cannot be placed, is an error
    naming the GPU and the profile."""
    geometry = geometry_for(model.name)
    if geometry is None or not mig:
        return tuple(mig)
    profiles = []
    for j, d in enumerate(mig):
        profile = geometry.profile(d.gi_profile)
        if profile is None:
            names = ", ".join(p.name for p in geometry.profiles)
            raise r.fail(f"{where}.mig[{j}]", f"{model.name} has no MIG profile {d.gi_profile!r} "
                         f"(its profiles: {names})")
        profiles.append(profile)
    placements = place_all(geometry, profiles)
    if placements is None:
        for k in range(1, len(profiles) + 1):  # the first instance that no longer fits
            if place_all(geometry, profiles[:k]) is None:
                break
        raise r.fail(f"{where}.mig[{k - 1}]", f"{mig[k - 1].profile} does not fit on the "
                     f"{model.name} beside {', '.join(d.profile for d in mig[:k - 1])} "
                     "(no legal MIG placement left)")
    return tuple(replace(d, placement=p) for d, p in zip(mig, placements))


def _read_fabric(r: SpecReader, value: object, where: str) -> tuple[str | None, int | None]:
    fabric = r.mapping(value, where, frozenset({"cluster_uuid", "clique_id"}))
    cluster = fabric.get("cluster_uuid")
    if cluster:
        try:
            cluster = str(uuid_mod.UUID(str(cluster)))
        except ValueError:
            raise r.fail(f"{where}.cluster_uuid", f"not a UUID: {cluster!r}") from None
    return cluster or None, r.opt_int(fabric.get("clique_id"), f"{where}.clique_id", minimum=0)


def _read_gpu(
    r: SpecReader,
    entry: Mapping[str, Any],
    i: int,
    machine: str,
    numa: Mapping[int, tuple[str, tuple[int, ...]]],
) -> GpuSpec:
    where = f"gpus[{i}]"
    model = _read_model(r, entry, where)
    node = r.opt_int(entry.get("numa_node"), f"{where}.numa_node", minimum=0)
    if node is not None and numa and node not in numa:
        raise r.fail(f"{where}.numa_node", f"NUMA node {node} is not in numa_nodes")
    if entry.get("cpus") is not None:
        cpulist: str | None = r.cpulist(entry["cpus"], f"{where}.cpus")
    else:
        cpulist = (numa[node][0] or None) if node is not None and node in numa else None
    mig = _read_mig(r, entry, model, where)
    if mig is not None and model.mig is None:
        model = replace(model, mig=True)  # MIG enabled: the GPU is capable
    cluster, clique = _read_fabric(r, entry.get("fabric"), f"{where}.fabric")
    return GpuSpec(
        index=i,
        model=model,
        bus_id=r.bus_id(entry.get("bus_id"), f"{where}.bus_id"),
        uuid=r.str_(entry["uuid"], f"{where}.uuid")
        if entry.get("uuid")
        else synthetic_gpu_uuid(machine, i),
        numa_node=node,
        cpulist=cpulist,
        host_bridge=r.str_(entry.get("host_bridge", "pci0000:00"), f"{where}.host_bridge"),
        switches=r.names(entry.get("switches"), f"{where}.switches"),
        minor_number=r.opt_int(entry.get("minor_number", i), f"{where}.minor_number", minimum=0),
        mig_enabled=mig is not None,
        mig_devices=mig or (),
        fabric_cluster_uuid=cluster,
        fabric_clique_id=clique,
        gpu_numa_id=r.opt_int(entry.get("gpu_numa_id"), f"{where}.gpu_numa_id", minimum=0),
        board=str(entry["board"]) if entry.get("board") is not None else None,
        compute_mode=_read_compute_mode(r, entry.get("compute_mode", "Default"), f"{where}.compute_mode"),
        processes=read_processes(entry.get("processes"), r.source, f"{where}.processes"),
    )


def _read_compute_mode(r: SpecReader, value: object, where: str) -> str:
    """nvidia-smi's name of a compute mode (``Default``, ``Exclusive_Process``,
    ``Prohibited``, ``Exclusive_Thread``), any case."""
    text = r.str_(value, where)
    for name in COMPUTE_MODES.values():
        if text.strip().lower() == name.lower():
            return name
    raise r.fail(where, f"expected one of {', '.join(COMPUTE_MODES.values())}, got {text!r}")
