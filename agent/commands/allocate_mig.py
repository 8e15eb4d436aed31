"""``gpu-topology-agent allocate --mig-profile PROFILE``: where dynamic MIG would cut a MIG
device of ``PROFILE`` on this node, and why.

The answer is the first device of that profile the agent publishes for the layout ``--in-use``
gives (DRA device names: ``gpu-0-mig-3g40gb-4``, ``gpu-2``, ``gpuset-2-m30``; as ``slices
--dynamic-mig --in-use`` takes them), which the scheduler's first fit takes: the rule of
:mod:`agent.dra.migslots`. Table output names the GPU, the placement and the room each
candidate costs (instances of each profile that could no longer be cut on its GPU); JSON is
``{"device", "gpu", "profile", "placement": {"start", "size"}, "lost": {profile: n}, "free_slices_after",
"runners_up": [...same...], "room_before": {gpu: {profile: n}}}``. A node with no free
placement for the profile prints why and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agent.commands.slices import parse_in_use
from agent.dra.migslots import MigSlot, by_size, dynamic_gpus, instance_slots, layouts, slot_order
from agent.errors import UsageError
from agent.topology.model import Topology

__all__ = ["run_mig"]

_RUNNERS_UP = 4


def _lost(layout_by_gpu: Any, slot: MigSlot) -> dict[str, int]:
    layout = layout_by_gpu[slot.gpu]
    names = [p.name for p in by_size(layout.geometry)]
    before = layout.room()
    layout.slots.append(slot)
    after = layout.room()
    layout.slots.pop()
    return {n: b - a for n, b, a in zip(names, before, after) if b != a}


def _entry(layout_by_gpu: Any, slot: MigSlot) -> dict[str, Any]:
    layout = layout_by_gpu[slot.gpu]
    layout.slots.append(slot)
    free = layout.free_slices()
    layout.slots.pop()
    return {"device": slot.name, "gpu": slot.gpu, "profile": slot.profile.name,
            "placement": {"start": slot.placement.start, "size": slot.placement.size},
            "lost": _lost(layout_by_gpu, slot), "free_slices_after": free}


def run_mig(args: argparse.Namespace, topology: Topology) -> int:
    """Answer ``--mig-profile`` (module docstring)."""
    geometries = dynamic_gpus(topology)
    offered = sorted({p.name for g in geometries.values() for p in g.profiles})
    if args.mig_profile not in offered:
        raise UsageError(f"--mig-profile {args.mig_profile!r}: no GPU of this machine offers it through dynamic MIG"
                         f" (offered: {', '.join(offered) or 'none: no GPU with a known MIG geometry'})")
    held = parse_in_use(args.in_use, topology, True)
    layout_by_gpu = layouts(geometries, held, instance_slots(topology, geometries))
    ranked = slot_order(layout_by_gpu, args.mig_profile)
    room = {i: {p.name: n for p, n in zip(by_size(lay.geometry), lay.room())} for i, lay in layout_by_gpu.items()}
    if not ranked:
        doc: dict[str, Any] = {"device": None, "profile": args.mig_profile, "room_before": room}
        _emit(args, doc, [f"profile   {args.mig_profile}", "device    none: no GPU has a free placement for it"
                          " (held whole, or its memory slices or engines taken)"])
        return 1
    chosen = _entry(layout_by_gpu, ranked[0])
    runners = [_entry(layout_by_gpu, s) for s in ranked[1 : 1 + _RUNNERS_UP]]
    doc = {**chosen, "runners_up": runners, "room_before": room}
    lines = [
        f"machine   {topology.machine or topology.source or '-'}",
        f"profile   {args.mig_profile}, in use: {', '.join(held) or 'nothing'}",
        f"device    {chosen['device']} (GPU {chosen['gpu']}, memory slices {ranked[0].placement.start}"
        f"-{ranked[0].placement.start + ranked[0].placement.size - 1})",
        f"why       {_why(chosen)}",
        "",
        "runners-up (in publication order):",
        *(f"  {r['device']:<24} {_why(r)}" for r in runners),
    ]
    _emit(args, doc, lines)
    return 0


def _why(entry: dict[str, Any]) -> str:
    lost = ", ".join(f"{n} {p}" for p, n in entry["lost"].items()) or "nothing"
    return f"room lost on its GPU: {lost}; {entry['free_slices_after']} memory slices left free there"


def _emit(args: argparse.Namespace, doc: dict[str, Any], lines: list[str]) -> None:
    if args.format == "json":
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n".join(lines) + "\n")
