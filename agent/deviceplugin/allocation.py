"""Request handling behind the gRPC servicer: validation, preferred allocation through the
allocation engine, and the Allocate response (what the container gets comes from
:func:`agent.containers.container_edits`, as in DRA's CDI specs).

Nothing here calls NVML: answers come from the frozen :class:`Topology` and the resource's
device table. Invalid requests raise :class:`AllocationError`, which the servicer turns into
``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import re
from typing import Sequence

from agent.config import Config
from agent.containers import ContainerDevice, ContainerEdits, MpsShare, container_edits
from agent.deviceplugin.resources import PluginDevice, PluginResource, physical_devices
from agent.errors import AllocationError, shorten
from agent.topology.allocator import AllocationEngine
from agent.topology.deviceids import DeviceTable
from agent.topology.model import Topology

# GPU/MIG UUIDs (including the old "MIG-GPU-<uuid>/<gi>/<ci>" form), optional replica suffix.
_DEVICE_ID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/-]+(::[0-9]+)?$")


def _lookup(resource: PluginResource, ids: Sequence[str], what: str) -> list[PluginDevice]:
    out: list[PluginDevice] = []
    seen: set[str] = set()
    for device_id in ids:
        if device_id in seen:
            raise AllocationError(f"{what}: device ID {shorten(device_id)!r} given twice")
        seen.add(device_id)
        device = resource.by_id.get(device_id)
        if device is None:
            shape = "unknown" if _DEVICE_ID_RE.match(device_id) else "malformed"
            raise AllocationError(f"{what}: {shape} device ID {shorten(device_id)!r} for resource {resource.name}")
        out.append(device)
    return out


class RequestHandler:
    """Answers GetPreferredAllocation and Allocate for one resource. Thread-safe: it only
    reads frozen state."""

    def __init__(
        self,
        resource: PluginResource,
        topology: Topology,
        config: Config,
    ) -> None:
        self.resource = resource
        self.topology = topology
        self.config = config
        self._engine: AllocationEngine | None = None
        self._table: DeviceTable | None = None
        # Advertised devices per GPU: per-GPU sharing gives GPUs different replica counts,
        # and the engine needs them to tell a GPU's load from its free replicas.
        self._replicas_per_gpu: dict[int, int] = {}
        for d in resource.devices:
            self._replicas_per_gpu[d.gpu_index] = self._replicas_per_gpu.get(d.gpu_index, 0) + 1

    @property
    def engine(self) -> AllocationEngine:
        """The allocation engine, built on first use (one per handler; it only reads the
        frozen topology, so sharing it between threads is safe)."""
        if self._engine is None:
            self._engine = AllocationEngine(self.topology)
        return self._engine

    @property
    def table(self) -> DeviceTable:
        """The resource's device IDs ranked for the engine (built on first use, like the
        engine: the resource's devices never change while it is served)."""
        if self._table is None:
            self._table = self.engine.device_table([(d.id, d.gpu_index) for d in self.resource.devices])
        return self._table

    # ------------------------------------------------------------------ preferred
    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """The device IDs to prefer; raises AllocationError on any invalid input."""
        what = f"preferred allocation for {self.resource.name}"
        avail = _lookup(self.resource, available, f"{what}: available")
        must = _lookup(self.resource, must_include, f"{what}: must-include")
        if size < 1:
            raise AllocationError(f"{what}: allocation size must be >= 1, got {size}")
        if size > len(avail):
            raise AllocationError(f"{what}: allocation size {size} exceeds the {len(avail)} available devices")
        avail_ids = {d.id for d in avail}
        outside = [d.id for d in must if d.id not in avail_ids]
        if outside:
            raise AllocationError(f"{what}: must-include devices {shorten(outside, 400)} are not in the available list")
        if len(must) > size:
            raise AllocationError(f"{what}: {len(must)} must-include devices exceed allocation size {size}")
        self._check_shared_size(size, what)
        kind = self.resource.kind
        engine = self.engine
        if kind == "gpu":
            indices = engine.best_set([d.gpu_index for d in avail], [d.gpu_index for d in must], size)
            by_index = {d.gpu_index: d.id for d in avail}
            return [by_index[i] for i in indices]
        if kind == "mig":
            return list(engine.mig([(d.id, d.gpu_index) for d in avail], [d.id for d in must], size))
        return engine.replicas_in(
            self.table, [d.id for d in avail], [d.id for d in must], size,
            self.config.shared_devices_allocation_policy, replicas_per_gpu=self._replicas_per_gpu,
        )

    def _check_shared_size(self, size: int, what: str) -> None:
        if self.config.fail_requests_greater_than_one and self.resource.shared and size > 1:
            raise AllocationError(
                f"{what}: request for {size} devices is too large: the maximum request size"
                f" for shared resources is 1 (failRequestsGreaterThanOne)"
            )

    # ------------------------------------------------------------------ allocate
    def allocate(self, device_ids: Sequence[str]) -> ContainerEdits:
        """The container response for ``device_ids``; raises AllocationError when invalid."""
        what = f"allocate {self.resource.name}"
        if not device_ids:
            raise AllocationError(f"{what}: empty device list")
        requested = _lookup(self.resource, device_ids, what)
        self._check_shared_size(len(requested), what)
        gpus = self.topology.gpus
        devices = [ContainerDevice(gpus[d.gpu_index], d.mig) for d in physical_devices(requested)]
        return container_edits(self.topology, devices, self.config, mps=self._mps_share(requested))

    def _mps_share(self, requested: Sequence[PluginDevice]) -> MpsShare | None:
        """What the container holds of an MPS resource's replicas (None: no MPS replica)."""
        held: dict[int, int] = {}
        for d in requested:
            if d.replica is not None:
                held[d.gpu_index] = held.get(d.gpu_index, 0) + 1
        if not self.resource.mps or not held:
            return None
        return MpsShare(self.resource.name, {i: self._replicas_per_gpu[i] for i in held}, held)
