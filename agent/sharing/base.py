"""The sharing interface and its records: sharing a GPU between containers, as one concept
with two instances: time-slicing (:mod:`agent.sharing.timeslicing`) and MPS
(:mod:`agent.sharing.mps`), both configured as NVIDIA's device plugin configures them
(``sharing.timeSlicing`` / ``sharing.mps``, the same ``resources`` entries).

A :class:`Sharing` says, for its instance:

- the label's strategy name (GFD's ``nvidia.com/gpu.sharing-strategy``) and the config
  file's section;
- whether the node can serve the planned replicas (:meth:`Sharing.check`: a ConfigError
  naming the GPU and the field where it cannot);
- what a container's share adds (:meth:`Sharing.additions`: environment and mounts);
- an optional supervisor per shared resource (:meth:`Sharing.supervisor`) with readiness:
  the resource's replicas are served while it is ready.

Replicas per GPU are counted once, by :func:`replicas_per_gpu`. A third mode is one more
module beside the two and one entry in :func:`agent.sharing.sharing_for`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from agent.config import Config, TimeSlicingResource
from agent.containers import ContainerAdditions, ContainerDevice
from agent.topology.model import Gpu, MigDevice, Topology

#: How often a running supervisor checks that what it supervises is still ready (s).
PROBE_INTERVAL_S = 5.0
#: How long a supervisor may take to stop (s): an MPS daemon's quit is one control command.
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PlannedShare:
    """A device the configuration shares: the GPU (and MIG device) behind it, how many
    replicas it is advertised as, and the ``resources`` entry that asked."""

    gpu: Gpu
    mig: MigDevice | None
    replicas: int
    entry: int


@dataclass(frozen=True)
class Share:
    """What a container holds of a shared resource."""

    resource: str  # the resource's name
    replicas: Mapping[int, int]  # GPU index -> replicas that GPU is advertised as
    held: Mapping[int, int]  # GPU index -> how many of them the container holds


class Supervisor(Protocol):
    """Keeps a shared resource servable (a daemon of its own); its replicas are served while
    it is :attr:`ready`. ``generation`` grows whenever ``ready`` flips."""

    @property
    def ready(self) -> bool: ...

    @property
    def generation(self) -> int: ...

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...


class Sharing(Protocol):
    """One way of sharing a GPU (see the module)."""

    #: GFD's ``gpu.sharing-strategy`` value
    strategy: str
    #: the config file's key, for messages
    section: str

    def entries(self, config: Config) -> tuple[TimeSlicingResource, ...]:
        """The configuration's ``resources`` entries of this sharing (its section's)."""
        ...

    def check(self, planned: Iterable[PlannedShare], topology: Topology, config: Config) -> None:
        """Raise ConfigError, naming the GPU and the field, where the node cannot serve a
        planned replica."""
        ...

    def additions(self, share: Share, topology: Topology, devices: Sequence[ContainerDevice],
                  config: Config) -> ContainerAdditions | None:
        """What a container holding ``share`` (on ``devices``, in the container's order)
        gets beyond its devices; None: nothing."""
        ...

    def supervisor(self, resource: str, replicas: Mapping[int, int], topology: Topology, config: Config,
                   on_change: Callable[[], None], probe_s: float) -> Supervisor | None:
        """The supervisor of ``resource`` (not yet started; ``on_change`` called whenever its
        readiness flips; asked every ``probe_s`` whether it is still ready), or None when
        this sharing needs none."""
        ...

    def same_supervisor(self, running: Supervisor, wanted: Supervisor) -> bool:
        """``running`` serves what ``wanted`` would (it is kept across a reload)."""
        ...


def replicas_per_gpu(replicas: Iterable[tuple[int, int | None]]) -> dict[int, int]:
    """GPU index -> how many replicas of it there are, from (GPU index, replica number or
    None) per advertised device."""
    out: dict[int, int] = {}
    for index, replica in replicas:
        if replica is not None:
            out[index] = out.get(index, 0) + 1
    return out


class Supervisors:
    """The supervisors of a node's shared resources, by resource name; used by the one
    thread that owns the device-plugin servers. ``on_change`` is called whenever one's
    readiness flips."""

    def __init__(self, on_change: Callable[[], None], probe_s: float) -> None:
        self._on_change = on_change
        self.probe_s = probe_s
        self._running: dict[str, tuple[Sharing, Supervisor]] = {}

    def get(self, resource: str) -> Supervisor | None:
        running = self._running.get(resource)
        return running[1] if running is not None else None

    def sync(self, shared: Iterable[tuple[str, Sharing, Mapping[int, int]]], topology: Topology,
             config: Config) -> None:
        """One supervisor per (resource, its sharing, its replicas per GPU) that needs one: a
        running one that serves what is wanted is kept (its pods keep what it supervises),
        the others stop, new ones start."""
        wanted: dict[str, tuple[Sharing, Supervisor]] = {}
        for name, sharing, replicas in shared:
            supervisor = sharing.supervisor(name, replicas, topology, config, self._on_change, self.probe_s)
            if supervisor is not None:
                wanted[name] = (sharing, supervisor)
        for name, (sharing, running) in list(self._running.items()):
            if name not in wanted or not sharing.same_supervisor(running, wanted[name][1]):
                del self._running[name]
                running.stop(STOP_TIMEOUT_S)
        for name, entry in wanted.items():
            if name not in self._running:
                self._running[name] = entry
                entry[1].start()

    def stop(self) -> None:
        """Every supervisor stops."""
        running, self._running = list(self._running.values()), {}
        for _, supervisor in running:
            supervisor.stop(STOP_TIMEOUT_S)
