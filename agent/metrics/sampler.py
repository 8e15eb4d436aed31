"""The one thread that polls the GPUs, and the immutable snapshot it publishes.

``Sampler.sample_once()`` reads every GPU through a :class:`~agent.hw.protocols.SampleSource`
(the NVML backend's ``sample_source()``), maps each :class:`~agent.hw.protocols.GpuSample` to
dcgm-exporter's metrics (:func:`~agent.metrics.fields.dcgm_values`), maps the GPUs'
processes to pods (:class:`~agent.attribution.pod_processes.PodProcesses`, when given) and
replaces ``Sampler.snapshot`` with a new :class:`Snapshot` (a single reference assignment, so
readers never see half a round and never take a lock). Scrapes only read ``snapshot``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from agent.attribution import ContainerRef
from agent.attribution.pod_processes import PodProcesses, PodUse
from agent.hw.protocols import ProcessSample, SampleSource
from agent.metrics.fields import XID_METRIC, dcgm_values
from agent.topology.model import Topology
from agent.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """One sampling round. ``gpus[index]`` maps metric name -> value; a GPU or field that
    could not be read is simply absent. ``last_busy_at[index]`` is the wall-clock time
    (``time.time()``) the GPU's utilisation was last seen above the idle threshold (the
    sampler's start when never). ``pods[index]`` is the use of each container with processes
    on the GPU (absent: its processes could not be read, or no pod mapping is configured);
    ``pod_busy_at[(container, index)]`` when that container's SM utilisation on the GPU was
    last above the idle threshold (never: absent; ``NO_POD`` for processes of no pod);
    ``pod_utilization`` the GPUs whose per-process utilisation NVML gave this round."""

    taken_at: float = 0.0
    duration_s: float = 0.0
    gpus: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    last_busy_at: Mapping[int, float] = field(default_factory=dict)
    rounds: int = 0
    pods: Mapping[int, tuple[PodUse, ...]] = field(default_factory=dict)
    pod_busy_at: Mapping[tuple[ContainerRef, int], float] = field(default_factory=dict)
    pod_utilization: frozenset[int] = frozenset()


EMPTY_SNAPSHOT = Snapshot()

#: Most (container, GPU) last-busy times kept; beyond it the oldest go (long-gone pods).
MAX_POD_BUSY_ENTRIES = 4096


class Sampler(Worker):
    """Polls ``source`` every ``interval_s`` on its own thread (``start``/``stop``); each
    round is one ``sample_once``. ``stop`` closes the source (and ``pods``)."""

    thread_name = "metrics-sampler"

    def __init__(
        self,
        source: SampleSource,
        topology: Topology,
        *,
        interval_s: float,
        idle_threshold_pct: float = 5.0,
        clock: Callable[[], float] = time.time,
        on_round: Callable[[Snapshot], None] | None = None,
        pods: PodProcesses | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"sample interval must be > 0 s, got {interval_s}")
        self.source = source
        self.pods = pods
        self.topology = topology
        self.interval_s = interval_s
        self.idle_threshold_pct = idle_threshold_pct
        self.clock = clock
        self.on_round = on_round
        self.snapshot: Snapshot = EMPTY_SNAPSHOT
        self._indices = tuple(g.index for g in topology.gpus)
        started = clock()
        # owned by the round in flight (only it reads or writes them; rounds are serialised)
        self._last_busy_at = {g.index: started for g in topology.gpus}
        self._pod_busy_at: dict[tuple[ContainerRef, int], float] = {}
        # Locks: two leaves, never nested, never held across an NVML read, a callback or
        # ``source.close()``. ``_xid_lock`` guards ``_xids`` (the health watcher writes, a
        # round copies). ``_round`` guards only the flags below, which ``stop`` (another
        # thread) and the round in flight share to decide who closes the source. The scrape
        # path takes neither: it reads ``snapshot``, a single reference.
        self._xids: dict[int, int] = {}
        self._xid_lock = threading.Lock()
        self._round = threading.Lock()
        self._in_round = False
        self._close_after_round = False
        super().__init__()

    def record_xid(self, gpu_index: int, xid: int) -> None:
        """Remember the last XID of a GPU (fed by the health watcher's NVML events); shown
        as ``DCGM_FI_DEV_XID_ERRORS`` from the next round."""
        with self._xid_lock:
            self._xids[gpu_index] = int(xid)

    def sample_once(self) -> Snapshot:
        """Read all GPUs now and publish the result; returns the new snapshot. Rounds are
        serialised by their one caller, the sampler's thread; call it directly only where no
        round of that thread can overlap (before ``start``)."""
        with self._round:
            self._in_round = True
        try:
            snap = self._read_round()
            self.snapshot = snap
        finally:
            self._end_round()
        if self.on_round is not None:
            self.on_round(snap)
        return snap

    def _read_round(self) -> Snapshot:
        t0 = time.perf_counter()
        now = self.clock()
        with self._xid_lock:
            xids = dict(self._xids)
        gpus: dict[int, Mapping[str, float]] = {}
        processes: dict[int, tuple[ProcessSample, ...]] = {}
        utilization: set[int] = set()
        for index in self._indices:
            sample = self.source.sample(index)
            if sample is None:
                continue  # lost (the health watcher probes it) or nothing answered
            if sample.processes is not None:
                processes[index] = sample.processes
                if sample.process_utilization:
                    utilization.add(index)
            values = dcgm_values(sample)
            values[XID_METRIC] = float(xids.get(index, 0))
            util = values.get("DCGM_FI_DEV_GPU_UTIL")
            if util is not None and util > self.idle_threshold_pct:
                self._last_busy_at[index] = now
            gpus[index] = MappingProxyType(values)
        pods = self._per_pod(processes, now)
        return Snapshot(
            taken_at=now,
            duration_s=time.perf_counter() - t0,
            gpus=MappingProxyType(gpus),
            last_busy_at=MappingProxyType(dict(self._last_busy_at)),
            rounds=self.snapshot.rounds + 1,
            pods=MappingProxyType(pods),
            pod_busy_at=MappingProxyType(dict(self._pod_busy_at)),
            pod_utilization=frozenset(utilization & pods.keys()),
        )

    def _per_pod(
        self, processes: Mapping[int, tuple[ProcessSample, ...]], now: float
    ) -> dict[int, tuple[PodUse, ...]]:
        """Each GPU's use per container, and the containers' last-busy times updated. A
        failure of the mapping (a bug, an unexpected answer) costs the per-pod view of this
        round only, never the GPU metrics."""
        if self.pods is None or not processes:
            return {}
        try:
            pods = self.pods.per_pod(processes)
        except Exception:
            log.exception("mapping GPU processes to pods failed")
            return {}
        for index, uses in pods.items():
            for use in uses:
                if use.sm_util_pct is not None and use.sm_util_pct > self.idle_threshold_pct:
                    self._pod_busy_at[(use.ref, index)] = now
        if len(self._pod_busy_at) > MAX_POD_BUSY_ENTRIES:
            newest = sorted(self._pod_busy_at.items(), key=lambda kv: kv[1])
            self._pod_busy_at = dict(newest[-MAX_POD_BUSY_ENTRIES:])
        return pods

    def _end_round(self) -> None:
        """Hand the round back. When ``stop`` asked for the source to close while this
        round was reading, it closes here first, still inside the round, so no other round
        reads while the GPM samples are freed."""
        while True:
            with self._round:
                if not self._close_after_round:
                    self._in_round = False
                    return
                self._close_after_round = False
            try:
                self.source.close()
                if self.pods is not None:
                    self.pods.close()
            except Exception:  # stopping goes on; the process is on its way out
                log.exception("closing the metrics sample source failed")

    # ---------------------------------------------------------------- thread
    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waiting up to ``timeout_s``) and close the source. Never waits
        on NVML: when a round is still reading (a hung GPU), that round closes the source
        as soon as its reads return."""
        super().stop(timeout_s)
        with self._round:
            self._close_after_round = True
            if self._in_round:
                return
            self._in_round = True  # this call owns a round now: it closes the source
        self._end_round()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # the sampler must outlive any single bad round
                log.exception("metrics sampling round failed")
            # fixed-rate schedule; after an overrun start the next round at once, not a burst
            next_at = max(next_at + self.interval_s, time.monotonic())
            self._stop.wait(max(0.0, next_at - time.monotonic()))
