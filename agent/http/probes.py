"""The probe listener: ``/health`` and ``/ready`` for the kubelet, on their own port.

Why a listener of their own: on the metrics port the probes shared one cap of connections with
``/metrics``, and any pod can reach that port, so a hundred connections dribbling a byte now
and then made every liveness probe a 503 and the kubelet restarted the agent. Here:

- nothing is shared with ``/metrics``: another port, another thread, no TLS and no
  authentication (the kubelet's ``httpGet`` probes speak plain HTTP and carry no credentials;
  the answers say only "alive" and "ready");
- one thread serves every connection from a selector, so a connection costs a socket and a few
  bytes, not a thread; a request must arrive whole within ``PROBE_DEADLINE_S`` of the
  connection (a total, not per byte), and is answered and closed at once;
- nobody can hold the place of the next probe: at ``MAX_PROBE_CONNECTIONS`` pending
  connections the oldest one is dropped to admit the new one. The kubelet's probe sends its
  request as soon as it is connected and is answered on arrival, so crowding it out takes
  more new connections than fit between its connect and its request, not a slow trickle.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable

from agent.formats import parse_host_port

log = logging.getLogger(__name__)

#: A probe's request must be whole this long after its connection was accepted.
PROBE_DEADLINE_S = 5.0
#: Connections waiting for their request; one more drops the oldest of them.
MAX_PROBE_CONNECTIONS = 256
#: Longest request head read (the kubelet's is ~150 bytes); a longer one is answered 431.
MAX_HEAD_BYTES = 8192
#: Connections accepted per round of the loop, so that reading keeps pace with accepting.
_ACCEPT_BATCH = 32

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def _response(status: int, body: bytes, head_only: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    return head if head_only else head + body


def _answer(check: Callable[[], bool], what: str) -> bool:
    """``check()``; False when it raises (logged with its traceback: a bug)."""
    try:
        return bool(check())
    except Exception:
        log.exception("%s check failed", what)
        return False


class ProbeServer:
    """Serves ``GET``/``HEAD`` ``/health`` (200 while ``live()`` is True, else 503) and
    ``/ready`` (200 when ``ready()`` is True, else 503) on ``address`` (``HOST:PORT``; port 0
    picks a free one, see ``.port``)."""

    def __init__(self, address: str, ready: Callable[[], bool], live: Callable[[], bool] = lambda: True) -> None:
        self.address = address
        self.ready = ready
        self.live = live
        self.port: int | None = None
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._pending: OrderedDict[socket.socket, tuple[float, bytearray]] = OrderedDict()
        self._selector = selectors.DefaultSelector()

    def start(self) -> None:
        """Bind (ValueError for a bad address, OSError when it is taken) and serve."""
        host, port = parse_host_port(self.address, "probe address")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener, self.port = listener, listener.getsockname()[1]
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="probes-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close every connection; idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        for conn in list(self._pending):
            self._drop(conn)
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
        self._selector.close()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stopping.is_set():
            now = time.monotonic()
            oldest = next(iter(self._pending.values()), None)
            wait = 0.2 if oldest is None else max(0.0, min(0.2, oldest[0] - now))
            for key, _ in self._selector.select(wait):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._expire(time.monotonic())

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                    self._drop(next(iter(self._pending)))  # out of descriptors: make room
                    continue
                log.debug("probes: accept failed: %s", exc)
                return
            if len(self._pending) >= MAX_PROBE_CONNECTIONS:
                self._drop(next(iter(self._pending)))
            conn.setblocking(False)
            self._pending[conn] = (time.monotonic() + PROBE_DEADLINE_S, bytearray())
            self._selector.register(conn, selectors.EVENT_READ, True)
            self._read(conn)  # the request is usually there already

    def _read(self, conn: socket.socket) -> None:
        entry = self._pending.get(conn)
        if entry is None:
            return
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        head = entry[1]
        head += data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            end = head.find(b"\n\n")
        if end >= 0:
            self._answer(conn, bytes(head[:end]))
        elif len(head) > MAX_HEAD_BYTES:
            self._send_and_drop(conn, _response(431, b"request head too long\n"))

    def _answer(self, conn: socket.socket, head: bytes) -> None:
        words = head.split(b"\n", 1)[0].split()
        if len(words) != 3 or not words[2].startswith(b"HTTP/1."):
            self._send_and_drop(conn, _response(400, b"bad request\n"))
            return
        method, path = words[0], words[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            self._send_and_drop(conn, _response(405, b"only GET and HEAD\n"))
            return
        head_only = method == b"HEAD"
        if path == b"/health":
            ok = _answer(self.live, "liveness")
            reply = _response(200 if ok else 503, b"ok\n" if ok else b"cannot serve\n", head_only)
        elif path == b"/ready":
            ok = _answer(self.ready, "readiness")
            reply = _response(200 if ok else 503, b"ready\n" if ok else b"not ready\n", head_only)
        else:
            reply = _response(404, b"not found: the probe port serves /health and /ready\n", head_only)
        self._send_and_drop(conn, reply)

    def _send_and_drop(self, conn: socket.socket, reply: bytes) -> None:
        try:
            conn.send(reply)  # a few hundred bytes: the socket buffer takes them whole
        except OSError as exc:
            log.debug("probes: reply not sent: %s", exc)
        self._drop(conn)

    def _expire(self, now: float) -> None:
        while self._pending:
            conn, (deadline, _) = next(iter(self._pending.items()))
            if deadline > now:
                return
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if self._pending.pop(conn, None) is None:
            return
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
