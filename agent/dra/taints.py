"""Unhealthy GPUs in the ResourceSlices: device taints (KEP-5055), or left out where the API
server keeps no taints.

A device that holds an unhealthy GPU (the single GPU, its MIG devices, every GPU set it is a
member of) stays published, with one taint per distinct reason among its unhealthy GPUs:
key ``<driver>/<kind>`` and a value saying why (:func:`agent.health.reason_kind`):

================================  ====================  ==============================
unhealthy because                 key                   value
================================  ====================  ==============================
a critical XID                    ``<driver>/xid``      the XID number, ``79``
a double-bit ECC error            ``<driver>/ecc``      ``double-bit``
lost (now or at discovery)        ``<driver>/lost``     ``true``
the health watcher failed         ``<driver>/fenced``   ``health-watcher-failed``
================================  ====================  ==============================

The effect is ``NoSchedule`` (no new claim gets the device unless it tolerates the taint;
pods already using it keep running), or ``NoExecute`` when configured (``dra.taintEffect``:
pods using it are evicted unless they tolerate it; ``agent.config_values.TAINT_EFFECTS``).
Recovery removes the taint. Keeping the
device in the pool matters: the scheduler counts the counters an allocated device consumes
only while the device is published, so removing an allocated set would free its members'
counters for other claims while it still holds them.

Where the API server drops the taints on write (``DRADeviceTaints`` off, found by reading
back what was written), the devices holding an unhealthy GPU are left out instead, except
those a prepared claim of this node uses (``keep``): they stay, untainted, until the claim is
unprepared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from agent.health import reason_kind

__all__ = ["MAX_TAINTS", "HealthMarks"]

#: DeviceTaintsMaxLength (k8s.io/api/resource/v1/types.go).
MAX_TAINTS = 16


@dataclass(frozen=True)
class HealthMarks:
    """How unhealthy GPUs show: ``reasons`` (GPU index -> reason, as
    :class:`agent.health.HealthState` words it), ``effect`` (a taint effect; None: the API
    server keeps no taints, leave the devices out) and ``keep`` (device names left in, untainted,
    when ``effect`` is None)."""

    reasons: Mapping[int, str] = field(default_factory=dict)
    effect: str | None = "NoSchedule"
    keep: frozenset[str] = frozenset()

    def device(self, driver: str, name: str, gpus: Iterable[int]) -> tuple[bool, list[dict[str, Any]]]:
        """(published, taints) of device ``name`` over the GPU indices ``gpus``."""
        bad = [self.reasons[i] for i in gpus if i in self.reasons]
        if not bad:
            return True, []
        if self.effect is None:
            return name in self.keep, []
        taints: list[dict[str, Any]] = []
        for reason in bad:
            kind, value = reason_kind(reason)
            taint = {"key": f"{driver}/{kind}", "value": value, "effect": self.effect}
            if taint not in taints:
                taints.append(taint)
        return True, taints[:MAX_TAINTS]
