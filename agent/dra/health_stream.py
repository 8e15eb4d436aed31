"""Device health to the kubelet: ``DRAResourceHealth/NodeWatchResources`` (KEP-4680), served
on the DRA socket in versions ``v1alpha1`` and ``v1beta1``.

The kubelet (feature gate ``ResourceHealthStatus``) keeps one stream open to each registered
plugin and shows each pod the health of its allocated devices in
``status.containerStatuses[].allocatedResourcesStatus``. A 1.34/1.35 kubelet opens the
``v1alpha1`` stream of every DRA plugin; later ones pick the newest version the registration's
``supported_versions`` lists (``v1beta1.DRAResourceHealth``, ``v1alpha1.DRAResourceHealth``:
:data:`HEALTH_SERVICES`).

Every message is the full list, as the kubelet expects: each device of the node's pool (single
GPUs, MIG devices, GPU sets), ``UNHEALTHY`` when a GPU behind it is unhealthy (a set: any
member), else ``HEALTHY``, with the reason as ``message`` (``v1beta1``). It is sent when the
stream opens, at once on every health change (the stream waits on
:meth:`agent.health.HealthState.wait_for_change`, never polls NVML), and again every
:data:`RESEND_S` seconds, because the kubelet marks a device it has not heard about for 30 s
``Unknown``. A stream ends when the kubelet cancels it or the plugin stops.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Protocol

import grpc

from agent._proto import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_health_v1beta1_pb2,
    dra_health_v1beta1_pb2_grpc,
)
from agent.dra.devices import DeviceRef
from agent.errors import shorten

log = logging.getLogger(__name__)

__all__ = ["HEALTH_SERVICES", "RESEND_S", "HealthStreams", "HealthWatch"]

#: The services' names in plugin registration (DRAResourceHealthService in upstream's
#: dra-health/<version>/types.go), newest first.
HEALTH_SERVICES = ("v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
#: Seconds between full lists without a change: well inside the kubelet's 30 s.
RESEND_S = 10.0
#: The kubelet keeps at most 1024 characters of a message (and shorten() adds its note).
MESSAGE_LIMIT = 1000


class HealthWatch(Protocol):
    """What the stream reads of :class:`agent.health.HealthState`."""

    generation: int

    def snapshot(self) -> dict[int, str]: ...

    def wait_for_change(self, generation: int, timeout_s: float | None) -> int: ...

    def wake(self) -> None: ...


class HealthStreams:
    """The streams of both versions over one device list and one health state. ``devices()``
    gives the devices served now (name -> :class:`DeviceRef`; it changes with the topology)."""

    def __init__(self, health: HealthWatch, devices: Callable[[], Mapping[str, DeviceRef]], pool: str,
                 *, resend_s: float = RESEND_S) -> None:
        self.health = health
        self.devices = devices
        self.pool = pool
        self.resend_s = resend_s
        self._stop = threading.Event()
        self._v1alpha1 = _Servicer(self, dra_health_v1alpha1_pb2)
        self._v1beta1 = _Servicer(self, dra_health_v1beta1_pb2)

    def add_to(self, server: grpc.Server) -> None:
        """Serve both versions on ``server`` (the DRA socket); streams may open again after
        :meth:`close` (the socket is served again after a kubelet restart)."""
        self._stop.clear()
        dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(self._v1alpha1, server)
        dra_health_v1beta1_pb2_grpc.add_DRAResourceHealthServicer_to_server(self._v1beta1, server)

    def close(self) -> None:
        """End every open stream (the plugin stops)."""
        self._stop.set()
        self.health.wake()

    def stream(self, pb: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """Full lists until the client goes or :meth:`close`."""
        context.add_callback(self.health.wake)  # a cancelled stream stops waiting at once
        generation = self.health.generation
        while not self._stop.is_set() and context.is_active():
            yield self._message(pb)
            deadline = time.monotonic() + self.resend_s
            while not self._stop.is_set() and context.is_active():
                now = self.health.wait_for_change(generation, max(0.0, deadline - time.monotonic()))
                if now != generation or time.monotonic() >= deadline:
                    generation = now
                    break

    def _message(self, pb: Any) -> Any:
        reasons = self.health.snapshot()
        now = int(time.time())
        out = pb.NodeWatchResourcesResponse()
        beta = hasattr(pb.DeviceHealth(), "message")
        for name, device in self.devices().items():
            bad = [f"GPU {g.index}: {reasons[g.index]}" for g in device.gpus if g.index in reasons]
            entry = out.devices.add(health=pb.UNHEALTHY if bad else pb.HEALTHY, last_updated_time=now)
            entry.device.pool_name = self.pool
            entry.device.device_name = name
            if beta and bad:
                entry.message = shorten("; ".join(bad), MESSAGE_LIMIT)
        return out


class _Servicer:
    """One version's ``DRAResourceHealth``: the stream of :class:`HealthStreams` in its messages."""

    def __init__(self, streams: HealthStreams, pb: Any) -> None:
        self._streams = streams
        self._pb = pb

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        log.info("kubelet opened the device-health stream (%s)", self._pb.DESCRIPTOR.package)
        yield from self._streams.stream(self._pb, context)
