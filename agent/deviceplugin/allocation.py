"""Request handling behind the gRPC servicer: the one validation of a request's device IDs,
preferred allocation through the allocation engine, and the Allocate response per
device-list strategy.

Nothing here calls NVML: answers come from the frozen :class:`Topology` and the resource's
device table. A request is checked once, at this edge, by the resource's
:class:`~agent.topology.deviceids.DeviceTable` (one message per kind of mistake, the same
for GetPreferredAllocation, Allocate and the ``allocate`` command), and goes down as ranks.
Invalid requests raise :class:`AllocationError`, which the servicer turns into
``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import os
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Sequence

from agent.config import Config
from agent.deviceplugin.resources import PluginDevice, PluginResource, physical_devices
from agent.errors import AllocationError
from agent.topology.allocator import AllocationEngine
from agent.topology.deviceids import DeviceRequest, DeviceTable
from agent.topology.model import Topology

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNTS_HOST_PATH = "/dev/null"
CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PLUGIN = "nvidia-device-plugin"
TOPOLOGY_ENV_PREFIX = "GPU_TOPOLOGY_"
#: Control device nodes passed with ``passDeviceSpecs`` where they exist on the host.
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


@dataclass
class ContainerAllocation:
    """What one container gets; mirrors ``ContainerAllocateResponse``."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (container, host, read_only)
    devices: list[tuple[str, str, str]] = field(default_factory=list)  # (container, host, permissions)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)


class RequestHandler:
    """Answers GetPreferredAllocation and Allocate for one resource. Thread-safe: it only
    reads frozen state."""

    def __init__(
        self,
        resource: PluginResource,
        topology: Topology,
        config: Config,
        path_exists: Callable[[str], bool] = os.path.exists,
    ) -> None:
        """``path_exists`` tells which device nodes exist on the host (the DRA plugin's tests
        pass a stand-in; the kubelet's node has the real ones)."""
        self._path_exists = path_exists
        self.resource = resource
        self.topology = topology
        self.config = config
        self._engine: AllocationEngine | None = None
        self._table: DeviceTable | None = None
        # read once: both scan the resource's devices
        self._kind = resource.kind
        self._one_at_most = config.fail_requests_greater_than_one and resource.shared
        self._packed = config.shared_devices_allocation_policy == "packed"

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
            devices = [(d.id, d.gpu_index) for d in self.resource.devices]
            self._table = DeviceTable(devices, self.topology.gpu_count, self.resource.name)
        return self._table

    # ------------------------------------------------------------------ preferred
    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """The device IDs to prefer; raises AllocationError on any invalid input."""
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
        kind = self._kind
        if kind == "gpu":
            ranks = self.engine.gpus(table, request)
        elif kind == "mig":
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
    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        """The container response for ``device_ids``; raises AllocationError when invalid."""
        table = self.table
        ranks = table.lookup(device_ids, "devices")
        if self._one_at_most and len(ranks) > 1:
            self._too_large(len(ranks))
        requested = [self.resource.by_id[table.ids[r]] for r in ranks]
        devices = physical_devices(requested)
        ids = [self._visible_id(d) for d in devices]
        out = ContainerAllocation()
        strategies = self.config.device_list_strategy
        cdi = [s for s in strategies if s.startswith("cdi-")]
        if cdi:
            names = [f"{CDI_KIND}={i}" for i in ids]
            if "cdi-annotations" in strategies:
                key = f"{self.config.cdi_annotation_prefix}{CDI_ANNOTATION_PLUGIN}_{uuidlib.uuid4()}"
                out.annotations[key] = ",".join(names)
            if "cdi-cri" in strategies:
                out.cdi_devices.extend(names)
        if len(cdi) < len(strategies):  # at least one non-CDI strategy: the anchor's env/mounts
            if "envvar" in strategies:
                out.envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
            if "volume-mounts" in strategies:
                out.envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNTS_ROOT
                out.mounts.extend((f"{VOLUME_MOUNTS_ROOT}/{i}", VOLUME_MOUNTS_HOST_PATH, False) for i in ids)
            if self.config.pass_device_specs:
                out.devices.extend(self._device_specs(devices))
        out.envs.update(self._topology_envs(devices))
        return out

    def _visible_id(self, device: PluginDevice) -> str:
        if self.config.device_id_strategy == "index":
            if device.mig is not None:
                return f"{device.gpu_index}:{device.mig.index}"
            return str(device.gpu_index)
        return device.uuid

    def _host_path(self, path: str) -> str:
        root = self.config.nvidia_driver_root.rstrip("/")
        return f"{root}{path}" if root else path

    def _device_specs(self, devices: Sequence[PluginDevice]) -> list[tuple[str, str, str]]:
        specs: list[tuple[str, str, str]] = []
        for node in CONTROL_DEVICE_NODES:
            if self._path_exists(self._host_path(node)):
                specs.append((node, self._host_path(node), "rw"))
        seen: set[str] = set()
        for d in devices:
            gpu = self.topology.gpus[d.gpu_index]
            minor = gpu.minor_number if gpu.minor_number is not None else gpu.index
            paths = [f"/dev/nvidia{minor}"]
            if d.mig is not None:
                paths.extend(self._mig_cap_nodes(minor, d))
            for path in paths:
                if path not in seen:
                    seen.add(path)
                    specs.append((path, self._host_path(path), "rw"))
        return specs

    def _mig_cap_nodes(self, minor: int, device: PluginDevice) -> list[str]:
        """``/dev/nvidia-caps/nvidia-cap<N>`` for the MIG device's GPU and compute instance,
        N read from the driver's ``/proc/driver/nvidia/capabilities`` files (skipped where
        the driver does not publish them)."""
        mig = device.mig
        assert mig is not None
        if mig.gi_id is None:
            return []
        base = f"/proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{mig.gi_id}"
        files = [f"{base}/access"]
        if mig.ci_id is not None:
            files.append(f"{base}/ci{mig.ci_id}/access")
        out = []
        for f in files:
            try:
                with open(self._host_path(f), encoding="ascii") as fh:
                    for line in fh:
                        if line.startswith("DeviceFileMinor:"):
                            out.append(f"/dev/nvidia-caps/nvidia-cap{int(line.split(':', 1)[1])}")
            except (OSError, ValueError):
                continue
        return out

    def _topology_envs(self, devices: Sequence[PluginDevice]) -> dict[str, str]:
        indices = sorted({d.gpu_index for d in devices})
        envs = {f"{TOPOLOGY_ENV_PREFIX}GPU_INDICES": ",".join(map(str, indices))}
        numa = sorted({d.numa_node for d in devices if d.numa_node is not None})
        if numa and all(d.numa_node is not None for d in devices):
            envs[f"{TOPOLOGY_ENV_PREFIX}NUMA_NODES"] = ",".join(map(str, numa))
            cpulists = [self.topology.numa_cpulists[n] for n in numa if n in self.topology.numa_cpulists]
            if len(cpulists) == len(numa):
                envs[f"{TOPOLOGY_ENV_PREFIX}CPULIST"] = ",".join(cpulists)
        if len(indices) > 1:
            one_island = any(set(indices) <= set(island) for island in self.topology.nvlink_islands)
            envs[f"{TOPOLOGY_ENV_PREFIX}NVLINK_CONNECTED"] = "true" if one_island else "false"
            envs[f"{TOPOLOGY_ENV_PREFIX}SCORE"] = str(self.topology.set_score(indices))
        return envs
