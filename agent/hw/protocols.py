"""The narrow typed protocols through which the agent's layers reach the hardware backend,
and the records they answer in (:class:`HealthEvent`, :class:`GpuSample`,
:class:`ProcessSample`).

:class:`agent.hw.nvml.backend.NvmlBackend` (on the real ``pynvml`` or on the simulator's
fake) implements every protocol here and subclasses each, so mypy checks every signature
against it. A consumer names only the protocols it uses, never the concrete class:

=====================  ===================================  ==============================
protocol               members                              who uses it
=====================  ===================================  ==============================
:class:`Lifecycle`     ``init``, ``shutdown``               the daemon
:class:`FactsReader`   ``read_facts``                       the daemon, ``agent.discovery``
:class:`EventSource`   ``wait_events``, ``probe``,          the health watcher (the daemon
                       ``lost_gpus``                        hands it the backend)
:class:`Telemetry`     ``sample_source``, ``error_counts``  the metrics service
:class:`SampleSource`  ``sample``, ``close``                the metrics sampler
:class:`HealthFacts`   ``remapped_rows``, ``nvlink_states``, the health facts check
                       ``fabric_state``, ``recovery_action``, (``agent.health.facts_check``)
                       ``pci_gpus``
:class:`MigControl`    ``mig_instances``, ``create_mig``,   dynamic MIG (DRA prepare and
                       ``destroy_mig``, ``enable_mig``      unprepare)
=====================  ===================================  ==============================

Every implementation is thread-safe unless it says otherwise; no method but ``init`` and
``wait_events`` blocks for long. A GPU that is lost makes its calls answer None, never raise.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.records import MigInstance, NodeFacts

__all__ = [
    "EventSource", "FabricState", "FactsReader", "GpuSample", "HealthEvent", "HealthFacts", "Lifecycle",
    "MigControl", "ProcessSample", "RecoveryAction", "RemappedRows", "SampleSource", "Telemetry",
]


@dataclass(frozen=True)
class HealthEvent:
    """Something happened to a GPU: an XID, a double-bit ECC error, or it fell off the bus."""

    gpu_index: int
    kind: str  # "xid" | "ecc_dbe" | "lost"
    xid: int | None = None  # the XID number of an "xid" event


@dataclass(frozen=True)
class ProcessSample:
    """One process on one GPU in one round. ``pid`` is the host PID NVML reports;
    ``used_memory_bytes`` the framebuffer it holds (None: NVML does not say);
    ``sm_util_pct``/``mem_util_pct`` its share of SM and memory-bandwidth time since the
    previous round (0 when NVML has no sample of it: idle; None: the GPU's driver gives no
    per-process utilisation)."""

    pid: int
    used_memory_bytes: int | None = None
    sm_util_pct: int | None = None
    mem_util_pct: int | None = None


@dataclass(frozen=True)
class GpuSample:
    """One GPU's telemetry of one round, each field in the unit its name says; None: the
    hardware gave no answer for it (``agent.hw.nvml.telemetry`` names each field's source)."""

    index: int
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    gpu_temp_c: int | None = None
    memory_temp_c: float | None = None
    power_mw: int | None = None
    energy_mj: int | None = None
    pcie_replays: int | None = None
    gpu_util_pct: int | None = None
    memory_util_pct: int | None = None
    encoder_util_pct: int | None = None
    decoder_util_pct: int | None = None
    fb_free_bytes: int | None = None
    fb_used_bytes: int | None = None
    fb_reserved_bytes: int | None = None
    nvlink_bandwidth_total: float | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_failure: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    graphics_active_pct: float | None = None
    tensor_active_pct: float | None = None
    dram_active_pct: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    #: the compute processes on the GPU (None: NVML could not list them this round)
    processes: tuple[ProcessSample, ...] | None = None
    #: whether the processes' utilisation is NVML's per-process figure this round (False:
    #: the driver gives none for this GPU, or it failed; their sm/mem fields are None)
    process_utilization: bool = False


class Lifecycle(Protocol):
    """Opening and closing the hardware library."""

    def init(self) -> None:
        """Open the hardware library; an ``AgentError`` (exit 1) with one clear line if it
        cannot."""
        ...

    def shutdown(self) -> None:
        """Release what :meth:`init` and the event registration took; never raises."""
        ...


class FactsReader(Protocol):
    """Discovery: the node as read (an initialised backend)."""

    def read_facts(self, source: str = "nvml") -> NodeFacts:
        """The node as read, named ``source``; ``agent.topology`` builds the model from it."""
        ...


class EventSource(Protocol):
    """Health: events, probes and the GPUs found lost."""

    def wait_events(self, timeout_ms: int) -> Sequence[HealthEvent]:
        """Block up to ``timeout_ms`` for health events; empty on timeout."""
        ...

    def probe(self, index: int) -> bool:
        """Whether GPU ``index`` answers normally now (a lost one that does is lost no more)."""
        ...

    @property
    def lost_gpus(self) -> Collection[int]:
        """GPUs found lost on any call (e.g. while the metrics sampler read them), until a
        successful :meth:`probe`."""
        ...


class SampleSource(Protocol):
    """GPU telemetry, one GPU at a time. Not thread-safe: owned by one sampling thread."""

    def sample(self, index: int) -> GpuSample | None:
        """One round of GPU ``index``; None when the GPU is lost or answered nothing."""
        ...

    def close(self) -> None:
        """Free what the source holds between rounds."""
        ...


class Telemetry(Protocol):
    """What the metrics service reads: GPU samples and the library's error counts."""

    def sample_source(self) -> SampleSource:
        """A new :class:`SampleSource` (its own state between rounds); the caller closes it."""
        ...

    @property
    def error_counts(self) -> dict[str, int]:
        """Library errors (not "not supported") by function name since start; a copy."""
        ...


class MigControl(Protocol):
    """Cutting a GPU into MIG instances on demand (dynamic MIG). Errors are
    :class:`agent.errors.MigError` subclasses; nothing else escapes."""

    def mig_instances(self, index: int) -> tuple[MigInstance, ...]:
        """The GPU instances that exist on GPU ``index`` now (each with its compute instance)."""
        ...

    def create_mig(self, index: int, profile: str, start: int) -> MigInstance:
        """Create a GPU instance of ``profile`` at memory slice ``start`` on GPU ``index`` and
        one compute instance spanning it."""
        ...

    def destroy_mig(self, index: int, gi_id: int) -> None:
        """Destroy GPU instance ``gi_id`` of GPU ``index`` (its compute instances first)."""
        ...

    def enable_mig(self, index: int) -> None:
        """Switch MIG mode on for GPU ``index`` (a free GPU); :class:`MigResetRequired` where
        the change would need a GPU reset (the agent never resets)."""
        ...

    def disable_mig(self, index: int) -> None:
        """Switch MIG mode off for GPU ``index``, which holds no GPU instance (what
        :meth:`enable_mig` switched on, once its last instance is gone)."""
        ...


@dataclass(frozen=True)
class RemappedRows:
    """A GPU's row remapping (``nvmlDeviceGetRemappedRows``): rows remapped for correctable
    and uncorrectable errors, a remap waiting for the next GPU reset, and a remap that
    failed (no spare row left: the memory cannot heal itself)."""

    correctable: int
    uncorrectable: int
    pending: bool
    failed: bool


class RecoveryAction(enum.IntEnum):
    """What the driver says a GPU needs (NVML's ``nvmlDeviceGpuRecoveryAction_t``, field
    ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``; XID 154 reports a change of it)."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3  # quiesce peer-to-peer traffic, then ask again
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


@dataclass(frozen=True)
class FabricState:
    """A GPU's NVLink fabric registration (``nvmlDeviceGetGpuFabricInfo[V]``, NVSwitch and
    multi-node NVLink systems): ``state`` one of ``"not-supported"`` (no fabric),
    ``"not-started"``, ``"in-progress"``, ``"completed"``; ``status`` the registration's
    NVML return code (0: success)."""

    state: str
    status: int = 0

    @property
    def ready(self) -> bool:
        """Not in a fabric, or registered in it."""
        return self.state == "not-supported" or (self.state == "completed" and self.status == 0)


class HealthFacts(Protocol):
    """Facts about the GPUs' health read on demand (a poll, not events). Every method answers
    None where the fact is unknown for that GPU (not supported, GPU lost, the call failed):
    one GPU failing never takes the others down."""

    def remapped_rows(self, index: int) -> RemappedRows | None:
        ...

    def nvlink_states(self, index: int) -> Mapping[int, bool] | None:
        """Per NVLink port the GPU has: True active, False inactive (empty: no NVLink)."""
        ...

    def fabric_state(self, index: int) -> FabricState | None:
        ...

    def recovery_action(self, index: int) -> int | None:
        """The driver's recovery action (a :class:`RecoveryAction` value, or a newer one)."""
        ...

    def pci_gpus(self) -> tuple[str, ...] | None:
        """The bus ids (NVML spelling) of the NVIDIA GPUs the PCI bus holds (sysfs), whether
        NVML lists them or not; None where sysfs is not read."""
        ...
