"""Time-slicing (``sharing.timeSlicing``): the GPU's own scheduler interleaves the replicas'
contexts. Nothing to check beyond the configuration, nothing added to a container, no
supervisor: the replicas are servable whenever their GPU is healthy."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from agent.config import Config, TimeSlicingResource
from agent.containers import ContainerAdditions, ContainerDevice
from agent.sharing.base import PlannedShare, Share, Supervisor
from agent.topology.model import Topology


class TimeSlicing:
    """The time-slicing instance of :class:`agent.sharing.base.Sharing`."""

    strategy = "time-slicing"
    section = "sharing.timeSlicing"

    def entries(self, config: Config) -> tuple[TimeSlicingResource, ...]:
        return config.time_slicing

    def check(self, planned: Iterable[PlannedShare], topology: Topology, config: Config) -> None:
        return None

    def additions(self, share: Share, topology: Topology, devices: Sequence[ContainerDevice],
                  config: Config) -> ContainerAdditions | None:
        return None

    def supervisor(self, resource: str, replicas: Mapping[int, int], topology: Topology, config: Config,
                   on_change: Callable[[], None], probe_s: float) -> Supervisor | None:
        return None

    def same_supervisor(self, running: Supervisor, wanted: Supervisor) -> bool:
        return False


TIME_SLICING = TimeSlicing()
