"""The machine spec: the model the fake NVML and the fake sysfs tree are built from, and its
one schema (:func:`machine_spec_from_dict`; files through :func:`load_machine_spec`).

The format is documented in README.md ("Machine spec format") and on
:func:`machine_spec_from_dict`. A fact a spec does not state stays unknown: the fake NVML
answers ``NotSupported`` for it, the fake sysfs writes ``-1`` or leaves the file out.
"""

from __future__ import annotations

import os
import re
import uuid as uuid_mod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.errors import InputFormatError
from agent.formats import BusIdError, parse_cpulist, read_document, sysfs_to_nvml_bus_id
from agent.hw.sim.catalogue import GPU_MODELS, GpuModel, unknown_model
from agent.hw.sim.nvml_types import CONSTANTS as _C
from agent.hw.sim.processes import ProcessSpec, check_process_cgroups, read_processes
from agent.records import synthetic_gpu_uuid


# =========================================================================== machine spec
@dataclass(frozen=True)
class MigDeviceSpec:
    """One MIG device: ``profile`` like ``"3g.40gb"`` or ``"1c.3g.40gb"``."""

    profile: str
    gi_slices: int
    ci_slices: int
    memory_gb: int


@dataclass(frozen=True)
class GpuSpec:
    index: int
    model: GpuModel
    bus_id: str  # NVML spelling
    uuid: str
    numa_node: int | None = None
    cpulist: str | None = None
    host_bridge: str = "pci0000:00"
    switches: tuple[str, ...] = ()
    minor_number: int | None = None
    mig_enabled: bool = False
    mig_devices: tuple[MigDeviceSpec, ...] = ()
    fabric_cluster_uuid: str | None = None
    fabric_clique_id: int | None = None
    gpu_numa_id: int | None = None  # nvmlDeviceGetNumaNodeId (GPU memory node on Grace)
    board: str | None = None  # GPUs on one multi-GPU board are NVML_TOPOLOGY_INTERNAL
    processes: tuple[ProcessSpec, ...] = ()  # agent.hw.sim.processes


@dataclass(frozen=True)
class NicSpec:
    name: str
    bus_id: str  # any spelling
    numa_node: int | None = None
    host_bridge: str = "pci0000:00"
    switches: tuple[str, ...] = ()
    cpulist: str | None = None  # local CPUs (sysfs local_cpulist); None: its NUMA node's


@dataclass(frozen=True)
class NvSwitchSpec:
    links_per_gpu: int
    bus_ids: tuple[str, ...]  # NVML spelling; links are spread over them
    gpus: tuple[int, ...] | None = None  # None: every GPU


@dataclass(frozen=True)
class FaultSpec:
    lost_gpus: tuple[int, ...] = ()
    unsupported: tuple[tuple[str, int | None], ...] = ()
    init_error: str | None = None  # an NVML_ERROR_* suffix: "library_not_found"


@dataclass(frozen=True)
class MachineSpec:
    """Everything the fake NVML and the fake sysfs tree of one machine are built from."""

    name: str
    gpus: tuple[GpuSpec, ...]
    numa_nodes: Mapping[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    nics: tuple[NicSpec, ...] = ()
    nvlink_pairs: tuple[tuple[int, int, int], ...] = ()
    nvswitch: NvSwitchSpec | None = None
    pcie_levels: Mapping[tuple[int, int], int] = field(default_factory=dict)  # NVML values
    product_name: str | None = None
    driver_version: str | None = None  # None: not stated (NVML answers NotSupported)
    cuda_driver_version: int | None = None  # NVML's integer, 12040 for 12.4; None: not stated
    faults: FaultSpec = FaultSpec()
    description: str = ""
    notes: tuple[str, ...] = ()  # what the simulation inferred or synthesised (a pasted matrix)


def nvml_bus_id(bus_id: str) -> str:
    """Either spelling -> NVML's ``00000000:3B:00.0`` (:func:`agent.formats.sysfs_to_nvml_bus_id`)."""
    return sysfs_to_nvml_bus_id(bus_id)


_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb$")


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


_LEVEL_NAMES = {
    "BOARD": 0,
    "INTERNAL": 0,
    "PIX": 10,
    "SINGLE": 10,
    "PXB": 20,
    "MULTIPLE": 20,
    "PHB": 30,
    "HOSTBRIDGE": 30,
    "NODE": 40,
    "SYS": 50,
    "SYSTEM": 50,
}
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
        "processes",
    }
)
_TOP_KEYS = frozenset(
    {
        "name",
        "description",
        "product_name",
        "driver_version",
        "cuda_driver_version",
        "numa_nodes",
        "gpu_defaults",
        "gpus",
        "nvlink",
        "nics",
        "pcie_levels",
        "faults",
    }
)
_NIC_KEYS = frozenset({"name", "bus_id", "numa_node", "cpus", "host_bridge", "switches"})


