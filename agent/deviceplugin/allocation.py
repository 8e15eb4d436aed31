"""Request handling behind the gRPC servicer: the one validation of a request's device IDs,
preferred allocation through the allocation engine, and the Allocate response (what the
container gets comes from :func:`agent.containers.container_facts`, as in DRA's CDI specs,
plus what the resource's sharing adds for the replicas held; rendered by
:mod:`agent.deviceplugin.device_lists`).

Nothing here calls NVML: answers come from the frozen :class:`Topology` and the resource's
device table. A request is checked once, at this edge, by the resource's
:class:`~agent.topology.deviceids.DeviceTable` (one message per kind of mistake, the same
for GetPreferredAllocation, Allocate and the ``allocate`` command), and goes down as ranks.
Invalid requests raise :class:`AllocationError`, which the servicer turns into
``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from typing import NoReturn, Sequence

from agent.config import Config
from agent.containers import ContainerAdditions, ContainerDevice, container_facts, nccl_additions
from agent.deviceplugin.device_lists import ContainerResponse, render
from agent.deviceplugin.resources import (
    PluginDevice,
    PluginResource,
    ResourceKind,
    physical_devices,
)
from agent.errors import AgentError, AllocationError
from agent.nccl.host_dir import NcclFile, NcclFiles, allocation_key
from agent.sharing.base import Share, replicas_per_gpu
from agent.topology.allocator import AllocationEngine
from agent.topology.deviceids import DeviceRequest, DeviceTable
from agent.topology.model import Topology


class RequestHandler:
    """Answers GetPreferredAllocation and Allocate for one resource. Thread-safe: it only
    reads frozen state."""

    def __init__(
        self,
        resource: PluginResource,
        topology: Topology,
        config: Config,
        nccl_files: NcclFiles | None = None,
    ) -> None:
        self.resource = resource
        self.nccl_files = nccl_files  # where Allocate writes the containers' NCCL files
        self.topology = topology
        self.config = config
        # built once, before the first request: the resource's devices never change while
        # it is served, and the engine only reads the frozen topology (safe to share)
        self.engine = AllocationEngine(topology)
        self.table = DeviceTable(
            [(d.id, d.gpu_index) for d in resource.devices], topology.gpu_count, resource.name
        )
        self._one_at_most = config.fail_requests_greater_than_one and resource.shared
        self._packed = config.shared_devices_allocation_policy == "packed"

    # ------------------------------------------------------------------ preferred
    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """The device IDs to prefer; raises AllocationError on any invalid input."""
        if self.resource.kind is ResourceKind.GPU:  # whole GPUs: checked and answered as GPU bitmasks
            table = self.table
            gpus = self.engine.gpu_set(*table.gpu_masks(available, must_include, size), size)
            return list(map(table.id_of_gpu.__getitem__, gpus))
        return self.answer(self.request(available, must_include, size))

    def request(self, available: Sequence[str], must_include: Sequence[str], size: int) -> DeviceRequest:
        """The one check of a preferred-allocation request, mapped to the table's ranks."""
        request = self.table.request(available, must_include, size)
        if self._one_at_most and size > 1:
            self._too_large(size)
        return request

    def answer(self, request: DeviceRequest) -> list[str]:
        """The device IDs the engine chooses for a checked request."""
        table = self.table
        kind = self.resource.kind
        if kind is ResourceKind.GPU:
            ranks = self.engine.gpus(table, request)
        elif kind is ResourceKind.MIG:
            ranks = self.engine.mig(table, request)
        else:
            ranks = self.engine.replicas(table, request, self._packed)
        return list(map(table.ids.__getitem__, ranks))

    @staticmethod
    def _too_large(size: int) -> NoReturn:
        raise AllocationError(
            f"request for {size} devices is too large: the maximum request size for shared"
            f" resources is 1 (failRequestsGreaterThanOne)"
        )

    # ------------------------------------------------------------------ allocate
    def allocate(self, device_ids: Sequence[str]) -> ContainerResponse:
        """The container response for ``device_ids``; raises AllocationError when invalid."""
        table = self.table
        ranks = table.lookup(device_ids, "devices")
        if self._one_at_most and len(ranks) > 1:
            self._too_large(len(ranks))
        requested = [self.resource.by_id[table.ids[r]] for r in ranks]
        gpus = self.topology.gpus
        devices = [ContainerDevice(gpus[d.gpu_index], d.mig) for d in physical_devices(requested)]
        nccl = nccl_additions(self._nccl_file(device_ids, devices), self.config)
        additions = [*self._share(requested, devices), *nccl]
        facts = container_facts(self.topology, devices, self.config, nodes=self.config.pass_device_specs,
                                additions=additions)
        return render(facts, self.config)

    def _nccl_file(self, device_ids: Sequence[str], devices: Sequence[ContainerDevice]) -> NcclFile | None:
        """The container's NCCL topology file (docs/nccl.md): for whole
        GPUs and for the GPUs behind replicas, none for MIG devices. Allocate only names it;
        the writer thread writes it and :meth:`pre_start` makes sure it is in place before
        the container starts."""
        if self.nccl_files is None or any(d.mig is not None for d in devices):
            return None
        key = allocation_key(self.resource.name, device_ids)
        return self.nccl_files.write_later(key, self.topology, sorted({d.gpu.index for d in devices}))

    def pre_start(self, device_ids: Sequence[str]) -> None:
        """PreStartContainer: the kubelet starts the container with ``device_ids`` next;
        its NCCL topology file is in place when this returns (written now if the deferred
        write failed or a restarted agent never queued it). AgentError when it cannot be
        written: the kubelet does not start a container whose mount has no source."""
        files = self.nccl_files
        if files is None or not device_ids:
            return
        key = allocation_key(self.resource.name, device_ids)
        if files.wait(key):
            return
        ranks = self.table.lookup(device_ids, "devices")
        requested = [self.resource.by_id[self.table.ids[r]] for r in ranks]
        if any(d.mig is not None for d in requested):
            return
        try:
            files.write(key, self.topology, sorted({d.gpu_index for d in requested}))
        except OSError as exc:
            raise AgentError(f"cannot write the NCCL topology file {files.path(key)}: {exc.strerror or exc}") from None

    def _share(self, requested: Sequence[PluginDevice], devices: Sequence[ContainerDevice]) -> list[ContainerAdditions]:
        """What the resource's sharing adds for the replicas the container holds."""
        sharing, held = self.resource.sharing, replicas_per_gpu((d.gpu_index, d.replica) for d in requested)
        if sharing is None or not held:
            return []
        share = Share(self.resource.name, {i: self.resource.replicas[i] for i in held}, held)
        added = sharing.additions(share, self.topology, devices, self.config)
        return [added] if added is not None else []
