"""What a container gets for a set of GPUs, as neutral facts: :func:`container_facts`.

Both kubelet-facing sides ask it, so both hand a container the same device nodes and the
same environment for the same GPUs, and each renders the facts in its own shape: the
device plugin's ``ContainerAllocateResponse`` per ``deviceListStrategy``
(:mod:`agent.deviceplugin.device_lists`), DRA's CDI spec (:mod:`agent.dra.cdi`).

The facts (:class:`ContainerFacts`):

- each device with its ID as ``deviceIDStrategy`` says (UUID, or index / ``<gpu>:<mig>``)
  and its own device nodes: ``/dev/nvidia<minor>``, and for a MIG device its capability
  nodes ``/dev/nvidia-caps/nvidia-cap<N>``, N read from the driver's
  ``/proc/driver/nvidia/capabilities`` files under ``nvidiaDriverRoot``;
- the common nodes every device needs: the control nodes (``/dev/nvidiactl``, ...) that
  exist under ``nvidiaDriverRoot``;
- the IMEX channels (``imex.channelIDs``, multi-node NVLink) that go with every set of GPUs,
  each with its node ``/dev/nvidia-caps-imex-channels/channel<id>``: a channel is handed out
  while its node exists (a character device under ``nvidiaDriverRoot``), a required one
  always (:func:`check_imex_channels` refused to load a configuration requiring a missing
  one);
- the environment: the agent's ``GPU_TOPOLOGY_*`` variables (the GPU indices, their NUMA
  nodes and CPUs, whether they share one NVLink island, the set's score, the nearest NICs),
  then what the caller adds (:class:`ContainerAdditions`: a share of a shared GPU, the
  container's NCCL topology file, :func:`nccl_additions`);
- the mounts the additions bring.

The host is read directly, under ``nvidiaDriverRoot`` (tests point it at a directory of
their own); nothing here calls NVML: the rest comes from the frozen :class:`Topology`.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from agent.config import Config
from agent.errors import ConfigError
from agent.nccl.container_file import nearest_nics
from agent.nccl.host_dir import NCCL_TOPO_FILE_ENV, NICS_ENV, NcclFile, nic_envs
from agent.topology.model import Gpu, MigDevice, Topology

log = logging.getLogger(__name__)

TOPOLOGY_ENV_PREFIX = "GPU_TOPOLOGY_"
#: The NVIDIA container toolkit's variables naming the devices and the IMEX channels to give
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
IMEX_CHANNELS_ENV = "NVIDIA_IMEX_CHANNELS"
#: Control device nodes every device needs, passed where they exist on the host.
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
IMEX_CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"


@dataclass(frozen=True)
class ContainerDevice:
    """One GPU, or one MIG device of it, handed to a container. Models no Kubernetes API: the
    physical device both siblings render (Allocate's response, DRA's CDI spec) from."""

    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu.uuid


@dataclass(frozen=True)
class DeviceNode:
    """A device node the container gets: its path there, the host's node, the access."""

    path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Mount:
    """A host path mounted into the container."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerAdditions:
    """What something beyond the GPUs themselves adds to a container (a share of a shared
    GPU): environment variables and mounts."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()


@dataclass(frozen=True)
class HandedDevice:
    """One device as the container gets it: the ID ``deviceIDStrategy`` names it by and its
    own device nodes (empty when nodes were not asked for)."""

    device: ContainerDevice
    id: str
    nodes: tuple[DeviceNode, ...] = ()


@dataclass(frozen=True)
class ImexChannel:
    id: int
    node: DeviceNode


@dataclass(frozen=True)
class ContainerFacts:
    """What a container gets for a set of devices, in no API's shape (see the module)."""

    devices: tuple[HandedDevice, ...]
    common_nodes: tuple[DeviceNode, ...]  # the control nodes every device needs
    imex_channels: tuple[ImexChannel, ...]
    envs: Mapping[str, str]  # GPU_TOPOLOGY_*, then the additions'
    mounts: tuple[Mount, ...]  # the additions'

    @property
    def ids(self) -> list[str]:
        return [d.id for d in self.devices]

    def own_nodes(self) -> list[DeviceNode]:
        """Every device's own nodes, in device order, each node once (two MIG devices of
        one GPU share its node)."""
        seen: set[str] = set()
        out = []
        for device in self.devices:
            for node in device.nodes:
                if node.path not in seen:
                    seen.add(node.path)
                    out.append(node)
        return out


