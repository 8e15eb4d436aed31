"""NVML health events: critical XIDs, double-bit ECC errors and lost GPUs, through the call
wrapper (:class:`agent.hw.nvml.calls.NvmlCalls`).

:class:`NvmlEvents` owns NVML's event set: it registers every GPU that supports them for
XID and double-bit ECC events, waits on the set (outside the wrapper's call lock: the wait
blocks), and reports each GPU the wrapper newly found lost as a ``lost`` event. A GPU that
comes back (:meth:`NvmlEvents.recovered`) is registered again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from agent.hw.nvml.calls import NvmlCalls, NvmlError
from agent.hw.protocols import HealthEvent

__all__ = ["NvmlEvents"]

log = logging.getLogger(__name__)

#: events drained per wait at most (the rest stay queued for the next one)
_MAX_EVENTS = 256


class NvmlEvents:
    """The event set of one :class:`NvmlCalls`. Registration and waits happen on one thread
    (the health watcher's); :meth:`close` may come from another."""

    def __init__(self, nvml: NvmlCalls) -> None:
        self._nvml = nvml
        # Lock order: a leaf; guards the event set and the bookkeeping below, never held
        # across an NVML call.
        self._lock = threading.Lock()
        self._event_set: Any = None
        self._registered: set[int] = set()
        self._reported_lost: set[int] = set()
        self._gpu_count: int | None = None  # read once, at the first registration

    def register(self) -> bool:
        """Create the event set and register XID and double-bit ECC events for every GPU
        that supports them (idempotent). False if NVML has no event support here."""
        nvml = self._nvml
        if self._event_set is None:
            event_set = nvml.call("nvmlEventSetCreate")
            with self._lock:
                self._event_set = event_set
        if self._event_set is None:
            return False
        if self._gpu_count is None:
            self._gpu_count = nvml.device_count()
        for index in range(self._gpu_count):
            if index not in self._registered:
                self._register_gpu(index)
        return True

    def _register_gpu(self, index: int) -> None:
        nvml = self._nvml
        h = nvml.handle(index)
        if h is None:
            return
        wanted = nvml.const("nvmlEventTypeXidCriticalError") | nvml.const(
            "nvmlEventTypeDoubleBitEccError"
        )
        supported = nvml.call("nvmlDeviceGetSupportedEventTypes", h, gpu=index)
        if supported is None:
            log.warning(
                "GPU %d: NVML events not supported; XID health checks are off for it", index
            )
            self._registered.add(index)
            return
        mask = wanted & int(supported)
        if mask:
            nvml.call("nvmlDeviceRegisterEvents", h, mask, self._event_set, gpu=index)
        if index not in nvml.lost_gpus:
            self._registered.add(index)

    def recovered(self, index: int) -> None:
        """GPU ``index`` was lost and answers again: a later loss is reported anew, and its
        events are registered again (once the event set exists)."""
        with self._lock:
            self._reported_lost.discard(index)
            self._registered.discard(index)
        if self._event_set is not None:
            self._register_gpu(index)

    def wait(self, timeout_ms: int) -> list[HealthEvent]:
        """Block up to ``timeout_ms`` for health events; [] on timeout. Returns every event
        already queued once one arrives, plus a ``lost`` event for each GPU newly marked lost
        (by any call, or found when NVML reports a lost GPU during the wait)."""
        nvml = self._nvml
        lib = nvml.lib
        if lib is None:
            raise NvmlError("wait_events before init()")
        events: list[HealthEvent] = []
        if not self.register():
            time.sleep(max(0, timeout_ms) / 1000)
        else:
            wait_name = (
                "nvmlEventSetWait_v2" if hasattr(lib, "nvmlEventSetWait_v2") else "nvmlEventSetWait"
            )
            wait = getattr(lib, wait_name)
            timeout = max(0, int(timeout_ms))
            while len(events) < _MAX_EVENTS:
                try:
                    data = wait(self._event_set, timeout)
                except lib.NVMLError as exc:
                    if exc.value == nvml.const("NVML_ERROR_TIMEOUT"):
                        break
                    nvml.count_error(wait_name)
                    if exc.value == nvml.const("NVML_ERROR_GPU_IS_LOST"):
                        for index in range(self._gpu_count or 0):
                            if index not in nvml.lost_gpus:
                                nvml.probe(index)
                        timeout = 0
                        continue
                    raise NvmlError(
                        f"NVML {wait_name} failed: {exc} (NVML error {exc.value})",
                        function_name=wait_name,
                        code=exc.value,
                    ) from exc
                events.extend(self._health_events(data))
                timeout = 0  # drain what is already queued, without waiting again
        lost = nvml.lost_gpus
        with self._lock:
            new_lost = sorted(lost - self._reported_lost)
            self._reported_lost.update(new_lost)
        events.extend(HealthEvent(i, "lost") for i in new_lost)
        return events

    def _health_events(self, data: Any) -> list[HealthEvent]:
        nvml = self._nvml
        index = nvml.gpu_of(data.device)
        if index is None:
            index = nvml.call("nvmlDeviceGetIndex", data.device)
        if index is None:
            return []
        out: list[HealthEvent] = []
        event_type = int(data.eventType)
        if event_type & nvml.const("nvmlEventTypeXidCriticalError"):
            out.append(HealthEvent(int(index), "xid", int(data.eventData)))
        if event_type & nvml.const("nvmlEventTypeDoubleBitEccError"):
            out.append(HealthEvent(int(index), "ecc_dbe"))
        return out

    def close(self) -> None:
        """Free the event set (before NVML shuts down); never raises."""
        with self._lock:
            event_set, self._event_set = self._event_set, None
            self._registered.clear()
            self._gpu_count = None
        lib = self._nvml.lib
        if event_set is None or lib is None:
            return
        try:
            lib.nvmlEventSetFree(event_set)
        except lib.NVMLError as exc:
            log.warning("NVML event set free failed: %s", exc)
