"""What a container gets for a set of GPUs: one function, :func:`container_edits`, used by
the device plugin's Allocate and by the DRA plugin's CDI writer alike, so both modes hand a
container the same device nodes and the same environment for the same GPUs.

The device plugin answers in the NVIDIA device plugin's formats (per
``deviceListStrategy``): ``NVIDIA_VISIBLE_DEVICES`` as an env variable or as volume mounts
under ``/var/run/nvidia-container-devices``, CDI device names ``nvidia.com/gpu=<id>`` as an
annotation or as CRI CDI devices, and with ``passDeviceSpecs`` the device nodes. IDs are
UUIDs or indices (``deviceIDStrategy``). The agent adds the ``GPU_TOPOLOGY_*`` variables:
the GPU indices, their NUMA nodes and CPUs, whether they share one NVLink island, and the
set's score.

MPS replicas (:class:`MpsShare`) get what NVIDIA's plugin hands them, so CUDA in the pod
finds the resource's control daemon: ``CUDA_MPS_PIPE_DIRECTORY`` and the pipe directory
mounted there from ``<mpsRoot>/<resource>/pipe``, and ``<mpsRoot>/shm`` as ``/dev/shm``; plus
the client limits matching the daemon's defaults (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), scaled by the replicas the container holds. The
paths and the per-replica shares are defined here once, for the daemon's supervisor too.

IMEX channels (``imex.channelIDs``, multi-node NVLink) go with every set of GPUs as NVIDIA's
plugin hands them: ``NVIDIA_IMEX_CHANNELS`` with ``envvar``, a mount under
``/var/run/nvidia-container-devices/imex`` with ``volume-mounts``, the CDI device
``nvidia.com/imex-channel=<id>`` (the toolkit's ``nvidia-ctk cdi generate --mode imex``
name) with the CDI strategies, and the node ``/dev/nvidia-caps-imex-channels/channel<id>``
with ``passDeviceSpecs``. A channel is handed out while its node exists (a character device
under ``nvidiaDriverRoot``); a required one always (:func:`check_imex_channels` refused to
load a configuration requiring a missing one).

Nothing here calls NVML: the answer comes from the frozen :class:`Topology`; device nodes
of the host are looked for only to pass the control nodes that exist and a MIG device's
capability nodes the driver publishes.
"""

from __future__ import annotations

import logging
import os
import stat
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from agent.config import Config
from agent.errors import ConfigError
from agent.ncclfiles import NCCL_TOPO_FILE_ENV, NcclFile, nic_envs
from agent.topology.model import Gpu, MigDevice, Topology
from agent.topology.nccl_file import nearest_nics

log = logging.getLogger(__name__)

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNTS_HOST_PATH = "/dev/null"
#: The CDI kind of the device plugin's CDI device names (``nvidia.com/gpu=<id>``).
CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PLUGIN = "nvidia-device-plugin"
TOPOLOGY_ENV_PREFIX = "GPU_TOPOLOGY_"
#: Control device nodes passed with ``passDeviceSpecs`` where they exist on the host.
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
IMEX_CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"
IMEX_CHANNELS_ENV = "NVIDIA_IMEX_CHANNELS"
IMEX_CDI_KIND = "nvidia.com/imex-channel"


#: Where NVIDIA's plugin puts a resource's MPS pipe directory in the container (its
#: ``ContainerRoot``), and the shared memory the MPS server and its clients use.
MPS_CONTAINER_ROOT = "/mps"
MPS_SHM_PATH = "/dev/shm"
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def mps_resource_dir(root: str, resource: str, kind: str) -> str:
    """``<root>/<resource>/<kind>``: a resource's MPS ``pipe`` or ``log`` directory (the
    resource name keeps its domain: ``/run/nvidia/mps/nvidia.com/gpu/pipe``)."""
    return os.path.join(root, resource, kind)


def mps_shm_dir(root: str) -> str:
    """The shared-memory directory every MPS resource's pods mount as ``/dev/shm``."""
    return os.path.join(root, "shm")