class _SpecReader:
    """Reads one spec mapping; every error names the source and the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> InputFormatError:
        return InputFormatError(f"{self.source}: {where}: {what}")

    def mapping(
        self, value: object, where: str, keys: frozenset[str] | None = None
    ) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(where, f"expected a mapping, got {type(value).__name__}")
        unknown = sorted(set(map(str, value)) - keys) if keys is not None else []
        if unknown:
            raise self.fail(where, f"unknown keys {unknown}; expected some of {sorted(keys or ())}")
        return value

    def seq(self, value: object, where: str) -> Sequence[Any]:
        if value is None:
            return []
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise self.fail(where, f"expected a list, got {type(value).__name__}")
        return value

    def int_(self, value: object, where: str, *, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(where, f"must be >= {minimum}, got {value}")
        return value

    def opt_int(self, value: object, where: str, *, minimum: int | None = None) -> int | None:
        return None if value is None else self.int_(value, where, minimum=minimum)

    def str_(self, value: object, where: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(where, f"expected a non-empty string, got {value!r}")
        return value.strip()

    def opt_str(self, value: object, where: str) -> str | None:
        return None if value is None else self.str_(value, where)

    def bool_(self, value: object, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {value!r}")
        return value

    def bus_id(self, value: object, where: str) -> str:
        try:
            return nvml_bus_id(self.str_(value, where))
        except BusIdError:
            raise self.fail(where, f"not a PCI bus id: {value!r} (e.g. '0000:3b:00.0')") from None

    def cpulist(self, value: object, where: str) -> str:
        text = self.str_(str(value) if isinstance(value, int) else value, where)
        try:
            parse_cpulist(text)
        except ValueError:
            raise self.fail(where, f"not a cpulist: {value!r} (e.g. '0-19,40-59')") from None
        return text

    def names(self, value: object, where: str) -> tuple[str, ...]:
        return tuple(self.str_(s, where) for s in self.seq(value, where))

    def indices(self, value: object, where: str, n: int) -> tuple[int, ...]:
        out = tuple(self.int_(x, where, minimum=0) for x in self.seq(value, where))
        if any(x >= n for x in out):
            raise self.fail(where, f"GPU indices must be 0..{n - 1}")
        return out


def machine_spec_from_dict(data: Mapping[str, Any], source: str = "<spec>") -> MachineSpec:
    """Build a :class:`MachineSpec` from a YAML/JSON mapping: the one schema of machine specs
    (README.md, "Machine spec format"). Keys not listed there are rejected; a fact not given
    stays unknown. InputFormatError names the source, the key path and what was expected.

    Outline::

        name: dgx-h100                      # required
        description, product_name, driver_version ("550.54.15"), cuda_driver_version (12040
        or "12.4"), numa_nodes: {id: {cpus, distances}}, gpu_defaults: {...},
        gpus: [{bus_id, model, numa_node, cpus, host_bridge, switches, uuid, minor_number,
                memory_mib, compute_capability, nvlinks, mig, mig_capable, fabric,
                gpu_numa_id, board, processes}],
        nvlink: {pairs: [[a, b, links]], nvswitch: {links_per_gpu, bus_ids, gpus}},
        nics: [{name, bus_id, numa_node, cpus, host_bridge, switches}],
        pcie_levels: {"0-1": PIX}, faults: {lost_gpus, unsupported, init_error}
    """
    r = _SpecReader(source)
    data = r.mapping(data, "top level", _TOP_KEYS)
    name = r.str_(data.get("name"), "name")
    numa = _read_numa_nodes(r, data.get("numa_nodes"))
    gpus = _read_gpus(r, data, name, numa)
    check_process_cgroups(((g.index, g.processes) for g in gpus), source)
    n = len(gpus)
    pairs, switch = _read_nvlink(r, data.get("nvlink"), n)
    _check_nvlink_ports(r, gpus, pairs, switch)
    product = data.get("product_name")
    return MachineSpec(
        name=name,
        gpus=gpus,
        numa_nodes=numa,
        nics=_read_nics(r, data.get("nics")),
        nvlink_pairs=pairs,
        nvswitch=switch,
        pcie_levels=_read_pcie_levels(r, data.get("pcie_levels"), n),
        product_name=str(product) if product else None,
        driver_version=r.opt_str(_opt_text(data.get("driver_version")), "driver_version"),
        cuda_driver_version=_read_cuda(r, data.get("cuda_driver_version")),
        faults=_read_faults(r, data.get("faults"), n),
        description=str(data.get("description") or ""),
    )


def _opt_text(value: object) -> object:
    # YAML reads an unquoted 550.54 as a float; a version is text
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _read_cuda(r: _SpecReader, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"(\d+)\.(\d+)", value.strip())
        if m is None:
            raise r.fail("cuda_driver_version", f"expected e.g. 12040 or '12.4', got {value!r}")
        return int(m[1]) * 1000 + int(m[2]) * 10
    return r.int_(value, "cuda_driver_version", minimum=1000)


def _read_numa_nodes(r: _SpecReader, value: object) -> dict[int, tuple[str, tuple[int, ...]]]:
    numa: dict[int, tuple[str, tuple[int, ...]]] = {}
    for key, node in r.mapping(value, "numa_nodes").items():
        where = f"numa_nodes.{key}"
        try:
            node_id = int(key)
        except (TypeError, ValueError):
            raise r.fail(where, "NUMA node ids must be integers") from None
        node = r.mapping(node, where, frozenset({"cpus", "distances"}))
        cpus = r.cpulist(node["cpus"], f"{where}.cpus") if node.get("cpus") is not None else ""
        distances = tuple(
            r.int_(d, f"{where}.distances") for d in r.seq(node.get("distances"), where)
        )
        numa[node_id] = (cpus, distances)
    for node_id, (_, distances) in numa.items():
        if distances and len(distances) != len(numa):
            raise r.fail(f"numa_nodes.{node_id}.distances", f"expected {len(numa)} values")
    return numa


def _read_gpus(
    r: _SpecReader,
    data: Mapping[str, Any],
    machine: str,
    numa: Mapping[int, tuple[str, tuple[int, ...]]],
) -> tuple[GpuSpec, ...]:
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
    return gpus


def _read_model(r: _SpecReader, entry: Mapping[str, Any], where: str) -> GpuModel:
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
    r: _SpecReader, entry: Mapping[str, Any], model: GpuModel, where: str
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
    return tuple(mig)


def _read_fabric(r: _SpecReader, value: object, where: str) -> tuple[str | None, int | None]:
    fabric = r.mapping(value, where, frozenset({"cluster_uuid", "clique_id"}))
    cluster = fabric.get("cluster_uuid")
    if cluster:
        try:
            cluster = str(uuid_mod.UUID(str(cluster)))
        except ValueError:
            raise r.fail(f"{where}.cluster_uuid", f"not a UUID: {cluster!r}") from None
    return cluster or None, r.opt_int(fabric.get("clique_id"), f"{where}.clique_id", minimum=0)


def _read_gpu(
    r: _SpecReader,
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
        processes=read_processes(entry.get("processes"), r.source, f"{where}.processes"),
    )


def _read_nvlink(
    r: _SpecReader, value: object, n: int
) -> tuple[tuple[tuple[int, int, int], ...], NvSwitchSpec | None]:
    nvlink = r.mapping(value, "nvlink", frozenset({"pairs", "nvswitch"}))
    pairs: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int]] = set()
    for j, raw in enumerate(r.seq(nvlink.get("pairs"), "nvlink.pairs")):
        where = f"nvlink.pairs[{j}]"
        item = r.seq(raw, where)
        if len(item) != 3:
            raise r.fail(where, "expected [gpu_a, gpu_b, links]")
        a, b, count = (r.int_(x, where, minimum=0) for x in item)
        if a == b or a >= n or b >= n or count < 1:
            raise r.fail(where, f"needs two distinct GPUs of 0..{n - 1} and at least one link")
        pair = (min(a, b), max(a, b))
        if pair in seen:
            raise r.fail(where, f"pair {pair[0]}-{pair[1]} given twice")
        seen.add(pair)
        pairs.append((pair[0], pair[1], count))
    if nvlink.get("nvswitch") is None:
        return tuple(pairs), None
    where = "nvlink.nvswitch"
    sw = r.mapping(nvlink["nvswitch"], where, frozenset({"links_per_gpu", "bus_ids", "gpus"}))
    per_gpu = r.int_(sw.get("links_per_gpu"), f"{where}.links_per_gpu", minimum=1)
    bus_ids = tuple(
        r.bus_id(b, f"{where}.bus_ids") for b in r.seq(sw.get("bus_ids"), f"{where}.bus_ids")
    ) or tuple(f"00000000:{0xC0 + k:02X}:00.0" for k in range(4))
    members = r.indices(sw["gpus"], f"{where}.gpus", n) if sw.get("gpus") is not None else None
    return tuple(pairs), NvSwitchSpec(per_gpu, bus_ids, members)


def _check_nvlink_ports(
    r: _SpecReader,
    gpus: Sequence[GpuSpec],
    pairs: Sequence[tuple[int, int, int]],
    switch: NvSwitchSpec | None,
) -> None:
    """Every GPU must have the NVLink ports its wiring uses."""
    used = [0] * len(gpus)
    for a, b, count in pairs:
        used[a] += count
        used[b] += count
    if switch is not None:
        for i in switch.gpus if switch.gpus is not None else range(len(gpus)):
            used[i] += switch.links_per_gpu
    for g in gpus:
        if used[g.index] > g.model.nvlinks:
            raise r.fail(
                f"gpus[{g.index}]",
                f"wired with {used[g.index]} NVLinks but {g.model.name or 'the GPU'} has "
                f"{g.model.nvlinks} (set 'nvlinks' for another model)",
            )


def _read_nics(r: _SpecReader, value: object) -> tuple[NicSpec, ...]:
    nics: list[NicSpec] = []
    for j, raw in enumerate(r.seq(value, "nics")):
        where = f"nics[{j}]"
        e = r.mapping(raw, where, _NIC_KEYS)
        nics.append(
            NicSpec(
                name=r.str_(e.get("name"), f"{where}.name"),
                bus_id=r.bus_id(e.get("bus_id"), f"{where}.bus_id"),
                numa_node=r.opt_int(e.get("numa_node"), f"{where}.numa_node", minimum=0),
                host_bridge=r.str_(e.get("host_bridge", "pci0000:00"), f"{where}.host_bridge"),
                switches=r.names(e.get("switches"), f"{where}.switches"),
                cpulist=r.cpulist(e["cpus"], f"{where}.cpus") if e.get("cpus") is not None else None,
            )
        )
    return tuple(nics)


def _read_pcie_levels(r: _SpecReader, value: object, n: int) -> dict[tuple[int, int], int]:
    levels: dict[tuple[int, int], int] = {}
    for key, level_name in r.mapping(value, "pcie_levels").items():
        where = f"pcie_levels.{key}"
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(key))
        if m is None or int(m[1]) == int(m[2]) or max(int(m[1]), int(m[2])) >= n:
            raise r.fail(where, f"keys are 'a-b' with two distinct GPUs of 0..{n - 1}")
        level = _LEVEL_NAMES.get(str(level_name).strip().upper())
        if level is None:
            raise r.fail(where, f"expected one of BOARD PIX PXB PHB NODE SYS, got {level_name!r}")
        a, b = sorted((int(m[1]), int(m[2])))
        levels[(a, b)] = level
    return levels


def _read_faults(r: _SpecReader, value: object, n: int) -> FaultSpec:
    faults = r.mapping(value, "faults", frozenset({"lost_gpus", "unsupported", "init_error"}))
    lost = r.indices(faults.get("lost_gpus"), "faults.lost_gpus", n)
    unsupported: list[tuple[str, int | None]] = []
    for j, raw in enumerate(r.seq(faults.get("unsupported"), "faults.unsupported")):
        where = f"faults.unsupported[{j}]"
        e = r.mapping(raw, where, frozenset({"function", "gpu"}))
        gpu = r.opt_int(e.get("gpu"), f"{where}.gpu", minimum=0)
        unsupported.append((r.str_(e.get("function"), f"{where}.function"), gpu))
    init_error = faults.get("init_error")
    if init_error is not None:
        init_error = r.str_(init_error, "faults.init_error").upper()
        if f"NVML_ERROR_{init_error}" not in _C:
            raise r.fail("faults.init_error", f"unknown NVML error {init_error.lower()!r}")
    return FaultSpec(lost, tuple(unsupported), init_error)


def load_machine_spec(path: str) -> MachineSpec:
    """Read a YAML or JSON machine spec file (:func:`agent.formats.read_document`) through
    the one schema; InputFormatError if unreadable or invalid."""
    data = read_document(path, "machine spec")
    if not isinstance(data, Mapping):
        raise InputFormatError(f"{path}: a machine spec is a mapping with 'name' and 'gpus'")
    return machine_spec_from_dict(data, source=os.path.basename(path))
