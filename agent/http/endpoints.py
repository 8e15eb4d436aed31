"""HTTP serving of the metrics address and the probe address.

:class:`HttpEndpoints` binds two listeners from the configuration:

- ``config.metrics_address``: ``/metrics`` (and ``/health``, ``/ready`` for whoever reads
  them there), one thread per connection, at most ``MAX_CONNECTIONS`` (one more is answered
  503 and closed at once), each request whole within ``REQUEST_DEADLINE_S`` of the
  connection or of the previous response (TLS handshake included; a total, not per read),
  behind the web configuration's TLS and basic auth (``--web-config-file``,
  :mod:`agent.http.webconfig`) when one is given;
- the probe address (``config.probe_address``, by default the next port): ``/health`` and
  ``/ready`` for the kubelet, plain HTTP, on a listener no ``/metrics`` client shares and no
  client can hold (:mod:`agent.http.probes`).

``render`` None means the agent is not sampling yet (waiting for NVML): ``/metrics`` answers
503 (:class:`WaitingEndpoint`).
"""

from __future__ import annotations

import io
import logging
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from agent.config import Config, probe_address_of
from agent.errors import shorten
from agent.formats import parse_host_port
from agent.http.probes import ProbeServer
from agent.http.webconfig import WebConfig, WebConfigWatch, load_web_config

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Pending connections the kernel queues before accept (Python's default is 5: 50 scrapers
#: at once overflowed it and stalled for seconds).
LISTEN_BACKLOG = 128
#: Connections served at once (one thread each); one more is answered 503 and closed at once.
MAX_CONNECTIONS = 100
#: Seconds a connection has to deliver a whole request (its TLS handshake included) after it
#: was accepted or answered its previous request: a client that dribbles bytes, or idles on
#: a keep-alive connection, is closed then and its thread freed.
REQUEST_DEADLINE_S = 5.0
#: Seconds a response may take to be taken by the client.
RESPONSE_TIMEOUT_S = 10.0

_BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 38\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    b"too many connections: try again later\n"
)


class _Deadline(io.RawIOBase):
    """The socket's reads, each bounded by what is left of the request's deadline."""

    def __init__(self, sock: socket.socket, deadline: list[float]) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline[0] - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not whole within the deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Writer(io.BufferedIOBase):
    """Writes go out whole (``sendall``), bounded by the socket's timeout."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._sock.sendall(data)
        return len(data)


class _MetricsServer(ThreadingHTTPServer):
    """One thread per connection, at most ``MAX_CONNECTIONS`` of them. Client resets,
    timeouts and failed handshakes are logged at debug level, never as a traceback."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
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
        if isinstance(exc, OSError):  # reset, broken pipe, timeout, bad handshake: the client's
            log.debug("metrics http: %s from %s", exc, client_address)
        else:
            log.warning("metrics http: %s from %s", shorten(repr(exc), 200), client_address)