def mps_thread_percentage(replicas: int) -> int:
    """A replica's share of the GPU's threads: ``100 / replicas`` (whole percent), as
    NVIDIA's MPS daemon sets the default active-thread percentage."""
    return max(1, 100 // replicas)


def mps_memory_limit_mib(gpu: Gpu, replicas: int) -> int | None:
    """A replica's pinned device memory: the GPU's memory / replicas (MiB, rounded down, as
    NVIDIA's MPS daemon sets it); None when the memory is not known."""
    return gpu.memory_mib // replicas if gpu.memory_mib else None


@dataclass(frozen=True)
class MpsShare:
    """What a container holds of an MPS-shared resource."""

    resource: str  # the resource's name: its control daemon's directory under mpsRoot
    replicas: Mapping[int, int]  # GPU index -> replicas that GPU is advertised as
    held: Mapping[int, int]  # GPU index -> how many of them the container holds


@dataclass(frozen=True)
class ContainerDevice:
    """One GPU, or one MIG device of it, handed to a container."""

    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu.uuid


@dataclass(frozen=True)
class ContainerEdits:
    """What one container gets; mirrors the device plugin's ``ContainerAllocateResponse``.

    ``nodes_by_device`` holds, by device UUID, the container paths in ``devices`` that
    belong to that device alone (its GPU node, a MIG device's capability nodes): the rest of
    ``devices`` are the control nodes every device needs."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (container, host, read_only)
    devices: tuple[tuple[str, str, str], ...] = ()  # (container, host, permissions)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    nodes_by_device: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def container_edits(
    topology: Topology,
    devices: Sequence[ContainerDevice],
    config: Config,
    *,
    path_exists: Callable[[str], bool] = os.path.exists,
    mps: MpsShare | None = None,
    nccl_file: NcclFile | None = None,
) -> ContainerEdits:
    """What a container gets for ``devices`` (distinct, at least one), as ``config``'s
    ``deviceListStrategy``, ``deviceIDStrategy``, ``passDeviceSpecs``, ``nvidiaDriverRoot``
    and CDI annotation prefix say. ``path_exists`` tells which control nodes exist on the
    host; ``mps`` adds what an MPS client needs; ``nccl_file`` (written for these devices)
    is mounted read-only at ``nccl.mountPath`` and named by ``NCCL_TOPO_FILE``. The nearest
    NICs are named in ``GPU_TOPOLOGY_NICS`` (and ``NCCL_IB_HCA`` with ``nccl.setIbHca``)."""
    ids = [_visible_id(d, config) for d in devices]
    channels = [c for c in config.imex_channel_ids if config.imex_required or _imex_node_exists(c, config)]
    envs: dict[str, str] = {}
    mounts: list[tuple[str, str, bool]] = []
    nodes: list[tuple[str, str, str]] = []
    nodes_by_device: dict[str, tuple[str, ...]] = {}
    annotations: dict[str, str] = {}
    cdi_devices: list[str] = []
    strategies = config.device_list_strategy
    cdi = [s for s in strategies if s.startswith("cdi-")]
    if cdi:
        names = [f"{CDI_KIND}={i}" for i in ids] + [f"{IMEX_CDI_KIND}={c}" for c in channels]
        if "cdi-annotations" in strategies:
            key = f"{config.cdi_annotation_prefix}{CDI_ANNOTATION_PLUGIN}_{uuidlib.uuid4()}"
            annotations[key] = ",".join(names)
        if "cdi-cri" in strategies:
            cdi_devices.extend(names)
    if len(cdi) < len(strategies):  # at least one non-CDI strategy: the anchor's env/mounts
        if "envvar" in strategies:
            envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
            if channels:
                envs[IMEX_CHANNELS_ENV] = ",".join(map(str, channels))
        if "volume-mounts" in strategies:
            envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNTS_ROOT
            mounts.extend((f"{VOLUME_MOUNTS_ROOT}/{i}", VOLUME_MOUNTS_HOST_PATH, False) for i in ids)
            mounts.extend((f"{VOLUME_MOUNTS_ROOT}/imex/{c}", VOLUME_MOUNTS_HOST_PATH, False) for c in channels)
        if config.pass_device_specs:
            nodes, nodes_by_device = _device_specs(devices, config.nvidia_driver_root, path_exists)
            nodes.extend((_imex_path(c), _host_path(_imex_path(c), config.nvidia_driver_root), "rw")
                         for c in channels)
    envs.update(_topology_envs(topology, devices))
    if nccl_file is not None:
        mounts.append((config.nccl_mount_path, nccl_file.host_path, True))
        envs[NCCL_TOPO_FILE_ENV] = config.nccl_mount_path
    nics = nccl_file.nics if nccl_file is not None else nearest_nics(topology, sorted({d.gpu.index for d in devices}))
    envs.update(nic_envs(nics, config.nccl_ib_hca))
    if mps is not None:
        envs.update(_mps_envs(topology, devices, mps))
        mounts.extend(_mps_mounts(mps, config.mps_root))
    return ContainerEdits(
        envs=envs, mounts=tuple(mounts), devices=tuple(nodes), annotations=annotations,
        cdi_devices=tuple(cdi_devices), nodes_by_device=nodes_by_device,
    )


def _imex_path(channel: int) -> str:
    return f"{IMEX_CHANNELS_DIR}/channel{channel}"


def _imex_node_exists(channel: int, config: Config) -> bool:
    """The channel's node is a character device under the driver root, or (an agent given
    the host's device nodes by CDI) at its own path: where NVIDIA's plugin looks."""
    path = _imex_path(channel)
    for candidate in dict.fromkeys((_host_path(path, config.nvidia_driver_root), path)):
        try:
            if stat.S_ISCHR(os.stat(candidate).st_mode):
                return True
        except OSError:
            continue
    return False


def check_imex_channels(config: Config) -> None:
    """Check the configured IMEX channels on this node, when a configuration is loaded (at
    start and at each reload): a required channel without its device node is a
    :class:`ConfigError` naming it (the agent does not start, a reload keeps the running
    configuration); an optional one is logged and left out of containers until its node
    exists."""
    for channel in config.imex_channel_ids:
        path = _host_path(_imex_path(channel), config.nvidia_driver_root)
        if _imex_node_exists(channel, config):
            log.info("IMEX channel channel%d (%s) goes to every container given GPUs", channel, path)
        elif config.imex_required:
            raise ConfigError(
                f"imex.required: IMEX channel channel{channel} does not exist on this node: no character"
                f" device at {path} (create the channel with the IMEX driver, or set imex.required false)"
            )
        else:
            log.warning("IMEX channel channel%d: no character device at %s; left out of containers"
                        " until it exists", channel, path)


def _mps_envs(topology: Topology, devices: Sequence[ContainerDevice], mps: MpsShare) -> dict[str, str]:
    """The pipe directory, and the limits of the replicas held: per GPU, ``held`` times a
    replica's threads and memory; one thread percentage for the container (CUDA takes one),
    the smallest; memory by the device's CUDA ordinal in the container (its place in
    ``devices``)."""
    envs = {MPS_PIPE_ENV: mps_resource_dir(MPS_CONTAINER_ROOT, mps.resource, "pipe")}
    shares = [
        min(100, held * mps_thread_percentage(mps.replicas[index]))
        for index, held in mps.held.items() if held and index in mps.replicas
    ]
    if shares:
        envs[MPS_THREAD_PERCENTAGE_ENV] = str(min(shares))
    limits = []
    for ordinal, device in enumerate(devices):
        index = device.gpu.index
        held, replicas = mps.held.get(index, 0), mps.replicas.get(index, 0)
        per_replica = mps_memory_limit_mib(topology.gpus[index], replicas) if held and replicas else None
        if per_replica is not None:
            limits.append(f"{ordinal}={held * per_replica}M")
    if limits:
        envs[MPS_MEMORY_LIMIT_ENV] = ",".join(limits)
    return envs


def _mps_mounts(mps: MpsShare, mps_root: str) -> list[tuple[str, str, bool]]:
    return [
        (mps_resource_dir(MPS_CONTAINER_ROOT, mps.resource, "pipe"),
         mps_resource_dir(mps_root, mps.resource, "pipe"), False),
        (MPS_SHM_PATH, mps_shm_dir(mps_root), False),
    ]


def _visible_id(device: ContainerDevice, config: Config) -> str:
    if config.device_id_strategy == "index":
        if device.mig is not None:
            return f"{device.gpu.index}:{device.mig.index}"
        return str(device.gpu.index)
    return device.uuid


def _host_path(path: str, driver_root: str) -> str:
    root = driver_root.rstrip("/")
    return f"{root}{path}" if root else path


def _device_specs(
    devices: Sequence[ContainerDevice], driver_root: str, path_exists: Callable[[str], bool]
) -> tuple[list[tuple[str, str, str]], dict[str, tuple[str, ...]]]:
    """The device nodes to pass (the control nodes that exist, then each device's own, each
    node once) and each device's own nodes by UUID."""
    specs: list[tuple[str, str, str]] = []
    for node in CONTROL_DEVICE_NODES:
        if path_exists(_host_path(node, driver_root)):
            specs.append((node, _host_path(node, driver_root), "rw"))
    own: dict[str, tuple[str, ...]] = {}
    seen: set[str] = set()
    for d in devices:
        paths = _device_nodes(d, driver_root)
        own[d.uuid] = tuple(paths)
        for path in paths:
            if path not in seen:
                seen.add(path)
                specs.append((path, _host_path(path, driver_root), "rw"))
    return specs, own


