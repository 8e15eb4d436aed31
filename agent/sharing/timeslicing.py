"""Time-slicing (``sharing.timeSlicing``): the GPU's own scheduler interleaves the replicas'
contexts. Nothing added to a container, no supervisor: the replicas are servable whenever
their GPU is healthy.

Checked on the node: a GPU shared into more than one replica must let several processes
make contexts on it at once. NVML's compute modes ``Exclusive_Process`` and
``Exclusive_Thread`` let one process at a time, ``Prohibited`` none: such a GPU is refused,
naming it and the field (one replica, renamed, is one container at a time: any mode serves
it).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from agent.config import Config, TimeSlicingResource
from agent.containers import ContainerAdditions, ContainerDevice
from agent.errors import ConfigError
from agent.sharing.base import PlannedShare, Share, Supervisor
from agent.topology.model import Topology

#: The compute modes (as NVML names them) that refuse a second process's context.
REFUSED_COMPUTE_MODES = ("Prohibited", "Exclusive_Process", "Exclusive_Thread")


class TimeSlicing:
    """The time-slicing instance of :class:`agent.sharing.base.Sharing`."""

    strategy = "time-slicing"
    section = "sharing.timeSlicing"

    def entries(self, config: Config) -> tuple[TimeSlicingResource, ...]:
        return config.time_slicing

    def check(self, planned: Iterable[PlannedShare], topology: Topology, config: Config) -> None:
        """Every GPU in a refused compute mode named in one error (module docstring)."""
        refused: dict[int, tuple[int, str]] = {}  # GPU index -> (entry, mode); MIG devices share their GPU's
        for p in planned:
            if p.replicas > 1 and p.gpu.compute_mode in REFUSED_COMPUTE_MODES:
                refused.setdefault(p.gpu.index, (p.entry, p.gpu.compute_mode))
        if not refused:
            return
        entries = ",".join(map(str, sorted({entry for entry, _ in refused.values()})))
        gpus = ", ".join(f"GPU {i} is shared but its compute mode is {mode}"
                         for i, (_, mode) in sorted(refused.items()))
        raise ConfigError(
            f"{config.config_file or 'configuration'}: {self.section}.resources[{entries}]: {gpus}; time-slicing"
            " needs Default (an exclusive mode lets one process at a time use the GPU, Prohibited none): set it"
            " with nvidia-smi -c DEFAULT -i <index>, or leave the GPU out of the devices"
        )

    def additions(self, share: Share, topology: Topology, devices: Sequence[ContainerDevice],
                  config: Config) -> ContainerAdditions | None:
        return None

    def supervisor(self, resource: str, replicas: Mapping[int, int], topology: Topology, config: Config,
                   on_change: Callable[[], None], probe_s: float) -> Supervisor | None:
        return None

    def same_supervisor(self, running: Supervisor, wanted: Supervisor) -> bool:
        return False


TIME_SLICING = TimeSlicing()
