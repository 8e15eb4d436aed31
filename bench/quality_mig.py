"""Dynamic MIG placement quality through the scheduler's DRA allocator: NVIDIA's order beside
the agent's best fit, and a repacking bound.

Run: ``.venv/bin/python bench/quality_mig.py`` (``--events N``, ``--seeds K``, ``--machine M``,
``--every N``, ``--placements N``, ``--markdown``, ``--quick``).

A churn of claims (seeded): each event one claim arrives, a MIG profile (1g.10gb, 1g.20gb,
2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb) or a whole GPU, and holds it for a drawn number of events
(then it is released: unprepared). Each claim is allocated alone by the allocator model
(``tests/testbed/dra_allocator_model.py``, Kubernetes 1.36's structured allocator: first fit
over the devices in slice order, counters), with the claims still held as its allocated
state. A claim that does not fit is refused and gone. Worlds:

* ``NVIDIA order``: what kubernetes-sigs/dra-driver-nvidia-gpu's DynamicMIG publishes: every
  placement of every profile of every GPU, the full GPUs beside them, one counter set per GPU
  (the same counters as the agent's), in device-name order, published once: the allocator's
  first fit is the lowest GPU and the lowest placement that fits;
* ``agent``: the agent's slices (``render_slices(..., dynamic_mig=True)``, GPU sets on,
  ``--placements`` per profile), re-rendered for the claims held after every allocation and
  release, as the publisher does at every prepare and unprepare; a device leaving is tainted
  first and goes once the agent has prepared every claim allocated before the taint was
  published (the grace, ``dra.gpuSetWithdrawalGraceSeconds``, outlasts the lag between an
  allocation and its prepare: a claim holding the device is known by then; a grace of one
  rendering, the model before, let the scheduler allocate a withdrawn device's slices to a
  second claim under ``--every 3``). With ``--every N`` the agent's prepares lag the
  scheduler: the claims allocated are prepared (and the slices re-rendered for them) before
  every N-th claim only, so N claims are allocated on one rendering; a release re-renders at
  once for the claims prepared by then (those allocated since stay as the pool showed them). A
  claim refused while some allocation is not prepared yet is tried once more at the next
  prepare's re-rendering, before that step's releases (kube-scheduler's DynamicResources
  plugin requeues a pod it refused when a ResourceSlice is added or updated), and is refused
  for good only then;
* ``repacking bound``: no allocator, a reference: each GPU's instances may be re-placed at will
  at every claim (a claim fits a GPU when some legal layout holds its instances and the new
  one; a whole GPU needs an empty one); the claim goes to the fullest GPU it fits. No
  allocator that never moves an instance does better on the fragmentation count; served
  claims are not a strict bound (its greedy choice of GPU is not optimal either).

Every allocation is checked against the GPUs (:func:`over_committed`: no memory slice, GPU or
engine given twice); a world that over-commits stops the run with an error naming the claim.
Counted per world: claims served; refusals; **fragmentation refusals**: a MIG claim refused
while some GPU, not held whole, had as many free memory slices as the profile's placement
takes and as many free compute slices as it uses (the repacking bound's own count is the
part no re-placement on one GPU avoids: the free slices are there, but no legal layout).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field, replace
from itertools import product
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from agent.dra.device_values import render_device  # noqa: E402
from agent.dra.devices import parse_mig_slot_name  # noqa: E402
from agent.dra.mig_publish import counter_slices, mig_devices  # noqa: E402
from agent.dra.migslots import (  # noqa: E402
    SLOTS_PER_PROFILE,
    GpuLayout,
    MigSlot,
    dynamic_gpus,
    gpu_counters,
    resolve_slot,
)
from agent.dra.occupancy import Occupancy  # noqa: E402
from agent.dra.slices import health_marks, render_devices, render_slices  # noqa: E402
from agent.dra.withdrawal import withdrawal_taint  # noqa: E402
from tests.testbed.dra_allocator_model import AllocatorModel  # noqa: E402
from tests.testbed.dra_shipped_classes import CEL, CLASSES, mig_request  # noqa: E402
from tests.testbed.mig_support import mig_topology  # noqa: E402

D = "gpu.gpu-agent.io"
#: (profile or "gpu", weight)
MIX = (("1g.10gb", 30), ("1g.20gb", 8), ("2g.20gb", 20), ("3g.40gb", 15), ("4g.40gb", 8), ("7g.80gb", 7),
       ("gpu", 12))
HOLD = (4, 44)  # events a claim holds its device, uniform


@dataclass
class Tally:
    served: int = 0
    refused: int = 0
    fragmentation: int = 0
    seconds: float = 0.0
    devices: list[int] = field(default_factory=list)


def trace(seed: int, events: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    names, weights = zip(*MIX)
    return [(rng.choices(names, weights)[0], rng.randint(*HOLD)) for _ in range(events)]


def claim(name: str, profile: str) -> dict[str, Any]:
    request = ({"name": "gpu", "exactly": {"deviceClassName": D, "allocationMode": "ExactCount", "count": 1}}
               if profile == "gpu" else mig_request(profile))
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": {"requests": [request]}}}


def layout_of(topology: Any, held: dict[str, tuple[int, ...]]) -> dict[int, GpuLayout]:
    geos = dynamic_gpus(topology)
    out = {i: GpuLayout(i, g) for i, g in geos.items()}
    for name, gpus in held.items():
        slot = resolve_slot(name, geos)
        if slot is not None:
            out[slot.gpu].slots.append(slot)
        else:
            for g in gpus:
                out[g].whole = True
    return out


def over_committed(topology: Any, held: dict[str, tuple[int, ...]]) -> str | None:
    """What the allocations ``held`` over-commit (None: nothing): a GPU held twice whole, a MIG
    device on a GPU held whole, two MIG devices on one memory slice, an engine over the GPU's."""
    geos = dynamic_gpus(topology)
    whole: list[int] = [g for n, gpus in held.items() if resolve_slot(n, geos) is None for g in gpus]
    if len(whole) != len(set(whole)):
        return f"a GPU held whole twice: {sorted(held)}"
    for i, lay in layout_of(topology, held).items():
        taken = [k for s in lay.slots for k in s.placement.slices]
        if lay.slots and lay.whole:
            return f"GPU {i} held whole beside its MIG devices {[s.name for s in lay.slots]}"
        cap = gpu_counters(lay.geometry)
        if len(taken) != len(set(taken)) or not all(v <= cap.get(k, v) for k, v in lay.used().items()):
            return f"GPU {i}: {[s.name for s in lay.slots]} overlap or take more than the GPU has"
    return None


