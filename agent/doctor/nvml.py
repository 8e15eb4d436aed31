"""NVML checks: the library and driver, every GPU answering, XID and ECC state, MIG mode
against the MIG strategy, persistence mode, NVLink states.

Every NVML read goes through the agent's own backend (:mod:`agent.hw.nvml`), the same code
path the agent runs; nothing here calls NVML itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from agent.config import is_critical_xid
from agent.doctor.context import DoctorContext, NodeRead, Unavailable
from agent.doctor.report import Check, Result, failed, passed, warned
from agent.errors import ConfigError
from agent.formats import sysfs_to_nvml_bus_id
from agent.hw.nvml.status import read_gpu_status

__all__ = ["CHECKS"]


def needs_node(check: Callable[[DoctorContext, NodeRead], Result]) -> Callable[[DoctorContext], Result]:
    """The check on the node as read; a WARN naming nvml.library when NVML did not load."""

    @functools.wraps(check)
    def run(context: DoctorContext) -> Result:
        try:
            node = context.node()
        except Unavailable:
            return warned("not run: NVML did not load (see nvml.library)", "fix nvml.library first")
        return check(context, node)

    return run


def _gpu_names(node: NodeRead, indices: list[int]) -> str:
    gpus = node.topology.gpus
    return ", ".join(f"GPU {i} ({gpus[i].pci_bus_id or _sysfs_bus_id(node, i)})" for i in indices)


def _sysfs_bus_id(node: NodeRead, index: int) -> str:
    """The bus id of a GPU NVML could not read (lost from the start): the NVIDIA GPUs sysfs
    lists that no answering GPU has, in bus order as NVML enumerates them, when there are as
    many of them as GPUs without a bus id."""
    if node.backend.sysfs is None:
        return "bus id unknown"
    known = {g.pci_bus_id for g in node.topology.gpus if g.pci_bus_id}
    listed = [b for b in node.backend.sysfs.nvidia_gpus() if sysfs_to_nvml_bus_id(b) not in known]
    nameless = [g.index for g in node.topology.gpus if not g.pci_bus_id]
    if len(listed) != len(nameless) or index not in nameless:
        return "bus id unknown"
    return f"{sysfs_to_nvml_bus_id(listed[nameless.index(index)])} per sysfs"


def library(context: DoctorContext) -> Result:
    """NVML loads; the driver and CUDA driver versions."""
    try:
        node = context.node()
    except Unavailable as exc:
        return failed(str(exc), "install the NVIDIA driver, or run the agent with the NVIDIA runtime"
                      " (runtimeClassName: nvidia) so that libnvidia-ml.so.1 and /dev/nvidia* are there")
    t = node.topology
    where = f"simulated machine {node.sim.name}" if node.sim is not None else "NVML"
    found = (f"{where}: driver {t.driver_version or 'unknown'}, CUDA {t.cuda_driver_version or 'unknown'},"
             f" {t.gpu_count} GPUs")
    if t.gpu_count == 0:
        return failed(found, "NVML sees no GPU: check `nvidia-smi -L` and that the container is given the GPUs")
    if t.driver_version is None:
        return warned(found, "NVML does not give the driver version: the driver-version label is left out")
    return passed(found)


@needs_node
def gpus(context: DoctorContext, node: NodeRead) -> Result:
    """Every GPU answers NVML; a lost one (fallen off the bus) is named with its bus ID."""
    lost = sorted(set(g.index for g in node.topology.gpus if g.lost) | set(node.backend.lost_gpus))
    answering = [g.index for g in node.topology.gpus if g.index not in lost and node.backend.probe(g.index)]
    silent = sorted(set(range(node.topology.gpu_count)) - set(answering) - set(lost))
    if lost or silent:
        parts = []
        if lost:
            parts.append(f"{_gpu_names(node, lost)} lost (NVML answers GPU_IS_LOST: fallen off the bus)")
        if silent:
            parts.append(f"{_gpu_names(node, silent)} not answering")
        return failed("; ".join(parts), "drain the node, look for XID 79 in the kernel log (dmesg), reset the"
                      " GPU (nvidia-smi -r -i <index>) or reboot; the agent advertises it Unhealthy meanwhile")
    return passed(f"all {len(answering)} GPUs answer NVML")


@needs_node
def health(context: DoctorContext, node: NodeRead) -> Result:
    """XIDs raised while watching (``xid_watch_s``), double-bit ECC errors and row-remapping
    failures since the driver loaded."""
    config = context.config
    events = node.backend.wait_events(int(context.xid_watch_s * 1000))
    critical = sorted({(e.gpu_index, e.xid) for e in events
                       if e.kind == "xid" and e.xid is not None and is_critical_xid(config, e.xid)})
    ignored = sorted({(e.gpu_index, e.xid) for e in events if e.kind == "xid" and (e.gpu_index, e.xid) not in critical})
    ecc = {e.gpu_index for e in events if e.kind == "ecc_dbe"}
    remap_failed: set[int] = set()
    source = node.backend.sample_source()
    try:
        for g in node.topology.gpus:
            sample = source.sample(g.index) if not g.lost else None
            if sample is None:
                continue
            if sample.ecc_dbe_volatile:
                ecc.add(g.index)
            if sample.row_remap_failure:
                remap_failed.add(g.index)
    finally:
        source.close()
    problems = []
    if critical:
        problems.append("critical XID " + ", ".join(f"{x} on GPU {i}" for i, x in critical))
    if ecc:
        problems.append(f"double-bit ECC errors on {_gpu_names(node, sorted(ecc))}")
    if remap_failed:
        problems.append(f"row remapping failed on {_gpu_names(node, sorted(remap_failed))}")
    watched = f"watched XID events for {context.xid_watch_s:g} s"
    if problems:
        return failed(f"{'; '.join(problems)} ({watched})",
                      "the agent marks these GPUs Unhealthy: drain the node and reset the GPU or reboot;"
                      " look the XID up in NVIDIA's XID catalogue")
    if ignored:
        return warned(f"application XID {', '.join(f'{x} on GPU {i}' for i, x in ignored)} ({watched})",
                      "not a GPU fault (ignored by the health watcher): look at the application on that GPU")
    return passed(f"no XID, no double-bit ECC error, no row-remap failure ({watched})")


@needs_node
def mig(context: DoctorContext, node: NodeRead) -> Result:
    """MIG mode of each GPU against ``migStrategy``: what the agent would refuse (FAIL) or
    leave unadvertised (WARN)."""
    strategy = context.config.mig_strategy
    t = node.topology
    enabled = [g.index for g in t.gpus if g.mig_enabled]
    found = f"migStrategy {strategy}; MIG enabled on GPUs {enabled or 'none'}"
    try:
        resources = context.resources()
    except ConfigError as exc:
        return failed(f"{found}: the agent refuses it: {exc}", "set migStrategy mixed, or make every GPU's MIG"
                      " layout fit the strategy (nvidia-smi mig / NVIDIA's mig-parted)")
    if strategy == "none" and enabled:
        return warned(f"{found}: those GPUs are not advertised", "set migStrategy single or mixed to serve their"
                      " MIG devices, or disable MIG on them (nvidia-smi -mig 0)")
    served = ", ".join(f"{r.name} x{len(r.devices)}" for r in resources)
    return passed(f"{found}; serves {served or 'nothing'}")


@needs_node
def persistence(context: DoctorContext, node: NodeRead) -> Result:
    """Persistence mode on every GPU (without it the driver tears the GPU down when the last
    client leaves, and each new one pays the initialisation)."""
    statuses = [read_gpu_status(node.backend, g.index) for g in node.topology.gpus if not g.lost]
    off = [s.index for s in statuses if s.persistence_mode is False]
    unknown = [s.index for s in statuses if s.persistence_mode is None]
    if off:
        return warned(f"persistence mode off on {_gpu_names(node, off)}",
                      "enable it (nvidia-smi -pm 1, or the nvidia-persistenced service)")
    if unknown and len(unknown) == len(statuses):
        return passed("NVML does not report persistence mode here (not supported)")
    return passed(f"persistence mode on for {len(statuses) - len(unknown)} GPUs")


@needs_node
def nvlink(context: DoctorContext, node: NodeRead) -> Result:
    """NVLink ports against what the topology expects: GPUs of one model wired alike have
    the same number of active links; fewer on one of them is a link down."""
    statuses = [read_gpu_status(node.backend, g.index) for g in node.topology.gpus if not g.lost]
    by_model: dict[str, list[int]] = {}
    for s in statuses:
        if s.nvlink_ports:
            by_model.setdefault(node.topology.gpus[s.index].name, []).append(s.index)
    active = {s.index: s.nvlinks_active for s in statuses}
    degraded = []
    for indices in by_model.values():
        expected = max(active[i] for i in indices)
        degraded += [(i, active[i], expected) for i in indices if active[i] < expected]
    if degraded:
        return failed(", ".join(f"GPU {i} has {n} of the {e} NVLinks its peers have active" for i, n, e in degraded),
                      "a link is down: `nvidia-smi nvlink -s -i <index>`; reset the GPU or reseat the bridge;"
                      " the topology the agent reads counts only active links")
    if not by_model:
        return passed("no NVLink ports (PCIe only)")
    cliques = node.topology.nvlink_cliques
    return passed(f"{sum(active.values())} active NVLinks on {sum(len(v) for v in by_model.values())} GPUs;"
                  f" NVLink cliques {[list(c) for c in cliques]}")


CHECKS = (
    Check("nvml.library", library, timeout_s=8.0),
    Check("nvml.gpus", gpus, timeout_s=8.0),
    Check("nvml.health", health, timeout_s=8.0),
    Check("nvml.mig", mig, timeout_s=8.0),
    Check("nvml.persistence", persistence, timeout_s=8.0),
    Check("nvml.nvlink", nvlink, timeout_s=8.0),
)
