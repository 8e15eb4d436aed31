"""Host checks: sysfs readable (NUMA nodes, each GPU's PCIe path, RDMA NICs), the
``/dev/nvidia*`` device nodes, and what the configured device-list strategy needs of the
container toolkit (its runtime for ``envvar``/``volume-mounts``, CDI specs for
``cdi-annotations``/``cdi-cri``).

A simulated machine has a fake sysfs (checked as the real one) but no device nodes and no
container toolkit: those two checks WARN that they cannot look.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat

from agent.containers import CONTROL_DEVICE_NODES, host_path
from agent.deviceplugin.device_lists import CDI_KIND
from agent.doctor.context import DoctorContext, NodeRead
from agent.doctor.nvml import needs_node
from agent.doctor.report import Check, Result, failed, passed, warned
from agent.formats import read_document
from agent.hw.sysfs import SysfsReader

__all__ = ["CHECKS", "CDI_SPEC_DIRS"]

#: Where CDI specs are read from (the CDI specification's default spec directories).
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
#: Where the NVIDIA Container Toolkit's runtime is found: on the PATH, or where NVIDIA's GPU
#: operator installs it on the host.
_TOOLKIT_BINARIES = ("nvidia-container-runtime", "nvidia-container-runtime-hook", "nvidia-ctk")
_TOOLKIT_DIRS = ("/usr/local/nvidia/toolkit", "/usr/bin", "/usr/local/bin")


@needs_node
def sysfs(context: DoctorContext, node: NodeRead) -> Result:
    """NUMA nodes, each GPU's PCIe path and the RDMA NICs, as the agent reads them."""
    root = context.sysfs_root
    if not os.path.isdir(os.path.join(root, "bus", "pci", "devices")):
        return failed(f"{root}/bus/pci/devices is not readable",
                      "mount the host's /sys (read-only) and point --sysfs-root at it; without it NUMA and"
                      " PCIe placement are unknown")
    reader = SysfsReader(root)
    numa = reader.numa_nodes()
    gpus = [g for g in node.topology.gpus if not g.lost]
    unplaced = [g.index for g in gpus if g.pci_bus_id and reader.pcie_root(g.pci_bus_id) is None]
    nics = reader.rdma_nics()
    where = f"{root}{' (simulated)' if context.simulate else ''}"
    placed = len(gpus) - len(unplaced)
    found = f"{where}: {len(numa)} NUMA nodes, {placed} of {len(gpus)} GPUs placed, {len(nics)} RDMA NICs"
    if unplaced:
        return warned(f"{found}; no PCIe path for GPUs {unplaced}",
                      "those GPUs' PCIe levels and NICs come from NVML alone; check that --sysfs-root is the host's")
    if not numa:
        return warned(f"{found}; no NUMA nodes listed", "NUMA placement is unknown: check --sysfs-root")
    return passed(found)


@needs_node
def device_nodes(context: DoctorContext, node: NodeRead) -> Result:
    """``/dev/nvidiactl``, ``/dev/nvidia-uvm`` and ``/dev/nvidia<minor>`` of each GPU, as
    character devices under the driver root."""
    if context.simulate:
        return warned("simulated machine: no /dev/nvidia* device nodes to look at",
                      "run without --simulate on the GPU node to check them")
    root = context.config.nvidia_driver_root
    wanted = [CONTROL_DEVICE_NODES[0], CONTROL_DEVICE_NODES[1]] + [
        f"/dev/nvidia{g.minor_number if g.minor_number is not None else g.index}" for g in node.topology.gpus]
    missing = []
    for path in wanted:
        try:
            if not stat.S_ISCHR(os.stat(host_path(path, root)).st_mode):
                missing.append(path)
        except OSError:
            missing.append(path)
    if missing:
        return failed(f"missing under driver root {root}: {', '.join(missing)}",
                      "load the driver (nvidia-modprobe -u -c=0 creates nvidia-uvm), or give the container the"
                      " host's /dev (the NVIDIA runtime or a hostPath)")
    return passed(f"{len(wanted)} device nodes present under driver root {root}")


def _cdi_devices(directories: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the spec files whose kind is ``nvidia.com/gpu``, the device names they declare)."""
    files, names = [], []
    for directory in directories:
        for path in sorted(glob.glob(os.path.join(directory, "*.json")) + glob.glob(os.path.join(directory, "*.yaml"))):
            try:
                spec = read_document(path, "CDI spec")
            except Exception:  # an unreadable spec is the runtime's problem; it is not ours
                continue
            if isinstance(spec, dict) and spec.get("kind") == CDI_KIND:
                files.append(path)
                names += [str(d.get("name")) for d in spec.get("devices") or [] if isinstance(d, dict)]
    return files, names


def container_toolkit(context: DoctorContext) -> Result:
    """What the device-list strategy needs: the NVIDIA runtime reading ``NVIDIA_VISIBLE_DEVICES``
    (envvar, volume-mounts) or CDI specs naming ``nvidia.com/gpu`` devices (cdi-*)."""
    config = context.config
    if config.mode == "dra":
        return passed("DRA mode: the agent writes the CDI spec of each prepared claim (see dra.directories)")
    strategies = config.device_list_strategy
    cdi = [s for s in strategies if s.startswith("cdi")]
    found = []
    if cdi:
        files, names = _cdi_devices(CDI_SPEC_DIRS)
        if not files:
            if context.simulate:
                return warned(f"device-list strategy {','.join(strategies)}: no {CDI_KIND} CDI spec in"
                              f" {' or '.join(CDI_SPEC_DIRS)} (simulated machine: none expected)",
                              "on the GPU node, generate one:"
                              " nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml")
            return failed(f"device-list strategy {','.join(cdi)} needs CDI specs of kind {CDI_KIND}; none in"
                          f" {' or '.join(CDI_SPEC_DIRS)}",
                          "generate them: nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml, and enable CDI"
                          " in the container runtime")
        found.append(f"{len(names)} CDI devices of {CDI_KIND} in {', '.join(files)}")
    if [s for s in strategies if not s.startswith("cdi")]:
        runtimes = [b for b in _TOOLKIT_BINARIES if shutil.which(b)] + [
            os.path.join(d, b) for d in _TOOLKIT_DIRS for b in _TOOLKIT_BINARIES
            if os.access(host_path(os.path.join(d, b), config.nvidia_driver_root), os.X_OK)]
        if not runtimes:
            why = "simulated machine: none expected" if context.simulate else "it may live on the host, out of sight"
            return warned(f"device-list strategy {','.join(strategies)}: no NVIDIA container runtime found"
                          f" from here ({why})",
                          "make the NVIDIA Container Toolkit the runtime for GPU pods (runtimeClassName: nvidia);"
                          " without it NVIDIA_VISIBLE_DEVICES gives a container nothing")
        found.append(f"NVIDIA container runtime: {json.dumps(sorted(set(runtimes)))}")
    return passed(f"device-list strategy {','.join(strategies)}: " + "; ".join(found))


CHECKS = (
    Check("host.sysfs", sysfs, timeout_s=8.0),
    Check("host.device_nodes", device_nodes, timeout_s=8.0),
    Check("host.container_toolkit", container_toolkit),
)
