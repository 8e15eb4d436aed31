"""A gRPC server on one unix socket, as the kubelet's plugin APIs want them: the device
plugins and the DRA plugin (registration and service sockets) all serve this way.

Never takes a socket a live server holds (a second agent, or NVIDIA's plugin, on the same
directory): :class:`SocketInUseError`, and the file is left alone. On stop only our own
socket file is removed (identified by inode and change time: tmpfs and ext4 hand a freed
inode number to the next file).

A socket is bound under a hidden staging name in the same directory and renamed into place
once it listens: the name appears atomically, already accepting (a kubelet that dials as
soon as it sees the file is never refused; the plugin watcher ignores names that start with
``.``, as its ``handleCreateEvent`` does), and a stale file is replaced in the same step.
It also keeps gRPC's own clean-up off the real name: its listener unlinks the path it bound
when it stops, whoever's file stands there by then (another server's, after it took the
name), and that path is the staging name, long renamed away. A kubelet restart that clears
the directory between the bind and the rename takes the staged socket with it: the rename
fails (ENOENT) and a new socket is bound, a few times, before the start fails.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from concurrent import futures
from typing import Callable

import grpc

from agent.errors import AgentError

log = logging.getLogger(__name__)

#: sun_path's size on Linux: a socket path must be shorter (its NUL included).
MAX_SOCKET_PATH = 108
_STAGED = itertools.count()
#: Binds tried when the directory is cleared between a bind and its rename, before giving up
#: (the owner's keeper tries again later).
_STAGE_TRIES = 3


class SocketInUseError(AgentError):
    """Another live server answers on the socket we would serve on (a second agent, or
    NVIDIA's device plugin, on the same kubelet directory)."""


def socket_in_use(path: str, timeout_s: float = 0.5) -> bool:
    """True when a server accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout_s)
    try:
        probe.connect(path)
    except OSError:  # absent, a stale file nobody listens on, not a socket
        return False
    finally:
        probe.close()
    return True


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


class UnixGrpcServer:
    """A gRPC server on ``path`` with the servicers ``add(server)`` installs; ``name``
    prefixes its worker threads. ``in_use`` is the message of the SocketInUseError raised
    when a live server already holds ``path``."""

    def __init__(
        self,
        path: str,
        add: Callable[[grpc.Server], None],
        *,
        name: str,
        max_workers: int = 8,
        in_use: str = "another server is serving on this socket",
    ) -> None:
        self.path = path
        self._add = add
        self.name = name
        self.max_workers = max_workers
        self._in_use = in_use
        self._server: grpc.Server | None = None
        self._identity: tuple[int, int] | None = None

    def start(self) -> None:
        """Serve (again, after :meth:`stop`) on ``path``, replacing a stale socket file.
        SocketInUseError when a live server holds the socket (it is never removed),
        AgentError if the path is too long, its directory cannot be made, something else
        stands at it (a directory), or it cannot bind."""
        if len(os.fsencode(self.path)) >= MAX_SOCKET_PATH:
            raise AgentError(f"cannot listen on {self.path}: socket paths must be shorter than {MAX_SOCKET_PATH} bytes")
        if socket_in_use(self.path):
            raise SocketInUseError(f"{self.path}: {self._in_use}")
        directory = os.path.dirname(self.path) or "."
        for attempt in range(1, _STAGE_TRIES + 1):
            server = self._serve_staged(directory)
            if server is not None:
                break
            # the directory was cleared between the bind and the rename (a kubelet restart
            # removes every file in it): the staged socket is gone, bind a new one
            log.debug("%s: the staged socket vanished before its rename (try %d)", self.path, attempt)
        else:
            raise AgentError(f"cannot serve on {self.path}: its directory was cleared {_STAGE_TRIES} times in a row"
                             " while the socket was being bound")
        self._server = server
        self._identity = _identity(self.path)

    def _serve_staged(self, directory: str) -> grpc.Server | None:
        """Bind a new server under a staging name in ``directory``, start it and rename it to
        ``path``; None when the staged socket vanished before the rename (the directory was
        cleared meanwhile). AgentError when it cannot bind or the rename fails otherwise."""
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:  # a regular file in its place, a read-only mount
            raise AgentError(f"cannot make the directory {directory}: {exc.strerror}") from exc
        staged = os.path.join(directory, f".{os.getpid()}-{next(_STAGED)}.sock")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=self.name))
        self._add(server)
        try:
            bound = server.add_insecure_port(f"unix:{staged}")
        except RuntimeError as exc:
            bound = 0
            log.debug("bind %s: %s", staged, exc)
        if not bound:
            server.stop(0)
            raise AgentError(f"cannot listen on {self.path}")
        server.start()
        try:  # the name appears at once, already listening, and replaces a stale file
            os.rename(staged, self.path)
        except FileNotFoundError:
            server.stop(0)
            return None
        except OSError as exc:  # a directory in its place: not ours to delete
            server.stop(0)
            raise AgentError(f"cannot serve on {self.path}: {exc.strerror}") from exc
        return server

    def socket_present(self) -> bool:
        """True while our socket file is still in place (the kubelet removes it on restart)."""
        return self._identity is not None and _identity(self.path) == self._identity

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and remove our socket file (never another process's)."""
        if self._server is not None:  # gRPC unlinks the staged name, long renamed away
            self._server.stop(grace_s).wait(grace_s + 1.0)
            self._server = None
        if self.socket_present():
            try:
                os.unlink(self.path)
            except OSError:
                pass

