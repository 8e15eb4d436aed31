"""Simulated machines: built-in machine specs, spec files and pasted ``nvidia-smi topo -m``
output, opened as a fake NVML plus a fake sysfs tree.

``MACHINE`` (the ``--simulate`` argument) is one of:

* a built-in name (:data:`BUILTIN_MACHINES`; the specs are ``specs/<name>.yaml`` next to
  this module, format in docs/getting-started.md, "Machine spec format");
* a machine spec file (``.yaml``/``.yml``/``.json``, or any file holding a YAML mapping);
* a file holding ``nvidia-smi topo -m`` output as a user pasted it (recognised by its
  ``GPU0`` header): read by :mod:`agent.hw.topo_matrix` and turned into a spec by
  :func:`agent.hw.sim.from_facts.spec_from_facts`;
* an NCCL topology file (recognised by content: its first character that is not blank is
  ``<``): read by :mod:`agent.nccl.node_file` in :mod:`agent.discovery`, which turns its
  facts into a spec the same way as a pasted matrix's and opens it here
  (:class:`SimulatedMachine` of that spec).

Every one of them becomes a :class:`MachineSpec`, then a :class:`SimulatedMachine` whose
backend is the real :class:`agent.hw.nvml.backend.NvmlBackend` on the fake: one path for all
inputs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import weakref

from agent.errors import InputFormatError
from agent.hw.nvml.backend import NvmlBackend
from agent.hw.sim.mig_state_file import state_path
from agent.hw.sim.nvml import FakeNvml
from agent.hw.sim.processes import write_proc_tree
from agent.hw.sim.spec import load_machine_spec
from agent.hw.sim.spec_model import MachineSpec
from agent.hw.sim.sysfs_tree import PciDeviceSpec, SysfsTreeSpec, write_tree
from agent.hw.sysfs import SysfsReader
from agent.records import MAX_GPUS

_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")

#: The machines shipped with the package (``agent/hw/sim/specs/<name>.yaml``).
BUILTIN_MACHINES: tuple[str, ...] = (
    "dgx1-v100",
    "dgx2",
    "dgx-a100",
    "dgx-h100",
    "pcie-pairs",
    "pcie-4gpu",
    "gb200-tray",
    "a100-mig",
    "single-gpu",
)

_SPEC_SUFFIXES = (".yaml", ".yml", ".json")
_TOPO_HEADER = re.compile(r"^\s*GPU0(\s|$)", re.MULTILINE)


def _unknown(machine: str) -> InputFormatError:
    return InputFormatError(
        f"unknown machine {machine!r}: not a built-in machine ({', '.join(BUILTIN_MACHINES)}) "
        "and not a readable file"
    )


def _file_kind(path: str) -> str:
    """``"nccl"`` for an NCCL topology file, ``"matrix"`` for pasted ``nvidia-smi topo -m``
    output (a ``GPU0`` header), ``"spec"`` otherwise."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as exc:
        raise InputFormatError(f"cannot read {path}: {exc.strerror or exc}") from None
    if text.lstrip(" \t\r\n\ufeff").startswith("<"):  # NCCL's XML; a YAML/JSON spec starts otherwise
        return "nccl"
    if path.lower().endswith(_SPEC_SUFFIXES):
        return "spec"
    return "matrix" if _TOPO_HEADER.search(text) is not None else "spec"


def load_spec(machine: str) -> MachineSpec:
    """The :class:`MachineSpec` of a built-in name, a spec file or a pasted topo matrix
    file. InputFormatError (exit 2) for an unknown name or an unreadable/invalid file, and
    for an NCCL topology file (read above the simulator: :func:`agent.discovery.load_spec`)."""
    if machine in BUILTIN_MACHINES:
        return load_machine_spec(os.path.join(_SPECS, f"{machine}.yaml"))
    if not machine or not os.path.isfile(machine):
        raise _unknown(machine)
    kind = _file_kind(machine)
    if kind == "nccl":
        raise InputFormatError(f"{machine}: an NCCL topology file; open it through agent.discovery")
    if kind != "spec":
        from agent.hw.sim.from_facts import spec_from_facts
        from agent.hw.topo_matrix import read_topo_matrix

        facts = read_topo_matrix(machine)
        check_gpu_count(len(facts.gpus), machine)
        return spec_from_facts(facts, name=machine_name(machine))
    spec = load_machine_spec(machine)
    check_gpu_count(len(spec.gpus), machine)
    return spec


def machine_name(path: str) -> str:
    """The name of a machine read from the file ``path``: its base name without suffix."""
    return os.path.splitext(os.path.basename(path))[0] or "pasted"


def is_nccl_file(machine: str) -> bool:
    """Whether ``machine`` names an NCCL topology file (not a built-in name)."""
    return machine not in BUILTIN_MACHINES and os.path.isfile(machine) and _file_kind(machine) == "nccl"


