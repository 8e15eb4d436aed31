"""The metrics service: sampler thread + pod-resources cache + HTTP server.

``MetricsService(backend, topology, config, hostname=..., ready=..., agent_metrics=...)``
registers the GPU collector on the registry of the agent's self-metrics (built first and
passed in, never the global registry) and reports its sampling rounds and pod-resources
errors to them. HTTP endpoints on
``config.metrics_address`` (``HOST:PORT``, ``:PORT`` for all interfaces, ``[::1]:PORT``;
port 0 picks a free one, see ``.port``):

- ``/metrics``: Prometheus text format of the latest snapshot; never calls NVML.
- ``/health``: 200 while the process is alive (liveness).
- ``/ready``: 200 when ``ready()`` is True (registered with the kubelet, topology read),
  else 503 (readiness).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from agent.config import Config
from agent.errors import shorten
from agent.formats import parse_host_port as parse_address
from agent.hw.protocols import Telemetry
from agent.kubelet.podresources import PodResourcesClient
from agent.metrics.collector import GpuCollector, PlacementScorer, render_text
from agent.metrics.podresources import (
    Attribution,
    PodResourcesCache,
)
from agent.metrics.sampler import Sampler, Snapshot
from agent.metrics.self_metrics import AgentMetrics
from agent.topology.model import Topology

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


#: Pending connections the kernel queues before accept (Python's default is 5: 50 scrapers
#: at once overflowed it and stalled for seconds).
LISTEN_BACKLOG = 128
#: Connections served at once (one thread each); one more is answered 503 and closed at once.
MAX_CONNECTIONS = 100
#: Seconds a connection may stay silent (a half-sent request, an idle keep-alive) before
#: it is closed and its thread freed.
READ_TIMEOUT_S = 10.0

_BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 38\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    b"too many connections: try again later\n"
)


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` of them; each connection
    times out after ``read_timeout_s`` of silence. Client resets and timeouts are logged at
    debug level, never as a traceback."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG
    max_connections = MAX_CONNECTIONS
    read_timeout_s = READ_TIMEOUT_S

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.settimeout(0.5)
                request.sendall(_BUSY_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            request.settimeout(self.read_timeout_s)
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # reset, broken pipe, timeout: the client's doing
            log.debug("metrics http: %s from %s", exc, client_address)
        else:
            log.warning("metrics http: %s from %s", shorten(repr(exc), 200), client_address)


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
    ) -> None:
        self.backend = backend
        self.topology = topology
        self.config = config
        self.hostname = hostname
        self.ready = ready
        self.agent_metrics = agent_metrics
        self.registry = agent_metrics.registry
        self.sampler = Sampler(
            backend.sample_source(), topology,
            interval_s=config.sample_interval_s,
            idle_threshold_pct=config.idle_utilization_threshold_pct,
            clock=clock, on_round=self._on_round,
        )
        self.scorer = PlacementScorer(topology)
        self.collector = GpuCollector(
            topology, hostname=hostname,
            snapshot=lambda: self.sampler.snapshot,
            attribution=self._attribution,
            scorer=self.scorer, clock=clock,
        )
        self.registry.register(self.collector)
        self.pod_resources = PodResourcesCache(
            PodResourcesClient(config.pod_resources_socket), topology,
            refresh_s=config.pod_resources_refresh_s,
            index_ids=config.device_id_strategy == "index",
            clock=clock,
            on_error=agent_metrics.pod_resources_errors.inc,
            on_refresh=self._warm_scores,
        )
        self._server: _Server | None = None
        self._server_thread: threading.Thread | None = None
        self.port: int | None = None

    # ---------------------------------------------------------------- reports
    def record_xid(self, gpu_index: int, xid: int) -> None:
        """The health watcher reports an XID; exported as ``DCGM_FI_DEV_XID_ERRORS``."""
        self.sampler.record_xid(gpu_index, xid)

    def _attribution(self) -> Attribution:
        return self.pod_resources.current

    def _on_round(self, snap: Snapshot) -> None:
        self.agent_metrics.sampler_duration.set(snap.duration_s)
        self.agent_metrics.samples.inc()

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
        """Bind the HTTP server (raises ValueError for a bad address, OSError when the
        port is taken), then start sampling and pod attribution."""
        self._server, self._server_thread = _serve(
            self.config.metrics_address, _make_handler(self.render, self.ready)
        )
        self.port = self._server.server_address[1]
        self.sampler.start()
        self.pod_resources.start()
        log.info("metrics on %s:%d (/metrics, /health, /ready)", self._server.server_address[0] or "*", self.port)

    def stop(self) -> None:
        """Stop serving and sampling; idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._server_thread is not None:
            self._server_thread.join(5.0)
            self._server_thread = None
        self.pod_resources.stop()
        self.sampler.stop()


def _serve(address: str, handler: type[BaseHTTPRequestHandler]) -> tuple[_Server, threading.Thread]:
    """Bind ``address`` (ValueError for a bad one, OSError when taken) and serve it on a
    daemon thread."""
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_cls = type("_BoundServer", (_Server,), {"address_family": family})
    server = server_cls((host, port), handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="metrics-http", daemon=True
    )
    thread.start()
    return server, thread


class WaitingEndpoint:
    """The metrics address while the agent waits for NVML (``failOnInitError: false``):
    ``/health`` answers 200 so liveness and startup probes leave a pod that waits on purpose
    alone, ``/ready`` and ``/metrics`` answer 503. Stopped before the real service binds."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def start(self) -> None:
        self._server, self._thread = _serve(self.address, _make_handler(None, lambda: False))
        self.port = self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


def _make_handler(
    render: Callable[[], bytes] | None, ready: Callable[[], bool]
) -> type[BaseHTTPRequestHandler]:
    """``render`` None: the agent is not sampling yet (``/metrics`` answers 503)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if render is None:
                    self._reply(503, b"waiting for NVML: no metrics yet\n")
                    return
                try:
                    body, status = render(), 200
                except Exception:  # a scrape must answer; say why in the log
                    log.exception("rendering /metrics failed")
                    body, status = b"internal error\n", 500
                self._reply(status, body, CONTENT_TYPE)
            elif path == "/health":
                self._reply(200, b"ok\n")
            elif path == "/ready":
                try:
                    ok = bool(ready())
                except Exception:
                    log.exception("readiness check failed")
                    ok = False
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._reply(404, b"not found: try /metrics, /health or /ready\n")

        def _reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("metrics http: " + format, *args)

    return Handler
