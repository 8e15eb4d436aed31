"""All the node's device-plugin servers, their registration, and the kubelet watch.

The kubelet clears its device-plugin directory when it starts, so a restarted kubelet knows
nothing of us: a watch thread notices ``kubelet.sock`` being re-created (its inode changes)
or our own socket vanishing, serves again and re-registers (well within 2 s: it polls every
``poll_s``). A kubelet that appears after the agent started is handled the same way.
Registration that fails is retried with capped exponential backoff.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from agent.config import Config
from agent.deviceplugin.allocation import RequestHandler
from agent.deviceplugin.resources import PluginResource, build_resources
from agent.deviceplugin.server import KUBELET_SOCKET, PluginServer, SocketInUseError, register
from agent.health import HealthState
from agent.topology.model import Topology

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    server: PluginServer
    registered: bool = False
    next_try_s: float = 0.0
    backoff_s: float = 0.0


class DevicePluginManager:
    """Serves and registers one plugin per resource built from (topology, config).

    ``start()`` raises :class:`agent.errors.ConfigError` when the resources cannot be built
    (a MIG layout that does not fit the strategy) and AgentError when a socket cannot be
    bound. ``metrics`` is an ``AgentMetrics`` or None.
    """

    def __init__(
        self,
        topology: Topology,
        config: Config,
        health: HealthState,
        *,
        engine_factory: Callable[[Topology], object] | None = None,
        metrics: object | None = None,
        poll_s: float = 0.1,
        register_timeout_s: float = 2.0,
        max_backoff_s: float = 5.0,
        path_exists: Callable[[str], bool] = os.path.exists,
    ) -> None:
        self.topology = topology
        self.config = config
        self.health = health
        self.metrics = metrics
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self.max_backoff_s = max_backoff_s
        self._engine_factory = engine_factory
        self._path_exists = path_exists
        self._lock = threading.RLock()
        self._slots: list[_Slot] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kubelet_inode: tuple[int, int, int] | None = None
        self._seen_kubelet = False
        self._taken: set[str] = set()  # our socket paths another live server holds now
        self.resources: tuple[PluginResource, ...] = ()
        self.kubelet_restarts = 0  # a new kubelet.sock after we had seen one
        self.socket_losses = 0  # our socket removed while the kubelet stayed
        self.registrations = 0  # successful Register calls
        #: Called (on the watch thread) after a kubelet restart was detected; the daemon
        #: uses it to read the topology again.
        self.on_kubelet_restart: Callable[[], None] | None = None
        health.add_listener(self._publish_health)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.config.kubelet_dir, KUBELET_SOCKET)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._lock:
            self._serve_all(self.topology, self.config)
        self._publish_health()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="kubelet-watch", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop watching, close streams, stop servers, remove our sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.register_timeout_s + 2.0)
            self._thread = None
        with self._lock:
            for slot in self._slots:
                slot.server.stop(grace_s)
            self._slots = []

    def reload(self, topology: Topology, config: Config) -> None:
        """Serve (topology, config) instead: new servers, then registration again. On a
        ConfigError the old servers keep running."""
        build_resources(topology, config)  # validate before tearing anything down
        with self._lock:
            for slot in self._slots:
                slot.server.stop(0.5)
            self._slots = []
            self.topology, self.config = topology, config
            self._serve_all(topology, config)
        self._publish_health()

    def attach_metrics(self, metrics: object | None) -> None:
        """Report to ``metrics`` (an ``AgentMetrics``) from now on: registrations, kubelet
        restarts, preferred-allocation latency, device health (published at once)."""
        with self._lock:
            self.metrics = metrics
            for slot in self._slots:
                slot.server.servicer.metrics = metrics
            if metrics is not None:
                for slot in self._slots:
                    if slot.registered:
                        hook = getattr(metrics, "registration", None)
                        if hook is not None:
                            hook(slot.server.resource.name)
        self._publish_health()

    def ready(self) -> bool:
        """Every resource is registered with the running kubelet."""
        with self._lock:
            return bool(self._slots) and all(s.registered for s in self._slots)

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return True
            time.sleep(0.02)
        return self.ready()

    def socket_paths(self) -> list[str]:
        with self._lock:
            return [s.server.path for s in self._slots]

    # ------------------------------------------------------------------ internals
    def _handler(self, resource: PluginResource, topology: Topology, config: Config) -> RequestHandler:
        engine = self._engine_factory(topology) if self._engine_factory is not None else None
        return RequestHandler(resource, topology, config, engine, path_exists=self._path_exists)

    def _new_server(self, resource: PluginResource, topology: Topology, config: Config) -> PluginServer:
        server = PluginServer(
            self._handler(resource, topology, config), self.health, config.kubelet_dir, metrics=self.metrics
        )
        server.start()
        return server

    def _serve_all(self, topology: Topology, config: Config) -> None:
        self.resources = build_resources(topology, config)
        if not self.resources:
            log.warning("no GPU resources to advertise on this node")
        os.makedirs(config.kubelet_dir, exist_ok=True)
        for resource in self.resources:
            self._slots.append(_Slot(self._new_server(resource, topology, config)))
            log.info("serving %s (%d devices) on %s", resource.name, len(resource.devices), self._slots[-1].server.path)
        if self.resources and not os.path.exists(self.kubelet_socket):
            log.warning(
                "no kubelet socket at %s yet: registering as soon as the kubelet creates it",
                self.kubelet_socket,
            )

    def _publish_health(self) -> None:
        set_health = getattr(self.metrics, "set_device_health", None)
        if set_health is None:
            return
        unhealthy = self.health.snapshot()
        for resource in self.resources:
            for d in resource.devices:
                set_health(resource.name, d.id, d.gpu_index not in unhealthy)

    def _kubelet_inode_now(self) -> tuple[int, int, int] | None:
        # The inode number alone is not enough: tmpfs and ext4 hand a freed inode number
        # to the next file, so a re-created kubelet.sock can get the same one. The change
        # time (ns) tells the new file apart.
        try:
            st = os.stat(self.kubelet_socket)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns)

    def _watch(self) -> None:
        while True:
            try:
                self._watch_once()
            except Exception:  # keep watching whatever happens; the next round retries
                log.exception("kubelet watch round failed")
            if self._stop.wait(self.poll_s):
                return

    def _watch_once(self) -> None:
        now = time.monotonic()
        inode = self._kubelet_inode_now()
        with self._lock:
            if inode != self._kubelet_inode:
                if inode is not None:
                    if self._seen_kubelet:
                        self.kubelet_restarts += 1
                        log.warning("kubelet restarted (kubelet.sock re-created): serving and registering again")
                        hook = getattr(self.metrics, "kubelet_restart", None)
                        if hook is not None:
                            hook()
                        if self.on_kubelet_restart is not None:
                            self.on_kubelet_restart()
                    else:
                        log.info("kubelet socket %s found", self.kubelet_socket)
                    self._seen_kubelet = True
                else:
                    log.warning("kubelet socket %s is gone; waiting for the kubelet", self.kubelet_socket)
                self._kubelet_inode = inode
                for slot in self._slots:
                    slot.registered = False
                    slot.next_try_s = now
                    slot.backoff_s = 0.0
            for i, slot in enumerate(self._slots):
                if self._stop.is_set():
                    return
                if not slot.server.socket_present():
                    path = slot.server.path
                    if path not in self._taken:
                        if inode is not None:
                            self.socket_losses += 1
                        log.warning("socket %s vanished: serving it again", path)
                    resource = slot.server.resource
                    slot.server.stop(0)
                    try:
                        server = self._new_server(resource, self.topology, self.config)
                    except SocketInUseError as exc:
                        # another live server took the name: never delete it, never fight
                        if path not in self._taken:
                            log.error("%s; not serving %s until it is gone", exc, resource.name)
                            self._taken.add(path)
                        slot.registered = False
                        continue
                    self._taken.discard(path)
                    self._slots[i] = slot = _Slot(server, next_try_s=now)
                if inode is None or slot.registered or now < slot.next_try_s:
                    continue
                self._register(slot, now)

    def _register(self, slot: _Slot, now: float) -> None:
        resource = slot.server.resource
        try:
            register(self.kubelet_socket, resource, self.register_timeout_s)
        except grpc.RpcError as exc:
            slot.backoff_s = min(self.max_backoff_s, max(0.2, slot.backoff_s * 2))
            slot.next_try_s = now + slot.backoff_s
            details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[attr-defined]
            log.warning(
                "kubelet refused registration of %s: %s (retry in %.1f s)",
                resource.name, details, slot.backoff_s,
            )
            return
        slot.registered = True
        self.registrations += 1
        log.info("registered %s with the kubelet (endpoint %s)", resource.name, resource.socket_name)
        hook = getattr(self.metrics, "registration", None)
        if hook is not None:
            hook(resource.name)
