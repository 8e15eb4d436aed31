"""The standing faults the health watcher keeps: raised, repeated, cleared on evidence, and
shown on :class:`HealthState` (its faults, and the per-GPU unhealthy marks the kubelet sides
read: a GPU named by a fatal fault is unhealthy, with a reason :func:`reason_kind` reads).

Each raise, repeat and clear is an :class:`Occurrence` handed to the state's occurrence
listeners (Events, metrics); recoveries carry ``recovered=True``. Logging is bounded: one
line when a fault is raised and one when it clears (with the count it stood for), whatever
the number of repeats in between.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from agent.health.faults import Fault, FaultClass, Occurrence
from agent.health.state import ECC_REASON, FENCED_REASON_PREFIX, LOST_REASON, HealthState

__all__ = ["FaultBook"]

log = logging.getLogger(__name__)


@dataclass
class _Standing:
    fault: Fault
    last_s: float  # monotonic: the last occurrence or failed probe (the quiet period's start)
    quiet: bool  # cleared by the quiet period (False: only by evidence: a reset, the driver, a boot)
    source: str


def _mark_reason(fault: Fault) -> str:
    if fault.key.startswith("lost/"):
        return LOST_REASON
    if fault.key.startswith("ecc-dbe/"):
        return ECC_REASON
    if fault.xid is not None:
        return f"XID {fault.xid}"
    return fault.cls.value


class FaultBook:
    """Owned by the watcher's thread (not thread-safe); ``state`` is what others read.
    ``clock`` is monotonic (quiet periods), ``wall`` wall-clock (``Fault.since``, ``at``)."""

    def __init__(self, state: HealthState, clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self.state = state
        self._clock = clock
        self._wall = wall
        self._standing: dict[str, _Standing] = {}
        self.fenced_at: float | None = None  # monotonic time of the last watcher failure
        self.changed = False  # the set of standing faults changed since the last save

    # ------------------------------------------------------------------ reading
    def get(self, key: str) -> Fault | None:
        standing = self._standing.get(key)
        return standing.fault if standing else None

    def faults(self) -> list[Fault]:
        return [s.fault for s in self._standing.values()]

    def saved_faults(self) -> list[Fault]:
        """The faults a restart restores (the facts' are polled again instead)."""
        return [s.fault for s in self._standing.values() if s.source != "facts"]

    # ------------------------------------------------------------------ raising
    def seen(self, fault: Fault, source: str, count: int = 1, *, quiet: bool = True) -> None:
        """``fault`` happened ``count`` times now: raised when new (one error line), else
        counted and its quiet period restarted. Records the occurrence."""
        now = self._clock()
        standing = self._standing.get(fault.key)
        if standing is None:
            fault = replace(fault, since=fault.since or self._wall(), count=count)
            self._standing[fault.key] = _Standing(fault, now, quiet, source)
            self.changed = True
            where = f"GPU {', '.join(map(str, fault.gpus))}" if fault.gpus else "node"
            log.error("%s: %s: %s; action: %s (fault %s)", where, fault.cls.value, fault.detail, fault.action,
                      fault.key)
        else:
            fault = replace(standing.fault, cls=fault.cls, action=fault.action,
                            count=standing.fault.count + count)
            standing.fault, standing.last_s = fault, now
        self.state.set_fault(fault)
        self.state.record(Occurrence(fault.key, fault.cls, fault.gpus, fault.detail, fault.action, fault.xid,
                                     at=self._wall(), source=source, count=count))

    def restore(self, fault: Fault, *, quiet: bool) -> None:
        """A fault a previous run of this boot saved: standing again, its quiet period from now."""
        self._standing[fault.key] = _Standing(fault, self._clock(), quiet, "restored")
        self.state.set_fault(fault)
        log.warning("%s stands since before this start: %s (fault %s)", fault.cls.value, fault.detail, fault.key)

    # ------------------------------------------------------------------ clearing
    def clear(self, key: str, why: str) -> bool:
        """Clear the fault of ``key`` (a Normal occurrence with ``recovered=True``)."""
        standing = self._standing.pop(key, None)
        if standing is None:
            return False
        self.changed = True
        f = standing.fault
        self.state.clear_fault(key)
        log.warning("fault %s cleared (%s) after %d occurrence(s)", key, why, f.count)
        self.state.record(Occurrence(key, f.cls, f.gpus, f"{f.detail}: cleared ({why})", xid=f.xid,
                                     recovered=True, at=self._wall(), source=standing.source))
        return True

    def clear_gpu(self, gpu: int, why: str) -> None:
        """Clear every fault naming GPU ``gpu`` (a reset of it was seen)."""
        for key in [k for k, s in self._standing.items() if gpu in s.fault.gpus and s.source != "facts"]:
            self.clear(key, why)

    def set_facts(self, faults: Iterable[Fault]) -> None:
        """The complete set of the watched facts' faults now: new ones raised, gone ones cleared."""
        now_keys = set()
        for fault in faults:
            now_keys.add(fault.key)
            standing = self._standing.get(fault.key)
            if standing is None or standing.fault.cls != fault.cls or standing.fault.detail != fault.detail:
                if standing is not None:
                    standing.fault = replace(fault, since=standing.fault.since, count=standing.fault.count)
                    self.state.set_fault(standing.fault)
                else:
                    self.seen(fault, "facts", quiet=False)
        for key in [k for k, s in self._standing.items() if s.source == "facts" and k not in now_keys]:
            self.clear(key, "no longer seen")

    def recover(self, recovery_s: float, probe: Callable[[int], bool]) -> None:
        """Clear the faults quiet for ``recovery_s`` whose GPUs answer ``probe``; a failed
        probe restarts a fault's quiet period."""
        now = self._clock()
        answers: dict[int, bool] = {}
        for key, standing in list(self._standing.items()):
            if not standing.quiet:
                continue
            ok = True
            for gpu in standing.fault.gpus:
                if gpu not in answers:
                    answers[gpu] = probe(gpu)
                ok = ok and answers[gpu]
            if not ok:
                standing.last_s = now
            elif now - standing.last_s >= recovery_s:
                self.clear(key, f"quiet for {recovery_s:.0f} s and answering NVML")
        if self.fenced_at is not None and now - self.fenced_at >= recovery_s:
            fenced = [g for g, r in self.state.snapshot().items() if r.startswith(FENCED_REASON_PREFIX)]
            if all(answers.setdefault(g, probe(g)) for g in fenced):
                self.fenced_at = None
            else:
                self.fenced_at = now

    # ------------------------------------------------------------------ the kubelet sides' marks
    def show_marks(self) -> None:
        """Make the per-GPU unhealthy marks agree with the fatal faults (and the fence)."""
        wanted: dict[int, str] = {}
        for standing in self._standing.values():
            fault = standing.fault
            if fault.cls.fatal or fault.cls == FaultClass.GPU_LOST:
                for gpu in fault.gpus:
                    wanted.setdefault(gpu, _mark_reason(fault))
        marks = self.state.snapshot()
        for gpu, reason in marks.items():
            if gpu in wanted:
                continue
            if reason.startswith(FENCED_REASON_PREFIX) and self.fenced_at is not None:
                continue
            if self.state.mark_healthy(gpu):
                log.warning("GPU %d healthy again (%s)", gpu, reason)
        for gpu, reason in wanted.items():
            if 0 <= gpu < self.state.gpu_count and gpu not in marks:
                self.state.mark_unhealthy(gpu, reason)
