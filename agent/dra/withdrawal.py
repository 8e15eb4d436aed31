"""The first step of withdrawing a GPU set: the withdrawal taint, and the clock of its grace.

A published set that must go (:func:`agent.dra.gpusets.sets_to_withdraw`: a member is held
through another device) first stays published with the taint ``<driver>/withdrawn``
(value ``member-in-use``, effect ``NoSchedule``, never ``NoExecute``: the pods already using
the set keep it), so the scheduler gives it to no new claim while it still counts its counters
for a claim it allocated the set to; it leaves at a re-publication at least the grace period
(``dra.gpuSetWithdrawalGraceSeconds``) after the taint was first published, unless a prepared
claim holds it then; chosen again by the policy before that, it is an ordinary set again
(:mod:`agent.dra.gpusets` says why that is safe).

**The clock.** The taint's ``timeAdded`` says when it was first published: the agent sets it
from its own clock when it adds the taint (rounded up to the second, the field's precision),
the publisher carries it over on every rewrite (:func:`agent.dra.readback.keep_taint_times`),
and it is read back from the stored slices, so the grace survives a restart of the agent and
is measured on one clock, the node's. A taint whose time is missing or unreadable counts from
now; a clock stepped back delays the withdrawal (never hastens it).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

__all__ = ["WITHDRAWN_KEY", "expired", "stamp_withdrawals", "withdrawal_taint", "withdrawal_times"]

#: The taint key under the driver's domain: ``<driver>/withdrawn``.
WITHDRAWN_KEY = "withdrawn"
_VALUE = "member-in-use"


def withdrawal_taint(driver: str) -> dict[str, Any]:
    """The taint a set carries while it is being withdrawn."""
    return {"key": f"{driver}/{WITHDRAWN_KEY}", "value": _VALUE, "effect": "NoSchedule"}


def _withdrawals(slices: Iterable[Mapping[str, Any]], driver: str) -> Iterable[tuple[str, dict[str, Any]]]:
    """(device name, its withdrawal taint) of every device carrying one."""
    key = f"{driver}/{WITHDRAWN_KEY}"
    for obj in slices:
        for d in (obj.get("spec") or {}).get("devices") or ():
            if isinstance(d, Mapping):
                for t in d.get("taints") or ():
                    if isinstance(t, dict) and t.get("key") == key:
                        yield str(d.get("name")), t


def _epoch(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def withdrawal_times(slices: Iterable[Mapping[str, Any]], driver: str, now: float) -> dict[str, float]:
    """Device name -> when its withdrawal taint was added (seconds since the epoch; ``now``
    where the time is missing or unreadable), over the slices as stored."""
    out: dict[str, float] = {}
    for name, taint in _withdrawals(slices, driver):
        when = _epoch(taint.get("timeAdded"))
        out[name] = now if when is None else when
    return out


def expired(times: Mapping[str, float], now: float, grace_s: float) -> set[str]:
    """The devices of ``times`` whose withdrawal taint has been published ``grace_s`` or longer."""
    return {name for name, when in times.items() if now - when >= grace_s}


def stamp_withdrawals(slices: Iterable[dict[str, Any]], driver: str, now: float) -> float | None:
    """Give every withdrawal taint of ``slices`` without a ``timeAdded`` the time ``now``
    (rounded up to the second); the earliest time any of them was added (None: none)."""
    stamp = datetime.fromtimestamp(math.ceil(now), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    earliest: float | None = None
    for _, taint in _withdrawals(slices, driver):
        taint.setdefault("timeAdded", stamp)
        when = _epoch(taint["timeAdded"])
        when = math.ceil(now) if when is None else when
        earliest = when if earliest is None else min(earliest, when)
    return earliest
