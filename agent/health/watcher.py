"""The health watcher: the one thread that turns what the sources say into faults.

Sources: NVML events (``backend.wait_events``: XIDs, double-bit ECC, lost GPUs), the kernel
log (:class:`agent.health.kernel_log.KernelLogReader`'s inbox: NVRM ``Xid``, NVSwitch
``SXid`` and GPU-initialisation lines), and the watched facts (``facts()``, polled every
``facts_interval_s``: the complete set of their faults now). The XID catalog
(:class:`agent.health.xid_catalog.XidCatalog`) says what an XID is:

- a fatal class: a standing fault ``xid-<n>/gpu-<i>`` (one per XID and GPU, whatever the
  number of lines), its GPU marked unhealthy for the kubelet sides;
- an application XID: an occurrence only, unless it comes ``config.repeated_xid_count``
  times on one GPU within ``config.repeated_xid_window_s``: then a ``RepeatedApplicationXID``
  fault ``repeated-xid-<n>/gpu-<i>``;
- informational: an occurrence only.

An XID in the device plugin's ignore list (``health.ignoredXids``, ``DP_DISABLE_HEALTHCHECKS``)
is never a fault by itself: it is treated as an application XID. The same XID on the same GPU
from NVML and from the kernel log within :data:`DEDUP_WINDOW_S` is one occurrence.

Faults clear on evidence: the quiet period (``config.health_recovery_s`` without a new
occurrence, the GPUs answering ``backend.probe``), the driver initialising the GPU again (a
reset), XID 154 naming no recovery action any more, or a new boot (the state file, see
:mod:`agent.health.persist`, is of another boot). If the watcher itself fails it *fences*:
every GPU is marked unhealthy, the state says it cannot watch, and an error is logged.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Iterable, Mapping

from agent.config import Config, is_critical_xid
from agent.health.book import FaultBook
from agent.health.faults import Fault, FaultClass, Occurrence, Watching
from agent.health.kernel_log import Inbox, KernelEvent, KernelLogReader
from agent.health.persist import SavedHealth, StateFile
from agent.health.state import HealthState
from agent.health.xid_catalog import XidCatalog, recovery_action_of
from agent.hw.protocols import EventSource, HealthEvent
from agent.worker import Worker

__all__ = ["DEDUP_WINDOW_S", "HealthWatcher"]

log = logging.getLogger(__name__)

#: the same XID on the same GPU from NVML and the kernel log within this is one occurrence
DEDUP_WINDOW_S = 10.0
#: an application XID's occurrences are logged at most this often per XID and GPU
_SAY_EVERY_S = 60.0
_SAVE_EVERY_S = 5.0
_REPEATED_ACTION = ("Run diagnostics on the GPU (dcgmi diag); reset it if they pass: NVIDIA's catalog says"
                    " repeats on one GPU may be hardware.")
_SXID_ACTION = "Reset the GPUs and NVSwitches of the fabric (NVSwitch fatal error); reboot if it persists."
#: (gpu or -1, xid) of a line from the kernel log
_Origin = tuple[int, int]


class HealthWatcher(Worker):
    """See the module docstring. ``bus_ids`` maps a GPU's ``(domain, bus, device)`` to its
    index (the kernel log names GPUs by bus ID); ``kernel_log`` is started and stopped with
    the watcher; ``state_file`` keeps faults across restarts (None: nothing kept);
    ``facts() -> faults`` is the watched facts' poll (None: none). ``config`` may be
    replaced (SIGHUP) by assigning the attribute; ``clock`` is monotonic, ``wall`` wall-clock."""

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
        wall: Callable[[], float] = time.time,
        on_xid: Callable[[int, int], None] | None = None,
        bus_ids: Mapping[tuple[int, int, int], int] | None = None,
        kernel_log: KernelLogReader | None = None,
        state_file: StateFile | None = None,
        facts: Callable[[], Iterable[Fault]] | None = None,
        facts_interval_s: float = 30.0,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.on_xid = on_xid  # (gpu_index, xid), every XID occurrence: the last-XID gauge
        self.state = state
        self.config = config
        self.poll_ms = poll_ms
        self.retry_s = retry_s
        self._clock = clock
        self.book = FaultBook(state, clock, wall)
        self.catalog = XidCatalog(dict(config.xid_overrides))
        self._overrides = config.xid_overrides
        self.bus_ids = dict(bus_ids or {})
        self.kernel_log = kernel_log
        self.inbox = kernel_log.inbox if kernel_log is not None else Inbox()
        self.state_file = state_file
        self.facts = facts
        self.facts_interval_s = facts_interval_s
        self._facts_at: float | None = None
        self._said_facts = False
        self.fenced = False  # public state (the GPUs are fenced), its loud wording its own
        self._nvml_failed = False
        self._seen_lost: set[int] = set()
        # (gpu, xid) -> source -> [time, count] not yet matched by the other source
        self._unmatched: dict[_Origin, dict[str, list[float]]] = {}
        self._repeats: dict[_Origin, deque[float]] = {}  # application XIDs' recent times
        self._said: dict[_Origin, float] = {}
        self._saved: SavedHealth = SavedHealth()
        self._saved_at = clock()
        self._dropped = 0
        for gpu, reason in sorted(state.snapshot().items()):  # lost at discovery
            self.book.seen(self._lost_fault(gpu, reason), "nvml")
        self._restore()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        super().start()
        if self.kernel_log is not None:
            self.kernel_log.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.kernel_log is not None:
            self.kernel_log.stop(timeout_s)
        super().stop(timeout_s)
        self._save(self._read_through() if self.kernel_log is not None and not self.kernel_log.alive() else None,
                   force=True)

    def _restore(self) -> None:
        if self.state_file is None:
            return
        self._saved = self.state_file.load()
        # another boot's file says faults this boot does not have: the first round writes this boot's
        self.book.changed = self.book.changed or self.state_file.outdated
        for fault in self._saved.faults:
            self.book.restore(fault, quiet=not fault.key.startswith("recovery-action/"))
        self.book.show_marks()
        if self.kernel_log is not None:
            saved = self._saved
            self.kernel_log.resume = lambda stream: saved.position if stream and stream == saved.stream else -1

    def _read_through(self) -> tuple[str, int]:
        """The kernel log's stream and the last position its reader has read."""
        if self.kernel_log is None:
            return "", -1
        return self.kernel_log.stream, self.kernel_log.position

    def _save(self, read_through: tuple[str, int] | None = None, force: bool = False) -> None:
        """Save the faults (when they changed) and how far the kernel log was handled (every
        few seconds); ``read_through``: read before the inbox was last drained."""
        if self.state_file is None:
            return
        stream, position = read_through if read_through is not None else (self._saved.stream, self._saved.position)
        due = self._clock() - self._saved_at >= _SAVE_EVERY_S and (stream, position) != (
            self._saved.stream, self._saved.position)
        if not (force or self.book.changed or due):
            return
        self._saved = SavedHealth(self.book.saved_faults(), stream, position)
        self._saved_at = self._clock()
        if self.state_file.save(self._saved):
            self.book.changed = False

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
        self.state.set_watching(Watching.NVML_UNAVAILABLE if self._nvml_failed else Watching.WATCHER_FAILED)
        self.state.fence(f"health watcher failed: {exc}")
        self.book.fenced_at = self._clock()

    def step(self) -> None:
        """One round: the kernel log's lines, NVML's events (waiting up to ``poll_ms``), the
        facts when due, then recovery. Exceptions propagate (the thread fences on them)."""
        if self.config.xid_overrides != self._overrides:  # a reload changed them
            self.catalog, self._overrides = XidCatalog(dict(self.config.xid_overrides)), self.config.xid_overrides
        read_through = self._read_through()
        # every line there was at start is in the inbox once the reader caught up: after this
        # round the state holds what the sources knew at start (the Node's first write waits)
        settled = self.kernel_log is None or self.kernel_log.caught_up.is_set()
        self.apply_kernel_log(self.inbox.drain())
        self._nvml_failed = True
        events = self.backend.wait_events(self.poll_ms)
        self._nvml_failed = False
        if self.fenced:
            log.warning("health watcher is receiving events again; GPUs recover after %.0f s quiet",
                        self.config.health_recovery_s)
            self.fenced = False
        self.state.set_watching(Watching.YES)
        self.apply(events)
        self._check_lost()
        self._poll_facts()
        self.book.recover(self.config.health_recovery_s, self.backend.probe)
        self.book.show_marks()
        if settled:
            self.state.settled.set()
        if self.inbox.dropped != self._dropped:
            log.warning("kernel log: %d line(s) dropped in a storm of distinct lines (inbox full)",
                        self.inbox.dropped - self._dropped)
            self._dropped = self.inbox.dropped
        self._save(read_through)

    def _poll_facts(self) -> None:
        if self.facts is None:
            return
        now = self._clock()
        if self._facts_at is not None and now - self._facts_at < self.facts_interval_s:
            return
        self._facts_at = now
        try:
            found = list(self.facts())
        except Exception as exc:  # noqa: BLE001 - a failing fact check keeps the last answer
            if not self._said_facts:
                log.exception("watched facts check failed (said once; keeping its last faults): %s", exc)
                self._said_facts = True
            return
        self._said_facts = False
        self.book.set_facts(found)

    def _check_lost(self) -> None:
        """GPUs the backend found lost on any call are lost too; each newly lost one once."""
        lost = set(self.backend.lost_gpus)
        for index in sorted(lost - self._seen_lost):
            if 0 <= index < self.state.gpu_count:
                self.book.seen(self._lost_fault(index, "GPU lost (NVML answered GPU_IS_LOST)"), "nvml")
        self._seen_lost = lost

    @staticmethod
    def _lost_fault(gpu: int, detail: str) -> Fault:
        return Fault(f"lost/gpu-{gpu}", FaultClass.GPU_LOST, (gpu,),
                     "Reboot the node if the GPU does not answer again.", detail)

    # ------------------------------------------------------------------ NVML
    def apply(self, events: Iterable[HealthEvent]) -> None:
        """NVML's events, aggregated (one per GPU, kind and XID) before they are applied."""
        counts: dict[tuple[int, str, int | None], int] = {}
        for event in events:
            key = (event.gpu_index, event.kind, event.xid)
            counts[key] = counts.get(key, 0) + 1
        for (gpu, kind, xid), count in counts.items():
            if kind == "xid" and xid is not None:
                self.xid_seen(gpu, xid, "", "nvml", count)
            elif kind == "ecc_dbe":
                self.book.seen(Fault(f"ecc-dbe/gpu-{gpu}", FaultClass.MEMORY_ERROR, (gpu,), "Reset the GPU.",
                                     "double-bit ECC error (NVML)"), "nvml", count)
            elif kind == "lost":
                self.book.seen(self._lost_fault(gpu, "GPU lost (NVML)"), "nvml", count)

    # ------------------------------------------------------------------ the kernel log
    def apply_kernel_log(self, entries: Iterable[tuple[KernelEvent, int, int | None]]) -> None:
        for event, count, _position in entries:
            gpu = self.bus_ids.get(event.pci, -1)
            bus = "%04x:%02x:%02x" % event.pci
            if event.kind == "gpu-init":
                if gpu >= 0:
                    self.book.clear_gpu(gpu, f"the driver initialised GPU {gpu} ({bus}) again: a reset")
            elif event.kind == "sxid":
                self._sxid_seen(event, bus, count)
            else:
                self.xid_seen(gpu, event.code, event.text, "kernel-log", count, bus=bus)

    def _sxid_seen(self, event: KernelEvent, bus: str, count: int) -> None:
        fatal = event.text.lower().startswith("fatal")
        detail = f"SXid {event.code} on {event.device} ({bus}): {event.text}"[:300]
        fault = Fault(f"sxid-{event.code}/{event.device}", FaultClass.GPU_RESET_REQUIRED if fatal else
                      FaultClass.INFORMATIONAL, (), _SXID_ACTION if fatal else "None.", detail)
        if fatal:
            self.book.seen(fault, "kernel-log", count)
        else:
            self._occurrence(fault, "kernel-log", count, (-1, event.code))

    # ------------------------------------------------------------------ XIDs, either source
    def xid_seen(self, gpu: int, xid: int, text: str, source: str, count: int = 1, *, bus: str = "") -> None:
        """XID ``xid`` on GPU ``gpu`` (-1: a bus ID that is no GPU of this agent's, named by
        ``bus``) ``count`` times, with its line's ``text``."""
        count = self._not_duplicate(gpu, xid, source, count)
        if count == 0:
            return
        if gpu >= 0 and self.on_xid is not None:
            try:
                self.on_xid(gpu, xid)
            except Exception:  # metrics must never break health
                log.exception("XID hook failed")
        rule = self.catalog.rule(xid, text)
        cls, action = rule.cls, rule.action
        critical = is_critical_xid(self.config, xid)
        if xid in self.config.extra_critical_xids and not cls.fatal:
            cls, action = FaultClass.GPU_RESET_REQUIRED, "Reset the GPU (a configured critical XID)."
        elif not critical and cls.fatal:
            cls = FaultClass.APPLICATION  # the ignore list: never a fault by itself
        gpus = (gpu,) if gpu >= 0 else ()
        where = f"gpu-{gpu}" if gpu >= 0 else f"pci-{bus}"
        name = f"XID {xid}" + (f" ({rule.mnemonic})" if rule.mnemonic else "")
        detail = (f"{name} on {bus or f'GPU {gpu}'}" + (f": {text}" if text else ""))[:300]
        if xid == 154 and gpu >= 0:
            key = f"recovery-action/gpu-{gpu}"
            if recovery_action_of(text) == 0 and self.book.get(key) is not None:
                self.book.clear(key, "the driver requires no recovery action any more")
                return
            fault = Fault(key, cls, gpus, action, detail, xid)
            if cls.fatal:
                self.book.seen(fault, source, count, quiet=False)
            else:
                self._occurrence(fault, source, count, (gpu, xid))
            return
        fault = Fault(f"xid-{xid}/{where}", cls, gpus, action, detail, xid)
        if cls.fatal:
            self.book.seen(fault, source, count)
            return
        self._occurrence(fault, source, count, (gpu, xid))
        if cls == FaultClass.APPLICATION and gpu >= 0:
            self._count_repeat(gpu, xid, count, detail, source)

    def _occurrence(self, fault: Fault, source: str, count: int, origin: _Origin) -> None:
        """An occurrence that is no fault: recorded; logged at most once a minute per XID and GPU."""
        now = self._clock()
        self.state.record(Occurrence(fault.key, fault.cls, fault.gpus, fault.detail, fault.action, fault.xid,
                                     at=time.time(), source=source, count=count))
        said = self._said.get(origin)
        if said is None or now - said >= _SAY_EVERY_S:
            self._said[origin] = now
            log.info("%s (%s; not a fault by itself)", fault.detail, fault.cls.value)

    def _count_repeat(self, gpu: int, xid: int, count: int, detail: str, source: str) -> None:
        threshold = self.config.repeated_xid_count
        times = self._repeats.get((gpu, xid))
        if times is None or times.maxlen != threshold:
            times = self._repeats[(gpu, xid)] = deque(times or (), maxlen=threshold)
        now = self._clock()
        for _ in range(min(count, threshold)):
            times.append(now)
        key = f"repeated-xid-{xid}/gpu-{gpu}"
        if len(times) == threshold and now - times[0] <= self.config.repeated_xid_window_s:
            window_h = self.config.repeated_xid_window_s / 3600
            said = f"XID {xid} {threshold} times within {window_h:g} h on GPU {gpu}; last: {detail}"
            fault = Fault(key, FaultClass.REPEATED_APPLICATION_XID, (gpu,), _REPEATED_ACTION, said[:300], xid)
            self.book.seen(fault, source, 1)

    def _not_duplicate(self, gpu: int, xid: int, source: str, count: int) -> int:
        """How many of ``count`` occurrences from ``source`` the other source has not
        already reported within :data:`DEDUP_WINDOW_S`."""
        now = self._clock()
        sources = self._unmatched.setdefault((gpu, xid), {})
        for other, entry in sources.items():
            if other == source or now - entry[0] > DEDUP_WINDOW_S or entry[1] <= 0:
                continue
            matched = min(count, int(entry[1]))
            entry[1] -= matched
            count -= matched
        if count > 0:
            mine = sources.setdefault(source, [now, 0])
            if now - mine[0] > DEDUP_WINDOW_S:
                mine[1] = 0
            mine[0], mine[1] = now, min(mine[1] + count, 1_000_000)
        return count
