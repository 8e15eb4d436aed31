"""Which resources the node advertises and which device IDs each holds.

A pure function of (Topology, Config): MIG strategy ``none`` / ``single`` / ``mixed``,
the sharing sections' replicas (:mod:`agent.sharing`) as NVIDIA's device plugin
defines them, except that per-GPU sharing (``devices``) and ``rename`` really take effect.
Device IDs are NVIDIA's device plugin's: the GPU UUID, the MIG device UUID, and ``<uuid>::<n>`` for the
n-th replica, however shared (the resource's :mod:`agent.sharing` instance checks the node
and says what a share adds).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from agent.config import Config, TimeSlicingResource
from agent.errors import ConfigError, shorten
from agent.formats import GPU_RESOURCE, MIG_RESOURCE_PREFIX
from agent.sharing import sharing_for
from agent.sharing.base import PlannedShare, Sharing, replicas_per_gpu
from agent.topology.model import Gpu, MigDevice, Topology

log = logging.getLogger(__name__)

REPLICA_SEPARATOR = "::"
#: NVIDIA's device plugin's socket names: ``nvidia-gpu.sock``, ``nvidia-mig-1g.10gb.sock``
DEFAULT_SOCKET_NAME = "nvidia-{resource}.sock"
#: The largest message the kubelet's gRPC client accepts (grpc-go's default receive limit):
#: a ListAndWatch device list above it never reaches the kubelet.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: All resources' device lists together. Each advertised device costs the agent about
#: 1.3 KiB (ID, records, the allocation table, the messages), and a reload holds the old and
#: the new lists for a moment. Measured on the simulated dgx-h100: 49 MiB peak RSS with 8
#: devices, 128 MiB with 63,200 replicas, 154 MiB across a SIGHUP to 62,400: 4 MiB of lists
#: (about 63,000 devices) keeps the agent within the DaemonSet's 256 MiB memory limit.
MAX_ADVERTISED_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class PluginDevice:
    """One device ID advertised to the kubelet. Models the device plugin API's
    ``v1beta1.Device`` (ListAndWatch: ID, health, TopologyInfo) plus what stands behind the ID."""

    id: str  # what the kubelet sees: GPU UUID, MIG UUID, or "<uuid>::<n>"
    gpu_index: int  # the physical GPU it lives on (a MIG device's parent)
    uuid: str  # the GPU or MIG UUID behind it (the ID without a replica suffix)
    numa_node: int | None
    mig: MigDevice | None = None
    replica: int | None = None  # n of "<uuid>::<n>"; None when not time-sliced


class ResourceKind(enum.Enum):
    """What a resource's devices are; picks the allocation engine's call."""

    GPU = "gpu"
    MIG = "mig"
    REPLICA = "replica"  # replicas of shared GPUs, however shared


@dataclass(frozen=True)
class PluginResource:
    """One extended resource and its devices, in the stable order they are advertised."""

    name: str  # "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared"
    devices: tuple[PluginDevice, ...]
    by_id: Mapping[str, PluginDevice] = field(default_factory=dict, compare=False, repr=False)
    #: ``config.socket_name``: ``{resource}`` stands for the name after the domain
    socket_template: str = field(default=DEFAULT_SOCKET_NAME, compare=False)
    #: how its replicas are shared; None when it has none
    sharing: Sharing | None = None
    kind: ResourceKind = field(init=False, default=ResourceKind.GPU)
    #: GPU index -> how many replicas of that GPU the resource holds (empty: no replicas)
    replicas: Mapping[int, int] = field(init=False, default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_id", {d.id: d for d in self.devices})
        replicas = replicas_per_gpu((d.gpu_index, d.replica) for d in self.devices)
        object.__setattr__(self, "replicas", replicas)
        if replicas:
            kind = ResourceKind.REPLICA
        elif any(d.mig is not None for d in self.devices):
            kind = ResourceKind.MIG
        else:
            kind = ResourceKind.GPU
        object.__setattr__(self, "kind", kind)
        if kind is not ResourceKind.REPLICA:
            object.__setattr__(self, "sharing", None)

    @property
    def shared(self) -> bool:
        return self.kind is ResourceKind.REPLICA

    @property
    def socket_name(self) -> str:
        """The socket file's base name in the kubelet's directory: by default as NVIDIA's device plugin
        names it (``nvidia-gpu.sock``, ``nvidia-mig-1g.10gb.sock``)."""
        return self.socket_template.replace("{resource}", self.name.split("/", 1)[-1])


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


#: A planned device: a base device and how many replicas of it are advertised (0: the
#: device itself), with the sharing section's ``resources`` entry that asked (or None).
_Planned = tuple[PluginDevice, int, "int | None"]


def _plan(topology: Topology, config: Config) -> dict[str, list[_Planned]]:
    """Resource name -> its planned devices: what :func:`build_resources` will build, before
    a single replica exists (so its size can be checked first)."""
    base = _base_resources(topology, config.mig_strategy)
    plan: dict[str, list[_Planned]] = {}
    claimed: set[str] = set()
    sharing = sharing_for(config)
    section = sharing.section
    for i, entry in enumerate(sharing.entries(config)):
        if entry.name not in base:
            log.warning("%s.resources[%d]: no %s on this node", section, i, entry.name)
            continue
        matched = [d for d in base[entry.name] if d.id not in claimed and _selects(entry, d, topology)]
        if entry.devices is not None:
            unmatched = [s for s in entry.devices if not any(_selects_one(s, d, topology) for d in base[entry.name])]
            if unmatched:
                raise ConfigError(
                    f"{config.config_file or 'configuration'}: {section}.resources[{i}].devices:"
                    f" {shorten(', '.join(map(repr, unmatched)))} is no {entry.name} device of this node"
                    f" (expected GPU indices 0-{topology.gpu_count - 1}, GPU:MIG indices, or GPU/MIG UUIDs"
                    " of this node)"
                )
        name = _shared_name(entry.name, entry, config.rename_by_default)
        itself = entry.replicas == 1 and name == entry.name
        for d in matched:
            claimed.add(d.id)
            plan.setdefault(name, []).append((d, 0 if itself else entry.replicas, i))
    for name, devices in base.items():
        rest: list[_Planned] = [(d, 0, None) for d in devices if d.id not in claimed]
        if rest:
            plan.setdefault(name, []).extend(rest)
    return plan


def build_resources(topology: Topology, config: Config) -> tuple[PluginResource, ...]:
    """The resources to serve, sorted by name, each with its devices in a stable order.

    Raises :class:`ConfigError` when the MIG layout does not fit ``mig_strategy`` (the
    NVIDIA's device plugin's checks), time-slicing names a device that does not exist, or the device lists
    would be too large (:func:`_check_sizes`, from arithmetic, before any replica is built).
    """
    plan = _plan(topology, config)
    sharing = sharing_for(config)
    sharing.check(
        (PlannedShare(topology.gpus[d.gpu_index], d.mig, replicas, i)
         for planned in plan.values() for d, replicas, i in planned if replicas and i is not None),
        topology, config,
    )
    _check_sizes(plan, config)

    def order(d: PluginDevice) -> tuple[int, int, int]:
        return (d.gpu_index, d.mig.index if d.mig else -1, d.replica if d.replica is not None else -1)

    out = tuple(
        PluginResource(
            name=name, devices=tuple(sorted(_materialise(planned), key=order)), socket_template=config.socket_name,
            sharing=sharing,
        )
        for name, planned in sorted(plan.items())
        if planned
    )
    _check_sockets(out, config)
    return out


def _materialise(planned: list[_Planned]) -> list[PluginDevice]:
    out: list[PluginDevice] = []
    for d, replicas, _ in planned:
        if not replicas:
            out.append(d)
            continue
        out.extend(
            PluginDevice(
                id=f"{d.uuid}{REPLICA_SEPARATOR}{n}", gpu_index=d.gpu_index, uuid=d.uuid,
                numa_node=d.numa_node, mig=d.mig, replica=n,
            )
            for n in range(replicas)
        )
    return out


def _check_sizes(plan: dict[str, list[_Planned]], config: Config) -> None:
    """Raise ConfigError, naming the file, the field and the limit, when a resource's device
    list would exceed one gRPC message or all of them together :data:`MAX_ADVERTISED_BYTES`.
    Computed from the plan (GPUs x replicas x bytes per device): a refused configuration
    costs no memory, where building ``replicas: 100000`` on 8 GPUs first took 300 MiB."""
    where = config.config_file or "configuration"
    total_bytes = total_devices = 0
    for name, planned in sorted(plan.items()):
        size = sum(_planned_bytes(d, replicas) for d, replicas, _ in planned)
        count = sum(replicas or 1 for _, replicas, _ in planned)
        total_bytes, total_devices = total_bytes + size, total_devices + count
        if size > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"{where}: {_replica_fields(planned, config)}: {name} would advertise {count} devices, a"
                f" ListAndWatch message of {size} bytes: more than the {MAX_MESSAGE_BYTES} bytes (4 MiB)"
                " gRPC lets the kubelet receive; lower the replicas"
            )
    if total_bytes > MAX_ADVERTISED_BYTES:
        everything = [p for planned in plan.values() for p in planned]
        raise ConfigError(
            f"{where}: {_replica_fields(everything, config)}: the node would advertise {total_devices} devices in"
            f" {len(plan)} resources, {total_bytes} bytes of device lists: more than the"
            f" {MAX_ADVERTISED_BYTES} bytes (4 MiB) the agent serves within its memory limit;"
            " lower the replicas"
        )


def _replica_fields(planned: list[_Planned], config: Config) -> str:
    """The ``replicas`` fields that made ``planned``: ``sharing.timeSlicing.resources[0,2].replicas``."""
    entries = sorted({i for _, replicas, i in planned if replicas and i is not None})
    section = sharing_for(config).section
    if not entries:
        return section
    return f"{section}.resources[{shorten(','.join(map(str, entries)), 40)}].replicas"


def _check_sockets(out: tuple[PluginResource, ...], config: Config) -> None:
    """Raise ConfigError when two resources would share one socket."""
    sockets = [r.socket_name for r in out]
    if len(set(sockets)) < len(sockets):
        raise ConfigError(
            f"socket name {shorten(repr(config.socket_name))} gives {len(out)} resources"
            f" ({', '.join(r.name for r in out)}) the same socket; put {{resource}} in it"
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


def _device_bytes(id_bytes: int, numa_node: int | None) -> int:
    """One Device entry of a ListAndWatchResponse, Unhealthy (the longer health word)."""
    size = _field_bytes(id_bytes) + _field_bytes(len("Unhealthy"))
    if numa_node is not None:
        # NUMANode.ID is an int64: 0 is not sent, a negative one takes ten bytes
        node = 0 if numa_node == 0 else 1 + (_varint_bytes(numa_node) if numa_node > 0 else 10)
        size += _field_bytes(_field_bytes(node))  # topology { nodes { ID } }
    return _field_bytes(size)


def _planned_bytes(device: PluginDevice, replicas: int) -> int:
    """What ``device`` (``replicas`` == 0) or its ``replicas`` replicas take in the device
    list: replica IDs ``<uuid>::<n>`` grouped by the digits of ``n``, a few steps however
    large ``replicas`` is."""
    if not replicas:
        return _device_bytes(len(device.id.encode()), device.numa_node)
    stem = len(device.uuid.encode()) + len(REPLICA_SEPARATOR)
    total, low, digits = 0, 0, 1
    while low < replicas:
        high = min(replicas, 10**digits)
        total += (high - low) * _device_bytes(stem + digits, device.numa_node)
        low, digits = high, digits + 1
    return total
