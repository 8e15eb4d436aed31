"""The scheduler's work per pod with dynamic MIG published, beside whole GPUs only.

Run: ``.venv/bin/python bench/bench_dra_mig_scheduler.py`` (``--nodes 100,500``,
``--pods N``, ``--states S`` (default 32), ``--seed S``, ``--placements N``, ``--quick``).

The model and the counts are ``bench/bench_dra_scheduler.py``'s (read its docstring): the
allocator model's :class:`Work` per Filter, gathering as Kubernetes 1.37 does
(``ClusterGather``), Filters per pod as kube-scheduler's ``findNodesThatPassFilters`` (from a
rotating start, until ``numFeasibleNodesToFind`` feasible nodes), ``items`` = devices
converted + consumptions validated + CEL evaluations + counters compared. Nodes: ``dgx-h100``
(8 H100 with the simulator's MIG geometry), each in one of S occupancy states (node i in state
i mod S), reached by allocating random claims of the pod mix through the model on the
agent's slices up to a random fill (0-90 % of the memory slices), re-rendered after each.

Worlds: ``whole GPUs`` = the agent's slices without dynamic MIG (GPU sets on), every pod one
whole GPU; ``dynamic MIG`` = the same with ``dynamic_mig=True``, pods of the MIG mix of
``bench/quality_mig.py`` (1g..7g and whole GPUs); ``dynamic MIG, whole-GPU pods`` = those
slices with pods of one whole GPU (what turning the feature on costs the pods that do not use it).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_dra_scheduler import items, num_feasible_nodes_to_find  # noqa: E402
from quality_mig import MIX, claim  # noqa: E402

from agent.dra.migslots import SLOTS_PER_PROFILE, dynamic_gpus, resolve_slot  # noqa: E402
from agent.dra.occupancy import Occupancy  # noqa: E402
from agent.dra.slices import render_slices  # noqa: E402
from tests.testbed.dra_allocator_model import AllocatorModel, ClusterGather, Work, gather_pools  # noqa: E402
from tests.testbed.dra_shipped_classes import CEL, CLASSES  # noqa: E402
from tests.testbed.mig_support import mig_topology  # noqa: E402

D = "gpu.gpu-agent.io"


def states(topology: Any, count: int, rng: random.Random, mig: bool,
           placements: int = SLOTS_PER_PROFILE) -> list[tuple[dict[str, tuple[int, ...]], list]]:
    """``count`` node states: (held devices, the slices published for them)."""
    geos = dynamic_gpus(topology)
    total = sum(g.memory_slices for g in geos.values())
    names, weights = zip(*MIX)
    out = []
    for s in range(count):
        fill, held, in_pool = rng.uniform(0, 0.9), {}, []
        for step in range(200):
            slices = render_slices(topology, node_name=f"state-{s}", driver=D, dynamic_mig=mig, mig_placements=placements,
                                   occupancy=Occupancy(dict(held), (), None, (), in_pool))
            in_pool = sorted(d["name"] for o in slices for d in o["spec"].get("devices", ()))
            used = sum(8 if resolve_slot(n, geos) is None else resolve_slot(n, geos).placement.size  # type: ignore[union-attr]
                       for n in held)
            if used >= fill * total:
                break
            profile = rng.choices(names, weights)[0] if mig else "gpu"
            model = AllocatorModel(slices, CLASSES, CEL, version="1.37",
                                   allocated=[(D, f"state-{s}", n) for n in held])
            got = model.allocate([claim(f"c{step}", profile)], f"state-{s}")
            if got is None:
                continue
            (((_, (_, _, name)),),) = got
            slot = resolve_slot(name, geos)
            held[name] = (slot.gpu,) if slot is not None else (int(name.split("-")[1]),)
        slices = render_slices(topology, node_name=f"state-{s}", driver=D, dynamic_mig=mig, mig_placements=placements,
                               occupancy=Occupancy(dict(held), (), None, (), in_pool))
        out.append((held, slices))
    return out


def per_pod(nodes: int, node_states: list, pods: list[str]) -> tuple[float, float, int, str]:
    """(items per pod, counters compared per pod, pods that fit no node, the work per Filter:
    devices converted / consumptions validated / CEL evaluations / counters compared)."""
    cluster = ClusterGather("1.37")
    where = [i % len(node_states) for i in range(nodes)]
    for s, (_, slices) in enumerate(node_states):
        cluster.set_node(f"state-{s}", slices, copies=where.count(s))
    gather = [cluster.filter_work(f"state-{s}") for s in range(len(node_states))]
    search: dict[tuple[int, str], tuple[Work, bool]] = {}
    for s, (held, slices) in enumerate(node_states):
        own = Work()
        gather_pools(slices, f"state-{s}", version="1.37", work=own)
        for profile in set(pods):
            model = AllocatorModel(slices, CLASSES, CEL, version="1.37",
                                   allocated=[(D, f"state-{s}", n) for n in held])
            got = model.allocate([claim("p", profile)], f"state-{s}")
            search[(s, profile)] = (model.work + own.times(-1), got is not None)
    want, start, total, unschedulable, filters = num_feasible_nodes_to_find(nodes), 0, Work(), 0, 0
    for profile in pods:
        feasible = seen = 0
        while seen < nodes and feasible < want:
            s = where[(start + seen) % nodes]
            work, fits = search[(s, profile)]
            total = total + gather[s] + work
            feasible += fits
            seen += 1
        start = (start + seen) % nodes
        filters += seen
        unschedulable += feasible == 0
    split = "/".join(f"{v / filters:.0f}" for v in (total.devices_converted, total.consumptions_validated,
                                                     total.cel_evaluations, total.counter_checks))
    return items(total) / len(pods), total.counter_checks / len(pods), unschedulable, split


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="100,500")
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--states", type=int, default=32,
                    help="occupancy states drawn (default 32: with 8 the ratio swung from 1.4x to 2.4x between"
                         " seeds, with the whole-GPU baseline the states drew)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--placements", type=int, default=SLOTS_PER_PROFILE,
                    help=f"dra.migPlacementsPerProfile of the dynamic MIG worlds (default {SLOTS_PER_PROFILE})")
    ap.add_argument("--quick", action="store_true", help="100 nodes, 3 states, 40 pods (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.states, args.pods = "100", 3, 40
    topology = mig_topology("dgx-h100")
    rng = random.Random(args.seed)
    whole = states(topology, args.states, rng, mig=False)
    migs = states(topology, args.states, rng, mig=True, placements=args.placements)
    names, weights = zip(*MIX)
    mix = [rng.choices(names, weights)[0] for _ in range(args.pods)]
    print(f"dgx-h100 (8 H100), {args.states} states, {args.pods} pods, Kubernetes 1.37 gathering,"
          f" {args.placements} placement(s) per MIG profile;"
          f" devices per node: whole GPUs {_mean(whole)}, dynamic MIG {_mean(migs)}")
    print("nodes  world                            items/pod  counters/pod  unschedulable  x whole GPUs"
          "  per Filter: devices/consumptions/CEL/counters")
    for n in (int(x) for x in args.nodes.split(",")):
        base = per_pod(n, whole, ["gpu"] * args.pods)
        rows = [("whole GPUs", base), ("dynamic MIG (MIG mix)", per_pod(n, migs, mix)),
                ("dynamic MIG, whole-GPU pods", per_pod(n, migs, ["gpu"] * args.pods))]
        for world, (it, cc, un, split) in rows:
            print(f"{n:<6} {world:<32} {it:>9.0f}  {cc:>12.0f}  {un:>13}  {it / base[0]:>11.2f}  {split:>14}")
    return 0


def _mean(node_states: list) -> str:
    counts = [sum(len(o["spec"].get("devices", ())) for o in slices) for _, slices in node_states]
    return f"{sum(counts) / len(counts):.0f}"


if __name__ == "__main__":
    sys.exit(main())
