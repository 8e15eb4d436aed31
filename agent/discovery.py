"""The one path from any input to the node's :class:`Topology`.

``MACHINE`` (``--simulate``) — a built-in machine, a spec file or a pasted
``nvidia-smi topo -m`` or an NCCL topology file — becomes a simulated machine (fake NVML + fake sysfs); without it the
real NVML and ``/sys`` are used. Either way the real :class:`NvmlBackend` reads the facts and
``Topology.from_facts`` builds the model, for every consumer (discover, labels, allocate, the
daemon, the demo). Sits above ``agent.hw`` and ``agent.topology``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from agent.topology.model import Topology

if TYPE_CHECKING:  # pragma: no cover
    from agent.hw.nvml.backend import NvmlBackend
    from agent.hw.protocols import FactsReader
    from agent.hw.sim.machines import SimulatedMachine
    from agent.hw.sim.spec_model import MachineSpec


def load_spec(machine: str) -> MachineSpec:
    """The machine spec of ``MACHINE``: :func:`agent.hw.sim.machines.load_spec`'s, or for an
    NCCL topology file the spec of the VM it describes (module docstring). InputFormatError
    (exit 2) for an unknown name or an unreadable or invalid file."""
    from agent.hw.sim import machines

    if not machines.is_nccl_file(machine):
        return machines.load_spec(machine)
    from agent.hw.sim.from_facts import spec_from_facts
    from agent.nccl.node_file import read_nccl_topology

    facts = read_nccl_topology(machine).facts
    machines.check_gpu_count(len(facts.gpus), machine)
    return replace(spec_from_facts(facts, name=machines.machine_name(machine)), nccl_file=machine)


def open_backend(
    simulate: str | None, sysfs_root: str = "/sys"
) -> tuple[NvmlBackend, SimulatedMachine | None]:
    """The backend for ``simulate`` (a simulated machine, returned too so the caller can
    close it) or for this node's NVML and sysfs under ``sysfs_root``; not yet initialised."""
    if simulate:
        from agent.hw.sim.machines import open_simulated

        sim = open_simulated(load_spec(simulate))
        return sim.backend(), sim
    from agent.hw.nvml.backend import NvmlBackend
    from agent.hw.sysfs import SysfsReader

    return NvmlBackend(sysfs=SysfsReader(sysfs_root)), None


def read_topology(backend: FactsReader, sim: SimulatedMachine | None, nccl_file: str = "") -> Topology:
    """The topology an initialised backend reads; a simulated machine adds the notes of
    what its spec synthesised. With ``nccl_file`` (``topology.ncclTopologyFile``; for a
    simulated NCCL file, that file), that NCCL topology file's placement is laid over the
    GPUs read, matched by bus ID (:func:`agent.nccl.node_file.overlay_nccl_topology`;
    NcclTopologyError, exit 2, when they are not the same GPUs)."""
    facts = backend.read_facts(source=f"simulated:{sim.name}" if sim is not None else "nvml")
    nccl_file = nccl_file or (sim.spec.nccl_file if sim is not None else "")
    if nccl_file:
        from agent.nccl.node_file import overlay_nccl_topology, read_nccl_topology

        facts = overlay_nccl_topology(facts, read_nccl_topology(nccl_file))
    if sim is not None and sim.spec.notes:
        facts = replace(facts, notes=(*sim.spec.notes, *facts.notes))
    return Topology.from_facts(facts)


def load_topology(simulate: str | None, sysfs_root: str = "/sys") -> Topology:
    """The topology of a simulated machine, or of this node through NVML + sysfs."""
    backend, sim = open_backend(simulate, sysfs_root)
    try:
        backend.init()
        try:
            return read_topology(backend, sim)
        finally:
            backend.shutdown()
    finally:
        if sim is not None:
            sim.close()
