"""The kubelet-facing gRPC pieces: one thin servicer per resource and its unix-socket server
(:class:`agent.kubelet.unix_server.UnixGrpcServer`); the options it registers with.

The servicer translates messages to :class:`RequestHandler` calls and back, nothing more.
``ListAndWatch`` follows grpc's ``HealthServicer.Watch``: it blocks on
:class:`DeviceListChanges` until something changes (a GPU's health, a sharing supervisor's
readiness, shutdown), then sends the whole list again.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Callable, Iterator

import grpc

from agent._proto import deviceplugin_v1beta1_pb2 as pb
from agent._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from agent.deviceplugin.allocation import RequestHandler
from agent.deviceplugin.reporting import DevicePluginEvents
from agent.deviceplugin.resources import PluginResource
from agent.errors import AgentError, AllocationError, shorten
from agent.health import HealthState
from agent.kubelet.unix_server import UnixGrpcServer
from agent.retry import Outage
from agent.sharing.base import Supervisor

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: Longest status message we send (characters); request values in it are shortened too.
MAX_STATUS_MESSAGE = 1000
#: ListAndWatch streams one plugin serves at a time (the kubelet holds one; a restarting
#: kubelet briefly two); the worker pool is larger, so unary calls always find a worker.
MAX_STREAMS = 4
#: What every plugin tells the kubelet, in Register and in GetDevicePluginOptions.
PLUGIN_OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def plugin_options(handler: RequestHandler) -> pb.DevicePluginOptions:
    """:data:`PLUGIN_OPTIONS`, asking for PreStartContainer where Allocate hands containers
    NCCL topology files: the kubelet calls it before each container starts, and it returns
    once the container's file is written."""
    if handler.nccl_files is None:
        return PLUGIN_OPTIONS
    return pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)


def device_list(
    resource: PluginResource, unhealthy: dict[int, str] | set[int], sharing_ready: bool = True
) -> pb.ListAndWatchResponse:
    """The full ListAndWatch message: every device, in the resource's order, with its health
    and its TopologyInfo. A device whose NUMA node is unknown has no TopologyInfo (as in
    NVIDIA's plugin); the others keep theirs, so the topology manager still aligns them.
    Replicas are Unhealthy while their sharing is not ready (its supervisor says so)."""
    out = pb.ListAndWatchResponse()
    for d in resource.devices:
        down = d.gpu_index in unhealthy or (d.replica is not None and not sharing_ready)
        dev = out.devices.add(ID=d.id, health=UNHEALTHY if down else HEALTHY)
        if d.numa_node is not None:
            dev.topology.nodes.add(ID=d.numa_node)
    return out


