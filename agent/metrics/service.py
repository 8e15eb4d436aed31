"""The metrics service: sampler thread + pod-resources cache + HTTP server.

``MetricsService(backend, topology, config, hostname=..., ready=..., agent_metrics=...)``
registers the GPU collector on the registry of the agent's self-metrics (built first and
passed in, never the global registry) and reports its sampling rounds and pod-resources
errors to them. Pod attribution comes from :mod:`agent.attribution`. It serves the registry
through :class:`agent.http.endpoints.HttpEndpoints`:
``/metrics`` on ``config.metrics_address`` (``HOST:PORT``, ``:PORT`` for all interfaces,
``[::1]:PORT``; port 0 picks a free one, see ``.port``), behind the web configuration's TLS
and basic auth when one is given, and the probes on their own listener (``.probe_port``):

- ``/metrics``: Prometheus text format of the latest snapshot; never calls NVML.
- ``/health``: 200 while ``live()`` is True (liveness: the daemon's servers can serve).
- ``/ready``: 200 when ``ready()`` is True (registered with the kubelet, topology read),
  else 503 (readiness).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from agent.attribution.cgroups import CgroupReader
from agent.attribution.holders import (
    Attribution,
    PodResourcesCache,
)
from agent.attribution.pod_processes import ContainerDirectory, PodProcesses
from agent.config import Config
from agent.http.endpoints import HttpEndpoints
from agent.hw.protocols import Telemetry
from agent.kubelet.cri import CriClient
from agent.kubelet.podresources import PodResourcesClient
from agent.metrics.collector import GpuCollector, PlacementScorer, render_text
from agent.metrics.sampler import Sampler, Snapshot
from agent.metrics.self_metrics import AgentMetrics
from agent.metrics.xids import XidCounter
from agent.topology.model import Topology

log = logging.getLogger(__name__)


class MetricsService:
    """Samples the GPUs, attributes them to pods and serves ``/metrics``, ``/health``,
    ``/ready``."""

    def __init__(
        self,
        backend: Telemetry,
        topology: Topology,
        config: Config,
        *,
        hostname: str,
        ready: Callable[[], bool],
        agent_metrics: AgentMetrics,
        clock: Callable[[], float] = time.time,
        live: Callable[[], bool] = lambda: True,
    ) -> None:
        self.backend = backend
        self.topology = topology
        self.config = config
        self.hostname = hostname
        self.ready = ready
        self.live = live
        self.agent_metrics = agent_metrics
        self.registry = agent_metrics.registry
        # GPU processes -> pods: the cgroups under the host's /proc, the runtime's CRI
        pod_processes = PodProcesses(CgroupReader(config.proc_root),
                                     ContainerDirectory(CriClient(config.cri_socket)))
        self.sampler = Sampler(
            backend.sample_source(), topology,
            interval_s=config.sample_interval_s,
            idle_threshold_pct=config.idle_utilization_threshold_pct,
            clock=clock, on_round=self._on_round, pods=pod_processes,
        )
        self.scorer = PlacementScorer(topology)
        self.collector = GpuCollector(
            topology, hostname=hostname,
            snapshot=lambda: self.sampler.snapshot,
            attribution=lambda: self.pod_resources.current,
            scorer=self.scorer, clock=clock,
        )
        self.registry.register(self.collector)
        self.xid_counter = XidCounter(topology, hostname)
        self.registry.register(self.xid_counter)
        self.pod_resources = PodResourcesCache(
            PodResourcesClient(config.pod_resources_socket), topology,
            refresh_s=config.pod_resources_refresh_s,
            index_ids=config.device_id_strategy == "index",
            clock=clock,
            on_error=agent_metrics.pod_resources_error,
            on_refresh=self._warm_scores,
        )
        self._http: HttpEndpoints | None = None
        self.port: int | None = None
        self.probe_port: int | None = None

    # ---------------------------------------------------------------- reports
    def record_xid(self, gpu_index: int, xid: int) -> None:
        """The health watcher reports an XID; exported as ``DCGM_FI_DEV_XID_ERRORS``."""
        self.sampler.record_xid(gpu_index, xid)

    def count_xid(self, gpu_index: int, xid: int, times: int) -> None:
        """``times`` occurrences of XID ``xid`` on GPU ``gpu_index``; exported as
        ``DCGM_EXP_XID_ERRORS_TOTAL``."""
        self.xid_counter.count(gpu_index, xid, times)

    def set_topology(self, topology: Topology, config: Config) -> None:
        """What a reload (or a topology read again) changes here: from the next pod-resources
        refresh on, the device IDs the kubelet reports map to GPUs by ``config``'s
        ``deviceIDStrategy`` and ``topology``'s device UUIDs (MIG devices included). The
        sampler and the collector keep the GPUs read at start: a reload never changes their
        count (the daemon keeps the old topology then)."""
        self.pod_resources.map_ids(topology, index_ids=config.device_id_strategy == "index")

    def _on_round(self, snap: Snapshot) -> None:
        self.agent_metrics.sampling_round(snap.duration_s)

    def _warm_scores(self, attribution: Attribution) -> None:
        # best scores are computed here, on the refresh thread, so no scrape pays for them
        for gpus in attribution.containers.values():
            self.scorer.best_score(len(gpus))

    def render(self) -> bytes:
        """The ``/metrics`` body: ``render_text(self.registry)`` (the GPU families' text is
        reused from the previous scrape while the snapshot and attribution are unchanged)."""
        return render_text(self.registry)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Bind the metrics and probe listeners (raises ValueError for a bad address, OSError
        when a port is taken, ConfigError for a bad web configuration), then start sampling
        and pod attribution."""
        self._http = HttpEndpoints(self.config, self.render, self.ready, self.live)
        self._http.start()
        self.port, self.probe_port = self._http.port, self._http.probe_port
        self.sampler.start()
        self.pod_resources.start()
        log.info("%s", self._http.describe())

    def stop(self) -> None:
        """Stop serving and sampling; idempotent."""
        if self._http is not None:
            self._http.stop()
            self._http = None
        self.pod_resources.stop()
        self.sampler.stop()

