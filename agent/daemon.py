"""``gpu-topology-agent run``: the node agent's lifecycle, and nothing else.

The collaborators are built first and passed in (:meth:`Daemon.from_config` builds the real
ones): the agent's own metrics before anything that reports to them, then factories for what
needs the topology read at start: the mode's servers, the metrics service, the health
watcher. The daemon runs "the servers" through one small interface
(:class:`agent.modes.Servers`: start, ready, live, set_topology, stop) without knowing which mode
they serve.

Start order: the effective configuration; NVML (real or simulated); topology; the servers
(registration in the background); labels; metrics service; health watcher; the Node health
publisher (``GPUHealthy`` condition, Events), after the sources' start-up read: never a blind True. Readiness
(``/ready``) = the topology is read, the servers are ready (every resource registered with
the running kubelet; in DRA mode the plugin registered and the slices published) and the
last label write worked. Liveness (``/health``) = the servers can serve: a socket that could
not be served for a while is a pod to restart, not one to leave unready forever.

Signals only set flags; the main thread does the work. SIGHUP and a kubelet restart take one
path (:meth:`Daemon.reread`): read the topology again and hand it to the servers, the
metrics and the labels (SIGHUP with the configuration read again). SIGTERM/SIGINT shut down in a fixed order
(servers, watcher, metrics, labels, NVML) within ``SHUTDOWN_BUDGET_S``, with a hard
backstop; a second SIGTERM/SIGINT exits at once.

Per-node configs (``--config-file-srcdir``): the node's label is followed from the start
(:class:`agent.nodeconfig.NodeConfigSelector`); the config it names is the one started with
when it is read within ``NODE_LABEL_WAIT_S``, and a new one takes the SIGHUP path.

Size: above 400 lines because it is the one place where every collaborator's start, reload
and stop order is written; each step is a few lines, and splitting them would scatter the
order this module exists to show.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Callable, Protocol

from prometheus_client import CollectorRegistry

from agent.config import Config, describe_config, keep_start_settings
from agent.errors import AgentError
from agent.health import HealthState, HealthWatcher, lost_at_discovery
from agent.health.facts_check import FactsCheck
from agent.health.node_publisher import NodeHealthPublisher
from agent.health.sources import build_watcher, xid_counter
from agent.http.endpoints import WaitingEndpoint
from agent.hw.protocols import EventSource, Lifecycle
from agent.labels.publishing import LabelPublisher
from agent.labels.sinks import label_sink
from agent.logs import setup_logging
from agent.metrics.self_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from agent.modes import Servers, ServersFactory, servers_for
from agent.nodeconfig import NamedConfigs, NodeConfigSelector, NodeLabelWatch
from agent.topology.model import Topology
from agent.topology.reread import merge_reread

log = logging.getLogger(__name__)

#: Seconds the ordered shutdown may take before a backstop exits the process; the
#: DaemonSet's terminationGracePeriodSeconds must stay above it.
SHUTDOWN_BUDGET_S = 20.0
#: Seconds between tries to open NVML when it is missing and failOnInitError is false.
NVML_RETRY_S = 10.0
#: Seconds the servers get to close their streams and calls at shutdown.
SERVERS_GRACE_S = 1.0
#: Seconds the start waits for the node's label (per-node configs) before it goes on with
#: the default config (the label's config follows once it is read).
NODE_LABEL_WAIT_S = 10.0


class DaemonBackend(Lifecycle, EventSource, Protocol):
    """What the daemon needs of the hardware backend (``agent.hw.nvml.backend.NvmlBackend``):
    its lifecycle and the health watcher's events (the topology comes from ``read_topology``)."""


#: (topology, config, ready) -> the metrics service (not yet started).
MetricsFactory = Callable[[Topology, Config, Callable[[], bool]], MetricsService]
#: (health, topology, config) -> the Node health publisher (not yet started; None: none).
NodeHealthFactory = Callable[[HealthState, Topology, Config], NodeHealthPublisher | None]
#: (backend, health, config, on_xid, topology) -> the health watcher (not yet started).
WatcherFactory = Callable[
    [EventSource, HealthState, Config, Callable[[int, int], None] | None, Topology], HealthWatcher
]


