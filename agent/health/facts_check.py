"""The watched facts: what a poll of the GPUs (not an event) says is wrong, as standing
faults on :class:`agent.health.HealthState`.

=================================  ====================================  ========================
fact (``agent.hw.protocols``)      fault (key)                           class
=================================  ====================================  ========================
PCI holds NVIDIA GPUs NVML does    ``gpu-count``                         GPU_COUNT_MISMATCH
not list (fell off the bus before
the agent started; zero visible)
row remapping failed               ``remap-failure/gpu-<i>``             MEMORY_ERROR
row remapping pending              ``remap-pending/gpu-<i>``             GPU_RESET_REQUIRED
NVLink port down                   ``nvlink-down/gpu-<i>``               NVLINK_DOWN
fabric registration not complete   ``fabric/gpu-<i>``                    FABRIC_NOT_READY
driver's recovery action           ``recovery-action/gpu-<i>``           by action (below)
=================================  ====================================  ========================

An NVLink port is down when it was active at the first look (what discovery read: the
topology's links) and is not now, or when the GPU has inactive ports and fewer active ones
than another GPU of its model in its NVLink island (a link down before the agent started,
or before a restart). A GPU in MIG mode is not checked (MIG turns NVLink P2P off). A fact that is
unknown for a GPU this round (not supported, GPU lost, NVML failed) leaves its fault as it
stood: a failing query neither raises nor clears a fault, and never stops the other GPUs'
checks. :func:`recovery_fault` is the driver's recovery action as a fault, for XID 154 too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from agent.health.faults import Fault, FaultClass
from agent.hw.protocols import HealthFacts, RecoveryAction

if TYPE_CHECKING:  # pragma: no cover
    from agent.topology.model import Topology

__all__ = ["FactsCheck", "nvlink_peers", "recovery_fault"]

log = logging.getLogger(__name__)

#: the driver's recovery action -> (class, what to do)
_RECOVERY: Mapping[RecoveryAction, tuple[FaultClass, str]] = {
    RecoveryAction.GPU_RESET: (FaultClass.GPU_RESET_REQUIRED, "Stop the GPU's processes and reset it (nvidia-smi -r)"),
    RecoveryAction.BUS_RESET: (FaultClass.GPU_RESET_REQUIRED, "Stop the GPU's processes and reset its PCIe bus"),
    RecoveryAction.NODE_REBOOT: (FaultClass.NODE_REBOOT_REQUIRED, "Reboot the node"),
    RecoveryAction.SYSTEM_REBOOT: (FaultClass.NODE_REBOOT_REQUIRED, "Reboot the node"),
    RecoveryAction.DRAIN_P2P: (
        FaultClass.GPU_RESET_REQUIRED,
        "Stop the processes using peer-to-peer traffic on the GPU (drain the node); the driver then names"
        " the next action",
    ),
    RecoveryAction.DRAIN_AND_RESET: (
        FaultClass.GPU_RESET_REQUIRED, "Drain the node's peer-to-peer traffic, then reset the GPU (nvidia-smi -r)",
    ),
    RecoveryAction.RECOVER_IMEX_DOMAIN: (FaultClass.FABRIC_NOT_READY, "Recover the GPU's IMEX domain"),
}


def recovery_fault(index: int, value: int, now: float = 0.0) -> Fault | None:
    """The fault the driver's recovery action ``value`` (NVML's
    ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, or XID 154's) stands for on GPU ``index``;
    None for NONE. It wins over the XID catalog's action: the driver knows the GPU's state."""
    try:
        action = RecoveryAction(value)
    except ValueError:
        return Fault(
            f"recovery-action/gpu-{index}", FaultClass.CONTACT_SUPPORT, (index,),
            f"Contact NVIDIA support (the driver reports recovery action {value}, unknown to this agent).",
            f"GPU {index}: the driver reports recovery action {value}", since=now,
        )
    if action is RecoveryAction.NONE:
        return None
    cls, what = _RECOVERY[action]
    return Fault(
        f"recovery-action/gpu-{index}", cls, (index,),
        f"{what} (the driver reports it: NVML GPU recovery action {action.name}).",
        f"GPU {index}: the driver reports recovery action {action.name}", since=now,
    )


def nvlink_peers(topology: Topology) -> dict[int, tuple[int, ...]]:
    """Per GPU, the GPUs of the same model in its NVLink island: those it is compared with."""
    peers: dict[int, tuple[int, ...]] = {}
    gpus = topology.gpus
    for island in topology.nvlink_islands:
        for i in island:
            peers[i] = tuple(j for j in island if j != i and gpus[j].name == gpus[i].name)
    return peers


class FactsCheck:
    """Reads the facts of GPUs ``0..len(bus_ids)-1`` from ``facts`` and says which faults
    stand (module docstring). ``bus_ids``: NVML's GPUs' bus ids in index order as read at
    start (``""`` for one NVML could not read); ``peers``: :func:`nvlink_peers`. Not
    thread-safe: one poller owns it."""

    def __init__(
        self,
        facts: HealthFacts,
        bus_ids: Sequence[str],
        peers: Mapping[int, Sequence[int]] | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.facts = facts
        self.bus_ids = tuple(bus_ids)
        self.peers = {i: tuple(p) for i, p in (peers or {}).items()}
        self._clock = clock
        self._baseline: dict[int, frozenset[int]] = {}  # GPU -> NVLink ports active at first look
        self._ports: dict[int, int] = {}  # GPU -> how many NVLink ports it has
        self._standing: dict[str, Fault] = {}  # key -> the fault as last determined

    @classmethod
    def for_topology(cls, facts: HealthFacts, topology: Topology) -> FactsCheck:
        return cls(facts, [g.pci_bus_id for g in topology.gpus], nvlink_peers(topology))

    def standing(self) -> list[Fault]:
        """The faults standing now (the health watcher's poll, :class:`agent.health.watcher.
        HealthWatcher` ``facts``): this round's findings over the last round's, so that a fact
        NVML cannot read this round leaves its fault as it stood."""
        for key, fault in self.observe().items():
            if fault is None:
                self._standing.pop(key, None)
            else:
                self._standing[key] = fault
        return list(self._standing.values())

    def observe(self) -> dict[str, Fault | None]:
        """Every fault key determined this round: its fault, or None (it does not stand);
        keys of facts unknown this round are absent."""
        now = self._clock()
        out: dict[str, Fault | None] = {}
        self._gpu_count(out, now)
        active: dict[int, frozenset[int]] = {}
        for i in range(len(self.bus_ids)):
            self._remap(i, out, now)
            self._fabric(i, out, now)
            action = self.facts.recovery_action(i)
            if action is not None:
                out[f"recovery-action/gpu-{i}"] = recovery_fault(i, action, now)
            states = self.facts.nvlink_states(i)
            if states is not None:
                self._ports[i] = len(states)
                active[i] = frozenset(port for port, up in states.items() if up)
                self._baseline.setdefault(i, active[i])
        self._nvlinks(active, out, now)
        return out

    # ------------------------------------------------------------------ the facts
    def _gpu_count(self, out: dict[str, Fault | None], now: float) -> None:
        pci = self.facts.pci_gpus()
        if pci is None:
            return
        known = {b for b in self.bus_ids if b}
        missing = [b for b in pci if b not in known]
        unread = sum(1 for b in self.bus_ids if not b)  # NVML lists them, lost at discovery (GPU_LOST)
        if len(missing) <= unread:
            out["gpu-count"] = None
            return
        out["gpu-count"] = Fault(
            "gpu-count", FaultClass.GPU_COUNT_MISMATCH, (),
            "Reboot the node; if the GPU stays missing, it needs service (look for XID 79 or RmInitAdapter"
            " failures in the kernel log).",
            f"the PCI bus holds {len(pci)} NVIDIA GPUs, NVML lists {len(self.bus_ids)}; not listed:"
            f" {', '.join(missing)}",
            since=now,
        )

    def _remap(self, i: int, out: dict[str, Fault | None], now: float) -> None:
        rows = self.facts.remapped_rows(i)
        if rows is None:
            return
        out[f"remap-failure/gpu-{i}"] = Fault(
            f"remap-failure/gpu-{i}", FaultClass.MEMORY_ERROR, (i,),
            "Drain the GPU and have it serviced: a row-remapping failure is an RMA criterion.",
            f"GPU {i}: row remapping failed ({rows.uncorrectable} rows remapped for uncorrectable errors,"
            f" {rows.correctable} for correctable): no spare memory row left",
            since=now,
        ) if rows.failed else None
        out[f"remap-pending/gpu-{i}"] = Fault(
            f"remap-pending/gpu-{i}", FaultClass.GPU_RESET_REQUIRED, (i,),
            "Reset the GPU (nvidia-smi -r) once its work is drained: the pending row remap is applied at reset.",
            f"GPU {i}: a row remap is pending ({rows.uncorrectable} rows remapped for uncorrectable errors)",
            since=now,
        ) if rows.pending and not rows.failed else None

    def _fabric(self, i: int, out: dict[str, Fault | None], now: float) -> None:
        fabric = self.facts.fabric_state(i)
        if fabric is None:
            return
        if fabric.ready:
            out[f"fabric/gpu-{i}"] = None
            return
        what = (f"fabric registration {fabric.state}" if fabric.status == 0 or fabric.state != "completed"
                else f"fabric registration failed (NVML error {fabric.status})")
        out[f"fabric/gpu-{i}"] = Fault(
            f"fabric/gpu-{i}", FaultClass.FABRIC_NOT_READY, (i,),
            "Check the NVLink fabric: nvidia-fabricmanager (NVSwitch systems) or the NVLink subnet manager must run"
            " and finish registering the GPU; CUDA cannot use it until then.",
            f"GPU {i}: NVLink {what}",
            since=now,
        )

    def _nvlinks(self, active: Mapping[int, frozenset[int]], out: dict[str, Fault | None], now: float) -> None:
        for i, ports in active.items():
            lost = sorted(self._baseline[i] - ports)
            best = max((len(active[j]) for j in self.peers.get(i, ()) if j in active), default=0)
            parts = []
            if lost:
                parts.append(f"NVLink port{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} down")
            if len(ports) < best and len(ports) < self._ports[i]:
                parts.append(f"{len(ports)} NVLinks active where its NVLink peers have {best}")
            out[f"nvlink-down/gpu-{i}"] = Fault(
                f"nvlink-down/gpu-{i}", FaultClass.NVLINK_DOWN, (i,),
                "Drain the node and reset the GPU or reboot; if the link stays down, the board or NVSwitch"
                " tray needs service.",
                f"GPU {i}: {'; '.join(parts)}",
                since=now,
            ) if parts else None
