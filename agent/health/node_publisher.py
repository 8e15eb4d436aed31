"""The Node health publisher: one thread that writes the ``GPUHealthy`` condition and the
Events of :mod:`agent.health.node_events` to the agent's own Node, never the watcher's thread.

The health state's listeners only mark the condition stale and count occurrences into the
:class:`agent.health.node_events.EventBook`, then wake this thread; they return at once.
Each round the thread derives the condition (:func:`agent.health.node_condition.derive_condition`)
and writes it when it differs from what it wrote (a new status at once, a new reason or
message at most once per :data:`CONDITION_MIN_INTERVAL_S`) or every :data:`HEARTBEAT_S` (``lastHeartbeatTime``, the
condition re-asserted), then writes the Events that are due.

``lastTransitionTime`` changes only when the status does (a new reason or message keeps it,
so a remediator's "False for 10 minutes" is not reset by a second fault); at start the stored
condition is read once and its time kept when the status is the same (an agent restart does
not restart the clock).

The API server unreachable or refusing never stops the agent and never piles up: the thread
waits with capped exponential backoff (:class:`agent.retry.Backoff`), logs each failure once
per change of reason and the recovery once (:class:`agent.retry.Outage`); meanwhile the
condition is only ever the newest derived state and the Events only counts, so the first
write after the outage is the newest state.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Protocol

from agent.config import Config
from agent.errors import ConfigError
from agent.health import HealthState
from agent.health.faults import CONDITION_TYPE, Occurrence
from agent.health.node_api import DryRunNodeApi, KubeNodeApi, NodeApi
from agent.health.node_condition import ConditionState, derive_condition
from agent.health.node_events import MAX_EVENTS, EventBook, PendingEvent, rfc3339
from agent.kube import ApiCallError, CoreObjects, api_client
from agent.records import Gpu
from agent.retry import Backoff, Outage
from agent.worker import Worker

log = logging.getLogger(__name__)

__all__ = ["CONDITION_MIN_INTERVAL_S", "HEARTBEAT_S", "NodeHealthPublisher", "NodeHealthReports"]

CONDITION_MIN_INTERVAL_S = 0.5
#: the condition is written at least this often (its lastHeartbeatTime), as
#: node-problem-detector re-asserts its conditions
HEARTBEAT_S = 300.0
#: at most this long the first write waits for the health sources' start-up read
SETTLE_WAIT_S = 10.0
_BACKOFF = (1.0, 60.0)


class NodeHealthReports(Protocol):
    """Where the publisher reports (the agent's metrics)."""

    def node_condition(self, status: str, reason: str) -> None: ...

    def node_write(self, kind: str, ok: bool) -> None: ...


class NodeHealthPublisher(Worker):
    """Writes ``state``'s condition and Events for ``node`` through ``api``; ``gpus`` (index ->
    Gpu) names the GPUs in messages."""

    thread_name = "node-health"

    def __init__(self, api: NodeApi, state: HealthState, node: str, gpus: Mapping[int, Gpu], *,
                 reports: NodeHealthReports | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.api = api
        self.state = state
        self.node = node
        self.gpus = dict(gpus)
        self.reports = reports
        self._clock = clock
        self._wall = wall
        self.book = EventBook(node, gpus, clock=clock, wall=wall)
        self._stale = True
        self._read_back = False
        self._stored: dict[str, Any] | None = None  # the condition on the server at start
        self._written: ConditionState | None = None
        self._desired = ConditionState("Unknown", "", "")
        self._written_at = 0.0
        self._transition = ""
        self._retry_at = 0.0
        self._settle_by = 0.0
        self._backoff = Backoff(*_BACKOFF)
        self._outage = Outage(log, f"writing the {CONDITION_TYPE} condition and Events of Node {node}",
                              per_reason=True)
        self._said_dropped = False
        state.add_listener(self._on_change)
        state.add_occurrence_listener(self._on_occurrence)

    @classmethod
    def from_config(cls, config: Config, state: HealthState, gpus: Mapping[int, Gpu],
                    reports: NodeHealthReports | None = None) -> NodeHealthPublisher | None:
        """The publisher ``health.nodeCondition`` asks for: None when ``off``, or ``auto`` where no
        node name or no API server is configured (said once); ``dry-run`` logs what it would
        write. ``on`` without a node name or an API client is a ConfigError (exit 2)."""
        mode = config.node_condition
        if mode == "off":
            return None
        if not config.node_name:
            if mode == "auto":
                log.info("no node name (NODE_NAME): the %s condition and Events are not written", CONDITION_TYPE)
                return None
            raise ConfigError(f"health.nodeCondition {mode} needs the node name: set --node-name or NODE_NAME")
        if mode == "dry-run":
            log.info("health.nodeCondition dry-run: the %s condition and Events are logged, not written",
                     CONDITION_TYPE)
            return cls(DryRunNodeApi(), state, config.node_name, gpus, reports=reports)
        try:
            client = api_client(config)
        except ConfigError as exc:
            if mode == "on":
                raise ConfigError(f"health.nodeCondition on: {exc}") from None
            log.info("no API server configured: the %s condition and Events are not written", CONDITION_TYPE)
            return None
        return cls(KubeNodeApi(CoreObjects(lambda: client)), state, config.node_name, gpus, reports=reports)

    # ------------------------------------------------------------------ listeners (other threads)
    def _on_change(self) -> None:
        self._stale = True
        self.wake()

    def _on_occurrence(self, occurrence: Occurrence) -> None:
        if self.book.add(occurrence):
            self.wake()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.is_set():
            wait_s = self.round()
            self._nap(wait_s)

    def round(self) -> float:
        """Write what is due; the seconds until something else will be."""
        now = self._clock()
        if not self.state.settled.is_set():
            # the start-up read first (a fault of the kernel log since boot would otherwise be
            # written True, then False); a watcher that never settles does not hold it long
            self._settle_by = self._settle_by or now + SETTLE_WAIT_S
            if now < self._settle_by:
                return min(0.2, self._settle_by - now)
        if now < self._retry_at:
            return self._retry_at - now
        try:
            if not self._read_back:
                self._stored = next((c for c in self.api.read_conditions(self.node)
                                     if c.get("type") == CONDITION_TYPE), None)
                self._read_back = True
            condition_due = self._write_condition(now)
            self._write_events()
        except ApiCallError as exc:
            delay = self._backoff.next()
            self._retry_at = self._clock() + delay
            self._outage.failed(str(exc), key=exc.state)
            return delay
        self._backoff.reset()
        self._outage.recovered()
        if self.book.dropped and not self._said_dropped:
            self._said_dropped = True
            log.warning("Node Events: %d occurrences dropped (more than %d Events unwritten at once)",
                        self.book.dropped, MAX_EVENTS)
        return min(condition_due, self.book.next_due_s())

    def _write_condition(self, now: float) -> float:
        """Write the condition when due; the seconds until it is due again."""
        if self._stale or self._written is None:
            self._stale = False
            self._desired = derive_condition(self.state.faults(), self.state.watching(), self.gpus)
            if self.reports is not None:
                self.reports.node_condition(self._desired.status, self._desired.reason)
        desired = self._desired
        since = now - self._written_at
        if desired == self._written and since < HEARTBEAT_S:
            return HEARTBEAT_S - since
        # a new status is written at once; a new reason or message at most so often
        if self._written is not None and self._written.status == desired.status and since < CONDITION_MIN_INTERVAL_S:
            return CONDITION_MIN_INTERVAL_S - since
        stamp = rfc3339(self._wall())
        before = self._written or self._stored_state()
        if before is not None and before.status == desired.status:
            transition = self._transition or str((self._stored or {}).get("lastTransitionTime") or stamp)
        else:
            transition = stamp
        condition = {"type": CONDITION_TYPE, "status": desired.status, "reason": desired.reason,
                     "message": desired.message, "lastHeartbeatTime": stamp, "lastTransitionTime": transition}
        try:
            self.api.patch_condition(self.node, condition)
        except ApiCallError:
            self._report("condition", False)
            raise
        self._report("condition", True)
        if self._written != desired:
            log.log(logging.INFO if desired.status == "True" else logging.WARNING,
                    "Node %s condition %s=%s (%s): %s", self.node, CONDITION_TYPE, desired.status, desired.reason,
                    desired.message)
        self._written, self._written_at, self._transition = desired, self._clock(), transition
        return HEARTBEAT_S

    def _stored_state(self) -> ConditionState | None:
        stored = self._stored
        if stored is None:
            return None
        return ConditionState(str(stored.get("status")), str(stored.get("reason")), str(stored.get("message")))

    def _write_events(self) -> None:
        due = self.book.due()
        for i, (entry, taken) in enumerate(due):
            try:
                self._write_event(entry, taken)
            except ApiCallError:
                self._report("event", False)
                for later, count in due[i:]:
                    self.book.undo(later, count)
                raise
            self._report("event", True)

    def _write_event(self, entry: PendingEvent, taken: int) -> None:
        total = entry.written + taken
        if entry.created and self.api.patch_event(entry.name, self.book.patch(entry, total)):
            self.book.done(entry, total)
            return
        try:
            self.api.create_event(self.book.body(entry, total))
        except ApiCallError as exc:
            if exc.status != 409:
                raise
            # written before this agent started (the same stable name): go on counting it
            existing = self.api.read_event(entry.name) or {}
            total = int(existing.get("count") or 1) + taken
            self.api.patch_event(entry.name, self.book.patch(entry, total))
        self.book.done(entry, total)

    def _report(self, kind: str, ok: bool) -> None:
        if self.reports is not None:
            self.reports.node_write(kind, ok)