def _default_watcher(
    backend: EventSource, health: HealthState, config: Config, on_xid: Callable[[int, int], None] | None,
    topology: Topology,
) -> HealthWatcher:
    return build_watcher(backend, health, config, topology, on_xid=on_xid)


class Daemon:
    """Owns every long-lived part of the agent.

    ``backend`` is the hardware backend (initialised by :meth:`start`); ``read_topology``
    reads the topology from it (at start, SIGHUP and kubelet restarts). ``servers``, ``metrics`` and
    ``watcher`` build the mode's servers, the metrics service (None: no metrics endpoint)
    and the health watcher once the topology is read; ``waiting_endpoint`` serves
    ``/health`` while NVML is awaited (None: nothing). ``labels`` publishes the node labels
    (None: none). ``node_health`` builds the writer of the ``GPUHealthy`` condition and the
    Node's Events (None: none). ``config_loader`` reads the configuration again (SIGHUP). ``node_config``
    follows the node's label choosing its config (None: one config). ``on_close`` runs last
    at shutdown (a simulated machine's clean-up).
    """

    def __init__(
        self,
        config: Config,
        backend: DaemonBackend,
        *,
        servers: ServersFactory,
        read_topology: Callable[[], Topology],
        labels: LabelPublisher | None = None,
        metrics: MetricsFactory | None = None,
        watcher: WatcherFactory = _default_watcher,
        waiting_endpoint: Callable[[Config], WaitingEndpoint] | None = None,
        node_health: NodeHealthFactory | None = None,
        config_loader: Callable[[], Config] | None = None,
        node_config: NodeConfigSelector | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.node_config = node_config
        self.backend = backend
        self._servers_factory = servers
        self._read_topology = read_topology
        self.labels = labels
        self._metrics_factory = metrics
        self._watcher_factory = watcher
        self._waiting_endpoint_factory = waiting_endpoint
        self._node_health_factory = node_health
        self.node_health: NodeHealthPublisher | None = None
        self.config_loader = config_loader
        self._on_close = on_close
        self._nvml_open = False
        self.topology: Topology | None = None
        self.health: HealthState | None = None
        self.servers: Servers | None = None
        self.watcher: HealthWatcher | None = None
        self.metrics: MetricsService | None = None
        # Signal handlers and the servers' kubelet watch only set these and wake the main
        # thread; no lock: each is one assignment, read by the main loop.
        self._wake = threading.Event()
        self._stop_requested = False
        self._reload_requested = False
        self._reread_requested = False
        self._signals = 0

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        simulate: str | None = None,
        config_loader: Callable[[], Config] | None = None,
        load_file: Callable[[str], Config] | None = None,
    ) -> Daemon:
        """The real agent: NVML (or the simulated machine ``simulate``, ``--simulate``),
        the servers of ``config.mode``, the metrics service and the label sink
        ``--labels-sink`` names; with ``config.config_file_srcdir``, the node label's config
        read by ``load_file(path)``. Raises AgentError when the simulated machine cannot be
        opened or the label sink cannot be set up (exit 2)."""
        from agent.discovery import open_backend, read_topology
        from agent.kube import api_client

        sink = label_sink(config)  # before the backend: a bad sink setting opens nothing
        backend, sim = open_backend(simulate, config.sysfs_root)
        hostname = config.node_name or socket.gethostname()
        # the agent's own metrics first: everything built below reports to them from its start
        agent_metrics = AgentMetrics(CollectorRegistry(auto_describe=True), backend)

        def metrics(topology: Topology, cfg: Config, ready: Callable[[], bool]) -> MetricsService:
            if sim is not None:  # the simulated machine's /proc holds its GPU processes
                cfg = dataclasses.replace(cfg, proc_root=sim.proc_root)
            return MetricsService(backend, topology, cfg, hostname=hostname, ready=ready, agent_metrics=agent_metrics,
                                  live=daemon.live)

        node_config = None
        if config.config_file_srcdir and load_file is not None:
            watch = NodeLabelWatch(lambda: api_client(config), config.node_name, config.node_label)
            node_config = NodeConfigSelector(
                NamedConfigs.from_config(config), watch, load_file, agent_metrics,
                active=os.path.basename(config.config_file or ""),
            )
            config_loader = node_config.load_active

        def watcher(backend_: EventSource, health: HealthState, cfg: Config,
                    on_xid: Callable[[int, int], None] | None, topology: Topology) -> HealthWatcher:
            return build_watcher(backend_, health, cfg, topology, on_xid=on_xid, simulated=sim is not None,
                                 facts=FactsCheck.for_topology(backend, topology).standing)

        daemon = cls(
            config, backend,
            servers=servers_for(config.mode, agent_metrics, mig=backend),
            watcher=watcher,
            # the running config's file: a node's own config (config_file_srcdir) may name one
            read_topology=lambda: read_topology(backend, sim, daemon.config.nccl_topology_file),
            labels=LabelPublisher(sink, count_error=agent_metrics.label_write_error),
            metrics=metrics,
            waiting_endpoint=WaitingEndpoint,
            node_health=lambda state, topology, cfg: NodeHealthPublisher.from_config(
                cfg, state, {g.index: g for g in topology.gpus}, agent_metrics),
            config_loader=config_loader,
            node_config=node_config,
            on_close=sim.close if sim is not None else None,
        )
        return daemon

    # ------------------------------------------------------------------ signals
    def _on_stop_signal(self, _signum: int, _frame: object) -> None:
        self._signals += 1
        if self._signals > 1:
            os.write(2, b"gpu-topology-agent: second signal, exiting now\n")
            os._exit(1)
        self._stop_requested = True
        self._wake.set()

    def _on_hup(self, _signum: int, _frame: object) -> None:
        self._reload_requested = True
        self._wake.set()

    def _on_kubelet_restart(self) -> None:
        self._reread_requested = True
        self._wake.set()

    # ------------------------------------------------------------------ readiness
    def ready(self) -> bool:
        servers, labels = self.servers, self.labels
        labelled = labels is None or labels.ready()
        return labelled and self.topology is not None and servers is not None and servers.ready()

    def live(self) -> bool:
        """``/health``: False only when the servers cannot serve and will not recover by
        themselves (:meth:`agent.modes.Servers.live`): the kubelet restarts the pod."""
        servers = self.servers
        return servers is None or servers.live()

    # ------------------------------------------------------------------ start
    def _init_nvml(self) -> bool:
        """Open NVML; False when stopped while waiting for it (failOnInitError false).
        While it waits, the metrics address answers /health (so the kubelet's probes do not
        restart a pod that waits on purpose) and 503 on /ready and /metrics."""
        waiting: WaitingEndpoint | None = None
        try:
            while True:
                try:
                    self.backend.init()
                except AgentError as exc:
                    if self.config.fail_on_init_error:
                        raise
                    log.error(
                        "NVML unavailable (%s); failOnInitError is false: retrying in %.0f s",
                        exc, NVML_RETRY_S,
                    )
                    if waiting is None:
                        waiting = self._start_waiting_endpoint()
                    if self._wait_interruptible(NVML_RETRY_S):
                        return False
                    continue
                self._nvml_open = True
                return True
        finally:
            if waiting is not None:
                waiting.stop()

    def _start_waiting_endpoint(self) -> WaitingEndpoint | None:
        if self._waiting_endpoint_factory is None:
            return None
        endpoint = self._waiting_endpoint_factory(self.config)
        try:
            endpoint.start()
        except OSError as exc:  # the real service reports this at its start; keep waiting
            log.error("cannot serve /health on %s while waiting: %s", self.config.metrics_address, exc.strerror or exc)
            return None
        log.info("while waiting for NVML, /health answers 200, /ready and /metrics 503: %s", endpoint.describe())
        return endpoint

    def _wait_interruptible(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if a stop was requested meanwhile."""
        deadline = time.monotonic() + seconds
        while not self._stop_requested and time.monotonic() < deadline:
            self._wake.wait(min(0.5, deadline - time.monotonic()))
            self._wake.clear()
        return self._stop_requested

    def start(self) -> bool:
        """Bring everything up; False if a stop arrived first. Raises AgentError on
        configuration or NVML problems (exit 2 / 1)."""
        if self.node_config is not None:
            labelled = self.node_config.start(self._wake.set, NODE_LABEL_WAIT_S, lambda: self._stop_requested)
            if labelled is not None:
                self.config = labelled
                setup_logging(labelled)
        log.info("effective configuration: %s", json.dumps(describe_config(self.config), sort_keys=True))
        if self.config.dynamic_mig == "on" and self.config.mode != "dra":
            log.warning("dra.dynamicMig is on, but dynamic MIG needs --mode dra: ignored in %s mode",
                        self.config.mode)
        if not self._init_nvml():
            return False
        topology = self.topology = self._read_topology()
        log.info(
            "topology: %d GPUs from %s, NVLink islands %s, NUMA groups %s",
            topology.gpu_count, topology.source or "nvml",
            [list(i) for i in topology.nvlink_islands],
            {k: list(v) for k, v in topology.numa_groups.items()},
        )
        self.health = HealthState(topology.gpu_count, lost_at_discovery(self.backend))
        # The servers start before the metrics service: registration is what the node waits
        # for (goal: within 2 s of start). Labels come after the sockets: an agent that finds
        # its socket served by another live one exits there, before touching its labels.
        self.servers = self._servers_factory(topology, self.config, self.health, self._on_kubelet_restart)
        self.servers.start()
        if self.labels is not None:
            self.labels.publish(topology, self.config)
        self._start_metrics(topology)
        metrics = self.metrics
        if metrics is not None:
            self.health.add_occurrence_listener(xid_counter(metrics.count_xid))
        self._start_watcher(self.config)
        if self._node_health_factory is not None:
            self.node_health = self._node_health_factory(self.health, topology, self.config)
            if self.node_health is not None:
                self.node_health.start()
        return True

    def _start_metrics(self, topology: Topology) -> None:
        if self._metrics_factory is None:
            return
        service = self._metrics_factory(topology, self.config, self.ready)
        try:
            service.start()
        except OSError as exc:
            service.stop()
            raise AgentError(f"cannot serve metrics on {self.config.metrics_address}: {exc.strerror or exc}") from exc
        self.metrics = service

    def _start_watcher(self, config: Config) -> None:
        assert self.health is not None
        if not config.health_checks_enabled:
            log.warning("health checks are disabled: GPUs are always advertised healthy")
            return
        on_xid = self.metrics.record_xid if self.metrics is not None else None
        assert self.topology is not None
        self.watcher = self._watcher_factory(self.backend, self.health, config, on_xid, self.topology)
        self.watcher.start()

    # ------------------------------------------------------------------ SIGHUP, kubelet restart
    def reread(self, reload_config: bool = False, loader: Callable[[], Config] | None = None) -> bool:
        """Read the topology again and hand it to the servers, the metrics and the labels.

        SIGHUP (``reload_config``): with the configuration read again (the start-only settings
        keep their running values: one warning), served again in any case (re-registered). A
        kubelet restart: with the running configuration, served only when the topology
        changed (a GPU replaced or MIG reconfigured during maintenance). A failure is logged
        and the running configuration and topology are kept. True when served. ``loader``
        reads the new configuration instead of ``config_loader`` (a per-node config the label
        chose).
        """
        current, servers = self.topology, self.servers
        loader = loader or self.config_loader
        if current is None or servers is None:
            return False
        try:
            loaded = loader() if reload_config and loader is not None else self.config
            config, ignored = keep_start_settings(loaded, self.config)
            if ignored:
                log.warning("not applied, these apply at start only (restart the agent to change them): %s", ignored)
            topology = self._read_again(current)
            if not reload_config and topology is current:
                return False
            if topology is not current:
                log.warning("topology changed since it was last read: serving the new one")
            servers.set_topology(topology, config)
        except AgentError as exc:
            what = "reload" if reload_config else "re-reading the topology"
            log.error("%s failed, keeping the running configuration and topology: %s", what, exc)
            return False
        self.config, self.topology = config, topology
        if self.metrics is not None:
            self.metrics.set_topology(topology, config)
        if reload_config:
            setup_logging(config)
            log.info("reloaded; effective configuration: %s", json.dumps(describe_config(config), sort_keys=True))
            self._follow_health_checks(config)
        if self.labels is not None:
            self.labels.publish(topology, config)
        return True

    def _follow_node_label(self, node_config: NodeConfigSelector) -> None:
        """Apply the config a new label value names (the SIGHUP path); a refused one keeps
        the running config."""
        choice = node_config.take()
        if choice is not None:
            node_config.applied(choice[0], self.reread(reload_config=True, loader=choice[1]))

    def _read_again(self, current: Topology) -> Topology:
        """The topology read now, merged with what ``current`` knew; ``current`` itself
        when nothing changed or the GPU count did."""
        topology = self._read_topology()
        # Health state and the watcher are sized by GPU count at start; a node whose GPU
        # count changes (a GPU fell off the bus) is a restart, not a reload.
        if topology.gpu_count != current.gpu_count:
            log.error(
                "GPU count changed from %d to %d: keeping the topology read at start; restart the agent",
                current.gpu_count, topology.gpu_count,
            )
            return current
        return merge_reread(current, topology)

    def _follow_health_checks(self, config: Config) -> None:
        if self.watcher is not None:
            self.watcher.config = config
            self.watcher.facts_interval_s = config.health_facts_interval_s
            if not config.health_checks_enabled:
                self.watcher.stop()
                self.watcher = None
        elif config.health_checks_enabled:
            self._start_watcher(config)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Ordered stop; every step runs even if an earlier one fails."""
        backstop = threading.Timer(SHUTDOWN_BUDGET_S, _hard_exit)
        backstop.daemon = True
        backstop.start()
        try:
            steps: list[tuple[str, Callable[[], None]]] = []
            servers, watcher, metrics, labels = self.servers, self.watcher, self.metrics, self.labels
            node_health = self.node_health
            if self.node_config is not None:
                steps.append(("node label watch", self.node_config.stop))
            if servers is not None:
                steps.append(("servers", lambda: servers.stop(SERVERS_GRACE_S)))
            if watcher is not None:
                steps.append(("health watcher", lambda: watcher.stop(2.0)))
            if node_health is not None:
                steps.append(("Node health publisher", lambda: node_health.stop(2.0)))
            if metrics is not None:
                steps.append(("metrics", metrics.stop))
            if labels is not None:
                steps.append(("labels", labels.withdraw))
            if self._nvml_open:
                steps.append(("NVML", self.backend.shutdown))
            if self._on_close is not None:
                steps.append(("simulated machine", self._on_close))
            for name, step in steps:
                try:
                    step()
                except Exception:
                    log.exception("stopping %s failed", name)
        finally:
            backstop.cancel()
        log.info("stopped")

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Run until SIGTERM/SIGINT; returns the exit code (0 after a clean stop)."""
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        try:
            if self.start():
                while not self._stop_requested:
                    due_s = self.labels.due_s if self.labels is not None else float("inf")
                    self._wake.wait(min(1.0, max(0.05, due_s - time.monotonic())))
                    self._wake.clear()
                    if self._stop_requested:
                        break
                    if self.labels is not None:
                        self.labels.maintain()
                    if self._reload_requested:
                        self._reload_requested = self._reread_requested = False
                        log.info("SIGHUP: reloading")
                        self.reread(reload_config=True)
                        if self.node_config is not None:
                            self.node_config.reconsider()
                    if self.node_config is not None:
                        self._follow_node_label(self.node_config)
                    if self._reread_requested:
                        self._reread_requested = False
                        self.reread()
        finally:
            self.shutdown()
        return 0


def _hard_exit() -> None:
    os.write(2, b"gpu-topology-agent: shutdown took too long, exiting\n")
    os._exit(1)
