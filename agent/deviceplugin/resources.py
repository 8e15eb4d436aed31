"""Which resources the node advertises and which device IDs each holds.

A pure function of (Topology, Config): MIG strategy ``none`` / ``single`` / ``mixed`` and
time-slicing (``sharing.timeSlicing``) as NVIDIA's device plugin defines them, except that
per-GPU sharing (``devices``) and ``rename`` really take effect. Device IDs are the anchor's:
the GPU UUID, the MIG device UUID, and ``<uuid>::<n>`` for the n-th time-sliced replica.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from agent.config import Config, TimeSlicingResource
from agent.errors import ConfigError
from agent.formats import GPU_RESOURCE, MIG_RESOURCE_PREFIX
from agent.topology.model import Gpu, MigDevice, Topology

log = logging.getLogger(__name__)

REPLICA_SEPARATOR = "::"
#: The anchor's socket names: ``nvidia-gpu.sock``, ``nvidia-mig-1g.10gb.sock``
DEFAULT_SOCKET_NAME = "nvidia-{resource}.sock"
#: The largest message the kubelet's gRPC client accepts (grpc-go's default receive limit):
#: a ListAndWatch device list above it never reaches the kubelet.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class PluginDevice:
    """One device ID advertised to the kubelet."""

    id: str  # what the kubelet sees: GPU UUID, MIG UUID, or "<uuid>::<n>"
    gpu_index: int  # the physical GPU it lives on (a MIG device's parent)
    uuid: str  # the GPU or MIG UUID behind it (the ID without a replica suffix)
    numa_node: int | None
    mig: MigDevice | None = None
    replica: int | None = None  # n of "<uuid>::<n>"; None when not time-sliced


@dataclass(frozen=True)
class PluginResource:
    """One extended resource and its devices, in the stable order they are advertised."""

    name: str  # "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared"
    devices: tuple[PluginDevice, ...]
    by_id: Mapping[str, PluginDevice] = field(default_factory=dict, compare=False, repr=False)
    #: ``config.socket_name``: ``{resource}`` stands for the name after the domain
    socket_template: str = field(default=DEFAULT_SOCKET_NAME, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_id", {d.id: d for d in self.devices})

    @property
    def kind(self) -> str:
        """``"mig"``, ``"replica"`` (any time-sliced device) or ``"gpu"``: picks the
        allocation engine call."""
        if any(d.replica is not None for d in self.devices):
            return "replica"
        if any(d.mig is not None for d in self.devices):
            return "mig"
        return "gpu"

    @property
    def shared(self) -> bool:
        return any(d.replica is not None for d in self.devices)

    @property
    def socket_name(self) -> str:
        """The socket file's base name in the kubelet's directory: by default as the anchor
        names it (``nvidia-gpu.sock``, ``nvidia-mig-1g.10gb.sock``)."""
        return self.socket_template.replace("{resource}", self.name.split("/", 1)[-1])

    def numa_consistent(self) -> bool:
        """True when every device has a NUMA node. (A device without one is advertised
        without TopologyInfo, as NVIDIA's plugin does; the others keep theirs.)"""
        return all(d.numa_node is not None for d in self.devices)


def _gpu_device(gpu: Gpu) -> PluginDevice:
    return PluginDevice(id=gpu.uuid, gpu_index=gpu.index, uuid=gpu.uuid, numa_node=gpu.numa_node)


def _mig_device(gpu: Gpu, mig: MigDevice) -> PluginDevice:
    return PluginDevice(id=mig.uuid, gpu_index=gpu.index, uuid=mig.uuid, numa_node=gpu.numa_node, mig=mig)


def _base_resources(topology: Topology, strategy: str) -> dict[str, list[PluginDevice]]:
    out: dict[str, list[PluginDevice]] = {}
    mig_gpus = [g for g in topology.gpus if g.mig_enabled]
    if strategy == "none" or (strategy == "single" and not mig_gpus):
        out[GPU_RESOURCE] = [_gpu_device(g) for g in topology.gpus if not g.mig_enabled]
        if mig_gpus and strategy == "none":
            log.warning(
                "GPUs %s are in MIG mode and migStrategy is none: they are not advertised",
                [g.index for g in mig_gpus],
            )
    elif strategy == "single":
        plain = [g.index for g in topology.gpus if not g.mig_enabled]
        if plain:
            raise ConfigError(
                f"migStrategy single: GPUs {plain} have MIG disabled while GPUs "
                f"{[g.index for g in mig_gpus]} have it enabled; use migStrategy mixed"
            )
        empty = [g.index for g in mig_gpus if not g.mig_devices]
        if empty:
            raise ConfigError(f"migStrategy single: GPUs {empty} are in MIG mode with no MIG devices")
        profiles = sorted({m.profile for g in mig_gpus for m in g.mig_devices})
        if len(profiles) > 1:
            raise ConfigError(
                f"migStrategy single: all MIG devices must have one profile, found {', '.join(profiles)};"
                " use migStrategy mixed"
            )
        out[GPU_RESOURCE] = [_mig_device(g, m) for g in mig_gpus for m in g.mig_devices]
    elif strategy == "mixed":
        plain_devices = [_gpu_device(g) for g in topology.gpus if not g.mig_enabled]
        if plain_devices:
            out[GPU_RESOURCE] = plain_devices
        for g in mig_gpus:
            for m in g.mig_devices:
                out.setdefault(f"{MIG_RESOURCE_PREFIX}{m.profile}", []).append(_mig_device(g, m))
    else:
        raise ConfigError(f"migStrategy: expected one of none, single, mixed, got {strategy!r}")
    return out


def _selects(entry: TimeSlicingResource, device: PluginDevice, topology: Topology) -> bool:
    if entry.devices is None:
        return True
    for sel in entry.devices:
        if sel == device.uuid or (device.mig is None and sel == topology.gpus[device.gpu_index].uuid):
            return True
        if sel.isdigit() and device.mig is None and int(sel) == device.gpu_index:
            return True
        if device.mig is not None and sel == f"{device.gpu_index}:{device.mig.index}":
            return True
    return False


def _shared_name(base: str, entry: TimeSlicingResource, rename_by_default: bool) -> str:
    if entry.rename:
        return f"{base.split('/', 1)[0]}/{entry.rename}"
    if rename_by_default:
        return f"{base}.shared"
    return base


def build_resources(topology: Topology, config: Config) -> tuple[PluginResource, ...]:
    """The resources to serve, sorted by name, each with its devices in a stable order.

    Raises :class:`ConfigError` when the MIG layout does not fit ``mig_strategy`` (the
    anchor's checks) or time-slicing names a resource that does not exist.
    """
    base = _base_resources(topology, config.mig_strategy)
    final: dict[str, list[PluginDevice]] = {}
    claimed: set[str] = set()
    for i, entry in enumerate(config.time_slicing):
        if entry.name not in base:
            log.warning("sharing.timeSlicing.resources[%d]: no %s on this node", i, entry.name)
            continue
        matched = [d for d in base[entry.name] if d.id not in claimed and _selects(entry, d, topology)]
        if entry.devices is not None:
            unmatched = [s for s in entry.devices if not any(_selects_one(s, d, topology) for d in base[entry.name])]
            if unmatched:
                raise ConfigError(
                    f"{config.config_file or 'configuration'}: sharing.timeSlicing.resources[{i}].devices:"
                    f" {', '.join(map(repr, unmatched))} is no {entry.name} device of this node (expected"
                    f" GPU indices 0-{topology.gpu_count - 1}, GPU:MIG indices, or GPU/MIG UUIDs of this node)"
                )
        name = _shared_name(entry.name, entry, config.rename_by_default)
        for d in matched:
            claimed.add(d.id)
            if entry.replicas == 1 and name == entry.name:
                final.setdefault(name, []).append(d)
                continue
            final.setdefault(name, []).extend(
                PluginDevice(
                    id=f"{d.uuid}{REPLICA_SEPARATOR}{n}", gpu_index=d.gpu_index, uuid=d.uuid,
                    numa_node=d.numa_node, mig=d.mig, replica=n,
                )
                for n in range(entry.replicas)
            )
    for name, devices in base.items():
        rest = [d for d in devices if d.id not in claimed]
        if rest:
            final.setdefault(name, []).extend(rest)

    def order(d: PluginDevice) -> tuple[int, int, int]:
        return (d.gpu_index, d.mig.index if d.mig else -1, d.replica if d.replica is not None else -1)

    out = tuple(
        PluginResource(name=name, devices=tuple(sorted(devs, key=order)), socket_template=config.socket_name)
        for name, devs in sorted(final.items())
        if devs
    )
    _check_served(out, config)
    return out


def _check_served(out: tuple[PluginResource, ...], config: Config) -> None:
    """Raise ConfigError when a resource's device list exceeds a gRPC message or two
    resources would share one socket."""
    for resource in out:
        size = device_list_bytes(resource)
        if size > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"{config.config_file or 'configuration'}: {resource.name} would advertise"
                f" {len(resource.devices)} devices, a ListAndWatch message of {size} bytes: more than the"
                f" {MAX_MESSAGE_BYTES} bytes (4 MiB) gRPC lets the kubelet receive; lower"
                " sharing.timeSlicing.resources[].replicas"
            )
    sockets = [r.socket_name for r in out]
    if len(set(sockets)) < len(sockets):
        raise ConfigError(
            f"socket name {config.socket_name!r} gives {len(out)} resources ({', '.join(r.name for r in out)})"
            " the same socket; put {resource} in it"
        )


