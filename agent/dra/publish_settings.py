"""What the ResourceSlice publisher (:class:`agent.dra.publisher.SlicePublisher`) is given:
its settings record, and the protocols of what it follows (health, prepared claims) and
reports to (the self-metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Protocol

from agent.config import DEFAULT_DRIVER_NAME, Config
from agent.dra.migslots import SLOTS_PER_PROFILE

__all__ = ["HealthSource", "PreparedDevices", "PublishSettings", "PublisherEvents"]


class PublisherEvents(Protocol):
    """What the publisher reports: the self-metrics implement it
    (:class:`agent.metrics.self_metrics.AgentMetrics`). Cheap, no I/O."""

    def dra_api_feature(self, feature: str, kept: bool) -> None:
        """Whether the API server keeps ``feature``'s fields (a feature-gate name)."""
        ...

    def dra_gpu_sets(self, on: bool, setting: str) -> None:
        """Whether GPU sets are published, decided from ``setting`` (dra.gpuSets)."""
        ...

    def dra_published_devices(self, counts: Mapping[tuple[str, str], int]) -> None:
        """The devices in the pool as last published: (kind, state) -> how many; kind ``gpu``,
        ``mig`` or ``gpuset``, state ``ordinary`` or ``withdrawing`` (tainted for the grace)."""
        ...


class PreparedDevices(Protocol):
    """The devices prepared claims of this node use (:class:`agent.dra.checkpoint.Checkpoint`)."""

    def devices(self) -> Collection[tuple[str, str]]:
        """(pool, device name) of every device of every prepared claim."""
        ...

    def add_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` after every prepared or forgotten claim."""
        ...


class HealthSource(Protocol):
    """What the publisher follows of :class:`agent.health.HealthState`."""

    def snapshot(self) -> Mapping[int, str]:
        """Unhealthy GPU index -> reason."""
        ...

    def add_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` after every change."""
        ...


@dataclass(frozen=True)
class PublishSettings:
    """What the publisher publishes and how it retries: the node (and pool) name, the
    driver, the taint effect on unhealthy GPUs, whether :meth:`SlicePublisher.stop` deletes
    the slices (default keep: a restarting agent must not make running pods' devices
    vanish), ``dra.gpuSets`` (:func:`agent.dra.gpusets.gpu_sets_decision`), the grace period
    of a set's withdrawal (``dra.gpuSetWithdrawalGraceSeconds``, :mod:`agent.dra.withdrawal`;
    0: withdrawn at once), whether MIG-capable GPUs offer MIG devices cut on demand
    (``dra.dynamicMig``, :mod:`agent.dra.mig_publish`) and how many placements of each profile
    (``dra.migPlacementsPerProfile``), the capped exponential backoff after a
    failure and the period of a full resync."""

    node_name: str
    driver_name: str = DEFAULT_DRIVER_NAME
    taint_effect: str = "NoSchedule"
    delete_on_stop: bool = False
    gpu_sets: str = "auto"
    withdrawal_grace_s: float = 60.0
    dynamic_mig: bool = False
    mig_placements: int = SLOTS_PER_PROFILE
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    resync_s: float = 300.0

    @classmethod
    def from_config(cls, config: Config) -> PublishSettings:
        return cls(config.node_name, config.driver_name, config.taint_effect, config.delete_slices_on_shutdown,
                   config.gpu_sets, config.gpu_set_withdrawal_grace_s, config.dynamic_mig == "on",
                   config.mig_placements_per_profile)