def fragmented(layouts: dict[int, GpuLayout], profile: str) -> bool:
    """Some GPU not held whole had as many free memory slices as ``profile``'s placements
    take and as many free compute slices as it uses (nvidia-smi's g)."""
    for lay in layouts.values():
        p = lay.geometry.profile(profile)
        if lay.whole or p is None:
            continue
        size = max(pl.size for pl in p.placements)
        compute_free = lay.geometry.compute_slices - sum(s.profile.compute_slices for s in lay.slots)
        if lay.free_slices() >= size and compute_free >= p.compute_slices:
            return True
    return False


# ----------------------------------------------------------------------- worlds
def nvidia_slices(topology: Any) -> list[dict[str, Any]]:
    """Every placement of every profile and the full GPUs, in device-name order, one counter
    set per GPU (module docstring)."""
    geos = dynamic_gpus(topology)
    marks = health_marks(topology)
    every = {f"gpu-{i}-mig-x-{p.name}-{pl.start}": MigSlot(i, p, pl)
             for i, geo in geos.items() for p in geo.profiles for pl in p.placements}
    migs = mig_devices(topology, D, marks, {}, [s.name for s in every.values()], None, graced=False)
    full = render_devices(topology, D, marks)
    full = [replace(d, shares=migs.gpu_share(int(d.name.split("-")[1]))) for d in full]
    devices = sorted([*full, *migs.devices], key=lambda d: _name_key(d.name))
    specs: list[dict[str, Any]] = counter_slices(migs)
    specs += [{"devices": [render_device(d, "v1") for d in devices[i : i + 64]]} for i in range(0, len(devices), 64)]
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"nvidia-{n:03d}"},
             "spec": {"driver": D, "nodeName": "node-1", "pool": {"name": "node-1", "generation": 1,
                                                                  "resourceSliceCount": len(specs)}, **body}}
            for n, body in enumerate(specs)]


def _name_key(name: str) -> tuple[Any, ...]:
    """NVIDIA's names sort as strings: gpu-<minor>, then gpu-<minor>-mig-<profile>-<id>-<start>."""
    parsed = parse_mig_slot_name(name)
    return (name,) if parsed is None else (f"gpu-{parsed[0]}-mig-{parsed[1]}", parsed[2])


