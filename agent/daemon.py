"""``gpu-topology-agent run``: the node agent's lifecycle.

Start order: logging and the effective configuration; NVML (real or simulated); topology;
labels file; device-plugin servers and their registration (in the background); metrics
service; health watcher. Readiness (``/ready``) = the topology is read and every
resource is registered with the running kubelet.

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
from typing import Any, Callable

from agent.config import Config, describe_config
from agent.errors import AgentError
from agent.health import HealthState, HealthWatcher, lost_at_discovery

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


def setup_logging(config: Config, stream: Any = None) -> None:
    """Replace the root handlers with one writing ``config.log_format`` at ``config.log_level``."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    if config.log_format == "json":
        formatter = JsonFormatter()
        formatter.converter = time.gmtime  # type: ignore[method-assign]  # the "Z" in the time field
        handler.setFormatter(formatter)
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(config.log_level)


#: Seconds the ordered shutdown may take before a backstop exits the process; the
#: DaemonSet's terminationGracePeriodSeconds must stay above it.
SHUTDOWN_BUDGET_S = 20.0


class Daemon:
    """Owns every long-lived part of the agent. ``config_loader`` re-reads the configuration
    (SIGHUP); ``simulate`` names a simulated machine (``--simulate``)."""

    def __init__(
        self,
        config: Config,
        *,
        simulate: str | None = None,
        config_loader: Callable[[], Config] | None = None,
        shutdown_budget_s: float = SHUTDOWN_BUDGET_S,
        nvml_retry_s: float = 10.0,
    ) -> None:
        self.config = config
        self.simulate = simulate
        self.config_loader = config_loader
        self.shutdown_budget_s = shutdown_budget_s
        self.nvml_retry_s = nvml_retry_s
        self.backend: Any = None
        self.topology: Any = None
        self.health: HealthState | None = None
        self.watcher: HealthWatcher | None = None
        self.manager: Any = None
        self.metrics: Any = None
        self.label_sink: Any = None
        self.sim: Any = None
        self.waiting_port: int | None = None  # the /health port while waiting for NVML
        self._wake = threading.Event()
        self._stop_requested = False
        self._reload_requested = False
        self._reread_requested = False
        self._signals = 0

    # ------------------------------------------------------------------ signals
    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._signals += 1
        if self._signals > 1:
            os.write(2, b"gpu-topology-agent: second signal, exiting now\n")
            os._exit(1)
        self._stop_requested = True
        self._wake.set()

    def _on_hup(self, signum: int, frame: object) -> None:
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
        return self.topology is not None and self.manager is not None and self.manager.ready()

    # ------------------------------------------------------------------ start
    def _open_backend(self) -> Any:
        if self.simulate:
            from agent.hw.machines import open_simulated

            self.sim = open_simulated(self.simulate)
            return self.sim.backend()
        from agent.hw.nvml import NvmlBackend
        from agent.hw.sysfs import SysfsReader

        return NvmlBackend(sysfs=SysfsReader(self.config.sysfs_root))

    def _read_topology(self) -> Any:
        return self.backend.read_topology(source=f"simulated:{self.simulate}" if self.simulate else "nvml")

    def _init_nvml(self) -> bool:
        """Open NVML; False when stopped while waiting for it (failOnInitError false).
        While it waits, the metrics address answers /health (so the kubelet's probes do not
        restart a pod that waits on purpose) and 503 on /ready and /metrics."""
        waiting: Any = None
        try:
            while True:
                try:
                    backend = self._open_backend()
                    backend.init()
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
                self.backend = backend
                return True
        finally:
            if waiting is not None:
                waiting.stop()

    def _start_waiting_endpoint(self) -> Any:
        from agent.metrics.service import WaitingEndpoint

        endpoint = WaitingEndpoint(self.config.metrics_address)
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
        self.topology = self._read_topology()
        log.info(
            "topology: %d GPUs from %s, NVLink islands %s, NUMA groups %s",
            self.topology.gpu_count, self.topology.source or "nvml",
            [list(i) for i in self.topology.nvlink_islands],
            {k: list(v) for k, v in self.topology.numa_groups.items()},
        )
        self.health = HealthState(self.topology.gpu_count, lost_at_discovery(self.backend))
        from agent.deviceplugin.manager import DevicePluginManager

        # The device plugins start before the metrics service: registration is what the
        # node waits for (goal: within 2 s of start); the metrics hooks are attached after.
        # Labels come after the sockets: an agent that finds its socket served by another
        # live one exits there, before touching that one's label file.
        self.manager = DevicePluginManager(self.topology, self.config, self.health)
        self.manager.on_kubelet_restart = self._on_kubelet_restart
        self.manager.start()
        self._write_labels()
        self._start_metrics()
        if self.metrics is not None:
            self.manager.attach_metrics(getattr(self.metrics, "agent_metrics", None))
        self._start_watcher()
        return True

    def _write_labels(self) -> None:
        try:
            from agent.labels import compute_labels
            from agent.labels.sinks import FeatureFileSink
        except ImportError as exc:  # the labels package is optional in a partial build
            log.warning("labels not available (%s): no feature file written", exc)
            return
        try:
            if self.label_sink is None:
                self.label_sink = FeatureFileSink(self.config.features_dir, self.config.feature_file)
            if self.label_sink.write(compute_labels(self.topology, self.config)):
                log.info("labels written to %s", self.config.features_dir)
        except OSError as exc:
            log.error("cannot write labels to %s: %s", self.config.features_dir, exc)

    def _start_metrics(self) -> None:
        try:
            from agent.metrics.service import MetricsService
        except ImportError as exc:
            log.warning("metrics not available (%s): no /metrics endpoint", exc)
            return
        hostname = self.config.node_name or socket.gethostname()
        self.metrics = MetricsService(self.backend, self.topology, self.config, hostname=hostname, ready=self.ready)
        try:
            self.metrics.start()
        except OSError as exc:
            self.metrics.stop()
            self.metrics = None
            raise AgentError(f"cannot serve metrics on {self.config.metrics_address}: {exc.strerror or exc}") from exc

    def _start_watcher(self) -> None:
        assert self.health is not None
        if not self.config.health_checks_enabled:
            log.warning("health checks are disabled: GPUs are always advertised healthy")
            return
        on_xid = getattr(self.metrics, "record_xid", None)
        self.watcher = HealthWatcher(self.backend, self.health, self.config, on_xid=on_xid)
        self.watcher.start()

    # ------------------------------------------------------------------ reload
    def reload(self) -> None:
        """SIGHUP: new configuration and topology, servers again, re-registration. A bad
        configuration is logged and the running one is kept."""
        if self.config_loader is None or self.manager is None:
            return
        try:
            config = self.config_loader()
            topology = self._read_topology()
            if not self._same_gpu_count(topology):
                topology = self.topology
            self.manager.reload(topology, config)
        except AgentError as exc:
            log.error("reload failed, keeping the running configuration: %s", exc)
            return
        self.config, self.topology = config, topology
        setup_logging(config)
        log.info("reloaded; effective configuration: %s", json.dumps(describe_config(config), sort_keys=True))
        self._write_labels()
        if self.watcher is not None:
            self.watcher.config = config
            if not config.health_checks_enabled:
                self.watcher.stop()
                self.watcher = None
        elif config.health_checks_enabled:
            self._start_watcher()

    def _same_gpu_count(self, topology: Any) -> bool:
        # Health state and the watcher are sized by GPU count at start; a node whose GPU
        # count changes (a GPU fell off the bus) is a restart, not a reload.
        if topology.gpu_count == self.topology.gpu_count:
            return True
        log.error(
            "GPU count changed from %d to %d: keeping the topology read at start; restart the agent",
            self.topology.gpu_count, topology.gpu_count,
        )
        return False

    def reread_topology(self) -> bool:
        """After a kubelet restart: read the topology again and serve it if it changed
        (a GPU replaced or MIG reconfigured while the node was in maintenance). True if it
        changed."""
        if self.backend is None or self.manager is None:
            return False
        try:
            topology = self._read_topology()
        except AgentError as exc:
            log.error("re-reading the topology failed, keeping the current one: %s", exc)
            return False
        if topology == self.topology:
            return False
        if not self._same_gpu_count(topology):
            return False
        log.warning("topology changed since start: serving the new one")
        try:
            self.manager.reload(topology, self.config)
        except AgentError as exc:
            log.error("cannot serve the new topology, keeping the current one: %s", exc)
            return False
        self.topology = topology
        self._write_labels()
        return True

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Ordered stop; every step runs even if an earlier one fails."""
        backstop = threading.Timer(self.shutdown_budget_s, _hard_exit)
        backstop.daemon = True
        backstop.start()
        try:
            steps: list[tuple[str, Callable[[], None]]] = []
            if self.manager is not None:
                steps.append(("device plugins", lambda: self.manager.stop(1.0)))
            watcher = self.watcher
            if watcher is not None:
                steps.append(("health watcher", lambda: watcher.stop(2.0)))
            if self.metrics is not None:
                steps.append(("metrics", self.metrics.stop))
            if self.label_sink is not None:
                # a clean stop withdraws our labels: NFD drops them from the node
                steps.append(("labels", self.label_sink.remove))
            if self.backend is not None:
                steps.append(("NVML", self.backend.shutdown))
            if self.sim is not None:
                steps.append(("simulated machine", self.sim.close))
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
                    self._wake.wait(1.0)
                    self._wake.clear()
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


def _hard_exit() -> None:
    os.write(2, b"gpu-topology-agent: shutdown took too long, exiting\n")
    os._exit(1)
