"""What the health side knows about a fault, as plain records: the interface between the
sources (NVML events, the kernel log, the watched facts, the XID catalog) and the listeners
(the kubelet sides, metrics, and the Node: condition ``GPUHealthy`` and Events).

:class:`FaultClass` values are the ``GPUHealthy`` condition's reasons: a documented, stable
list (docs/health.md); one per class of fault, each with the action it needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["CONDITION_TYPE", "Fault", "FaultClass", "Occurrence", "Watching"]

#: the one Node condition the agent owns
CONDITION_TYPE = "GPUHealthy"


class FaultClass(str, enum.Enum):
    """A class of fault, as the condition's reason names it. Listed most severe first: the
    condition's reason is the most severe class among the standing faults."""

    NODE_REBOOT_REQUIRED = "NodeRebootRequired"
    GPU_LOST = "GPULost"
    GPU_COUNT_MISMATCH = "GPUCountMismatch"  # fewer GPUs than the node's PCI devices
    GPU_RESET_REQUIRED = "GPUResetRequired"
    MEMORY_ERROR = "GPUMemoryError"  # double-bit ECC, row-remap failure
    FABRIC_NOT_READY = "FabricNotReady"
    NVLINK_DOWN = "NVLinkDown"
    REPEATED_APPLICATION_XID = "RepeatedApplicationXID"
    CONTACT_SUPPORT = "ContactSupport"  # the catalog says so and nothing above applies
    #: not a condition reason: application faults (XID 13, 31, 43, 45, ...) and other
    #: findings that are Events and metrics only
    APPLICATION = "ApplicationXID"
    INFORMATIONAL = "Informational"

    @property
    def fatal(self) -> bool:
        """Sets ``GPUHealthy`` False."""
        return self not in (FaultClass.APPLICATION, FaultClass.INFORMATIONAL)


class Watching(str, enum.Enum):
    """Whether the agent can watch its GPUs: ``Unknown`` condition when it cannot."""

    YES = "yes"
    NVML_UNAVAILABLE = "NVMLUnavailable"
    WATCHER_FAILED = "HealthWatcherFailed"


@dataclass(frozen=True)
class Fault:
    """One standing fault: what the condition says while it stands.

    ``key`` identifies it across sources and repeats (``"xid-79/gpu-3"``): the same XID on the
    same GPU from NVML and from the kernel log is one fault; its Event is aggregated under it.
    """

    key: str
    cls: FaultClass
    gpus: tuple[int, ...]  # GPU indices; () for a node-wide fault (fabric, missing GPUs)
    action: str  # the recommended action, one short sentence ("Reset the GPU.")
    detail: str  # what was seen, one line ("XID 79: GPU has fallen off the bus")
    xid: int | None = None
    since: float = 0.0  # wall-clock time first seen
    count: int = 1  # occurrences while it stood


@dataclass(frozen=True)
class Occurrence:
    """One thing seen (an XID line, an NVML event, a fact that changed, a recovery): what
    becomes an Event on the Node (Warning for faults, Normal for recoveries) and a metric.
    ``key`` is the fault's key: Events of one key are aggregated."""

    key: str
    cls: FaultClass
    gpus: tuple[int, ...]
    detail: str
    action: str = ""
    xid: int | None = None
    recovered: bool = False
    at: float = 0.0
    source: str = "nvml"  # "nvml" | "kernel-log" | "facts"
    count: int = 1  # lines or events this one stands for (a storm is aggregated before it is recorded)
