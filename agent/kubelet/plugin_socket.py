"""Keeping a plugin's unix sockets served while the kubelet comes and goes: the one socket
lifecycle both kubelet-facing sides compose (the device plugin's per-resource sockets, the
DRA plugin's service and registration sockets).

It follows what the kubelet does to plugin sockets:

- **Device manager** (``pkg/kubelet/cm/devicemanager``, its v1beta1 plugin server): at start
  the kubelet creates its directory, removes every file in it but its checkpoint
  (``removeContents``), and listens on a new ``kubelet.sock``. A plugin learns of a kubelet
  restart only from outside: ``kubelet.sock`` re-created (a new inode) or its own socket
  gone. It must then serve again and call ``Register`` again (NVIDIA's plugin restarts on the
  fsnotify ``Create`` of ``kubelet.sock``). Pass ``kubelet_dir`` for this.
- **Plugin watcher** (``pkg/kubelet/pluginmanager/pluginwatcher``): the kubelet watches its
  registry directory; a socket created there is registered anew (``GetInfo``, then
  ``NotifyRegistrationStatus``), a removed one deregistered. So a registration socket served
  again means a registration to wait for again (the owner's ``on_vanished``).
- **Directories**: the directory the kubelet owns (``kubelet_dir``) is the kubelet's to
  create; while it is missing nothing is served there, said once, until it is back. A
  socket's own directory that cannot be made (a regular file in its place) is a failure of
  serving that socket.

What it does each round (every ``poll_s``, on its one thread, or at once on :meth:`wake`):
the owner's ``before_round``; with a ``kubelet_dir``, the kubelet socket's identity (found,
gone, re-created: a restart, or something that is not a socket there, each said once, and
``on_kubelet`` hears of each change); then every kept socket that vanished is served again.
It never fights another owner: a socket a live server holds is left alone
(:class:`SocketInUseError`, said once until it is free; gRPC's unlink on stop is guarded in
:class:`~agent.kubelet.unix_server.UnixGrpcServer`). A failure to serve is said once,
retried with capped exponential backoff, and its end said once; a round that fails
unexpectedly is said once per distinct error (with its traceback) and retried with backoff.
Then the owner's ``after_round`` (the device plugin registers there).

A socket the owner could not serve itself (a reload's new server whose start failed) is
handed over with :meth:`SocketKeeper.unserved` and served the same way. :meth:`SocketKeeper.serving`
is the owner's liveness: False once a kept socket has failed to be served for ``limit_s``
(the kubelet's directory present; a socket another live server holds does not count: never
fight), or once the keeper's thread is gone: a pod that cannot serve its GPUs is restarted
instead of staying unready forever.

Log lines go to the owner's logger (``log``): they are about the owner's sockets.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from agent.errors import AgentError
from agent.kubelet.registration import KUBELET_SOCKET
from agent.kubelet.unix_server import SocketInUseError
from agent.retry import Backoff, Outage
from agent.worker import Worker

__all__ = ["UNSERVED_LIMIT_S", "Served", "SocketKeeper"]

#: Seconds a kept socket may fail to be served before the owner reports itself not alive
#: (``/health`` 503, so the kubelet's liveness probe restarts the pod).
UNSERVED_LIMIT_S = 30.0


class Served(Protocol):
    """A server on one unix socket that can be started again after a stop
    (:class:`agent.kubelet.unix_server.UnixGrpcServer` and what wraps it)."""

    @property
    def path(self) -> str: ...

    def start(self) -> None: ...

    def stop(self, grace_s: float = 1.0) -> None: ...

    def socket_present(self) -> bool: ...


@dataclass
class _Kept:
    server: Served
    outage: Outage
    backoff: Backoff
    next_s: float = 0.0
    taken: bool = False  # another live server holds the path (said once until it is free)
    failing_since: float | None = None  # monotonic seconds: serving it fails since then


@dataclass
class _KubeletWatch:
    identity: tuple[int, int, int] | None = None
    oddity: str | None = None  # what stands at kubelet.sock when it is not a socket
    seen: bool = False
    dir_missing: bool = False


class SocketKeeper(Worker):
    """Keeps the sockets handed to :meth:`keep` served (see the module docstring).

    ``log`` is the owner's logger and ``name`` what its log lines call the keeper ("kubelet
    watch"); ``kubelet_dir`` the kubelet's device-plugin directory, to wait for and to watch
    its ``kubelet.sock`` in (None: no kubelet socket is watched and the sockets' directories
    are made as needed, the DRA side; :meth:`follow_kubelet` changes it). The callbacks run on the
    keeper's thread, with no lock of the keeper held: ``before_round()``,
    ``on_kubelet(restarted)`` when the kubelet socket changed (appeared, went, or was
    re-created after one had been seen: ``restarted``), ``on_vanished(server)`` before a vanished socket is served
    again, ``on_served(server)`` once it is, and ``after_round(kubelet_present)``.
    """

    def __init__(
        self,
        log: logging.Logger,
        name: str,
        *,
        thread_name: str,
        poll_s: float,
        max_backoff_s: float = 5.0,
        kubelet_dir: str | None = None,
        before_round: Callable[[], None] | None = None,
        on_kubelet: Callable[[bool], None] | None = None,
        on_vanished: Callable[[Served], None] | None = None,
        on_served: Callable[[Served], None] | None = None,
        after_round: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__()
        self.thread_name = thread_name
        self.log = log
        self.poll_s = poll_s
        self.max_backoff_s = max(max_backoff_s, poll_s)
        self.kubelet_dir = kubelet_dir
        self._before_round = before_round
        self._on_kubelet = on_kubelet
        self._on_vanished = on_vanished
        self._on_served = on_served
        self._after_round = after_round
        self._kept: list[_Kept] = []  # the keeper's thread only, once started
        self._kubelet = _KubeletWatch()  # the keeper's thread only
        self._round_outage = Outage(log, f"{name} round", level=logging.ERROR, per_reason=True)
        self._round_backoff = Backoff(poll_s, self.max_backoff_s)
        # when the longest failure to serve a kept socket began (None: none fails); written
        # by the keeper's thread at the end of each round, read by :meth:`serving`
        self._unserved_since: float | None = None
        self._started = False

    @property
    def kubelet_socket(self) -> str | None:
        """The kubelet's registration socket watched (None: none)."""
        return None if self.kubelet_dir is None else os.path.join(self.kubelet_dir, KUBELET_SOCKET)

    # ------------------------------------------------------------------ the owner's calls
    def keep(self, servers: Sequence[Served], labels: Sequence[str] | None = None) -> None:
        """Keep ``servers`` (already serving) from now on instead of the ones kept so far;
        ``labels`` name them in the log (default: their paths). Called before :meth:`start`
        or on the keeper's thread (in ``before_round``)."""
        names = labels if labels is not None else [s.path for s in servers]
        self._kept = [
            _Kept(s, Outage(self.log, f"serving {name} on {s.path}", level=logging.ERROR,
                            recovered_level=logging.WARNING),
                  Backoff(self.poll_s, self.max_backoff_s))
            for s, name in zip(servers, names)
        ]

    def unserved(self, server: Served, reason: str) -> None:
        """``server`` (kept) could not be served by its owner: said once, served with backoff
        from now on. Called on the keeper's thread (in ``before_round``)."""
        now = time.monotonic()
        for kept in self._kept:
            if kept.server is server:
                kept.outage.failed(reason)
                kept.next_s = now + kept.backoff.next()
                kept.failing_since = kept.failing_since or now

    def serving(self, limit_s: float = UNSERVED_LIMIT_S) -> bool:
        """False when the keeper's thread, once started, is gone, or a kept socket has
        failed to be served for ``limit_s`` seconds or more (see the module). Never waits."""
        if self._started and not self._stop.is_set() and not self.alive():
            return False
        since = self._unserved_since
        return since is None or time.monotonic() - since < limit_s

    def start(self) -> None:
        self._started = True
        super().start()

    def follow_kubelet(self, kubelet_dir: str | None) -> None:
        """Watch this kubelet directory from the next round (a reload moved it). Called
        before :meth:`start` or on the keeper's thread."""
        self.kubelet_dir = kubelet_dir

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching (the sockets keep serving: the owner stops them); :meth:`wake` runs
        the next round now (the owner has news: a reload, a supervisor's change)."""
        super().stop(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            wait_s = self.poll_s
            try:
                self._round()
                self._round_outage.recovered()
                self._round_backoff.reset()
            except Exception as exc:  # keep watching whatever happens; the next round retries
                # said once per distinct failure, with its traceback (an unexpected one is a bug)
                self._round_outage.failed(f"{type(exc).__name__}: {exc}", exc_info=True)
                wait_s = self._round_backoff.next()
            self._nap(wait_s)

    def _round(self) -> None:
        if self._before_round is not None:
            self._before_round()
        present = self._watch_kubelet()
        kept_now = list(self._kept)
        if self._kubelet_dir_present(present):
            now = time.monotonic()
            for kept in kept_now:
                if self._stop.is_set():
                    return
                if kept.server.socket_present():
                    kept.failing_since = None
                elif now >= kept.next_s:
                    self._serve_again(kept, now)
        else:  # waiting for the kubelet is no failure to serve
            for kept in kept_now:
                kept.failing_since = None
        self._unserved_since = min((k.failing_since for k in kept_now if k.failing_since is not None), default=None)
        if self._after_round is not None and not self._stop.is_set():
            self._after_round(present)

    # ------------------------------------------------------------------ the kubelet socket
    @staticmethod
    def _kubelet_identity(path: str) -> tuple[tuple[int, int, int] | None, str | None]:
        """The kubelet socket's identity (None: no socket there) and, when something else
        stands at its path, what it is."""
        # The inode number alone is not enough: tmpfs and ext4 hand a freed inode number
        # to the next file, so a re-created kubelet.sock can get the same one. The change
        # time (ns) tells the new file apart.
        try:
            st = os.stat(path)
        except OSError:
            return None, None
        if not stat.S_ISSOCK(st.st_mode):  # no kubelet listens on a file: nothing to register with
            kinds = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory"}
            return None, kinds.get(stat.S_IFMT(st.st_mode), "not a socket")
        return (st.st_dev, st.st_ino, st.st_ctime_ns), None

    def _watch_kubelet(self) -> bool:
        """Whether the kubelet socket is there (True when none is watched); each change is
        said once and handed to ``on_kubelet``."""
        path = self.kubelet_socket
        if path is None:
            return True
        watch = self._kubelet
        identity, oddity = self._kubelet_identity(path)
        if oddity != watch.oddity:
            watch.oddity = oddity
            if oddity is not None:
                self.log.warning(
                    "%s is %s, not the kubelet's socket: registering once the kubelet creates its socket there",
                    path, oddity,
                )
        if identity == watch.identity:
            return identity is not None
        restarted = identity is not None and watch.seen
        if restarted:
            self.log.warning("kubelet restarted (kubelet.sock re-created): serving and registering again")
        elif identity is not None:
            self.log.info("kubelet socket %s found", path)
        elif oddity is None:  # else said above
            self.log.warning("kubelet socket %s is gone; waiting for the kubelet", path)
        watch.seen = watch.seen or identity is not None
        watch.identity = identity
        if self._on_kubelet is not None:
            self._on_kubelet(restarted)
        return identity is not None

    def _kubelet_dir_present(self, kubelet_present: bool) -> bool:
        """Whether the kubelet's directory exists (True when none is waited for); its
        disappearance and return are said once each."""
        if self.kubelet_dir is None:
            return True
        watch = self._kubelet
        present = kubelet_present or os.path.isdir(self.kubelet_dir)
        if present != watch.dir_missing:
            return present
        watch.dir_missing = not present
        if present:
            self.log.warning("kubelet directory %s is back: serving again", self.kubelet_dir)
        else:
            self.log.warning(
                "kubelet directory %s does not exist any more: waiting for the kubelet to create it",
                self.kubelet_dir,
            )
        return present

    # ------------------------------------------------------------------ a vanished socket
    def _serve_again(self, kept: _Kept, now: float) -> None:
        """Serve a vanished socket again, unless another live server holds its path (never
        delete it, never fight: said once until it is free) or serving fails (said once,
        retried with capped exponential backoff)."""
        server = kept.server
        if not kept.taken and not kept.outage.failing:
            self.log.warning("socket %s vanished: serving it again", server.path)
        if self._on_vanished is not None:
            self._on_vanished(server)
        server.stop(0)
        try:
            server.start()
        except SocketInUseError as exc:
            if not kept.taken:
                self.log.error("%s; not serving it until it is gone", exc)
            kept.taken = True
            kept.failing_since = None  # another owner serves it: never fought over
            return
        except AgentError as exc:
            kept.outage.failed(str(exc))
            kept.next_s = now + kept.backoff.next()
            kept.failing_since = kept.failing_since or now
            return
        kept.outage.recovered()
        kept.backoff.reset()
        kept.taken = False
        kept.failing_since = None
        if self._on_served is not None:
            self._on_served(server)
