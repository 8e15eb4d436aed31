"""Keeps the node's labels published: written at start and after every re-read of the
topology, re-asserted every ``config.label_interval_s`` (a file deleted or edited behind the
agent's back, or a removed features directory, comes back), withdrawn on a clean stop.

A failed write, whichever the sink, is counted (``count_error``: the agent's
``gpu_agent_label_write_errors_total``), makes :meth:`LabelPublisher.ready` False until a
write succeeds, and is tried again with capped exponential backoff (``RETRY_INITIAL_S``
doubling up to ``RETRY_MAX_S``, never later than the interval), so the node is ready again
within seconds of the API server or the directory working again; after a write that works
the interval resumes. A feature file that cannot be written is logged here once per outage
and the recovery once (:class:`agent.retry.Outage`); the NodeFeature sink says its API-server
failures itself, once per change of state, and raises :class:`agent.errors.LabelWriteError`.
Called from the daemon's main thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from agent.config import Config
from agent.errors import LabelWriteError
from agent.labels import compute_labels
from agent.labels.gfd import TIMESTAMP_LABEL
from agent.labels.sinks import LabelSink
from agent.retry import Backoff, Outage
from agent.topology.model import Topology

log = logging.getLogger(__name__)

#: Seconds before a failed label write is tried again the first time; doubled after each
#: failure up to ``RETRY_MAX_S`` (and never more than the label interval).
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 16.0


#: What the outage lines of a failed label write say about what happens next.
RETRYING = f"not ready; retrying in {RETRY_INITIAL_S:g} s, doubling up to {RETRY_MAX_S:g} s"


class LabelPublisher:
    """Publishes ``compute_labels(topology, config)`` to ``sink``.

    ``count_error`` is called once per failed write (an OSError or a LabelWriteError from
    the sink). ``clock`` (monotonic seconds) times the
    re-assertion; ``wall_clock`` stamps GFD's timestamp label.
    """

    def __init__(
        self,
        sink: LabelSink,
        *,
        count_error: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self._count_error = count_error
        self._clock = clock
        self._wall_clock = wall_clock
        self._served: tuple[Topology, Config] | None = None
        # a write this publisher failed: said once, the recovery once
        self._outage = Outage(log, f"writing labels to {sink.where}", level=logging.ERROR,
                              recovered_level=logging.WARNING, retrying=RETRYING)
        # the last write failed in the sink, which said why itself (readiness only, no log line)
        self._sink_failing = False
        self._retry = Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
        self._logged: dict[str, str] = {}  # the labels last reported in the log
        #: when the next re-assertion is due (``clock`` seconds); infinite before the first write
        self.due_s = float("inf")

    def publish(self, topology: Topology, config: Config) -> None:
        """Write the labels of (topology, config) now, and re-assert them from now on."""
        self._served = (topology, config)
        now = self._clock()
        self.due_s = now + config.label_interval_s
        labels = compute_labels(topology, config, self._wall_clock())
        try:
            changed = self.sink.write(labels)
        except LabelWriteError:  # the sink said why
            self._sink_failing = True
            self._failed(now, config)
            return
        except OSError as exc:
            self._outage.failed(str(exc.strerror or exc))
            self._failed(now, config)
            return
        self._retry.reset()
        if changed:
            # GFD's timestamp moves with every write: say so only when a label changed
            facts = {k: v for k, v in labels.items() if k != TIMESTAMP_LABEL}
            if facts != self._logged:
                log.info("labels written to %s", self.sink.where)
                self._logged = facts
        self._outage.recovered()
        self._sink_failing = False

    def _failed(self, now: float, config: Config) -> None:
        """Count a failed write and try again after the next backoff delay."""
        self._count_error()
        delay_s = min(self._retry.next(), config.label_interval_s)
        self.due_s = now + delay_s
        log.debug("labels: next write in %.1f s", delay_s)

    def maintain(self) -> None:
        """Re-assert the labels last published once ``label_interval_s`` has passed (after a
        failed write: once its backoff delay has)."""
        if self._served is not None and self._clock() >= self.due_s:
            self.publish(*self._served)

    def ready(self) -> bool:
        """False while the last write failed."""
        return not (self._outage.failing or self._sink_failing)

    def withdraw(self) -> None:
        """A clean stop withdraws the labels (NFD drops them from the node); nothing if none
        were published."""
        if self._served is not None:
            self.sink.remove()
