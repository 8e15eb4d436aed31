"""All the node's device-plugin servers, their registration, and the kubelet watch.

The kubelet clears its device-plugin directory when it starts, so a restarted kubelet knows
nothing of us: the :class:`agent.kubelet.plugin_socket.SocketKeeper` (the DRA plugin's too)
notices ``kubelet.sock`` being re-created (its inode changes) or our own socket vanishing
and serves again (well within 2 s: it polls every ``poll_s``); this module then registers
again. A kubelet that appears after the agent started is handled the same way; anything
but a socket at ``kubelet.sock`` is no kubelet, said once for what it is. Registration
that fails is retried with capped exponential backoff: said when it starts failing, each
failure counted (``events.registration_failure``).

The manager is the device-plugin mode's servers as the daemon runs them (start, ready,
set_topology, stop; the DRA mode's :class:`agent.dra.servers.DraServers` has the same shape).

Threads: the daemon's main thread calls :meth:`DevicePluginManager.start`,
:meth:`~DevicePluginManager.set_topology` and :meth:`~DevicePluginManager.stop`; the
keeper's thread (``kubelet-watch``) re-serves and registers; the metrics HTTP server calls
:meth:`~DevicePluginManager.ready`. What the kubelet is offered (each device with its health) is
reported to ``events.devices_offered`` whenever it changes, on the thread that changed it: the
servers replaced, a GPU's health (a listener of the health state), a sharing supervisor's readiness.
Once started, the keeper's thread alone starts, stops and registers servers (all of that is
I/O); ``set_topology`` hands it the new (topology, config) and waits for the outcome.

A shared resource whose sharing needs a supervisor (:mod:`agent.sharing`: a daemon that
keeps the replicas servable) has one, synced with the servers; such a resource is registered
once its sharing is ready.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from agent.config import Config
from agent.deviceplugin.allocation import RequestHandler
from agent.deviceplugin.reporting import DevicePluginEvents
from agent.deviceplugin.resources import PluginResource, build_resources
from agent.deviceplugin.server import DeviceListChanges, PluginServer, plugin_options
from agent.errors import AgentError, shorten
from agent.health import HealthState
from agent.kubelet.plugin_socket import UNSERVED_LIMIT_S, Served, SocketKeeper
from agent.kubelet.podresources import rpc_message
from agent.kubelet.registration import KUBELET_SOCKET, register_device_plugin
from agent.nccl.host_dir import NcclFiles, nccl_files_for
from agent.nccl.sweep import NcclSweeper
from agent.retry import Backoff, Outage
from agent.sharing.base import PROBE_INTERVAL_S, Supervisor, Supervisors
from agent.topology.model import Topology

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    server: PluginServer
    register_backoff: Backoff  # the keeper's thread only
    register_outage: Outage  # the keeper's thread only
    supervisor: Supervisor | None = None  # its sharing's supervisor, when it has one
    registered: bool = False  # written under the manager's lock (ready() reads it)
    next_try_s: float = 0.0  # the keeper's thread only


def _sharing_ready(slot: _Slot) -> bool:
    """The slot's resource can be served as shared: no supervisor, or a ready one."""
    return slot.supervisor is None or slot.supervisor.ready


