"""Which container holds which GPU: the kubelet's pod-resources API v1, cached.

``PodResourcesCache`` calls ``List`` on the kubelet's ``pod-resources/kubelet.sock`` (with
:class:`agent.kubelet.podresources.PodResourcesClient`) on its own timer (``refresh_s``) and
publishes an immutable :class:`Attribution`; scrapes read the latest one and never call the
kubelet. (dcgm-exporter calls ``List`` on every scrape, which is slow and rate-limited by the
kubelet on busy nodes.) When a call fails the last good attribution stays in place: pods do
not vanish because the kubelet restarts.

Device IDs map back to GPU indices through the topology: a GPU UUID, a time-sliced replica
``<uuid>::<n>``, a MIG device UUID (its parent GPU), or with ``deviceIDStrategy: index`` a
GPU index ``"3"`` or MIG ``"3:1"``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from agent.attribution import ContainerRef
from agent.kubelet.podresources import PodResourcesClient, PodResourcesError
from agent.retry import Outage
from agent.topology.model import Topology
from agent.worker import Worker

log = logging.getLogger(__name__)

#: Resources attributed to GPUs: ``nvidia.com/gpu``, renamed/shared variants, ``mig-*``.
GPU_RESOURCE_PREFIX = "nvidia.com/"


@dataclass(frozen=True)
class Attribution:
    """Immutable GPU <-> container map. ``containers[c]`` are the distinct GPU indices of
    container ``c`` (sorted); ``by_gpu[i]`` the containers holding GPU ``i`` (sorted);
    ``first_seen[(c, i)]`` when this agent first saw ``c`` holding ``i`` (wall clock)."""

    containers: Mapping[ContainerRef, tuple[int, ...]] = field(default_factory=dict)
    by_gpu: Mapping[int, tuple[ContainerRef, ...]] = field(default_factory=dict)
    first_seen: Mapping[tuple[ContainerRef, int], float] = field(default_factory=dict)


EMPTY_ATTRIBUTION = Attribution()


class DeviceIdResolver:
    """Maps the device IDs the kubelet reports to GPU indices of ``topology``."""

    def __init__(self, topology: Topology, index_ids: bool = False) -> None:
        self.index_ids = index_ids
        self._by_id: dict[str, int] = {}
        for g in topology.gpus:
            self._by_id[g.uuid] = g.index
            for m in g.mig_devices:
                self._by_id[m.uuid] = g.index
        self._count = topology.gpu_count

    def resolve(self, device_id: str) -> int | None:
        """The GPU index behind ``device_id``; None when it is not one of this node's."""
        base = device_id.split("::", 1)[0]
        index = self._by_id.get(base)
        if index is not None:
            return index
        if self.index_ids:
            head = base.split(":", 1)[0]
            if head.isdigit() and int(head) < self._count:
                return int(head)
        return None


def attribute(pod_resources: Iterable[Any], resolver: DeviceIdResolver) -> dict[ContainerRef, tuple[int, ...]]:
    """Containers -> sorted distinct GPU indices, from ``ListPodResourcesResponse.pod_resources``.

    Pure. Non-GPU resources and device IDs unknown to this node are ignored; containers
    without GPUs are left out.
    """
    out: dict[ContainerRef, tuple[int, ...]] = {}
    for pod in pod_resources:
        for c in pod.containers:
            gpus: set[int] = set()
            for dev in c.devices:
                if not dev.resource_name.startswith(GPU_RESOURCE_PREFIX):
                    continue
                for device_id in dev.device_ids:
                    index = resolver.resolve(device_id)
                    if index is not None:
                        gpus.add(index)
            if gpus:
                out[ContainerRef(pod.namespace, pod.name, c.name)] = tuple(sorted(gpus))
    return out


class PodResourcesCache(Worker):
    """Refreshes an :class:`Attribution` every ``refresh_s`` on its own thread."""

    thread_name = "pod-resources"

    def __init__(
        self,
        client: PodResourcesClient,
        topology: Topology,
        *,
        refresh_s: float,
        index_ids: bool = False,
        clock: Callable[[], float] = time.time,
        on_error: Callable[[], None] | None = None,
        on_refresh: Callable[[Attribution], None] | None = None,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError(f"pod-resources refresh must be > 0 s, got {refresh_s}")
        self.client = client
        self.resolver = DeviceIdResolver(topology, index_ids)
        self.refresh_s = refresh_s
        self.clock = clock
        self.on_error = on_error
        self.on_refresh = on_refresh
        self.current: Attribution = EMPTY_ATTRIBUTION
        # No lock: refreshes run on the cache's one thread, which owns ``_outage`` and
        # publishes ``current`` by a single assignment, which scrapes read as it is.
        self._outage = Outage(log, f"pod-resources List on {client.socket_path}", retrying="keeping the last answer")
        super().__init__()

    def map_ids(self, topology: Topology, *, index_ids: bool) -> None:
        """Map device IDs by ``topology`` (and GPU indices when ``index_ids``) from the next
        refresh on."""
        self.resolver = DeviceIdResolver(topology, index_ids)  # one reference: the refresh reads it once

    def refresh_once(self) -> bool:
        """Call ``List`` now and publish the result; False (and the old attribution kept)
        when the kubelet could not be asked. Refreshes are serialised by their one caller,
        the cache's thread; call it directly only where no refresh of that thread can overlap
        (before ``start``)."""
        response = self._list()
        if response is None:
            return False
        self._publish(response)
        return True

    def _list(self) -> Any:
        """The kubelet's answer, None (logged once per outage, counted) when it failed."""
        try:
            response = self.client.list()
        except PodResourcesError as exc:
            self._outage.failed(str(exc))
            if self.on_error is not None:
                self.on_error()
            return None
        self._outage.recovered()
        return response

    def _publish(self, response: Any) -> None:
        now = self.clock()
        containers = attribute(response.pod_resources, self.resolver)
        old_seen = self.current.first_seen
        first_seen: dict[tuple[ContainerRef, int], float] = {}
        by_gpu: dict[int, list[ContainerRef]] = {}
        for ref in sorted(containers):
            for index in containers[ref]:
                first_seen[(ref, index)] = old_seen.get((ref, index), now)
                by_gpu.setdefault(index, []).append(ref)
        attribution = Attribution(
            containers=MappingProxyType(containers),
            by_gpu=MappingProxyType({i: tuple(v) for i, v in sorted(by_gpu.items())}),
            first_seen=MappingProxyType(first_seen),
        )
        if self.on_refresh is not None:
            # before publishing: whatever it prepares (placement scores) is ready when
            # the first scrape sees the new attribution
            try:
                self.on_refresh(attribution)
            except Exception:
                log.exception("pod-resources refresh hook failed")
        self.current = attribution

    def stop(self, timeout_s: float = 5.0) -> None:
        super().stop(timeout_s)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh_once()
            except Exception:  # keep attributing after any unexpected answer
                log.exception("pod-resources refresh failed")
            self._stop.wait(self.refresh_s)
