"""Withdrawing published devices: which must go (:func:`sets_to_withdraw`,
:func:`singles_to_withdraw`; why it is safe: docs/design/dra-gpu-sets.md), the
withdrawal taint of the first step, and the clock of its grace.

A published set that must go (:func:`sets_to_withdraw`: a member is held
through another device) first stays published with the taint ``<driver>/withdrawn``
(value ``member-in-use``, effect ``NoSchedule``, never ``NoExecute``: the pods already using
the set keep it), so the scheduler gives it to no new claim while it still counts its counters
for a claim it allocated the set to; it leaves at a re-publication at least the grace period
(``dra.gpuSetWithdrawalGraceSeconds``) after the taint was first published, unless a prepared
claim holds it then; chosen again by the policy before that, it is an ordinary set again
(docs/design/dra-gpu-sets.md says why that is safe).

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
from typing import Any, Collection, Iterable, Mapping

from agent.dra.devices import parse_set_name
from agent.dra.gpusets import GpuSet

__all__ = ["WITHDRAWN_KEY", "expired", "held_through_sets", "sets_to_keep", "sets_to_withdraw", "singles_to_withdraw",
           "stamp_withdrawals", "withdrawal_taint", "withdrawal_times"]

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


def sets_to_keep(published: Iterable[str], held: Mapping[str, Collection[int]]) -> list[GpuSet]:
    """The rule: of the set devices ``published`` (names), those that must
    stay published, given ``held``: every device a prepared claim of this node holds, name ->
    GPU indices. A set stays unless one of its members is held through another device."""
    return _split(published, held)[0]


def sets_to_withdraw(published: Iterable[str], held: Mapping[str, Collection[int]]) -> list[GpuSet]:
    """Of the set devices ``published``, those :func:`sets_to_keep` does not keep: one of their
    members is held through another device (published tainted for the grace period first,
    module docstring)."""
    return _split(published, held)[1]


def singles_to_withdraw(held: Mapping[str, Collection[int]], whole: Mapping[int, str], published: Collection[str],
                        expired: Collection[str]) -> tuple[set[str], set[str]]:
    """The whole GPUs' single devices (``whole``: GPU index -> its device name) to publish with
    the withdrawal taint, and those to leave out: of the GPUs held through a set (``held``, and
    not through their single device), a single in the pool now (``published``) stays, tainted,
    until its taint has been out for the grace period (``expired``); one not in the pool stays
    out (docs/design/dra-gpu-sets.md, a single GPU held through a set)."""
    due = {whole[g] for g in held_through_sets(held) if g in whole and whole[g] not in held}
    gone = {n for n in due if n not in published or n in expired}
    return due - gone, gone


def held_through_sets(held: Mapping[str, Collection[int]]) -> set[int]:
    """The GPUs of ``held`` (device name -> GPU indices) held through a set device."""
    return {g for name, gpus in held.items() if parse_set_name(name) is not None for g in gpus}


def _split(published: Iterable[str], held: Mapping[str, Collection[int]]) -> tuple[list[GpuSet], list[GpuSet]]:
    through: dict[int, set[str]] = {}
    for device, gpus in held.items():
        for g in gpus:
            through.setdefault(g, set()).add(device)
    keep: list[GpuSet] = []
    withdraw: list[GpuSet] = []
    for name in sorted(set(published)):
        members = parse_set_name(name)
        if members is None:
            continue  # not a set of ours (a stored slice of another agent version): nothing to keep
        blocked = any(through.get(g, set()) - {name} for g in members)
        (withdraw if blocked else keep).append(GpuSet(members))
    return keep, withdraw