def _device_nodes(device: ContainerDevice, driver_root: str) -> list[str]:
    """The device's own nodes (container paths): ``/dev/nvidia<minor>``, and for a MIG
    device its capability nodes."""
    gpu = device.gpu
    minor = gpu.minor_number if gpu.minor_number is not None else gpu.index
    paths = [f"/dev/nvidia{minor}"]
    if device.mig is not None:
        paths.extend(_mig_cap_nodes(minor, device.mig, driver_root))
    return paths


def _mig_cap_nodes(minor: int, mig: MigDevice, driver_root: str) -> list[str]:
    """``/dev/nvidia-caps/nvidia-cap<N>`` for the MIG device's GPU and compute instance,
    N read from the driver's ``/proc/driver/nvidia/capabilities`` files (skipped where
    the driver does not publish them)."""
    if mig.gi_id is None:
        return []
    base = f"/proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{mig.gi_id}"
    files = [f"{base}/access"]
    if mig.ci_id is not None:
        files.append(f"{base}/ci{mig.ci_id}/access")
    out = []
    for f in files:
        try:
            with open(_host_path(f, driver_root), encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("DeviceFileMinor:"):
                        out.append(f"/dev/nvidia-caps/nvidia-cap{int(line.split(':', 1)[1])}")
        except (OSError, ValueError):
            continue
    return out


def _topology_envs(topology: Topology, devices: Sequence[ContainerDevice]) -> dict[str, str]:
    indices = sorted({d.gpu.index for d in devices})
    envs = {f"{TOPOLOGY_ENV_PREFIX}GPU_INDICES": ",".join(map(str, indices))}
    numa = sorted({d.gpu.numa_node for d in devices if d.gpu.numa_node is not None})
    if numa and all(d.gpu.numa_node is not None for d in devices):
        envs[f"{TOPOLOGY_ENV_PREFIX}NUMA_NODES"] = ",".join(map(str, numa))
        cpulists = [topology.numa_cpulists[n] for n in numa if n in topology.numa_cpulists]
        if len(cpulists) == len(numa):
            envs[f"{TOPOLOGY_ENV_PREFIX}CPULIST"] = ",".join(cpulists)
    if len(indices) > 1:
        one_island = any(set(indices) <= set(island) for island in topology.nvlink_islands)
        envs[f"{TOPOLOGY_ENV_PREFIX}NVLINK_CONNECTED"] = "true" if one_island else "false"
        envs[f"{TOPOLOGY_ENV_PREFIX}SCORE"] = str(topology.set_score(indices))
    return envs
