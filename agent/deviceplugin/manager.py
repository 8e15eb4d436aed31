"""All the node's device-plugin servers, their registration, and the kubelet watch.

The kubelet clears its device-plugin directory when it starts, so a restarted kubelet knows
nothing of us: a watch thread notices ``kubelet.sock`` being re-created (its inode changes)
or our own socket vanishing, serves again and re-registers (well within 2 s: it polls every
``poll_s``). A kubelet that appears after the agent started is handled the same way;
anything but a socket at ``kubelet.sock`` is no kubelet, said once for what it is.
Registration that fails is retried with capped exponential backoff: logged when it starts
failing, each failure counted (``events.registration_failure``).

The manager is the device-plugin mode's servers as the daemon runs them (start, ready,
set_topology, stop; the DRA mode's :class:`agent.dra.servers.DraServers` has the same shape).

Threads: the daemon's main thread calls :meth:`DevicePluginManager.start`,
:meth:`~DevicePluginManager.set_topology` and :meth:`~DevicePluginManager.stop`; the
kubelet-watch thread registers and re-serves; the metrics HTTP server calls
:meth:`~DevicePluginManager.ready`. What the kubelet is offered (each device with its health) is
reported to ``events.devices_offered`` whenever it changes, on the thread that changed it: the
servers replaced, a GPU's health (a listener of the health state), a sharing supervisor's readiness.
Once started, the watch thread alone starts, stops and registers servers (all of that is
I/O); ``set_topology`` hands it the new (topology, config) and waits for the outcome.

A shared resource whose sharing needs a supervisor (:mod:`agent.sharing`: a daemon that
keeps the replicas servable) has one, synced with the servers; the watch thread registers such a
resource once its sharing is ready.

Size: above 400 lines because it is one lifecycle: the servers per resource, their
registration, the kubelet-socket watch and the sharing supervisors' sync all share the one watch
thread and its state; splitting them would spread that state over modules.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from agent.config import Config
from agent.deviceplugin.allocation import RequestHandler
from agent.deviceplugin.ncclsweep import NcclSweeper
from agent.deviceplugin.reporting import DevicePluginEvents
from agent.deviceplugin.resources import PluginResource, build_resources
from agent.deviceplugin.server import DeviceListChanges, PluginServer, plugin_options
from agent.errors import AgentError, shorten
from agent.health import HealthState
from agent.kubelet.registration import KUBELET_SOCKET, register_device_plugin
from agent.kubelet.unix_server import SocketInUseError
from agent.ncclfiles import NcclFiles
from agent.sharing.base import PROBE_INTERVAL_S, Supervisor, Supervisors
from agent.topology.model import Topology

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    server: PluginServer
    supervisor: Supervisor | None = None  # its sharing's supervisor, when it has one
    registered: bool = False  # written under the manager's lock (ready() reads it)
    next_try_s: float = 0.0  # watch thread only
    backoff_s: float = 0.0  # watch thread only
    serve_failing: bool = False  # watch thread only: serving again failed, being retried
    next_serve_s: float = 0.0  # watch thread only
    serve_backoff_s: float = 0.0  # watch thread only
    register_failing: bool = False  # watch thread only: registration failed, being retried


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
        supervisor_probe_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.health = health
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self.max_backoff_s = max_backoff_s
        # Lock order: ``_lock`` is a leaf. It guards the fields other threads read (the
        # slots list and their ``registered`` flags, topology, config, resources, the
        # pending reload) and is held only to read or assign them: never across I/O (a
        # Register call, starting or stopping a server), an event or a callback, and no
        # other lock (the health state's condition included) is taken while it is held.
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
        self._stop = threading.Event()
        self._wake = threading.Event()  # a reload is pending, or stop
        self._thread: threading.Thread | None = None
        # watch thread only
        self._kubelet_inode: tuple[int, int, int] | None = None
        self._kubelet_oddity: str | None = None  # what stands at kubelet.sock if not a socket
        self._seen_kubelet = False
        self._taken: set[str] = set()  # our socket paths another live server holds now
        self._dir_missing = False  # the kubelet directory is gone (said once)
        self._round_error: str | None = None  # the last failed round's error (said once)
        self._round_backoff_s = 0.0
        self.resources: tuple[PluginResource, ...] = ()
        # removes the NCCL topology files of containers the kubelet no longer lists
        self._nccl_sweeper = NcclSweeper(lambda: (self.config, [r.name for r in self.resources]))
        health.add_listener(self._report_offers)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.config.kubelet_dir, KUBELET_SOCKET)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._replace_servers(self.topology, self.config)
        self._stop.clear()
        self._wake.clear()
        thread = threading.Thread(target=self._watch, name="kubelet-watch", daemon=True)
        with self._lock:
            self._thread = thread
        thread.start()
        self._nccl_sweeper.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop watching, close streams, stop servers, remove our sockets."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self.register_timeout_s + 2.0)
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
            thread = self._thread
            if thread is not None:
                self._pending = request
        if thread is None:  # not started (or stopped): nobody else touches the servers
            self._replace_servers(topology, config)
            return
        self._wake.set()
        while not request.done.wait(0.2):
            if not thread.is_alive():
                raise AgentError("the device plugins stopped while reloading")
        if request.error is not None:
            raise request.error

    def ready(self) -> bool:
        """Every resource is registered with the running kubelet. Never waits on I/O (the
        readiness probe calls it)."""
        with self._lock:
            slots = list(self._slots)
        return bool(slots) and all(s.registered and _sharing_ready(s) for s in slots)

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
        server = PluginServer(
            RequestHandler(resource, topology, config, NcclFiles.from_config(config)),
            self.health, config.kubelet_dir, events=self.events,
            supervisor=self._supervisors.get(resource.name), changes=self._changes,
        )
        server.start()
        return server

    def _report_offers(self) -> None:
        """Report what the kubelet is offered now (``events.devices_offered``)."""
        with self._offers_lock:
            self.events.devices_offered(self.advertised())

    def _sharing_changed(self) -> None:
        """A sharing supervisor became ready or stopped being ready: report the offers, re-send
        the device lists and let the watch thread register a resource whose sharing is now ready."""
        self._report_offers()
        self._changes.changed()
        self._wake.set()

    def _replace_servers(self, topology: Topology, config: Config) -> None:
        """Stop the servers, serve (topology, config). Runs on the thread that owns the
        servers (the caller before start, the watch thread after)."""
        resources = build_resources(topology, config)
        with self._lock:
            old, self._slots = self._slots, []
            self.topology, self.config, self.resources = topology, config, resources
        for slot in old:
            slot.server.stop(0.5)
        self._supervisors.sync(
            ((r.name, r.sharing, r.replicas) for r in resources if r.sharing is not None), topology, config)
        if not resources:
            log.warning("no GPU resources to advertise on this node")
        os.makedirs(config.kubelet_dir, exist_ok=True)
        for resource in resources:  # a new slot is unregistered: the next round registers it
            slot = _Slot(self._new_server(resource, topology, config), self._supervisors.get(resource.name))
            with self._lock:
                self._slots.append(slot)
            log.info("serving %s (%d devices) on %s", resource.name, len(resource.devices), slot.server.path)
        self._report_offers()
        if resources and not os.path.exists(self.kubelet_socket):
            log.warning(
                "no kubelet socket at %s yet: registering as soon as the kubelet creates it",
                self.kubelet_socket,
            )

    def _kubelet_inode_now(self) -> tuple[tuple[int, int, int] | None, str | None]:
        """The kubelet socket's identity (None: no socket there) and, when something else
        stands at its path, what it is."""
        # The inode number alone is not enough: tmpfs and ext4 hand a freed inode number
        # to the next file, so a re-created kubelet.sock can get the same one. The change
        # time (ns) tells the new file apart.
        try:
            st = os.stat(self.kubelet_socket)
        except OSError:
            return None, None
        if not stat.S_ISSOCK(st.st_mode):  # no kubelet listens on a file: nothing to register with
            kinds = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory"}
            return None, kinds.get(stat.S_IFMT(st.st_mode), "not a socket")
        return (st.st_dev, st.st_ino, st.st_ctime_ns), None

    def _watch(self) -> None:
        while not self._stop.is_set():
            wait_s = self.poll_s
            try:
                self._apply_pending_reload()
                self._watch_once()
                if self._round_error is not None:
                    log.info("kubelet watch works again")
                self._round_error, self._round_backoff_s = None, 0.0
            except Exception as exc:  # keep watching whatever happens; the next round retries
                # said once per distinct failure (with its traceback), then retried with backoff
                message = f"{type(exc).__name__}: {exc}"
                if message != self._round_error:
                    log.exception("kubelet watch round failed (retrying with backoff)")
                self._round_error = message
                self._round_backoff_s = min(self.max_backoff_s, max(self.poll_s, self._round_backoff_s * 2))
                wait_s = self._round_backoff_s
            self._wake.wait(wait_s)
            self._wake.clear()
        self._apply_pending_reload()  # never leave a reload waiting

    def _apply_pending_reload(self) -> None:
        with self._lock:
            request, self._pending = self._pending, None
        if request is None:
            return
        try:
            if self._stop.is_set():
                raise AgentError("the device plugins stopped while reloading")
            self._replace_servers(request.topology, request.config)
        except BaseException as exc:  # handed to the thread that asked for the reload
            request.error = exc
        finally:
            request.done.set()

    def _watch_once(self) -> None:
        now = time.monotonic()
        inode, oddity = self._kubelet_inode_now()
        with self._lock:
            slots = list(self._slots)
        restarted = False
        if oddity != self._kubelet_oddity:
            self._kubelet_oddity = oddity
            if oddity is not None:
                log.warning(
                    "%s is %s, not the kubelet's socket: registering once the kubelet creates its socket there",
                    self.kubelet_socket, oddity,
                )
        if inode != self._kubelet_inode:
            if inode is not None:
                if self._seen_kubelet:
                    restarted = True
                    log.warning("kubelet restarted (kubelet.sock re-created): serving and registering again")
                else:
                    log.info("kubelet socket %s found", self.kubelet_socket)
                self._seen_kubelet = True
            elif oddity is None:  # else said above
                log.warning("kubelet socket %s is gone; waiting for the kubelet", self.kubelet_socket)
            self._kubelet_inode = inode
            with self._lock:
                for slot in slots:
                    slot.registered = False
            for slot in slots:
                slot.next_try_s = now
                slot.backoff_s = 0.0
        if restarted:
            self.events.kubelet_restart()
            if self._on_kubelet_restart is not None:
                self._on_kubelet_restart()
        if not self._kubelet_dir_present(inode is not None):
            return  # nothing can be served there; the kubelet re-creates it
        for slot in slots:
            if self._stop.is_set():
                return
            if not slot.server.socket_present():
                if now < slot.next_serve_s:
                    continue
                fresh = self._serve_again(slot, now)
                if fresh is None:
                    continue
                slot = fresh
            if inode is None or slot.registered or now < slot.next_try_s:
                continue
            if not _sharing_ready(slot):
                continue  # shared replicas are advertised once their sharing is ready
            self._register(slot, now)

    def _kubelet_dir_present(self, kubelet_present: bool) -> bool:
        """Whether the kubelet directory exists; its disappearance and return are logged
        once each (not once per round)."""
        present = kubelet_present or os.path.isdir(self.config.kubelet_dir)
        if present == (not self._dir_missing):
            return present
        self._dir_missing = not present
        if present:
            log.warning("kubelet directory %s is back: serving again", self.config.kubelet_dir)
        else:
            log.warning(
                "kubelet directory %s does not exist any more: waiting for the kubelet to create it",
                self.config.kubelet_dir,
            )
        return present

    def _serve_again(self, slot: _Slot, now: float) -> _Slot | None:
        """Serve a vanished socket again; None while another live server holds its name
        (never delete it, never fight: logged once until it is gone) or while serving
        fails (logged once, retried with capped exponential backoff)."""
        path = slot.server.path
        if path not in self._taken and not slot.serve_failing:
            log.warning("socket %s vanished: serving it again", path)
        slot.server.stop(0)
        with self._lock:
            topology, config = self.topology, self.config
        try:
            server = self._new_server(slot.server.resource, topology, config)
        except SocketInUseError as exc:
            if path not in self._taken:
                log.error("%s; not serving %s until it is gone", exc, slot.server.resource.name)
                self._taken.add(path)
            with self._lock:
                slot.registered = False
            return None
        except AgentError as exc:
            slot.serve_backoff_s = min(self.max_backoff_s, max(self.poll_s, slot.serve_backoff_s * 2))
            slot.next_serve_s = now + slot.serve_backoff_s
            if not slot.serve_failing:
                log.error("cannot serve %s again: %s (retrying with backoff)", slot.server.resource.name, exc)
            else:
                log.debug("cannot serve %s again: %s (retry in %.1f s)", slot.server.resource.name, exc,
                          slot.serve_backoff_s)
            slot.serve_failing = True
            with self._lock:
                slot.registered = False
            return None
        if slot.serve_failing:
            log.warning("serving %s again on %s", slot.server.resource.name, path)
        self._taken.discard(path)
        fresh = _Slot(server, slot.supervisor, next_try_s=now)
        with self._lock:
            self._slots = [fresh if s is slot else s for s in self._slots]
        return fresh

    def _register(self, slot: _Slot, now: float) -> None:
        resource = slot.server.resource
        try:
            register_device_plugin(
                self.kubelet_socket, resource_name=resource.name, endpoint=resource.socket_name,
                options=plugin_options(slot.server.servicer.handler), timeout_s=self.register_timeout_s,
            )
        except grpc.RpcError as exc:
            slot.backoff_s = min(self.max_backoff_s, max(0.2, slot.backoff_s * 2))
            slot.next_try_s = now + slot.backoff_s
            details = exc.details() if hasattr(exc, "details") else str(exc)
            self.events.registration_failure(resource.name)
            # one line when registering starts failing; the retries are counted, not logged
            log.log(
                logging.DEBUG if slot.register_failing else logging.WARNING,
                "registering %s with the kubelet failed: %s (retrying with backoff up to %g s; failures"
                " are counted in gpu_agent_registration_failures_total)",
                resource.name, shorten(details, 300), self.max_backoff_s,
            )
            slot.register_failing = True
            return
        slot.register_failing = False
        with self._lock:
            slot.registered = True
        log.info("registered %s with the kubelet (endpoint %s)", resource.name, resource.socket_name)
        self.events.registration(resource.name)

