"""Events on the Node, bounded: occurrences in, a few API writes out.

:class:`EventBook` is the bounded, coalescing structure between the health sources and the
publisher's thread. :meth:`EventBook.add` (called on the watcher's thread) only counts an
occurrence into the entry of its Event and returns; the publisher takes what is due
(:meth:`EventBook.due`) and writes it. One Event per fault key and kind (Warning for a fault,
Normal for its recovery), aggregated: the first occurrence creates it with ``count`` 1, later
ones update ``count``, ``lastTimestamp`` and ``message`` of the same object, as client-go's
event recorder does for an identical event (``eventLogger``; its spam filter is a token
bucket per source and object, burst 25 and one token per 5 minutes).

Bounds (a storm of 10,000 occurrences of one key in a minute costs a handful of writes):
each Event is written at most :data:`BURST` times at once, then once per :data:`REFILL_S`
(the occurrences between two writes become one count update); the book holds at most
:data:`MAX_EVENTS` entries (the oldest idle one is forgotten first; when every entry has
something unwritten, the new occurrence is dropped and counted in ``dropped``). Memory is
constant whatever the storm.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

from agent.health.faults import Occurrence
from agent.health.node_condition import cap_message, gpu_names, sentence
from agent.records import Gpu

__all__ = ["BURST", "EVENTS_NAMESPACE", "MAX_EVENTS", "REFILL_S", "EventBook", "PendingEvent", "COMPONENT"]

#: where Events about cluster-scoped objects (Nodes) live, as the kubelet writes them
EVENTS_NAMESPACE = "default"
BURST = 3
REFILL_S = 30.0
MAX_EVENTS = 512
#: the Events' ``source.component`` and ``reportingComponent``
COMPONENT = "gpu-topology-agent"
RECOVERED_REASON = "GPUFaultCleared"
_MAX_EVENT_MESSAGE = 1024


def rfc3339(wall_s: float) -> str:
    return datetime.fromtimestamp(wall_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_name(node: str, key: str, recovered: bool) -> str:
    """``<node>.gpuhealth-<hash>``: one stable name per fault key and kind, so a restarted
    agent finds (and goes on counting) the Event it wrote before."""
    digest = hashlib.sha256(f"{key}|{'recovered' if recovered else 'fault'}".encode()).hexdigest()[:16]
    return f"{node}.gpuhealth-{digest}"[:253]


def event_message(occurrence: Occurrence, gpus: Mapping[int, Gpu]) -> str:
    where = gpu_names(occurrence.gpus, gpus) if occurrence.gpus else "node"
    text = f"{where}: {sentence(occurrence.detail)}"
    if occurrence.action and not occurrence.recovered:
        text += f" Action: {sentence(occurrence.action)}"
    return cap_message([text], _MAX_EVENT_MESSAGE)


@dataclass
class PendingEvent:
    """One Event's bookkeeping: ``written`` occurrences are on the server, ``pending`` more
    are not yet; ``latest`` is the newest occurrence."""

    name: str
    latest: Occurrence
    first_s: float
    written: int = 0
    pending: int = 0
    created: bool = False
    tokens: float = BURST
    refilled_s: float = 0.0
    last_touch_s: float = 0.0

    def refill(self, now_s: float) -> None:
        if self.refilled_s:
            self.tokens = min(BURST, self.tokens + (now_s - self.refilled_s) / REFILL_S)
        self.refilled_s = now_s

    def due_in(self, now_s: float) -> float:
        """Seconds until this entry may be written (0: now; inf: nothing to write)."""
        if not self.pending:
            return float("inf")
        self.refill(now_s)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) * REFILL_S


class EventBook:
    """The occurrences not yet written, per Event. Thread-safe: a leaf lock, held only to
    count in or take out (never across an API call). ``clock`` is the monotonic clock the
    rate limits use; ``wall`` the wall clock of the Events' timestamps."""

    def __init__(self, node: str, gpus: Mapping[int, Gpu], *, clock: Any, wall: Any) -> None:
        self.node = node
        self.gpus = dict(gpus)
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, bool], PendingEvent] = {}
        self.dropped = 0

    def add(self, occurrence: Occurrence) -> bool:
        """Count ``occurrence`` in (O(1), never blocks on I/O); False when dropped (the book is
        full of unwritten Events)."""
        key = (occurrence.key, occurrence.recovered)
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if len(self._entries) >= MAX_EVENTS and not self._forget_idle():
                    self.dropped += 1
                    return False
                entry = PendingEvent(event_name(self.node, *key), occurrence, occurrence.at or self._wall())
                self._entries[key] = entry
            entry.latest = occurrence
            entry.pending += 1
            entry.last_touch_s = now
            return True

    def _forget_idle(self) -> bool:
        idle = [k for k, e in self._entries.items() if not e.pending]
        if not idle:
            return False
        del self._entries[min(idle, key=lambda k: self._entries[k].last_touch_s)]
        return True

    def next_due_s(self) -> float:
        """Seconds until some entry may be written (inf: none pending)."""
        now = self._clock()
        with self._lock:
            return min((e.due_in(now) for e in self._entries.values()), default=float("inf"))

    def due(self) -> list[tuple[PendingEvent, int]]:
        """The entries that may be written now, each with the count taken out of ``pending``
        (a token spent); give a failed one back with :meth:`undo`."""
        now = self._clock()
        out = []
        with self._lock:
            for entry in self._entries.values():
                if entry.due_in(now) == 0.0:
                    entry.tokens -= 1
                    taken, entry.pending = entry.pending, 0
                    out.append((entry, taken))
        return out

    def done(self, entry: PendingEvent, total: int) -> None:
        """The Event on the server holds ``total`` occurrences now."""
        with self._lock:
            entry.written = total
            entry.created = True

    def undo(self, entry: PendingEvent, taken: int) -> None:
        """A write failed: its count is pending again (merged with what came meanwhile)."""
        with self._lock:
            entry.pending += taken
            entry.tokens = min(BURST, entry.tokens + 1)

    def body(self, entry: PendingEvent, count: int) -> dict[str, Any]:
        """The Event to create, holding ``count`` occurrences."""
        occ = entry.latest
        now = rfc3339(self._wall())
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": entry.name, "namespace": EVENTS_NAMESPACE},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node},
            "type": "Normal" if occ.recovered else "Warning",
            "reason": RECOVERED_REASON if occ.recovered else occ.cls.value,
            "message": event_message(occ, self.gpus),
            "source": {"component": COMPONENT, "host": self.node},
            "reportingComponent": COMPONENT, "reportingInstance": self.node,
            "firstTimestamp": rfc3339(entry.first_s), "lastTimestamp": now, "count": count,
        }

    def patch(self, entry: PendingEvent, count: int) -> dict[str, Any]:
        """The repeat's update: ``count``, ``lastTimestamp`` and ``message``."""
        return {"count": count, "lastTimestamp": rfc3339(self._wall()),
                "message": event_message(entry.latest, self.gpus)}
