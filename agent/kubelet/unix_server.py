"""A gRPC server on one unix socket, as the kubelet's plugin APIs want them: the device
plugins and the DRA plugin (registration and service sockets) all serve this way.

Never takes a socket a live server holds (a second agent, or NVIDIA's plugin, on the same
directory): :class:`SocketInUseError`, and the file is left alone. On stop only our own
socket file is removed (identified by inode and change time: tmpfs and ext4 hand a freed
inode number to the next file); gRPC's listener unlinks its path when it stops, whoever's
file stands there by then, so a file that replaced ours is held by a hard link across the
stop and put back.
"""

from __future__ import annotations

import logging
import os
import socket
from concurrent import futures
from typing import Callable

import grpc

from agent.errors import AgentError

log = logging.getLogger(__name__)


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
        """Remove a stale socket file, then serve (again, after :meth:`stop`). SocketInUseError
        when a live server holds the socket (it is never removed), AgentError if its
        directory cannot be made, something else stands at its path, or it cannot bind."""
        if socket_in_use(self.path):
            raise SocketInUseError(f"{self.path}: {self._in_use}")
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:  # a regular file in its place, a read-only mount
            raise AgentError(f"cannot make the directory {directory}: {exc.strerror}") from exc
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a directory in its place: not ours to delete
            raise AgentError(f"cannot replace {self.path}: {exc.strerror}") from exc
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=self.name))
        self._add(server)
        try:
            bound = server.add_insecure_port(f"unix:{self.path}")
        except RuntimeError as exc:
            bound = 0
            log.debug("bind %s: %s", self.path, exc)
        if not bound:
            server.stop(0)
            raise AgentError(f"cannot listen on {self.path} (socket paths must be shorter than 108 bytes)")
        server.start()
        self._server = server
        self._identity = _identity(self.path)

    def _hold_foreign_socket(self) -> str | None:
        """A second name (a hard link) for what stands at our path when it is not our socket
        (another server took the name): gRPC's listener unlinks its path when it stops,
        whatever stands there then, and the link lets us put that file back."""
        if self._identity is None or self.socket_present() or _identity(self.path) is None:
            return None
        keep = f"{self.path}.keep-{os.getpid()}"
        try:
            os.link(self.path, keep)
        except OSError as exc:  # gone meanwhile, or a filesystem without hard links
            log.debug("cannot hold %s while stopping: %s", self.path, exc)
            return None
        return keep

    def socket_present(self) -> bool:
        """True while our socket file is still in place (the kubelet removes it on restart)."""
        return self._identity is not None and _identity(self.path) == self._identity

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and remove our socket file (never another process's)."""
        if self._server is not None:
            keep = self._hold_foreign_socket()
            try:
                self._server.stop(grace_s).wait(grace_s + 1.0)
            finally:
                self._server = None
                if keep is not None:
                    _put_back(keep, self.path)
        if self.socket_present():
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _put_back(keep: str, path: str) -> None:
    """Give ``path`` back the file held at ``keep`` if the stop removed it; drop the link."""
    try:
        if os.path.lexists(path):
            os.unlink(keep)
        else:
            os.rename(keep, path)
    except OSError as exc:
        log.debug("cannot put %s back: %s", path, exc)
