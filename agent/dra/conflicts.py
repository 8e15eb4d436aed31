"""Which claims' devices cannot be prepared together: no GPU, MIG device or memory slice is
prepared for two claims (:mod:`agent.dra.prepare`'s rule, the defence behind the scheduler's
counters), as problems naming the device, the other claim and its device.

A GPU set holds every member GPU; a whole GPU and a MIG device of it clash, two different MIG
devices of one GPU do not; a dynamic MIG device (a profile on a placement) clashes with the
whole GPU and with any placement overlapping its memory slices.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Mapping, Sequence

from agent.dra.checkpoint import PreparedClaim
from agent.dra.devices import DeviceRef, DeviceRefs, MigSlot
from agent.errors import shorten

__all__ = ["Holders", "clashing", "held_elsewhere", "holders_of", "mig_conflicts", "shared_gpus"]

#: (GPU index, MIG device index or None for the whole GPU) -> the claim holding it, its device
Holders = Mapping[tuple[int, int | None], tuple[PreparedClaim, str]]


def holders_of(claims: Iterable[PreparedClaim], devices: DeviceRefs) -> Holders:
    """(GPU index, MIG index or None) -> the prepared claim holding it and its device."""
    holders: dict[tuple[int, int | None], tuple[PreparedClaim, str]] = {}
    for claim in claims:
        for d in claim.devices:
            for key in devices.parts(d.device):
                holders.setdefault(key, (claim, d.device))
    return holders


def held_elsewhere(chosen: Sequence[tuple[str, DeviceRef]], holders: Holders,
                   name_of: Callable[[PreparedClaim], str]) -> list[str]:
    """A problem for each device holding a GPU (or MIG device) that another prepared claim
    holds (``holders``: :func:`holders_of`), naming that claim (``name_of``) and its device."""
    problems = []
    for request, device in chosen:
        for p in device.parts:
            mine = (p.gpu.index, p.mig.index if p.mig is not None else None)
            clash = next((holders[k] for k in clashing(mine, holders)), None)
            if clash is not None:
                other, theirs = clash
                problems.append(
                    f"device {device.name!r} (request {shorten(repr(request))}): GPU {p.gpu.index} ({p.gpu.uuid})"
                    f" is held by {name_of(other)} through device {theirs!r}"
                    " (prepared again once that claim is unprepared)")
                break
    return problems


def shared_gpus(chosen: Sequence[tuple[str, DeviceRef]]) -> list[str]:
    """A problem for each device holding a GPU (or MIG device) an earlier device of the claim
    holds (no allocator gives one out twice: the counters forbid it)."""
    seen: dict[tuple[int, int | None], str] = {}
    problems = []
    for _, device in chosen:
        keys = [(p.gpu.index, p.mig.index if p.mig is not None else None) for p in device.parts]
        taken = [k for k in keys if k in seen]
        if taken:
            problems.append(f"device {device.name!r} holds GPU {taken[0][0]}, which device {seen[taken[0]]!r}"
                            " of the same claim holds too")
        for k in keys:
            seen.setdefault(k, device.name)
    return problems


def clashing(part: tuple[int, int | None], held: Collection[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    """The held parts ``part`` cannot share its GPU with: the same part; the whole GPU for a
    MIG device; any part of the GPU for the whole GPU."""
    gpu, mig = part
    return [k for k in held if k[0] == gpu and (mig is None or k[1] is None or k[1] == mig)]


def mig_conflicts(claims: Iterable[PreparedClaim], uid: str, chosen: Sequence[tuple[str, DeviceRef | MigSlot]],
                  holders: Holders, name_of: Callable[[PreparedClaim], str],
                  switched_on: Collection[int] = ()) -> list[str]:
    """A problem for each device of the claim ``uid`` that a dynamic MIG device rules out:
    a placement overlapping one another claim (or this one) holds, or on a GPU another
    claim holds whole; a whole GPU another claim holds a MIG instance of; a MIG device
    that is an instance cut for another claim; a whole GPU whose MIG mode dynamic MIG switched
    on (``switched_on``: a container given it would find no CUDA device). ``holders``: (GPU,
    MIG index or None) -> the claim holding it and its device; ``name_of`` names a claim."""
    cut = [(c, m) for c in claims if c.uid != uid for m in c.mig]
    problems: list[str] = []
    mine: list[tuple[str, MigSlot]] = []
    for request, d in chosen:
        what = f"device {d.name!r} (request {shorten(repr(request))})"
        if isinstance(d, MigSlot):
            g, slices = d.gpu.index, set(d.placement.slices)
            whole = holders.get((g, None))
            if whole is not None:
                problems.append(f"{what}: GPU {g} ({d.gpu.uuid}) is held whole by"
                                f" {name_of(whole[0])} through device {whole[1]!r}")
                continue
            clash = next(((c, m) for c, m in cut if m.gpu == g and slices & set(range(m.start, m.start + m.size))),
                         None)
            if clash is not None:
                problems.append(f"{what}: its memory slices on GPU {g} ({d.gpu.uuid}) overlap MIG device"
                                f" {clash[1].device!r} of {name_of(clash[0])}")
                continue
            twin = next((n for n, s in mine if s.gpu.index == g and slices & set(s.placement.slices)), None)
            if twin is not None:
                problems.append(f"{what}: its memory slices on GPU {g} overlap device {twin!r} of the same claim")
                continue
            mine.append((d.name, d))
            continue
        for p in d.parts:
            if p.mig is None and p.gpu.index in switched_on:
                problems.append(f"{what}: GPU {p.gpu.index} ({p.gpu.uuid}) is in MIG mode (switched on for"
                                " dynamic MIG): a whole GPU needs MIG mode off (nvidia-smi -i"
                                f" {p.gpu.index} -mig 0)")
                break
            if p.mig is None:
                held = next(((c, m) for c, m in cut if m.gpu == p.gpu.index), None)
                if held is not None:
                    problems.append(f"{what}: GPU {p.gpu.index} ({p.gpu.uuid}) holds MIG device"
                                    f" {held[1].device!r} of {name_of(held[0])}")
                    break
            elif (held := next(((c, m) for c, m in cut if m.uuid == p.mig.uuid), None)) is not None:
                problems.append(f"{what}: MIG device {p.mig.uuid} was cut for {name_of(held[0])}"
                                f" (device {held[1].device!r})")
                break
    whole_gpus = {p.gpu.index for _, d in chosen if isinstance(d, DeviceRef) for p in d.parts if p.mig is None}
    problems += [f"device {s.name!r} is a MIG device of GPU {s.gpu.index}, which the same claim holds whole"
                 for _, s in mine if s.gpu.index in whole_gpus]
    return problems
