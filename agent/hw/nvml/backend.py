"""The NVML backend: the call wrapper with discovery, health events and telemetry on it.

:class:`NvmlBackend` is the implementation of every protocol of :mod:`agent.hw.protocols`
(it subclasses each, so mypy checks them against it), on the real ``pynvml`` or on the
simulator's fake. It is an :class:`~agent.hw.nvml.calls.NvmlCalls` (every NVML call goes
through that wrapper) that adds what the layers above ask of the hardware:

* discovery, :meth:`NvmlBackend.read_facts` (:mod:`agent.hw.nvml.facts`);
* health events, :meth:`NvmlBackend.wait_events` (:mod:`agent.hw.nvml.events`);
* telemetry, :meth:`NvmlBackend.sample_source` (:mod:`agent.hw.nvml.telemetry`);
* health facts polled, :meth:`NvmlBackend.remapped_rows` and the rest of
  :class:`~agent.hw.protocols.HealthFacts` (:mod:`agent.hw.nvml.health_facts`).
* dynamic MIG, :meth:`NvmlBackend.create_mig` and the rest of
  :class:`~agent.hw.protocols.MigControl` (:mod:`agent.hw.nvml.mig_control`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agent.hw.nvml.calls import NvmlCalls
from agent.hw.nvml.events import NvmlEvents
from agent.hw.nvml.facts import read_node_facts
from agent.hw.nvml.health_facts import NvmlHealthFacts
from agent.hw.nvml.mig_control import NvmlMig
from agent.hw.nvml.telemetry import NvmlSampler
from agent.hw.protocols import (
    EventSource,
    FabricState,
    FactsReader,
    HealthEvent,
    HealthFacts,
    Lifecycle,
    MigControl,
    RemappedRows,
    SampleSource,
    Telemetry,
)
from agent.records import MigInstance, NodeFacts

if TYPE_CHECKING:  # pragma: no cover
    from agent.hw.sysfs import SysfsReader

__all__ = ["NvmlBackend"]


class NvmlBackend(NvmlCalls, Lifecycle, FactsReader, EventSource, Telemetry, HealthFacts, MigControl):
    """NVML (real or fake) behind one wrapper, with discovery, events and telemetry.

    ``lib``: None for the real ``pynvml`` (imported in :meth:`init`), else a module-like
    object with pynvml's API (the fake). ``sysfs``: where NUMA, cpulists, NICs and the
    product name come from; None means NVML only (no NICs, no NUMA distances).
    ``missing_function_level``: how loudly a function the driver lacks is logged (once
    each); a simulated machine that leaves facts unknown on purpose logs it at INFO.
    Thread-safe: calls are serialised by one lock, except event waits.
    """

    def __init__(
        self,
        lib: Any = None,
        sysfs: SysfsReader | None = None,
        *,
        missing_function_level: int = logging.WARNING,
    ) -> None:
        super().__init__(lib, missing_function_level=missing_function_level)
        self._sysfs = sysfs
        self._events = NvmlEvents(self)
        self._health_facts = NvmlHealthFacts(self, sysfs)
        self._mig = NvmlMig(self)

    @property
    def sysfs(self) -> SysfsReader | None:
        """The sysfs reader discovery uses (None: NVML only)."""
        return self._sysfs

    def shutdown(self) -> None:
        """Free the event set and shut NVML down; never raises."""
        self._events.close()
        super().shutdown()

    # ------------------------------------------------------------------ discovery
    def read_facts(self, source: str = "nvml") -> NodeFacts:
        """Discover the node, as read (:func:`agent.hw.nvml.facts.read_node_facts`):
        ``agent.topology`` derives the model from it. GPUs that are lost while being read are
        returned with ``lost=True`` and whatever was read before; the others are complete."""
        return read_node_facts(self, self._sysfs, source)

    # ------------------------------------------------------------------ health
    def probe(self, index: int) -> bool:
        """Whether GPU ``index`` answers NVML normally right now. A lost GPU that answers is
        no longer lost (its handle and event registration are renewed)."""
        was_lost = index in self.lost_gpus
        if not super().probe(index):
            return False
        if was_lost:
            self._events.recovered(index)
        return True

    def wait_events(self, timeout_ms: int) -> list[HealthEvent]:
        """Block up to ``timeout_ms`` for health events (:meth:`NvmlEvents.wait`)."""
        return self._events.wait(timeout_ms)

    # ------------------------------------------------------------------ telemetry
    def sample_source(self) -> SampleSource:
        """A new telemetry sampler on this backend (its own GPM state); the caller closes it."""
        return NvmlSampler(self)

    # ------------------------------------------------------------------ health facts
    def remapped_rows(self, index: int) -> RemappedRows | None:
        return self._health_facts.remapped_rows(index)

    def nvlink_states(self, index: int) -> Mapping[int, bool] | None:
        return self._health_facts.nvlink_states(index)

    def fabric_state(self, index: int) -> FabricState | None:
        return self._health_facts.fabric_state(index)

    def recovery_action(self, index: int) -> int | None:
        return self._health_facts.recovery_action(index)

    def pci_gpus(self) -> tuple[str, ...] | None:
        return self._health_facts.pci_gpus()

    # ------------------------------------------------------------------ dynamic MIG
    def mig_instances(self, index: int) -> tuple[MigInstance, ...]:
        """The GPU instances on GPU ``index`` now (:meth:`NvmlMig.mig_instances`)."""
        return self._mig.mig_instances(index)

    def create_mig(self, index: int, profile: str, start: int) -> MigInstance:
        """A ``profile`` GPU instance at memory slice ``start`` with one compute instance
        spanning it (:meth:`NvmlMig.create_mig`)."""
        return self._mig.create_mig(index, profile, start)

    def destroy_mig(self, index: int, gi_id: int) -> None:
        """GPU instance ``gi_id`` and its compute instances (:meth:`NvmlMig.destroy_mig`)."""
        self._mig.destroy_mig(index, gi_id)

    def enable_mig(self, index: int) -> None:
        """MIG mode on for a free GPU ``index`` (:meth:`NvmlMig.enable_mig`)."""
        self._mig.enable_mig(index)

    def disable_mig(self, index: int) -> None:
        """MIG mode off for GPU ``index`` holding no instance (:meth:`NvmlMig.disable_mig`)."""
        self._mig.disable_mig(index)