def _selects_one(sel: str, device: PluginDevice, topology: Topology) -> bool:
    return _selects(TimeSlicingResource(devices=(sel,)), device, topology)


def physical_devices(devices: Iterable[PluginDevice]) -> list[PluginDevice]:
    """Replicas reduced to the GPU or MIG device behind them, de-duplicated, first-seen order."""
    seen: dict[str, PluginDevice] = {}
    for d in devices:
        if d.uuid not in seen:
            seen[d.uuid] = PluginDevice(id=d.uuid, gpu_index=d.gpu_index, uuid=d.uuid, numa_node=d.numa_node, mig=d.mig)
    return list(seen.values())


def _varint_bytes(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field_bytes(payload: int) -> int:
    """A length-delimited field with a one-byte tag: tag + length + payload."""
    return 1 + _varint_bytes(payload) + payload


def device_list_bytes(resource: PluginResource) -> int:
    """The serialized size of ``resource``'s ListAndWatchResponse with every device
    Unhealthy (the longer health word), computed from the wire format without building
    the message (a test checks it against protobuf's own ``ByteSize``)."""
    total = 0
    health = _field_bytes(len("Unhealthy"))
    for d in resource.devices:
        size = _field_bytes(len(d.id.encode())) + health
        if d.numa_node is not None:
            # NUMANode.ID is an int64: 0 is not sent, a negative one takes ten bytes
            node = 0 if d.numa_node == 0 else 1 + (_varint_bytes(d.numa_node) if d.numa_node > 0 else 10)
            size += _field_bytes(_field_bytes(node))  # topology { nodes { ID } }
        total += _field_bytes(size)
    return total