class DeviceListChanges:
    """What ``ListAndWatch`` streams wait on: something their device lists show may have
    changed (a GPU's health, which it follows once :meth:`follow` is called; a sharing
    supervisor's readiness, which its owner reports with :meth:`changed`), or a stream must
    look again (stopped, cancelled). ``generation`` increases at each :meth:`changed`."""

    def __init__(self) -> None:
        # Lock order: a leaf, held only to read or bump the generation.
        self._cond = threading.Condition()
        self.generation = 0

    def follow(self, health: HealthState) -> DeviceListChanges:
        health.add_listener(self.changed)
        return self

    def changed(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def wait(self, generation: int, timeout_s: float) -> None:
        """Block until the generation differs from ``generation``, or the timeout."""
        with self._cond:
            if self.generation == generation:
                self._cond.wait(timeout_s)


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """``/v1beta1.DevicePlugin/*`` for one resource."""

    def __init__(
        self,
        handler: RequestHandler,
        health: HealthState,
        events: DevicePluginEvents,
        *,
        max_streams: int = MAX_STREAMS,
        supervisor: Supervisor | None = None,
        changes: DeviceListChanges | None = None,
    ) -> None:
        """``changes``: what the streams wait on (one following ``health`` when None)."""
        self.handler = handler
        self.resource = handler.resource
        self.health = health
        self.events = events
        self.supervisor = supervisor  # the resource's sharing supervisor: its replicas follow it
        self.changes = changes if changes is not None else DeviceListChanges().follow(health)
        self._stopped = threading.Event()
        # Each open ListAndWatch holds a worker thread for its lifetime; past this many the
        # stream is refused, so the rest of the pool always serves the unary calls.
        self.max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams)
        # From a refused stream until one is accepted again: the refusals in between are one
        # outage, said once (the lock: gRPC workers refuse and accept concurrently)
        self._refusing = Outage(
            log, f"{self.resource.name}: opening a ListAndWatch stream", recovered_level=None,
            retrying="refusals are counted in gpu_agent_list_and_watch_refused_total",
        )
        self._refusing_lock = threading.Lock()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """End every open ListAndWatch stream."""
        self._stopped.set()
        self.changes.changed()

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return plugin_options(self.handler)

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        if not self._streams.acquire(blocking=False):
            self.events.stream_refused(self.resource.name)
            with self._refusing_lock:  # a client retrying in a loop is counted, not logged
                self._refusing.failed(
                    f"refusing ListAndWatch streams: {self.max_streams} are open already (the kubelet needs one)"
                )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.resource.name}: at most {self.max_streams} ListAndWatch streams at a time",
            )
        with self._refusing_lock:
            self._refusing.recovered()
        try:
            context.add_callback(self.changes.changed)  # a cancelled stream stops waiting at once
            sent: tuple[int, int] | None = None
            supervisor = self.supervisor
            while not self._stopped.is_set() and context.is_active():
                seen = self.changes.generation  # before the state: a change after it ends the wait
                state = (self.health.generation, supervisor.generation if supervisor is not None else 0)
                if state != sent:
                    sent = state
                    ready = supervisor is None or supervisor.ready
                    yield device_list(self.resource, self.health.snapshot(), ready)
                self.changes.wait(seen, 1.0)
        finally:
            self._streams.release()

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        started = time.perf_counter()
        out = pb.PreferredAllocationResponse()
        try:
            for creq in request.container_requests:
                ids = self.handler.preferred(
                    creq.available_deviceIDs, creq.must_include_deviceIDs, creq.allocation_size
                )
                out.container_responses.add(deviceIDs=ids)
        except AgentError as exc:
            self._abort(context, exc)
        self.events.observe_preferred_allocation(time.perf_counter() - started)
        return out

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        out = pb.AllocateResponse()
        try:
            if not request.container_requests:
                raise AllocationError(f"allocate {self.resource.name}: no container requests")
            for creq in request.container_requests:
                a = self.handler.allocate(list(creq.devices_ids))
                resp = out.container_responses.add()
                resp.envs.update(a.envs)
                resp.annotations.update(a.annotations)
                for cpath, hpath, ro in a.mounts:
                    resp.mounts.add(container_path=cpath, host_path=hpath, read_only=ro)
                for cpath, hpath, perms in a.devices:
                    resp.devices.add(container_path=cpath, host_path=hpath, permissions=perms)
                for name in a.cdi_devices:
                    resp.cdi_devices.add(name=name)
        except AgentError as exc:
            self._abort(context, exc)
        return out

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        try:
            self.handler.pre_start(list(request.devices_ids))
        except AgentError as exc:
            self._abort(context, exc)
        return pb.PreStartContainerResponse()

    def _abort(self, context: grpc.ServicerContext, exc: AgentError) -> None:
        code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, AllocationError) else grpc.StatusCode.INTERNAL
        # the message may quote request fields: bounded, so the status itself always fits
        message = shorten(exc, MAX_STATUS_MESSAGE)
        log.warning("%s: %s", self.resource.name, message)
        context.abort(code, message)


class PluginServer:
    """A gRPC server for one resource on ``<socket_dir>/<resource.socket_name>``.

    ``max_workers`` sizes the thread pool: each open ListAndWatch holds a worker for its
    lifetime, and at most ``max_streams`` (fewer than ``max_workers``) are open at a time:
    a stream past that gets RESOURCE_EXHAUSTED, so ``max_workers - max_streams`` workers are
    always there for Allocate, GetPreferredAllocation and GetDevicePluginOptions.
    """

    def __init__(
        self,
        handler: RequestHandler,
        health: HealthState,
        socket_dir: str,
        *,
        events: DevicePluginEvents,
        max_workers: int = 16,
        max_streams: int = MAX_STREAMS,
        supervisor: Supervisor | None = None,
        changes: DeviceListChanges | None = None,
    ) -> None:
        if not 0 < max_streams < max_workers:
            raise ValueError(f"max_streams must be 1 to {max_workers - 1} (below max_workers), got {max_streams}")
        self.resource = handler.resource
        self.path = os.path.join(socket_dir, self.resource.socket_name)
        self._new_servicer: Callable[[], DevicePluginServicer] = functools.partial(
            DevicePluginServicer, handler, health, events, max_streams=max_streams, supervisor=supervisor,
            changes=changes,
        )
        self.servicer = self._new_servicer()
        self.max_workers = max_workers
        self._unix = UnixGrpcServer(
            self.path,
            lambda server: pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server),
            name=f"dp-{self.resource.name}",
            max_workers=max_workers,
            in_use=(
                "another device plugin is serving on this socket (a second agent or NVIDIA's device"
                " plugin on the same kubelet directory?); stop it, or give this agent another --socket-name"
            ),
        )

    def start(self) -> None:
        """Remove a stale socket file, then serve (again after :meth:`stop`, with a new
        servicer: the old one's streams have ended). Raises SocketInUseError when a live
        server holds the socket (it is never removed), AgentError if it cannot serve there."""
        if self.servicer.stopped:
            self.servicer = self._new_servicer()
        self._unix.start()

    def socket_present(self) -> bool:
        """True while our socket file is still in place (the kubelet removes it on restart)."""
        return self._unix.socket_present()

    def stop(self, grace_s: float = 1.0) -> None:
        """Close the streams, stop serving, remove our socket file."""
        self.servicer.stop()
        self._unix.stop(grace_s)
