"""GPU health as one mutable, thread-safe state object: which physical GPUs are unhealthy and
why (the kubelet sides' view), the standing faults and whether the agent can watch (the
Node condition's), and the occurrence listeners (Events, metrics).

Consumers block on :meth:`HealthState.wait_for_change` instead of polling NVML; the health
watcher (:mod:`agent.health.watcher`) is the only writer in production.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Callable, Mapping

from agent.health.faults import Fault, Occurrence, Watching
from agent.hw.protocols import EventSource
from agent.listeners import Listeners

log = logging.getLogger(__name__)

FENCED_REASON_PREFIX = "fenced: "
ECC_REASON = "double-bit ECC error"
LOST_REASON = "GPU lost"
_XID_REASON = re.compile(r"^XID (\d+)$")


def reason_kind(reason: str) -> tuple[str, str]:
    """What an unhealthy reason written here says, as (kind, detail): ``("xid", "79")``,
    ``("ecc", "double-bit")``, ``("lost", "true")`` (lost now or at discovery),
    ``("fenced", "health-watcher-failed")``; any other reason ``("unhealthy", "true")``."""
    m = _XID_REASON.match(reason)
    if m:
        return "xid", m.group(1)
    if reason == ECC_REASON:
        return "ecc", "double-bit"
    if reason.startswith(LOST_REASON):
        return "lost", "true"
    if reason.startswith(FENCED_REASON_PREFIX):
        return "fenced", "health-watcher-failed"
    return "unhealthy", "true"


class HealthState:
    """Per-GPU health, thread-safe. ``generation`` increases on every change.

    ``unhealthy`` holds the GPUs that are unhealthy from the start (index -> reason): a GPU
    that failed at discovery is Unhealthy in the very first device list, never advertised
    Healthy until the watcher gets to it."""

    def __init__(self, gpu_count: int, unhealthy: Mapping[int, str] | None = None) -> None:
        self.gpu_count = gpu_count
        # Lock order: a leaf. Held only to read or change the state; listeners run after it
        # is released (they take their own locks, e.g. the device-plugin manager's).
        self._cond = threading.Condition()
        #: set once the sources' start-up read is in the state (the kernel log since boot, the
        #: first NVML round, the facts): the Node's condition is first written after it
        self.settled = threading.Event()
        self._unhealthy: dict[int, str] = {i: r for i, r in (unhealthy or {}).items() if 0 <= i < gpu_count}
        self.generation = 0
        self._listeners = Listeners(log, "health")
        self._faults: dict[str, Fault] = {}
        self._watching = Watching.YES
        self._occurrence_listeners: list[Callable[[Occurrence], None]] = []

    def snapshot(self) -> dict[int, str]:
        """Unhealthy GPU index -> reason, a copy."""
        with self._cond:
            return dict(self._unhealthy)

    # --- faults (the Node condition's input) and occurrences (its Events)

    def set_fault(self, fault: Fault) -> bool:
        """Stand ``fault`` (replacing one of its key); True if the set of standing keys or
        the fault's class changed."""
        with self._cond:
            was = self._faults.get(fault.key)
            self._faults[fault.key] = fault
            changed = was is None or was.cls != fault.cls
            if changed:
                self._changed()
        if changed:
            self._notify()
        return changed

    def clear_fault(self, key: str) -> bool:
        """Clear the fault of ``key``; True if one stood."""
        with self._cond:
            changed = self._faults.pop(key, None) is not None
            if changed:
                self._changed()
        if changed:
            self._notify()
        return changed

    def faults(self) -> tuple[Fault, ...]:
        """The standing faults, oldest first."""
        with self._cond:
            return tuple(sorted(self._faults.values(), key=lambda f: (f.since, f.key)))

    def set_watching(self, watching: Watching) -> None:
        with self._cond:
            changed = self._watching != watching
            self._watching = watching
            if changed:
                self._changed()
        if changed:
            self._notify()

    def watching(self) -> Watching:
        with self._cond:
            return self._watching

    def add_occurrence_listener(self, callback: Callable[[Occurrence], None]) -> None:
        """``callback(occurrence)`` for everything seen (Events, metrics); must return at once."""
        self._occurrence_listeners.append(callback)

    def record(self, occurrence: Occurrence) -> None:
        """Hand ``occurrence`` to the occurrence listeners (a failing one is logged)."""
        for callback in tuple(self._occurrence_listeners):
            try:
                callback(occurrence)
            except Exception:  # noqa: BLE001 - a listener never breaks the watcher
                log.exception("health occurrence listener failed")

    def is_healthy(self, index: int) -> bool:
        with self._cond:
            return index not in self._unhealthy

    def add_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs (outside the lock) after every change."""
        self._listeners.add(callback)

    def _changed(self) -> None:
        self.generation += 1
        self._cond.notify_all()

    def _notify(self) -> None:
        self._listeners.notify()  # a listener that fails is logged: it never breaks the watcher

    def mark_unhealthy(self, index: int, reason: str) -> bool:
        """Mark GPU ``index`` unhealthy; True if that changed its state."""
        with self._cond:
            if not 0 <= index < self.gpu_count:
                raise IndexError(f"no GPU {index} (have {self.gpu_count})")
            was = self._unhealthy.get(index)
            self._unhealthy[index] = reason
            changed = was is None
            if changed:
                self._changed()
        if changed:
            self._notify()
        return changed

    def mark_healthy(self, index: int) -> bool:
        with self._cond:
            changed = self._unhealthy.pop(index, None) is not None
            if changed:
                self._changed()
        if changed:
            self._notify()
        return changed

    def fence(self, reason: str) -> None:
        """Mark every GPU unhealthy (the watcher cannot vouch for any of them)."""
        with self._cond:
            added = [i for i in range(self.gpu_count) if i not in self._unhealthy]
            for i in added:
                self._unhealthy[i] = FENCED_REASON_PREFIX + reason
            if added:
                self._changed()
        if added:
            self._notify()

    def wait_for_change(self, generation: int, timeout_s: float | None) -> int:
        """Block until ``self.generation != generation``, :meth:`wake`, or the timeout;
        returns the current generation."""
        with self._cond:
            if self.generation == generation:
                self._cond.wait(timeout_s)
            return self.generation

    def wake(self) -> None:
        """Wake every waiter without a change (used to close streams at shutdown)."""
        with self._cond:
            self._cond.notify_all()


def lost_at_discovery(backend: EventSource) -> dict[int, str]:
    """GPUs the backend already found lost (``backend.lost_gpus``, e.g. while the topology
    was read), as the ``unhealthy`` seed of :class:`HealthState`."""
    return {int(i): f"{LOST_REASON} at discovery" for i in sorted(backend.lost_gpus)}