class _Handler(BaseHTTPRequestHandler):
    """One connection of the metrics listener. ``_make_handler`` sets what it serves."""

    protocol_version = "HTTP/1.1"
    waiting = True  # for NVML: no metrics yet, /metrics is 503
    web: WebConfigWatch | None = None
    web_config: WebConfig | None = None  # the configuration in force when it connected

    def is_ready(self) -> bool:
        return False

    def is_live(self) -> bool:
        return True

    def body(self) -> bytes:
        return b""

    def setup(self) -> None:
        self._deadline = [time.monotonic() + REQUEST_DEADLINE_S]
        conn: socket.socket = self.request
        if self.web is not None:
            self.web_config = self.web.current()  # re-read here when a file changed
            if self.web_config.context is not None:
                conn = self._handshake(self.web_config.context, conn)
        self.connection = conn
        self.rfile = io.BufferedReader(_Deadline(conn, self._deadline))
        self.wfile = _Writer(conn)

    def _handshake(self, context: ssl.SSLContext, conn: socket.socket) -> ssl.SSLSocket:
        wrapped = context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        try:
            wrapped.settimeout(max(0.001, self._deadline[0] - time.monotonic()))
            wrapped.do_handshake()  # one timeout for the whole handshake (CPython's _ssl)
        except BaseException:
            wrapped.close()
            raise
        return wrapped

    def finish(self) -> None:
        super().finish()
        if self.connection is not self.request:
            self.connection.close()  # the TLS socket took the accepted one's descriptor

    def handle_one_request(self) -> None:
        super().handle_one_request()
        self._deadline[0] = time.monotonic() + REQUEST_DEADLINE_S  # the next one's

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        config = self.web_config
        if config is not None and self.web is not None and not self.web.auth.allows(
            config.users, self.headers.get("Authorization")
        ):
            self._reply(401, b"Unauthorized\n", extra=(("WWW-Authenticate", "Basic"),))
            return
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._metrics()
        elif path == "/health":
            self._probe(self.is_live, "liveness", b"ok\n", b"cannot serve\n")
        elif path == "/ready":
            self._probe(self.is_ready, "readiness", b"ready\n", b"not ready\n")
        else:
            self._reply(404, b"not found: try /metrics, /health or /ready\n")

    def _probe(self, check: Callable[[], object], what: str, yes: bytes, no: bytes) -> None:
        """200 ``yes`` when ``check()`` holds, else 503 ``no`` (a check that raises: logged, 503)."""
        try:
            ok = bool(check())
        except Exception:
            log.exception("%s check failed", what)
            ok = False
        self._reply(200 if ok else 503, yes if ok else no)

    def _metrics(self) -> None:
        if self.waiting:
            self._reply(503, b"waiting for NVML: no metrics yet\n")
            return
        try:
            body, status = self.body(), 200
        except Exception:  # a scrape must answer; say why in the log
            log.exception("rendering /metrics failed")
            body, status = b"internal error\n", 500
        self._reply(status, body, CONTENT_TYPE)

    def _reply(
        self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.connection.settimeout(RESPONSE_TIMEOUT_S)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra + (self.web_config.headers if self.web_config else ()):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("metrics http: " + format, *args)


def _make_handler(
    render: Callable[[], bytes] | None, ready: Callable[[], bool], web_watch: WebConfigWatch | None,
    live: Callable[[], bool],
) -> type[_Handler]:
    class Handler(_Handler):
        waiting = render is None
        web = web_watch

        def body(self) -> bytes:
            return render() if render is not None else b""

        def is_ready(self) -> bool:
            return ready()

        def is_live(self) -> bool:
            return live()

    return Handler


class _MetricsServerV6(_MetricsServer):
    address_family = socket.AF_INET6


def _serve(address: str, handler: type[BaseHTTPRequestHandler]) -> tuple[_MetricsServer, threading.Thread]:
    """Bind ``address`` (ValueError for a bad one, OSError when taken) and serve it on a
    daemon thread."""
    host, port = parse_host_port(address)
    server = (_MetricsServerV6 if ":" in host else _MetricsServer)((host, port), handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="metrics-http", daemon=True
    )
    thread.start()
    return server, thread


class HttpEndpoints:
    """The metrics listener and the probe listener of ``config``. ``.port`` and
    ``.probe_port`` are the bound ports once started. ``/ready`` answers ``ready()``,
    ``/health`` ``live()`` (200 while True, else 503)."""

    def __init__(self, config: Config, render: Callable[[], bytes] | None, ready: Callable[[], bool],
                 live: Callable[[], bool] = lambda: True) -> None:
        self.config = config
        self.render = render
        self.ready = ready
        self.live = live
        self.port: int | None = None
        self.probe_port: int | None = None
        self.tls = False
        self._server: _MetricsServer | None = None
        self._thread: threading.Thread | None = None
        self._probes: ProbeServer | None = None

    def start(self) -> None:
        """Bind both (ValueError for a bad address, OSError when one is taken, ConfigError
        for a bad web configuration); nothing stays bound when one fails."""
        web = WebConfigWatch(load_web_config(self.config.web_config_file)) if self.config.web_config_file else None
        self.tls = web is not None and web.current().context is not None
        try:
            self._probes = ProbeServer(probe_address_of(self.config), self.ready, self.live)
            self._probes.start()
            self.probe_port = self._probes.port
            self._server, self._thread = _serve(
                self.config.metrics_address, _make_handler(self.render, self.ready, web, self.live)
            )
        except BaseException:
            self.stop()
            raise
        self.port = self._server.server_address[1]

    def describe(self) -> str:
        """Where each listener is, for the start-up log line."""
        host = parse_host_port(self.config.metrics_address)[0] or "*"
        probe_host = parse_host_port(probe_address_of(self.config))[0] or "*"
        scheme = "https" if self.tls else "http"
        return (f"metrics on {host}:{self.port} ({scheme}: /metrics), probes on {probe_host}:{self.probe_port}"
                " (http: /health, /ready)")

    def stop(self) -> None:
        """Stop both; idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._probes is not None:
            self._probes.stop()
            self._probes = None


class WaitingEndpoint(HttpEndpoints):
    """Both addresses while the agent waits for NVML (``failOnInitError: false``):
    ``/health`` answers 200 so liveness and startup probes leave a pod that waits on purpose
    alone, ``/ready`` and ``/metrics`` answer 503. Stopped before the real service binds."""

    def __init__(self, config: Config) -> None:
        super().__init__(config, None, lambda: False)