@dataclass
class _Reload:
    """A reload handed to the watch thread; ``done`` is set once it was applied (or failed)."""

    topology: Topology
    config: Config
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class DevicePluginManager:
    """Serves and registers one plugin per resource built from (topology, config).

    ``start()`` raises :class:`agent.errors.ConfigError` when the resources cannot be built
    (a MIG layout that does not fit the strategy) and AgentError when a socket cannot be
    bound. Registrations, kubelet restarts and preferred-allocation latency are reported to
    ``events`` (the agent's self-metrics); ``on_kubelet_restart`` is called (on the watch
    thread, no lock held) after a kubelet restart was seen: the daemon reads the topology
    again.
    """

    def __init__(
        self,
        topology: Topology,
        config: Config,
        health: HealthState,
        *,
        events: DevicePluginEvents,
        on_kubelet_restart: Callable[[], None] | None = None,
        poll_s: float = 0.1,
        register_timeout_s: float = 2.0,
        max_backoff_s: float = 5.0,
        unserved_limit_s: float = UNSERVED_LIMIT_S,
        supervisor_probe_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.health = health
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self.max_backoff_s = max_backoff_s
        self.unserved_limit_s = unserved_limit_s
        # Lock order: ``_lock`` is a leaf. It guards the fields other threads read (the
        # slots list and their ``registered`` flags, topology, config, resources, the
        # pending reload, whether the keeper runs) and is held only to read or assign them:
        # never across I/O (a Register call, starting or stopping a server), an event or a
        # callback, and no other lock (the health state's condition included) is taken
        # while it is held.
        self._lock = threading.Lock()
        # Held while the offered devices are computed and reported, so that two threads'
        # reports cannot land out of order; taken before ``_lock`` and the health state's.
        self._offers_lock = threading.Lock()
        self.topology = topology
        self.config = config
        self.events = events
        self._on_kubelet_restart = on_kubelet_restart
        self._slots: list[_Slot] = []
        self._supervisors = Supervisors(self._sharing_changed, supervisor_probe_s)  # the servers' owner only
        self._changes = DeviceListChanges().follow(health)  # what the device-list streams wait on
        self._pending: _Reload | None = None
        self._stopping = threading.Event()
        self._keeper = SocketKeeper(
            log, "kubelet watch", thread_name="kubelet-watch", poll_s=poll_s, max_backoff_s=max_backoff_s,
            kubelet_dir=config.kubelet_dir, before_round=self._apply_pending_reload,
            on_kubelet=self._kubelet_changed, on_vanished=self._unregister, on_served=self._served_again,
            after_round=self._register_all,
        )
        self._keeping = False
        self.resources: tuple[PluginResource, ...] = ()
        # the containers' NCCL files: one owner of the host directory, shared by every
        # resource's handler and the sweeper (which leaves a file being written alone)
        self.nccl_files: NcclFiles | None = None
        # removes the NCCL topology files of containers the kubelet no longer lists
        self._nccl_sweeper = NcclSweeper(lambda: (self.config, self.nccl_files, [r.name for r in self.resources]))
        health.add_listener(self._report_offers)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.config.kubelet_dir, KUBELET_SOCKET)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._replace_servers(self.topology, self.config)
        self._stopping.clear()
        with self._lock:
            self._keeping = True
        self._keeper.start()
        self._nccl_sweeper.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop watching, close streams, stop servers, remove our sockets."""
        self._stopping.set()
        with self._lock:
            self._keeping = False
        self._keeper.stop(self.register_timeout_s + 2.0)
        self._apply_pending_reload()  # never leave a reload waiting
        with self._lock:
            slots, self._slots = self._slots, []
        for slot in slots:
            slot.server.stop(grace_s)
        self._supervisors.stop()
        self._nccl_sweeper.stop()

    def set_topology(self, topology: Topology, config: Config) -> None:
        """Serve (topology, config) instead: new servers, then registration again. On a
        ConfigError the old servers keep running; AgentError when a socket cannot be bound."""
        build_resources(topology, config)  # validate before tearing anything down
        request = _Reload(topology, config)
        with self._lock:
            keeping = self._keeping
            if keeping:
                self._pending = request
        if not keeping:  # not started (or stopped): nobody else touches the servers
            self._replace_servers(topology, config)
            return
        self._keeper.wake()
        while not request.done.wait(0.2):
            if not self._keeper.alive():
                raise AgentError("the device plugins stopped while reloading")
        if request.error is not None:
            raise request.error

    def ready(self) -> bool:
        """Every resource is registered with the running kubelet. Never waits on I/O (the
        readiness probe calls it)."""
        with self._lock:
            slots = list(self._slots)
        return bool(slots) and all(s.registered and _sharing_ready(s) for s in slots)

    def live(self) -> bool:
        """False once a resource's socket could not be served for ``unserved_limit_s``
        (:meth:`agent.kubelet.plugin_socket.SocketKeeper.serving`). Never waits on I/O."""
        return self._keeper.serving(self.unserved_limit_s)

    def advertised(self) -> list[tuple[str, str, bool]]:
        """(resource, device ID, healthy) for every device offered to the kubelet now. Never
        waits on I/O."""
        with self._lock:
            resources, slots = self.resources, list(self._slots)
        unhealthy = self.health.snapshot()
        not_ready = {s.server.resource.name for s in slots if not _sharing_ready(s)}
        return [
            (r.name, d.id, d.gpu_index not in unhealthy and not (d.replica is not None and r.name in not_ready))
            for r in resources for d in r.devices
        ]

    # ------------------------------------------------------------------ internals
    def _new_server(self, resource: PluginResource, topology: Topology, config: Config) -> PluginServer:
        return PluginServer(
            RequestHandler(resource, topology, config, self.nccl_files),
            self.health, config.kubelet_dir, events=self.events,
            supervisor=self._supervisors.get(resource.name), changes=self._changes,
        )

    def _report_offers(self) -> None:
        """Report what the kubelet is offered now (``events.devices_offered``)."""
        with self._offers_lock:
            self.events.devices_offered(self.advertised())

    def _sharing_changed(self) -> None:
        """A sharing supervisor became ready or stopped being ready: report the offers, re-send
        the device lists and let the keeper's thread register a resource whose sharing is now
        ready."""
        self._report_offers()
        self._changes.changed()
        self._keeper.wake()

    def _replace_servers(self, topology: Topology, config: Config, *, keeping: bool = False) -> None:
        """Stop the servers, serve (topology, config). Runs on the thread that owns the
        servers (the caller before start, the keeper's thread after: ``keeping``). Before
        start a server that cannot start fails the start (AgentError); after it, the
        keeper serves that one with backoff (a kubelet restart may have cleared the
        directory under it), so a reload always ends with every resource kept."""
        resources = build_resources(topology, config)
        nccl_files = nccl_files_for(config, self.nccl_files)
        with self._lock:
            old, self._slots = self._slots, []
            self.topology, self.config, self.resources = topology, config, resources
            self.nccl_files = nccl_files
        self._keeper.follow_kubelet(config.kubelet_dir)
        unserved: list[tuple[PluginServer, str]] = []
        try:
            self._serve(resources, old, topology, config, unserved if keeping else None)
        finally:  # the servers that serve now are the ones kept, even after a failure
            with self._lock:
                slots = list(self._slots)
            self._keeper.keep([s.server for s in slots], [s.server.resource.name for s in slots])
        for server, reason in unserved:
            self._keeper.unserved(server, reason)
        if resources and not os.path.exists(self.kubelet_socket):
            log.warning(
                "no kubelet socket at %s yet: registering as soon as the kubelet creates it",
                self.kubelet_socket,
            )

    def _serve(
        self, resources: tuple[PluginResource, ...], old: list[_Slot], topology: Topology, config: Config,
        unserved: list[tuple[PluginServer, str]] | None,
    ) -> None:
        """Stop ``old``, serve ``resources``. A server that cannot start raises, unless
        ``unserved`` collects it (with why) and its slot stays."""
        for slot in old:
            slot.server.stop(0.5)
        self._supervisors.sync(
            ((r.name, r.sharing, r.replicas) for r in resources if r.sharing is not None), topology, config)
        if not resources:
            log.warning("no GPU resources to advertise on this node")
        os.makedirs(config.kubelet_dir, exist_ok=True)
        for resource in resources:  # a new slot is unregistered: the next round registers it
            server = self._new_server(resource, topology, config)
            try:
                server.start()
            except AgentError as exc:
                if unserved is None:
                    raise
                unserved.append((server, str(exc)))
            slot = _Slot(
                server, Backoff(min(0.2, self.max_backoff_s), self.max_backoff_s),
                Outage(log, f"registering {resource.name} with the kubelet", recovered_level=None, retrying=(
                    f"retrying with backoff up to {self.max_backoff_s:g} s; failures are counted in"
                    " gpu_agent_registration_failures_total")),
                self._supervisors.get(resource.name),
            )
            with self._lock:
                self._slots.append(slot)
            if server.socket_present():
                log.info("serving %s (%d devices) on %s", resource.name, len(resource.devices), server.path)
        self._report_offers()

    def _apply_pending_reload(self) -> None:
        with self._lock:
            request, self._pending = self._pending, None
        if request is None:
            return
        try:
            if self._stopping.is_set():
                raise AgentError("the device plugins stopped while reloading")
            self._replace_servers(request.topology, request.config, keeping=True)
        except BaseException as exc:  # handed to the thread that asked for the reload
            request.error = exc
        finally:
            request.done.set()

    def _kubelet_changed(self, restarted: bool) -> None:
        """A new kubelet socket (or none): every resource registers again, at once."""
        with self._lock:
            slots = list(self._slots)
            for slot in slots:
                slot.registered = False
        for slot in slots:
            slot.next_try_s = 0.0
            slot.register_backoff.reset()
        if restarted:
            self.events.kubelet_restart()
            if self._on_kubelet_restart is not None:
                self._on_kubelet_restart()

    def _slot_of(self, server: Served) -> _Slot | None:
        with self._lock:
            return next((s for s in self._slots if s.server is server), None)

    def _unregister(self, server: Served) -> None:
        """Our socket vanished: the kubelet forgot it; registered again once served."""
        slot = self._slot_of(server)
        if slot is not None:
            with self._lock:
                slot.registered = False

    def _served_again(self, server: Served) -> None:
        slot = self._slot_of(server)
        if slot is not None:
            slot.next_try_s = 0.0
            slot.register_backoff.reset()

    def _register_all(self, kubelet_present: bool) -> None:
        """Register every served, unregistered resource whose retry is due (shared replicas
        once their sharing is ready)."""
        if not kubelet_present:
            return
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            if self._stopping.is_set():
                return
            if slot.registered or time.monotonic() < slot.next_try_s or not slot.server.socket_present():
                continue
            if not _sharing_ready(slot):
                continue  # shared replicas are advertised once their sharing is ready
            self._register(slot)

    def _register(self, slot: _Slot) -> None:
        resource = slot.server.resource
        try:
            register_device_plugin(
                self.kubelet_socket, resource_name=resource.name, endpoint=resource.socket_name,
                options=plugin_options(slot.server.servicer.handler), timeout_s=self.register_timeout_s,
            )
        except grpc.RpcError as exc:
            slot.next_try_s = time.monotonic() + slot.register_backoff.next()
            self.events.registration_failure(resource.name)
            # one line when registering starts failing; the retries are counted, not logged
            slot.register_outage.failed(shorten(rpc_message(exc), 300))
            return
        slot.register_outage.recovered()
        slot.register_backoff.reset()
        with self._lock:
            slot.registered = True
        log.info("registered %s with the kubelet (endpoint %s)", resource.name, resource.socket_name)
        self.events.registration(resource.name)