def run_allocator(topology: Any, events: list[tuple[str, int]], agent: bool, every: int = 1,
                  placements: int = SLOTS_PER_PROFILE) -> Tally:
    """One world's churn. The agent renders for the claims it has prepared, at every prepare
    and unprepare; with ``every`` N > 1 its prepares lag the scheduler's allocations: the
    claims allocated are prepared (and the slices re-rendered) before every N-th claim only,
    so up to N claims are allocated on one rendering, while a release (an unprepare) re-renders
    at once for the claims prepared by then (those allocated since stay in the pool as it saw
    them: a claim the agent has not heard of may hold them)."""
    tally = Tally()
    held: dict[str, tuple[int, ...]] = {}  # allocated
    prepared: set[str] = set()  # of those, the ones the agent knows
    until: dict[str, int] = {}
    static = None if agent else nvidia_slices(topology)
    slices: list[dict[str, Any]] = []
    in_pool: list[str] = []
    withdrawing: set[str] = set()
    sets: list[str] = []
    key = withdrawal_taint(D)["key"]
    waiting: list[tuple[str, int]] = []  # refused on a rendering older than an allocation: retried once
    tainted_at: dict[str, int] = {}  # withdrawing device -> the step its withdrawal taint was first published
    prepares: list[int] = [-1]  # the steps the agent prepared every claim allocated by then

    def render(step: int) -> None:
        nonlocal slices, in_pool, sets, withdrawing
        known = {n: g for n, g in held.items() if n in prepared}
        # the grace outlasts the lag: a device goes once the agent has prepared every claim allocated
        # before its taint was published (a claim holding it would be known by then)
        expired = sorted(n for n in withdrawing if tainted_at[n] < prepares[-1])
        slices = render_slices(topology, node_name="node-1", driver=D, dynamic_mig=True, mig_placements=placements,
                               occupancy=Occupancy(known, sets, expired, sorted(withdrawing), in_pool))
        devs = [d for s in slices for d in s["spec"].get("devices", ())]
        in_pool = sorted(d["name"] for d in devs if not d["name"].startswith("gpuset-"))
        sets = sorted(d["name"] for d in devs if d["name"].startswith("gpuset-"))
        withdrawing = {d["name"] for d in devs if any(t.get("key") == key for t in d.get("taints", ()))}
        for n in list(tainted_at):
            if n not in withdrawing:
                del tainted_at[n]
        for n in withdrawing:
            tainted_at.setdefault(n, step)
        tally.devices.append(len(devs))

    def place(step: int, profile: str, hold: int, retry: bool) -> None:
        model = AllocatorModel(slices, CLASSES, CEL, allocated=[(D, "node-1", n) for n in held])
        result = model.allocate([claim(f"c{step}", profile)], "node-1")
        if result is None:
            if agent and held.keys() - prepared and not retry:  # requeued on the next ResourceSlice update
                waiting.append((profile, hold))
                return
            tally.refused += 1
            tally.fragmentation += profile != "gpu" and fragmented(layout_of(topology, held), profile)
            return
        (((_, (_, _, name)),),) = result
        slot = resolve_slot(name, dynamic_gpus(topology))
        if not agent and slot is None and "-mig-" in name:
            raise AssertionError(name)
        held[name] = (slot.gpu,) if slot is not None else (int(name.split("-")[1]),)
        if (wrong := over_committed(topology, held)) is not None:
            raise AssertionError(f"{'agent' if agent else 'NVIDIA order'}, claim {step}: {wrong}")
        until[name] = step + hold
        tally.served += 1

    start = time.perf_counter()
    for step, (profile, hold) in enumerate(events):
        boundary = agent and step % every == 0
        if boundary:
            prepares.append(step)
        if boundary and waiting:
            # the re-publication the window's prepares cause, before anything is released: the
            # claims refused on the older rendering are tried once more, then refused for good
            prepared.update(held)
            render(step)
            for p, h in waiting:
                place(step, p, h, retry=True)
            waiting = []
        released = [n for n, t in until.items() if t <= step]
        for name in released:
            del held[name], until[name]
            prepared.discard(name)
        if boundary:
            prepared.update(held)
        if boundary or (agent and released):
            render(step)
        elif not agent:
            slices = static or []
        place(step, profile, hold, retry=False)
    for p, h in waiting:  # the last window's
        prepared.update(held)
        render(len(events))
        place(len(events), p, h, retry=True)
    tally.seconds = time.perf_counter() - start
    return tally


