"""The device plugin's shape of what a container gets: the ``ContainerAllocateResponse``
NVIDIA's device plugin answers, rendered from :class:`agent.containers.ContainerFacts` per
``deviceListStrategy``:

- ``envvar``: ``NVIDIA_VISIBLE_DEVICES`` = the IDs (and ``NVIDIA_IMEX_CHANNELS``);
- ``volume-mounts``: ``NVIDIA_VISIBLE_DEVICES`` = ``/var/run/nvidia-container-devices`` and
  one ``/dev/null`` mount per ID under it (IMEX channels under ``.../imex``);
- ``cdi-annotations`` / ``cdi-cri``: CDI device names ``nvidia.com/gpu=<id>`` (and
  ``nvidia.com/imex-channel=<id>``, the name ``nvidia-ctk cdi generate --mode imex`` gives)
  as an annotation ``<cdiAnnotationPrefix>nvidia-device-plugin_<uuid>`` or as CRI CDI
  devices;
- with ``passDeviceSpecs``, under the non-CDI strategies: the device nodes (the common ones,
  each device's own once, the IMEX channels').

The facts' environment (``GPU_TOPOLOGY_*``, a share's) and mounts come after the strategy's.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Mapping

from agent.config import Config
from agent.containers import IMEX_CHANNELS_ENV, VISIBLE_DEVICES_ENV, ContainerFacts, DeviceNode

VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNTS_HOST_PATH = "/dev/null"
#: The CDI kind of the device plugin's CDI device names (``nvidia.com/gpu=<id>``).
CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PLUGIN = "nvidia-device-plugin"
IMEX_CDI_KIND = "nvidia.com/imex-channel"


@dataclass(frozen=True)
class ContainerResponse:
    """One container's answer, as the device plugin API's ``ContainerAllocateResponse``."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (container, host, read_only)
    devices: tuple[tuple[str, str, str], ...] = ()  # (container, host, permissions)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


def render(facts: ContainerFacts, config: Config) -> ContainerResponse:
    """``facts`` as ``config``'s ``deviceListStrategy``, ``passDeviceSpecs`` and CDI
    annotation prefix say."""
    ids, channels = facts.ids, [c.id for c in facts.imex_channels]
    envs: dict[str, str] = {}
    mounts: list[tuple[str, str, bool]] = []
    nodes: list[tuple[str, str, str]] = []
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
    if len(cdi) < len(strategies):  # at least one non-CDI strategy: NVIDIA's env/mounts
        if "envvar" in strategies:
            envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
            if channels:
                envs[IMEX_CHANNELS_ENV] = ",".join(map(str, channels))
        if "volume-mounts" in strategies:
            envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNTS_ROOT
            mounts.extend((f"{VOLUME_MOUNTS_ROOT}/{i}", VOLUME_MOUNTS_HOST_PATH, False) for i in ids)
            mounts.extend((f"{VOLUME_MOUNTS_ROOT}/imex/{c}", VOLUME_MOUNTS_HOST_PATH, False) for c in channels)
        if config.pass_device_specs:
            nodes = [_spec(n) for n in _device_nodes(facts)]
    envs.update(facts.envs)
    mounts.extend((m.container_path, m.host_path, m.read_only) for m in facts.mounts)
    return ContainerResponse(envs=envs, mounts=tuple(mounts), devices=tuple(nodes), annotations=annotations,
                             cdi_devices=tuple(cdi_devices))


def _device_nodes(facts: ContainerFacts) -> list[DeviceNode]:
    """The common nodes, then each device's own (each node once), then the IMEX channels'."""
    return [*facts.common_nodes, *facts.own_nodes(), *(c.node for c in facts.imex_channels)]


def _spec(node: DeviceNode) -> tuple[str, str, str]:
    return node.path, node.host_path, node.permissions