def check_gpu_count(count: int, machine: str) -> None:
    if count > MAX_GPUS:
        raise InputFormatError(
            f"{machine}: {count} GPUs; gpu-topology-agent supports at most {MAX_GPUS} GPUs per node"
        )


def sysfs_tree_spec(spec: MachineSpec) -> SysfsTreeSpec:
    """The fake sysfs tree of a machine: DMI name, NUMA nodes, GPUs and RDMA NICs where
    the spec's PCIe tree puts them."""
    devices = [
        PciDeviceSpec(
            bus_id=g.bus_id,
            numa_node=g.numa_node,
            local_cpulist=g.cpulist,
            host_bridge=g.host_bridge,
            switches=g.switches,
            class_known=g.model.name is not None,
        )
        for g in spec.gpus
    ]
    for nic in spec.nics:
        cpus = nic.cpulist or (
            spec.numa_nodes[nic.numa_node][0]
            if nic.numa_node is not None and nic.numa_node in spec.numa_nodes
            else None
        )
        devices.append(
            PciDeviceSpec(
                bus_id=nic.bus_id,
                numa_node=nic.numa_node,
                local_cpulist=cpus or None,
                host_bridge=nic.host_bridge,
                switches=nic.switches,
                rdma_name=nic.name,
            )
        )
    return SysfsTreeSpec(
        product_name=spec.product_name, numa_nodes=dict(spec.numa_nodes), devices=devices
    )


class SimulatedMachine:
    """A fake NVML (:attr:`lib`), a fake sysfs tree under :attr:`sysfs_root` and a fake
    ``/proc`` (the cgroup files of the spec's GPU processes) under :attr:`proc_root` for one
    machine spec. The trees live in temp dirs removed by :meth:`close` (or at garbage
    collection / exit); a ``sysfs_root`` given by the caller is left alone. Usable as a
    context manager."""

    def __init__(self, spec: MachineSpec, sysfs_root: str | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.lib = FakeNvml(spec)
        kept = state_path()  # the GPUs' MIG layout outlives the agent, as a real GPU's does
        if kept is not None:
            self.lib.keep_mig_state(kept)
        owned = sysfs_root is None
        if owned:
            remove_stale_trees()
        # the pid in the name tells a tree whose process died (SIGKILL: no clean-up ran)
        self.sysfs_root = sysfs_root or tempfile.mkdtemp(prefix=f"gta-sysfs-{os.getpid()}-{_safe(spec.name)}-")
        self._finalizer = (
            weakref.finalize(self, shutil.rmtree, self.sysfs_root, True) if owned else None
        )
        self.proc_root = tempfile.mkdtemp(prefix=f"gta-proc-{os.getpid()}-{_safe(spec.name)}-")
        self._proc_finalizer = weakref.finalize(self, shutil.rmtree, self.proc_root, True)
        write_proc_tree(self.proc_root, (p for g in spec.gpus for p in g.processes))
        try:
            write_tree(self.sysfs_root, sysfs_tree_spec(spec))
        except ValueError as exc:
            self.close()
            raise InputFormatError(f"machine {spec.name}: impossible PCIe tree: {exc}") from None

    def backend(self) -> NvmlBackend:
        """A new :class:`NvmlBackend` on this machine's fake NVML and sysfs (not yet
        initialised)."""
        # a pasted matrix states no MIG capability: the fake answers as a driver without
        # GetMigMode, on purpose; the spec's notes already say what is unknown
        quiet = logging.INFO if self.spec.notes else logging.WARNING
        return NvmlBackend(lib=self.lib, sysfs=SysfsReader(self.sysfs_root), missing_function_level=quiet)

    def close(self) -> None:
        """Remove the fake /proc tree, and the fake sysfs tree if this object created it."""
        self._proc_finalizer()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> SimulatedMachine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        gpus = len(self.spec.gpus)
        return f"SimulatedMachine({self.name!r}, {gpus} GPUs, sysfs={self.sysfs_root!r})"


def remove_stale_trees(tmp_dir: str | None = None) -> list[str]:
    """Remove ``gta-sysfs-<pid>-*`` and ``gta-proc-<pid>-*`` trees in the temp dir whose
    process is gone (a simulated agent killed with SIGKILL); trees of live processes and
    other users' are left alone. Returns the removed paths."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(tmp_dir):
        m = re.match(r"gta-(?:sysfs|proc)-(\d+)-", entry.name)
        try:
            if m is None or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
        except FileNotFoundError:  # its owner (or another agent's clean-up) removed it just now
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or pid reused): not ours to judge
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40]


def open_simulated(machine: str | MachineSpec) -> SimulatedMachine:
    """Open ``machine`` (built-in name, spec file or pasted topo matrix, or a spec read
    elsewhere: :func:`agent.discovery.load_spec`) as a :class:`SimulatedMachine`."""
    return SimulatedMachine(load_spec(machine) if isinstance(machine, str) else machine)
