"""GPU health: one mutable state object, one watcher thread that owns it.

:class:`HealthState` holds which physical GPUs are unhealthy and why; it is shared between
threads and consumers (the device-plugin streams) block on :meth:`HealthState.wait_for_change`
instead of polling NVML. :class:`HealthWatcher` is the only writer in production: it waits on
NVML events through ``backend.wait_events(timeout_ms)`` (critical XIDs, double-bit ECC, lost
GPUs), marks the GPU unhealthy, and brings it back once it has answered NVML normally
(``backend.probe(index)``) for ``config.health_recovery_s`` with no new critical event. If the
watcher itself fails, it *fences*: every GPU is marked unhealthy and an error is logged,
because advertising GPUs nobody watches hides faults from the scheduler.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable, Iterable, Mapping

from agent.config import Config, is_critical_xid
from agent.health.faults import Fault, Occurrence, Watching
from agent.hw.protocols import EventSource, HealthEvent
from agent.listeners import Listeners
from agent.worker import Worker

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


class HealthWatcher(Worker):
    """The thread that turns NVML events into :class:`HealthState` changes.

    ``poll_ms`` bounds each ``wait_events`` call, hence how often recovery is checked and
    how fast :meth:`stop` returns. ``clock`` is injectable for tests. ``config`` may be
    replaced (SIGHUP) by assigning the attribute.
    """

    thread_name = "health-watcher"

    def __init__(
        self,
        backend: EventSource,
        state: HealthState,
        config: Config,
        *,
        poll_ms: int = 500,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_xid: Callable[[int, int], None] | None = None,
    ) -> None:
        self.backend = backend
        self.on_xid = on_xid  # (gpu_index, xid), every XID seen: the metrics' XID counter
        self.state = state
        self.config = config
        self.poll_ms = poll_ms
        self.retry_s = retry_s
        self._clock = clock
        super().__init__()
        self._last_bad_s: dict[int, float] = {}  # GPU -> last critical event / failed probe
        self.fenced = False  # no Outage: public state (the GPUs are fenced), its loud wording its own
        self._seen_lost: set[int] = set()

    # ------------------------------------------------------------------ work
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:
                self._fence(exc)
                self._stop.wait(self.retry_s)

    def _fence(self, exc: BaseException) -> None:
        if self.fenced:  # already said loudly; keep the log readable while it keeps failing
            log.debug("health watcher still failing: %s", exc)
        else:
            log.error(
                "HEALTH WATCHER FAILED (%s: %s): fencing all %d GPUs as unhealthy until it recovers",
                type(exc).__name__, exc, self.state.gpu_count,
            )
        self.fenced = True
        self.state.fence(f"health watcher failed: {exc}")
        now = self._clock()
        for i in range(self.state.gpu_count):
            self._last_bad_s[i] = now

    def step(self) -> None:
        """One round: wait for events (up to ``poll_ms``), apply them, then try recovery.
        Exceptions propagate (the thread fences on them)."""
        events = self.backend.wait_events(self.poll_ms)
        if self.fenced:
            log.warning("health watcher is receiving events again; GPUs recover after %.0f s quiet",
                        self.config.health_recovery_s)
            self.fenced = False
        self.apply(events)
        self._check_lost()
        self.recover()

    def _check_lost(self) -> None:
        """GPUs the backend found lost on any call (``backend.lost_gpus``, e.g. while the
        metrics sampler read them) are unhealthy too; each newly lost one once."""
        lost = set(self.backend.lost_gpus)
        now = self._clock()
        for index in sorted(lost - self._seen_lost):
            if 0 <= index < self.state.gpu_count:
                self._last_bad_s[index] = now
                if self.state.mark_unhealthy(index, LOST_REASON):
                    log.error("GPU %d marked unhealthy: GPU lost (NVML answered GPU_IS_LOST)", index)
        self._seen_lost = lost

    def apply(self, events: Iterable[HealthEvent]) -> None:
        now = self._clock()
        for event in events:
            index = event.gpu_index
            kind = event.kind
            xid = event.xid
            if kind == "xid" and xid is not None and self.on_xid is not None:
                try:
                    self.on_xid(index, xid)
                except Exception:  # metrics must never break health
                    log.exception("XID hook failed")
            if kind == "xid" and xid is not None and not is_critical_xid(self.config, xid):
                log.info("GPU %d: XID %d is not critical (ignored)", index, xid)
                continue
            reason = f"XID {xid}" if kind == "xid" else (ECC_REASON if kind == "ecc_dbe" else LOST_REASON)
            self._last_bad_s[index] = now
            if self.state.mark_unhealthy(index, reason):
                log.error("GPU %d marked unhealthy: %s", index, reason)

    def recover(self) -> None:
        """Unhealthy GPUs quiet for the recovery period and answering NVML become healthy;
        a failed probe restarts the quiet period."""
        now = self._clock()
        for index in sorted(self.state.snapshot()):
            if not self.backend.probe(index):
                self._last_bad_s[index] = now
                continue
            last_bad = self._last_bad_s.setdefault(index, now)
            if now - last_bad >= self.config.health_recovery_s:
                if self.state.mark_healthy(index):
                    self._last_bad_s.pop(index, None)
                    log.warning("GPU %d healthy again after %.0f s without faults", index, now - last_bad)