def run_repack(topology: Any, events: list[tuple[str, int]]) -> Tally:
    tally = Tally()
    geos = dynamic_gpus(topology)
    gpus: dict[int, list[str]] = {i: [] for i in geos}  # profiles held; "gpu" for whole
    until: list[tuple[int, int, str]] = []
    for step, (profile, hold) in enumerate(events):
        for entry in [u for u in until if u[0] <= step]:
            until.remove(entry)
            gpus[entry[1]].remove(entry[2])
        fits = [i for i in gpus if _packs(geos[i], gpus[i] + [profile])]
        if not fits:
            tally.refused += 1
            held = {f"x{n}-{i}": (i,) for i, ps in gpus.items() for n, p in enumerate(ps) if p == "gpu"}
            lay = layout_of(topology, held)
            for i, ps in gpus.items():  # any legal layout of the same profiles: the counters are the same
                if "gpu" not in ps and ps:
                    lay[i].slots = _layout(geos[i], ps) or []
            tally.fragmentation += profile != "gpu" and fragmented(lay, profile)
            continue
        best = min(fits, key=lambda i: (_free(geos[i], gpus[i]) if gpus[i] else 99, i))
        gpus[best].append(profile)
        until.append((step + hold, best, profile))
        tally.served += 1
    return tally


def _free(geo: Any, profiles: list[str]) -> int:
    return geo.memory_slices - sum(max(pl.size for pl in geo.profile(p).placements) for p in profiles)


_PACKED: dict[tuple[int, tuple[str, ...]], list[MigSlot] | None] = {}


def _layout(geo: Any, profiles: list[str]) -> list[MigSlot] | None:
    """A legal layout of ``profiles`` on a GPU of ``geo`` (None: none)."""
    key = (id(geo), tuple(sorted(profiles)))
    if key not in _PACKED:
        lay = GpuLayout(0, geo)
        options = [geo.profile(p).placements for p in sorted(profiles)]
        found = None
        for choice in product(*options):
            lay.slots = [MigSlot(0, geo.profile(p), pl) for p, pl in zip(sorted(profiles), choice)]
            cut = [i for s in lay.slots for i in s.placement.slices]
            used, cap = lay.used(), gpu_counters(geo)
            if len(cut) == len(set(cut)) and all(v <= cap[k] for k, v in used.items()):
                found = list(lay.slots)
                break
        _PACKED[key] = found
    return _PACKED[key]


def _packs(geo: Any, profiles: list[str]) -> bool:
    if "gpu" in profiles:
        return profiles == ["gpu"]
    return _layout(geo, profiles) is not None


# ----------------------------------------------------------------------- report
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--machine", default="dgx-h100")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--every", type=int, default=1,
                    help="the agent prepares (and re-publishes) before every N-th claim only: N claims are"
                         " allocated on one rendering (default 1: after each)")
    ap.add_argument("--placements", type=int, default=SLOTS_PER_PROFILE,
                    help=f"dra.migPlacementsPerProfile of the agent's world (default {SLOTS_PER_PROFILE})")
    ap.add_argument("--quick", action="store_true", help="one seed, 60 events (a smoke run for CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.events, args.seeds = 60, 1
    topology = mig_topology(args.machine)
    totals = {w: Tally() for w in ("NVIDIA order", "agent", "repacking bound")}
    for seed in range(args.seeds):
        events = trace(seed, args.events)
        for world, tally in (("NVIDIA order", run_allocator(topology, events, False)),
                             ("agent", run_allocator(topology, events, True, args.every, args.placements)),
                             ("repacking bound", run_repack(topology, events))):
            t = totals[world]
            t.served += tally.served
            t.refused += tally.refused
            t.fragmentation += tally.fragmentation
            t.seconds += tally.seconds
            t.devices += tally.devices
    n = args.events * args.seeds
    print(f"{args.machine}: {args.seeds} seed(s) x {args.events} claims ({n}); mix "
          + ", ".join(f"{p} {w}" for p, w in MIX) + f"; hold {HOLD[0]}-{HOLD[1]} events")
    rows = [("world", "served", "refused", "fragmentation refusals", "devices published (mean)")]
    for world, t in totals.items():
        mean = f"{sum(t.devices) / len(t.devices):.0f}" if t.devices else ("-" if world != "NVIDIA order"
                                                                           else str(_count(topology)))
        rows.append((world, str(t.served), str(t.refused), str(t.fragmentation), mean))
    if args.markdown:
        print("| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
        print("\n".join("| " + " | ".join(r) + " |" for r in rows[1:]))
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows))
    nv, ours = totals["NVIDIA order"], totals["agent"]
    print(f"goal: fragmentation refusals <= half of NVIDIA's ({ours.fragmentation} vs {nv.fragmentation}):"
          f" {'met' if 2 * ours.fragmentation <= nv.fragmentation else 'missed'}; served >= NVIDIA's"
          f" ({ours.served} vs {nv.served}): {'met' if ours.served >= nv.served else 'missed'}")
    return 0


def _count(topology: Any) -> int:
    return sum(len(s["spec"].get("devices", ())) for s in nvidia_slices(topology))


if __name__ == "__main__":
    sys.exit(main())
