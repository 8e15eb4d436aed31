"""GPU health: the state others read (:mod:`agent.health.state`), the watcher that owns it
(:mod:`agent.health.watcher`), the fault records (:mod:`agent.health.faults`), the kernel log
reader and the XID catalog."""

from __future__ import annotations

from agent.health.faults import CONDITION_TYPE, Fault, FaultClass, Occurrence, Watching
from agent.health.state import (
    ECC_REASON,
    FENCED_REASON_PREFIX,
    LOST_REASON,
    HealthState,
    lost_at_discovery,
    reason_kind,
)
from agent.health.watcher import HealthWatcher

__all__ = [
    "CONDITION_TYPE", "ECC_REASON", "FENCED_REASON_PREFIX", "LOST_REASON", "Fault", "FaultClass", "HealthState",
    "HealthWatcher", "Occurrence", "Watching", "lost_at_discovery", "reason_kind",
]
