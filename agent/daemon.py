"""``gpu-topology-agent run``: the node agent's lifecycle.

The collaborators (the hardware backend, and factories for the device plugins, the metrics
service and the health watcher, which need the topology read at start) are constructor
arguments; :meth:`Daemon.from_config` builds the real ones.

Start order: logging and the effective configuration; NVML (real or simulated); topology;
labels file; device-plugin servers and their registration (in the background); metrics
service; health watcher. Readiness (``/ready``) = the topology is read and every
resource is registered with the running kubelet.

``mode: dra`` replaces the device-plugin servers (no device-plugin socket at all) with the
DRA kubelet plugin and the ResourceSlice publisher (factories ``dra_plugin`` and
``slice_publisher``): ready = the kubelet registered the DRA plugin and the slices are
published. The publisher follows health (an unhealthy GPU leaves the slice); SIGHUP and a
kubelet restart hand both the topology read again; a clean stop removes the sockets and
keeps the slices (unless ``deleteSlicesOnShutdown``).

Signals only set flags; the main thread does the work: SIGHUP reloads the configuration and
topology and re-registers; SIGTERM/SIGINT shut down in a fixed order (close streams, stop
servers, remove sockets, stop the watcher and metrics, NVML shutdown) within
``shutdown_budget_s``, with a hard backstop; a second SIGTERM/SIGINT exits at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol, TextIO

from agent.config import Config, describe_config
from agent.deviceplugin.manager import DevicePluginManager
from agent.errors import AgentError
from agent.health import HealthState, HealthWatcher, lost_at_discovery
from agent.hw.protocols import EventSource, FactsReader, Lifecycle
from agent.kube import api_client
from agent.labels import TIMESTAMP_LABEL, compute_labels
from agent.labels.sinks import LabelSink, label_sink
from agent.metrics.service import MetricsService, WaitingEndpoint
from agent.topology.model import Topology
from agent.topology.reread import merge_reread

if TYPE_CHECKING:
    from agent.dra.plugin import DraPlugin
    from agent.dra.publisher import SlicePublisher

log = logging.getLogger(__name__)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (+ exception)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(config: Config, stream: TextIO | None = None) -> None:
    """Replace the root handlers with one writing ``config.log_format`` at ``config.log_level``."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    if config.log_format == "json":
        formatter = JsonFormatter()
        formatter.converter = time.gmtime  # the "Z" in the time field
        handler.setFormatter(formatter)
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(config.log_level)


#: Seconds the ordered shutdown may take before a backstop exits the process; the
#: DaemonSet's terminationGracePeriodSeconds must stay above it.
SHUTDOWN_BUDGET_S = 20.0


class DaemonBackend(Lifecycle, FactsReader, EventSource, Protocol):
    """What the daemon needs of the hardware backend (``agent.hw.nvml.backend.NvmlBackend``):
    its lifecycle, the facts it builds the Topology from, and the health watcher's events."""


