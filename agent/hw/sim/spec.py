"""The machine spec's one schema: :func:`machine_spec_from_dict` reads a YAML/JSON mapping into
the model of :mod:`agent.hw.sim.spec_model` (files through :func:`load_machine_spec`).

The format is documented in docs/getting-started.md ("Machine spec format") and on
:func:`machine_spec_from_dict`. A key not listed there is rejected; a fact a spec does not
state stays unknown.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.errors import InputFormatError
from agent.formats import read_document
from agent.hw.sim.nvml_types import CONSTANTS as _C
from agent.hw.sim.spec_gpus import read_gpus
from agent.hw.sim.spec_model import (
    FaultSpec,
    GpuSpec,
    MachineSpec,
    NicSpec,
    NvSwitchSpec,
)
from agent.hw.sim.spec_reader import SpecReader

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


def machine_spec_from_dict(data: Mapping[str, Any], source: str = "<spec>") -> MachineSpec:
    """Build a :class:`MachineSpec` from a YAML/JSON mapping: the one schema of machine specs
    (docs/getting-started.md, "Machine spec format"). Keys not listed there are rejected; a fact not given
    stays unknown. InputFormatError names the source, the key path and what was expected.

    Outline::

        name: dgx-h100                      # required
        description, product_name, driver_version ("550.54.15"), cuda_driver_version (12040
        or "12.4"), numa_nodes: {id: {cpus, distances}}, gpu_defaults: {...},
        gpus: [{bus_id, model, numa_node, cpus, host_bridge, switches, uuid, minor_number,
                memory_mib, compute_capability, nvlinks, mig, mig_capable, fabric,
                gpu_numa_id, board, processes, compute_mode, faults: {missing_from_nvml,
                row_remap_failure, row_remap_pending, nvlink_down, fabric_state,
                fabric_status, recovery_action}}],
        nvlink: {pairs: [[a, b, links]], nvswitch: {links_per_gpu, bus_ids, gpus}},
        nics: [{name, bus_id, numa_node, cpus, host_bridge, switches}],
        pcie_levels: {"0-1": PIX}, faults: {lost_gpus, unsupported, init_error,
        xids: [{gpu, xid}]}
    """
    r = SpecReader(source)
    data = r.mapping(data, "top level", _TOP_KEYS)
    name = r.str_(data.get("name"), "name")
    numa = _read_numa_nodes(r, data.get("numa_nodes"))
    gpus = read_gpus(r, data, name, numa)
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


def _read_cuda(r: SpecReader, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"(\d+)\.(\d+)", value.strip())
        if m is None:
            raise r.fail("cuda_driver_version", f"expected e.g. 12040 or '12.4', got {value!r}")
        return int(m[1]) * 1000 + int(m[2]) * 10
    return r.int_(value, "cuda_driver_version", minimum=1000)


def _read_numa_nodes(r: SpecReader, value: object) -> dict[int, tuple[str, tuple[int, ...]]]:
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


def _read_nvlink(
    r: SpecReader, value: object, n: int
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
    r: SpecReader,
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


def _read_nics(r: SpecReader, value: object) -> tuple[NicSpec, ...]:
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


def _read_pcie_levels(r: SpecReader, value: object, n: int) -> dict[tuple[int, int], int]:
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


def _read_faults(r: SpecReader, value: object, n: int) -> FaultSpec:
    faults = r.mapping(value, "faults", frozenset({"lost_gpus", "unsupported", "init_error", "xids"}))
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
    xids: list[tuple[int, int]] = []
    for j, raw in enumerate(r.seq(faults.get("xids"), "faults.xids")):
        where = f"faults.xids[{j}]"
        e = r.mapping(raw, where, frozenset({"gpu", "xid"}))
        gpu = r.int_(e.get("gpu"), f"{where}.gpu", minimum=0)
        if gpu >= n:
            raise r.fail(f"{where}.gpu", f"expected a GPU of 0..{n - 1}, got {gpu}")
        xids.append((gpu, r.int_(e.get("xid"), f"{where}.xid", minimum=1)))
    return FaultSpec(lost, tuple(unsupported), init_error, tuple(xids))


def load_machine_spec(path: str) -> MachineSpec:
    """Read a YAML or JSON machine spec file (:func:`agent.formats.read_document`) through
    the one schema; InputFormatError if unreadable or invalid."""
    data = read_document(path, "machine spec")
    if not isinstance(data, Mapping):
        raise InputFormatError(f"{path}: a machine spec is a mapping with 'name' and 'gpus'")
    return machine_spec_from_dict(data, source=os.path.basename(path))
