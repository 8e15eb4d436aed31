"""The simulated machine's health facts: a spec's per-GPU ``faults`` (read here), what the
fake NVML answers for them (a base of :class:`agent.hw.sim.nvml.FakeNvml`), and the GPUs
NVML does not list although the PCI bus holds them.

=========================  ===========================================================
``gpus[i].faults`` key     what the fake answers
=========================  ===========================================================
``missing_from_nvml``      NVML does not list the GPU (the others are numbered without
                           it); the fake sysfs keeps its PCI device: fell off the bus
                           before the agent started
``row_remap_failure``      ``nvmlDeviceGetRemappedRows``: failureOccurred 1
``row_remap_pending``      ``nvmlDeviceGetRemappedRows``: isPending 1
``nvlink_down: [ports]``   ``nvmlDeviceGetNvLinkState``: those ports inactive, and the
                           other end of a port wired to a GPU too (a link has two ends)
``fabric_state``           ``nvmlDeviceGetGpuFabricInfo[V]``: ``not_started``,
                           ``in_progress`` or ``completed`` (a Hopper or newer GPU)
``fabric_status``          the fabric info's ``status``: an NVML error name
                           (``unknown``) when the registration failed
``recovery_action``        ``nvmlDeviceGetFieldValues``' NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                           ``gpu_reset``, ``node_reboot``, ``drain_p2p``,
                           ``drain_and_reset``, ... (NVML_GPU_RECOVERY_ACTION_* in lower case)
=========================  ===========================================================

Changed on a running fake with :meth:`HealthFactsApi.set_nvlink_down`,
:meth:`HealthFactsApi.set_fabric_state` and ``set_value`` (``remap_failure``,
``remap_pending``, ``recovery_action``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agent.hw.sim.nvml_core import FakeNvmlCore, _Handle
from agent.hw.sim.nvml_types import CONSTANTS as _C
from agent.hw.sim.nvml_types import c_nvmlGpuFabricInfo_t, c_nvmlGpuFabricInfoV_t
from agent.hw.sim.spec_model import FaultSpec, GpuFaultSpec, MachineSpec, NvSwitchSpec
from agent.hw.sim.spec_reader import SpecReader

__all__ = ["FAULT_KEYS", "HealthFactsApi", "nvml_view", "read_gpu_faults"]

FAULT_KEYS = frozenset(
    {
        "missing_from_nvml", "row_remap_failure", "row_remap_pending", "nvlink_down",
        "fabric_state", "fabric_status", "recovery_action",
    }
)
_FABRIC_STATES = ("not_started", "in_progress", "completed")
_RECOVERY_PREFIX = "NVML_GPU_RECOVERY_ACTION_"


def read_gpu_faults(r: SpecReader, value: object, where: str, nvlinks: int) -> GpuFaultSpec:
    """A GPU entry's ``faults`` (module docstring); ``nvlinks``: the ports the GPU has."""
    f = r.mapping(value, where, FAULT_KEYS)
    if f.get("nvlink_down") and not nvlinks:
        raise r.fail(f"{where}.nvlink_down", "the GPU has no NVLink ports")
    ports = r.indices(f.get("nvlink_down"), f"{where}.nvlink_down", nvlinks)
    state = f.get("fabric_state")
    if state is not None:
        state = r.str_(state, f"{where}.fabric_state").lower().replace("-", "_")
        if state not in _FABRIC_STATES:
            raise r.fail(f"{where}.fabric_state", f"expected one of {', '.join(_FABRIC_STATES)}, got {state!r}")
    status = f.get("fabric_status")
    if status is not None:
        status = r.str_(status, f"{where}.fabric_status").lower()
        if f"NVML_ERROR_{status.upper()}" not in _C:
            raise r.fail(f"{where}.fabric_status", f"unknown NVML error {status!r}")
    action = f.get("recovery_action")
    if action is not None:
        action = r.str_(action, f"{where}.recovery_action").lower().replace("-", "_")
        if _RECOVERY_PREFIX + action.upper() not in _C:
            known = sorted(k[len(_RECOVERY_PREFIX):].lower() for k in _C if k.startswith(_RECOVERY_PREFIX))
            raise r.fail(f"{where}.recovery_action", f"expected one of {', '.join(known)}, got {action!r}")
    return GpuFaultSpec(
        missing_from_nvml=r.bool_(f.get("missing_from_nvml", False), f"{where}.missing_from_nvml"),
        row_remap_failure=r.bool_(f.get("row_remap_failure", False), f"{where}.row_remap_failure"),
        row_remap_pending=r.bool_(f.get("row_remap_pending", False), f"{where}.row_remap_pending"),
        nvlink_down=tuple(sorted(set(ports))),
        fabric_state=state,
        fabric_status=status,
        recovery_action=action,
    )


