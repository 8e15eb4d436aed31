"""The processes on each GPU and what each uses, through the NVML call wrapper (a step of
:class:`agent.hw.nvml.telemetry.NvmlSampler`, so they are read with the rest of the
telemetry, once per sampling round).

=========================  ===========================================================
ProcessSample field        NVML source (all through ``NvmlCalls.call``)
=========================  ===========================================================
pid, used_memory_bytes     ``nvmlDeviceGetComputeRunningProcesses(h)`` and
                           ``nvmlDeviceGetMPSComputeRunningProcesses(h)`` (MPS clients),
                           joined by PID: ``.pid``, ``.usedGpuMemory`` (bytes; None where
                           NVML cannot say)
sm_util_pct, mem_util_pct  ``nvmlDeviceGetProcessUtilization(h, lastSeen)``: ``.smUtil``,
                           ``.memUtil`` of the newest sample of each PID since the previous
                           round; a process without a sample was idle (0)
=========================  ===========================================================

``lastSeen`` (CPU time in microseconds) is the newest sample's ``timeStamp`` of the previous
round, or that round's start when it had none (NVML answers NotFound when no process had
any utilisation since ``lastSeen``: every process is idle), so each round's figures cover
the time since the previous round. A process with utilisation but not in the lists (it
exited just now) is reported with ``used_memory_bytes`` None.

A GPU whose driver gives no per-process utilisation (NotSupported: MIG mode, GPUs before
Maxwell, vGPU guests; or a driver without the function) has ``sm_util_pct``/``mem_util_pct``
None for every process, and one log line says why, once per GPU; the processes and their
memory are still read. A failed listing leaves the GPU's processes unknown for that round
(``GpuSample.processes`` None), logged once per GPU and function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.errors import AgentError
from agent.hw.nvml.calls import NvmlCalls
from agent.hw.protocols import ProcessSample

__all__ = ["GpuProcessReader"]

log = logging.getLogger(__name__)

_LISTS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses")
_UTILIZATION = "nvmlDeviceGetProcessUtilization"


@dataclass
class _GpuProcessState:
    last_seen_us: int = 0
    utilization_supported: bool = True


class GpuProcessReader:
    """Reads each GPU's processes (module docstring); keeps each GPU's ``lastSeen`` between
    rounds. Not thread-safe: owned by the sampling thread."""

    def __init__(self, backend: NvmlCalls) -> None:
        self.backend = backend
        self._state: dict[int, _GpuProcessState] = {}
        self._warned: set[tuple[int, str]] = set()

    def _warn_once(self, index: int, key: str, message: str, *args: object) -> None:
        if (index, key) not in self._warned:
            self._warned.add((index, key))
            log.warning(message, *args)

    def read(self, index: int, handle: Any) -> tuple[tuple[ProcessSample, ...], bool] | None:
        """The processes on GPU ``index`` now, and whether their utilisation is known this
        round; None when NVML could not list them."""
        state = self._state.setdefault(index, _GpuProcessState())
        memory = self._memory_by_pid(index, handle)
        if memory is None:
            return None
        util = self._utilization(index, handle, state) if state.utilization_supported else None
        pids = list(memory)
        if util is not None:
            pids.extend(pid for pid in util if pid not in memory)
        out = []
        for pid in pids:
            sm, mem = util.get(pid, (0, 0)) if util is not None else (None, None)
            out.append(ProcessSample(pid, memory.get(pid), sm, mem))
        return tuple(out), util is not None

    def _memory_by_pid(self, index: int, handle: Any) -> dict[int, int | None] | None:
        """PID -> framebuffer bytes from both lists; None when neither could be read. A PID
        listed twice in one list (MIG instances) adds up; one in both lists (an MPS client
        the driver lists twice) counts once."""
        memory: dict[int, int | None] = {}
        listed = False
        for function in _LISTS:
            try:
                procs = self.backend.call(function, handle, gpu=index)
            except AgentError as exc:
                self._warn_once(index, function, "GPU %d: %s failed: %s", index, function, exc)
                continue
            if procs is None:
                continue  # NotSupported / missing (MPS list on an older driver) / lost
            listed = True
            this_list: dict[int, int | None] = {}
            for p in procs:
                pid, used = int(p.pid), getattr(p, "usedGpuMemory", None)
                if used is None:
                    this_list.setdefault(pid, None)
                else:
                    this_list[pid] = (this_list.get(pid) or 0) + int(used)
            for pid, used in this_list.items():
                known = memory.get(pid)
                memory[pid] = used if known is None else max(known, used or 0)
        return memory if listed else None

    def _utilization(
        self, index: int, handle: Any, state: _GpuProcessState
    ) -> dict[int, tuple[int, int]] | None:
        """PID -> (SM %, memory %) of the processes with a sample since the last round;
        None when not known this round."""
        started_us = int(time.time() * 1_000_000)
        not_found = self.backend.const("NVML_ERROR_NOT_FOUND", None)
        try:
            samples = self.backend.call(
                _UTILIZATION, handle, state.last_seen_us, gpu=index,
                empty=(not_found,) if not_found is not None else (),
            )
        except AgentError as exc:
            self._warn_once(index, _UTILIZATION, "GPU %d: %s failed: %s", index, _UTILIZATION, exc)
            return None
        if samples is None:
            if index not in self.backend.lost_gpus:
                state.utilization_supported = False
                self._warn_once(
                    index, "unsupported",
                    "GPU %d: the driver gives no per-process utilisation (%s not supported: "
                    "MIG mode, a GPU before Maxwell or a vGPU guest); the per-pod SM and "
                    "memory-bandwidth series are left out for this GPU", index, _UTILIZATION,
                )
            return None
        newest = _newest_by_pid(samples)
        state.last_seen_us = max((ts for ts, _s, _m in newest.values()), default=started_us)
        return {pid: (sm, mem) for pid, (_ts, sm, mem) in newest.items()}


def _newest_by_pid(samples: Iterable[Any]) -> dict[int, tuple[int, int, int]]:
    """PID -> (timeStamp, smUtil, memUtil) of its newest sample; empty slots (PID 0) of the
    driver's buffer are skipped."""
    newest: dict[int, tuple[int, int, int]] = {}
    for s in samples:
        pid = int(s.pid)
        if pid == 0:
            continue
        ts = int(s.timeStamp)
        if pid not in newest or ts >= newest[pid][0]:
            newest[pid] = (ts, int(s.smUtil), int(s.memUtil))
    return newest