class Endpoint(Protocol):
    """Something serving the metrics address that the daemon starts and stops."""

    @property
    def port(self) -> int | None:
        """The bound port once started (the address may ask for port 0)."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


#: (topology, config, health) -> the device plugins (not yet started).
PluginsFactory = Callable[[Topology, Config, HealthState], DevicePluginManager]
#: (topology, config, ready) -> the metrics service (not yet started).
MetricsFactory = Callable[[Topology, Config, Callable[[], bool]], MetricsService]
#: (backend, health, config, on_xid) -> the health watcher (not yet started).
WatcherFactory = Callable[[EventSource, HealthState, Config, Callable[[int, int], None] | None], HealthWatcher]


#: (topology, config, health) -> the DRA kubelet plugin (not yet started), ``mode: dra``.
DraPluginFactory = Callable[[Topology, Config, HealthState], "DraPlugin"]
#: (topology, config, health) -> the ResourceSlice publisher (not yet started), subscribed
#: to ``health``, ``mode: dra``.
SlicePublisherFactory = Callable[[Topology, Config, HealthState], "SlicePublisher"]


def _default_dra_plugin(topology: Topology, config: Config, health: HealthState) -> DraPlugin:
    """The DRA kubelet plugin, reading ResourceClaims with :func:`agent.kube.api_client`."""
    from agent.dra.claims import KubernetesClaimReader
    from agent.dra.plugin import DraPlugin

    return DraPlugin(config, topology, health, KubernetesClaimReader(api_client(config)))


def _default_slice_publisher(topology: Topology, config: Config, health: HealthState) -> SlicePublisher:
    from agent.dra.publisher import SlicePublisher

    return SlicePublisher(lambda: api_client(config, retries=False), config.node_name, topology,
                          config.driver_name, health=health, delete_on_stop=config.delete_slices_on_shutdown)


def _default_watcher(
    backend: EventSource, health: HealthState, config: Config, on_xid: Callable[[int, int], None] | None
) -> HealthWatcher:
    return HealthWatcher(backend, health, config, on_xid=on_xid)


class Daemon:
    """Owns every long-lived part of the agent.

    ``backend`` is the hardware backend (initialised by :meth:`start`); ``source`` names it
    in the topology. ``plugins``, ``metrics`` and ``watcher`` build the device plugins, the
    metrics service (None: no metrics endpoint) and the health watcher once the topology is
    read; ``waiting_endpoint`` serves ``/health`` while NVML is awaited (None: nothing).
    ``read_topology`` reads the topology from the initialised backend (default: the
    backend's facts, named ``source``). ``label_sink`` receives the labels (None: no labels
    written). ``config_loader`` re-reads the configuration (SIGHUP). ``on_close`` runs last
    at shutdown (a simulated machine's clean-up).
    """

    def __init__(
        self,
        config: Config,
        backend: DaemonBackend,
        *,
        source: str = "nvml",
        plugins: PluginsFactory = DevicePluginManager,
        metrics: MetricsFactory | None = None,
        watcher: WatcherFactory = _default_watcher,
        waiting_endpoint: Callable[[str], Endpoint] | None = None,
        label_sink: LabelSink | None = None,
        config_loader: Callable[[], Config] | None = None,
        on_close: Callable[[], None] | None = None,
        read_topology: Callable[[], Topology] | None = None,
        shutdown_budget_s: float = SHUTDOWN_BUDGET_S,
        nvml_retry_s: float = 10.0,
        dra_plugin: DraPluginFactory = _default_dra_plugin,
        slice_publisher: SlicePublisherFactory = _default_slice_publisher,
    ) -> None:
        self.config = config
        self.backend = backend
        self.source = source
        self._plugins_factory = plugins
        self._metrics_factory = metrics
        self._watcher_factory = watcher
        self._waiting_endpoint_factory = waiting_endpoint
        self.label_sink = label_sink
        self.config_loader = config_loader
        self._on_close = on_close
        self._topology_reader = read_topology or self._read_facts_topology
        self.shutdown_budget_s = shutdown_budget_s
        self.nvml_retry_s = nvml_retry_s
        self._nvml_open = False
        self.topology: Topology | None = None
        self.health: HealthState | None = None
        self.watcher: HealthWatcher | None = None
        self.manager: DevicePluginManager | None = None
        self.metrics: MetricsService | None = None
        self.waiting_port: int | None = None  # the /health port while waiting for NVML
        # the label file (main thread only): re-asserted every config.label_interval_s; a
        # failed write makes the agent not ready until one succeeds
        self._labels_failing = False
        self.label_write_errors = 0
        self._label_errors_counted = 0  # how many of them the metrics counter has
        self._next_labels_s = float("inf")  # set by the first write
        self._labels_logged: dict[str, str] = {}  # the labels last reported in the log
        # mode: dra (in place of the device plugins)
        self._dra_plugin_factory = dra_plugin
        self._slice_publisher_factory = slice_publisher
        self.dra: DraPlugin | None = None
        self.publisher: SlicePublisher | None = None
        # Signal handlers and the kubelet-watch thread only set these and wake the main
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
    ) -> Daemon:
        """The real agent: NVML (or the simulated machine ``simulate``, ``--simulate``),
        the device plugins, the metrics service and the label sink ``--labels-sink`` names.
        Raises AgentError when the simulated machine cannot be opened or the label sink
        cannot be set up (exit 2)."""
        from agent.discovery import open_backend, read_topology

        sink = label_sink(config)  # before the backend: a bad sink setting opens nothing
        backend, sim = open_backend(simulate, config.sysfs_root)
        on_close = sim.close if sim is not None else None
        hostname = config.node_name or socket.gethostname()

        def metrics(topology: Topology, cfg: Config, ready: Callable[[], bool]) -> MetricsService:
            return MetricsService(backend, topology, cfg, hostname=hostname, ready=ready)

        return cls(
            config, backend,
            source=f"simulated:{simulate}" if simulate else "nvml",
            metrics=metrics,
            waiting_endpoint=WaitingEndpoint,
            label_sink=sink,
            config_loader=config_loader,
            on_close=on_close,
            read_topology=lambda: read_topology(backend, sim),
        )

    def _read_facts_topology(self) -> Topology:
        return Topology.from_facts(self.backend.read_facts(source=self.source))

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

    def request_stop(self) -> None:
        self._stop_requested = True
        self._wake.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)

    # ------------------------------------------------------------------ readiness
    def ready(self) -> bool:
        manager, dra, publisher = self.manager, self.dra, self.publisher
        if self._labels_failing:
            return False
        if dra is not None and publisher is not None:
            # DRA: the kubelet registered us and the scheduler can see our devices
            return self.topology is not None and dra.ready() and publisher.ready()
        return self.topology is not None and manager is not None and manager.ready()

    def _serving(self) -> bool:
        return self.manager is not None or self.dra is not None

    # ------------------------------------------------------------------ start
    def _read_topology(self) -> Topology:
        return self._topology_reader()

    def _init_nvml(self) -> bool:
        """Open NVML; False when stopped while waiting for it (failOnInitError false).
        While it waits, the metrics address answers /health (so the kubelet's probes do not
        restart a pod that waits on purpose) and 503 on /ready and /metrics."""
        waiting: Endpoint | None = None
        try:
            while True:
                try:
                    self.backend.init()
                except AgentError as exc:
                    if self.config.fail_on_init_error:
                        raise
                    log.error(
                        "NVML unavailable (%s); failOnInitError is false: retrying in %.0f s",
                        exc, self.nvml_retry_s,
                    )
                    if waiting is None:
                        waiting = self._start_waiting_endpoint()
                    if self._wait_interruptible(self.nvml_retry_s):
                        return False
                    continue
                self._nvml_open = True
                return True
        finally:
            if waiting is not None:
                waiting.stop()

    def _start_waiting_endpoint(self) -> Endpoint | None:
        if self._waiting_endpoint_factory is None:
            return None
        endpoint = self._waiting_endpoint_factory(self.config.metrics_address)
        try:
            endpoint.start()
        except OSError as exc:  # the real service reports this at its start; keep waiting
            log.error("cannot serve /health on %s while waiting: %s", self.config.metrics_address, exc.strerror or exc)
            return None
        self.waiting_port = endpoint.port
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
        log.info("effective configuration: %s", json.dumps(describe_config(self.config), sort_keys=True))
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
        # The device plugins start before the metrics service: registration is what the
        # node waits for (goal: within 2 s of start); the metrics hooks are attached after.
        # Labels come after the sockets: an agent that finds its socket served by another
        # live one exits there, before touching that one's label file.
        if self.config.mode == "dra":
            self._start_dra(topology)
        else:
            self.manager = self._plugins_factory(topology, self.config, self.health)
            self.manager.on_kubelet_restart = self._on_kubelet_restart
            self.manager.start()
        self._write_labels(topology)
        self._start_metrics(topology)
        if self.metrics is not None and self.manager is not None:
            self.manager.attach_hooks(self.metrics.agent_metrics)
        self._start_watcher(self.config)
        return True

    def _start_dra(self, topology: Topology) -> None:
        """``mode: dra``: the kubelet plugin and the slice publisher, no device plugins (a GPU
        is never handed out by both). The publisher follows health (its own subscription). The
        device order is the static one: an occupancy-following order (re-published after each
        prepare/unprepare) was measured worse, see ``bench/quality_dra.py``."""
        assert self.health is not None
        plugin = self._dra_plugin_factory(topology, self.config, self.health)
        publisher = self._slice_publisher_factory(topology, self.config, self.health)
        plugin.on_kubelet_restart = self._on_kubelet_restart
        self.dra, self.publisher = plugin, publisher
        plugin.start()
        publisher.start()

    def _serve_topology(self, topology: Topology, config: Config) -> None:
        """Serve ``topology`` (SIGHUP or a kubelet restart read it again)."""
        if self.manager is not None:
            self.manager.reload(topology, config)
            return
        if self.dra is not None and self.publisher is not None:
            if config.mode != self.config.mode or _dra_settings(config) != _dra_settings(self.config):
                log.warning("mode and DRA settings apply at start: restart the agent to change them")
            self.dra.set_topology(topology)
            self.publisher.update(topology=topology)

    def _write_labels(self, topology: Topology) -> None:
        """Write (or re-assert) the label file. A failure is logged every time, counted
        (``gpu_agent_label_write_errors_total``) and keeps the agent not ready until a write works."""
        if self.label_sink is None:
            return
        self._next_labels_s = time.monotonic() + self.config.label_interval_s
        labels = compute_labels(topology, self.config, time.time())
        try:
            if self.label_sink.write(labels):
                # GFD's timestamp moves with every write: say so only when a label changed
                facts = {k: v for k, v in labels.items() if k != TIMESTAMP_LABEL}
                if facts != self._labels_logged:
                    log.info("labels written to %s", self.label_sink.where)
                    self._labels_logged = facts
        except OSError as exc:
            self._labels_failing = True
            self.label_write_errors += 1
            self._count_label_errors()
            log.error(
                "cannot write labels to %s: %s (not ready; retrying in %g s)",
                self.label_sink.where, exc.strerror or exc, self.config.label_interval_s,
            )
            return
        if self._labels_failing:
            log.warning("labels written to %s again", self.label_sink.where)
        self._labels_failing = False

    def _count_label_errors(self) -> None:
        if self.metrics is not None:
            counter = self.metrics.agent_metrics.label_write_errors
            counter.inc(self.label_write_errors - self._label_errors_counted)
            self._label_errors_counted = self.label_write_errors

    def maintain(self) -> None:
        """The main loop's periodic work: re-assert the label file once
        ``config.label_interval_s`` has passed (a file deleted or edited behind the agent's
        back, or a removed features directory, comes back)."""
        if self.topology is not None and time.monotonic() >= self._next_labels_s:
            self._write_labels(self.topology)

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
        self._count_label_errors()  # failures before the counter existed

    def _start_watcher(self, config: Config) -> None:
        assert self.health is not None
        if not config.health_checks_enabled:
            log.warning("health checks are disabled: GPUs are always advertised healthy")
            return
        on_xid = self.metrics.record_xid if self.metrics is not None else None
        self.watcher = self._watcher_factory(self.backend, self.health, config, on_xid)
        self.watcher.start()

    # ------------------------------------------------------------------ reload
    def reload(self) -> None:
        """SIGHUP: new configuration and topology, servers again, re-registration. A bad
        configuration is logged and the running one is kept."""
        if self.config_loader is None or not self._serving() or self.topology is None:
            return
        try:
            config = self.config_loader()
            topology = self._read_topology()
            if not self._same_gpu_count(self.topology, topology):
                topology = self.topology
            topology = merge_reread(self.topology, topology)
            self._serve_topology(topology, config)
        except AgentError as exc:
            log.error("reload failed, keeping the running configuration: %s", exc)
            return
        self.config, self.topology = config, topology
        setup_logging(config)
        log.info("reloaded; effective configuration: %s", json.dumps(describe_config(config), sort_keys=True))
        self._write_labels(topology)
        if self.watcher is not None:
            self.watcher.config = config
            if not config.health_checks_enabled:
                self.watcher.stop()
                self.watcher = None
        elif config.health_checks_enabled:
            self._start_watcher(config)

    @staticmethod
    def _same_gpu_count(current: Topology, topology: Topology) -> bool:
        # Health state and the watcher are sized by GPU count at start; a node whose GPU
        # count changes (a GPU fell off the bus) is a restart, not a reload.
        if topology.gpu_count == current.gpu_count:
            return True
        log.error(
            "GPU count changed from %d to %d: keeping the topology read at start; restart the agent",
            current.gpu_count, topology.gpu_count,
        )
        return False

    def reread_topology(self) -> bool:
        """After a kubelet restart: read the topology again and serve it if it changed
        (a GPU replaced or MIG reconfigured while the node was in maintenance). True if it
        changed."""
        if not self._serving() or self.topology is None:
            return False
        try:
            topology = self._read_topology()
        except AgentError as exc:
            log.error("re-reading the topology failed, keeping the current one: %s", exc)
            return False
        if not self._same_gpu_count(self.topology, topology):
            return False
        topology = merge_reread(self.topology, topology)
        if topology == self.topology:
            return False
        log.warning("topology changed since start: serving the new one")
        try:
            self._serve_topology(topology, self.config)
        except AgentError as exc:
            log.error("cannot serve the new topology, keeping the current one: %s", exc)
            return False
        self.topology = topology
        self._write_labels(topology)
        return True

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Ordered stop; every step runs even if an earlier one fails."""
        backstop = threading.Timer(self.shutdown_budget_s, _hard_exit)
        backstop.daemon = True
        backstop.start()
        try:
            steps: list[tuple[str, Callable[[], None]]] = []
            manager, watcher, metrics = self.manager, self.watcher, self.metrics
            if manager is not None:
                steps.append(("device plugins", lambda: manager.stop(1.0)))
            dra, publisher = self.dra, self.publisher
            if dra is not None:
                steps.append(("DRA plugin", lambda: dra.stop(1.0)))
            if publisher is not None:  # slices kept unless deleteSlicesOnShutdown
                steps.append(("ResourceSlice publisher", lambda: publisher.stop(3.0)))
            if watcher is not None:
                steps.append(("health watcher", lambda: watcher.stop(2.0)))
            if metrics is not None:
                steps.append(("metrics", metrics.stop))
            if self.label_sink is not None and self.topology is not None:
                # a clean stop withdraws our labels: NFD drops them from the node
                steps.append(("labels", self.label_sink.remove))
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
        self.install_signal_handlers()
        try:
            if self.start():
                while not self._stop_requested:
                    self._wake.wait(min(1.0, max(0.05, self._next_labels_s - time.monotonic())))
                    self._wake.clear()
                    if not self._stop_requested:
                        self.maintain()
                    if self._reload_requested and not self._stop_requested:
                        self._reload_requested = self._reread_requested = False
                        log.info("SIGHUP: reloading")
                        self.reload()
                    if self._reread_requested and not self._stop_requested:
                        self._reread_requested = False
                        self.reread_topology()
        finally:
            self.shutdown()
        return 0


def _dra_settings(config: Config) -> tuple[object, ...]:
    return (config.driver_name, config.plugins_registry_dir, config.plugins_dir, config.cdi_dir,
            config.kubeconfig, config.node_name)


def _hard_exit() -> None:
    os.write(2, b"gpu-topology-agent: shutdown took too long, exiting\n")
    os._exit(1)