def container_facts(
    topology: Topology,
    devices: Sequence[ContainerDevice],
    config: Config,
    *,
    nodes: bool = True,
    additions: Sequence[ContainerAdditions] = (),
) -> ContainerFacts:
    """The facts for ``devices`` (distinct, at least one) under ``config``
    (``deviceIDStrategy``, ``nvidiaDriverRoot``, ``imex``). ``nodes``: look for the device
    nodes on the host (the common ones, each device's own); IMEX channels are found either
    way (whether a channel is handed out depends on its node)."""
    root = config.nvidia_driver_root
    handed = tuple(
        HandedDevice(d, _visible_id(d, config), tuple(_node(p, root) for p in _device_nodes(d, root)) if nodes else ())
        for d in devices
    )
    common = tuple(_node(n, root) for n in CONTROL_DEVICE_NODES if os.path.exists(host_path(n, root))) if nodes else ()
    channels = tuple(
        ImexChannel(c, _node(_imex_path(c), root))
        for c in config.imex_channel_ids if config.imex_required or imex_channel_present(c, config)
    )
    envs = _topology_envs(topology, devices)
    if not any(NICS_ENV in a.envs for a in additions):  # an NCCL file names its NICs itself
        envs.update(nic_envs(nearest_nics(topology, sorted({d.gpu.index for d in devices})), config.nccl_ib_hca))
    mounts: list[Mount] = []
    for added in additions:
        envs.update(added.envs)
        mounts.extend(added.mounts)
    return ContainerFacts(handed, common, channels, envs, tuple(mounts))


def nccl_additions(nccl_file: NcclFile | None, config: Config) -> tuple[ContainerAdditions, ...]:
    """What a container's NCCL topology file adds (docs/nccl.md): the file
    mounted read-only at ``nccl.mountPath``, ``NCCL_TOPO_FILE`` naming it, and the NICs it
    holds named (``GPU_TOPOLOGY_NICS``, with ``nccl.setIbHca`` ``NCCL_IB_HCA``)."""
    if nccl_file is None:
        return ()
    envs = {NCCL_TOPO_FILE_ENV: config.nccl_mount_path, **nic_envs(nccl_file.nics, config.nccl_ib_hca)}
    return (ContainerAdditions(envs, (Mount(config.nccl_mount_path, nccl_file.host_path, True),)),)


def _node(path: str, driver_root: str) -> DeviceNode:
    return DeviceNode(path, host_path(path, driver_root))


def _imex_path(channel: int) -> str:
    return f"{IMEX_CHANNELS_DIR}/channel{channel}"


def imex_channel_present(channel: int, config: Config) -> bool:
    """The channel's node is a character device under the driver root, or (an agent given
    the host's device nodes by CDI) at its own path: where NVIDIA's plugin looks."""
    path = _imex_path(channel)
    for candidate in dict.fromkeys((host_path(path, config.nvidia_driver_root), path)):
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
        path = host_path(_imex_path(channel), config.nvidia_driver_root)
        if imex_channel_present(channel, config):
            log.info("IMEX channel channel%d (%s) goes to every container given GPUs", channel, path)
        elif config.imex_required:
            raise ConfigError(
                f"imex.required: IMEX channel channel{channel} does not exist on this node: no character"
                f" device at {path} (create the channel with the IMEX driver, or set imex.required false)"
            )
        else:
            log.warning("IMEX channel channel%d: no character device at %s; left out of containers"
                        " until it exists", channel, path)


def _visible_id(device: ContainerDevice, config: Config) -> str:
    if config.device_id_strategy == "index":
        if device.mig is not None:
            return f"{device.gpu.index}:{device.mig.index}"
        return str(device.gpu.index)
    return device.uuid


def host_path(path: str, driver_root: str) -> str:
    """Where the host's ``path`` is seen from here: under ``driver_root`` (``nvidiaDriverRoot``)."""
    root = driver_root.rstrip("/")
    return f"{root}{path}" if root else path


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
            with open(host_path(f, driver_root), encoding="ascii") as fh:
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