def nvml_view(spec: MachineSpec) -> MachineSpec:
    """The machine as NVML lists it: without the GPUs ``missing_from_nvml``, the others
    numbered in order, and what named a GPU (NVLink pairs, NVSwitch members, PCIe levels,
    faults) renumbered or left out with it. ``spec`` itself when none is missing."""
    kept = [g for g in spec.gpus if not g.faults.missing_from_nvml]
    if len(kept) == len(spec.gpus):
        return spec
    new = {g.index: k for k, g in enumerate(kept)}
    switch = spec.nvswitch
    if switch is not None and switch.gpus is not None:
        switch = NvSwitchSpec(switch.links_per_gpu, switch.bus_ids, tuple(new[i] for i in switch.gpus if i in new))
    faults = spec.faults
    return replace(
        spec,
        gpus=tuple(replace(g, index=new[g.index]) for g in kept),
        nvlink_pairs=tuple((new[a], new[b], n) for a, b, n in spec.nvlink_pairs if a in new and b in new),
        nvswitch=switch,
        pcie_levels={
            (new[a], new[b]): level for (a, b), level in spec.pcie_levels.items() if a in new and b in new
        },
        faults=FaultSpec(
            lost_gpus=tuple(new[i] for i in faults.lost_gpus if i in new),
            unsupported=tuple((fn, new.get(i) if i is not None else None) for fn, i in faults.unsupported
                              if i is None or i in new),
            init_error=faults.init_error,
            xids=tuple((new[i], xid) for i, xid in faults.xids if i in new),
        ),
    )


class HealthFactsApi(FakeNvmlCore):
    """The fake's health facts: NVLink ports down, fabric state, and the spec's faults set
    on the telemetry knobs (row remapping, recovery action) at the start."""

    def __init__(self, spec: MachineSpec) -> None:
        super().__init__(nvml_view(spec))
        self._links_down: set[tuple[int, int]] = set()
        self._fabric: dict[int, tuple[int, int]] = {}  # gpu -> (state, status)
        for g in self.spec.gpus:
            f = g.faults
            t = self._telemetry[g.index]
            t["remap_failure"] = int(f.row_remap_failure)
            t["remap_pending"] = int(f.row_remap_pending)
            if f.recovery_action is not None:
                t["recovery_action"] = _C[_RECOVERY_PREFIX + f.recovery_action.upper()]
            for port in f.nvlink_down:
                if port < len(self._links[g.index]):  # a port not wired is inactive anyway
                    self.set_nvlink_down(g.index, port)
            if f.fabric_state is not None or f.fabric_status is not None:
                self.set_fabric_state(g.index, f.fabric_state or "completed", f.fabric_status)

    # ------------------------------------------------------------------ fault injection
    def set_nvlink_down(self, index: int, link: int, down: bool = True) -> None:
        """NVLink port ``link`` of GPU ``index`` goes inactive (``down``) or active again;
        the other end of a port wired to a GPU with it."""
        with self._lock:
            ports = self._links[self._gpu(index).index]
            if not 0 <= link < len(ports):
                raise ValueError(f"GPU {index} has no NVLink port {link} ({len(ports)} ports)")
            ends = [(index, link)]
            wired = ports[link]
            if wired is not None and wired.remote_gpu is not None:
                ends.append((wired.remote_gpu, self._remote_port(index, link, wired.remote_gpu)))
            for end in ends:
                if down:
                    self._links_down.add(end)
                else:
                    self._links_down.discard(end)

    def _remote_port(self, index: int, link: int, remote: int) -> int:
        """The port of ``remote`` at the other end of ``index``'s port ``link``: the k-th
        port of one GPU to the other is wired to the other's k-th port to it."""
        nth = sum(1 for p in self._links[index][:link] if p is not None and p.remote_gpu == remote)
        theirs = [k for k, p in enumerate(self._links[remote]) if p is not None and p.remote_gpu == index]
        return theirs[nth]

    def set_fabric_state(self, index: int, state: str, status: str | None = None) -> None:
        """GPU ``index``'s fabric registration: ``state`` one of ``not_started``,
        ``in_progress``, ``completed``; ``status`` an NVML error name (None: success)."""
        code = _C[f"NVML_GPU_FABRIC_STATE_{state.upper()}"]
        result = _C[f"NVML_ERROR_{status.upper()}"] if status else _C["NVML_SUCCESS"]
        with self._lock:
            self._fabric[self._gpu(index).index] = (code, result)

    # ------------------------------------------------------------------ what the API reads
    def _link_active(self, handle: _Handle, link: int) -> bool:
        with self._lock:
            return (handle.gpu, link) not in self._links_down

    def _fabric_fault(self, device: _Handle, info: Any) -> None:
        """Lay an injected fabric state over what ``_fill_fabric`` wrote: a GPU whose
        registration has not completed has no clique yet."""
        target = getattr(info, "_obj", info)
        with self._lock:
            fault = self._fabric.get(device.gpu)
        if fault is None or not isinstance(target, (c_nvmlGpuFabricInfo_t, c_nvmlGpuFabricInfoV_t)):
            return
        target.state, target.status = fault
        if fault[0] != _C["NVML_GPU_FABRIC_STATE_COMPLETED"] or fault[1] != _C["NVML_SUCCESS"]:
            target.cliqueId = 0
            for k in range(16):
                target.clusterUuid[k] = 0
