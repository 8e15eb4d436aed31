"""The scheduler's work per pod with the agent's ResourceSlices, beside single GPUs only.

Run: ``.venv/bin/python bench/bench_dra_scheduler.py`` (``--nodes 100,500,1000``,
``--gpus 8,16,64``, ``--pods N``, ``--states S``, ``--seed S``, ``--markdown``,
``--publisher MODULE:FUNCTION``, ``--history EVENTS``, ``--settled``).

``--history EVENTS`` reaches each node state through EVENTS pods arriving and leaving
(:func:`churned_states`), so that the agent's slices hold what a node in use publishes: the sets
its pods hold, sets kept because a claim may hold them, sets being withdrawn; every path is then
measured on the GPUs that history ended with, right after the last pod (what it made due still
tainted), or with ``--settled`` once the node was quiet for longer than the withdrawal grace.
Without it (the default) a state's GPUs are held
one by one with nothing published before.

What is counted is the work of ``tests/testbed/dra_allocator_model.py`` (:class:`Work`), the model of
the scheduler's structured allocator, per Filter as upstream does it: pools gathered, devices
converted, counter consumptions validated, slices scanned by ``checkSlicesInPool``, CEL
evaluations, counters compared by ``checkAvailableCounters``; under ``GatherPools`` of 1.36
(v0.36.2) and of 1.37 (v0.37.0-alpha.2, kubernetes#138917). Counts, not seconds: nothing built
from Kubernetes runs here, and counts are what differ between the agent's slices and single
GPUs (the per-item costs are the same code on both).

The cluster: N nodes of one synthetic machine (``synthetic_islands_topology``: NVSwitch
islands of 8 on two NUMA nodes; 8 GPUs = one island, like ``dgx-h100``'s NVLink), each in one
of S occupancy states (node i in state i mod S). A state is drawn by placing pods of the mix
with the device plugin's choice (``best_set``) until a random occupancy between 0 and 90 %;
its held GPUs are the allocated devices (single GPUs: a set's counters are its members', so
the counters and the walk are the same as for the claims' set devices). What a node publishes
in a state is the *publisher*'s answer for those GPUs held one by one, nothing published
before (``tests/testbed/dra_publishers.py``; the default is the agent's ``render_slices`` for that
occupancy and server version, as ``slices --in-use LIST --server-version V`` prints it).

A pod: 40 % 1 GPU, 30 % 2, 20 % 4, 10 % 8 (sizes above the node's GPUs are left out), one
ResourceClaim. Claim shapes: ``list`` = a multi-GPU pod asks ``[one set (gpuset class +
gpuCount selector) -> k singles]``; ``set-of-k`` = ``[one set of the set-of-k class (one
selector) -> k singles]``; ``set alone`` = one set of the set-of-k class, no fallback
(``daemonset/dra/examples``' ``best-set-of-4``, or ``gpu.gpu-agent.io/set-of-k: 1`` in a pod's
limits); single GPUs only: k singles. The agent publishes a free set of every size in
``set_sizes`` (2, 4, 8, ...: the mix's sizes) wherever that many GPUs are free, so a node
where the set alone does not fit is one where k singles do not fit either (the bench checks
that: ``unschedulable``, the pods that fit no node, must equal the single GPUs'), and the
singles tier of the lists serves only while the scheduler's view of the slices lags the
claims it allocated (``bench/quality_dra.py`` measures what the set alone then costs in
placement). A pod's Filters follow
kube-scheduler's ``findNodesThatPassFilters``: from the rotating start index
(``nextStartNodeIndex``), node after node, until ``numFeasibleNodesToFind`` feasible ones
(adaptive: all below 100 nodes, else ``N * max(50 - N/125, 5) %``, at least 100); pods are
not bound (the snapshot stays as drawn), so every figure is the work of filtering one pod in
that snapshot.

Counted analytically, not by gathering N pools per Filter: a Filter's gathering work is
``ClusterGather.filter_work`` (equal to ``gather_pools`` over the whole cluster, tested in
``tests/test_dra_allocator_model.py``), and its search work (CEL, counter checks, steps)
depends only on the node's state and the claim, so each (state, claim shape, size) is run once
through ``AllocatorModel.allocate`` and charged to every Filter of a node in that state; on 1.36
the other nodes' pools add no device to the search (their devices do not target the node).

Paths (columns): ``agent`` = the publisher with server version 1.37 under 1.37's gathering
(``agent set-of-k``, ``agent set alone``: the same with those claim shapes);
``agent@1.36`` = the publisher with server version 1.36 under 1.36's; ``sets forced@1.36`` = what
it publishes for 1.37 (sets, counters) under 1.36's gathering (``dra.gpuSets: on`` on a 1.36
cluster); ``singles`` = single GPUs
only (``with_sets=False``) under 1.37's (1.36 gathers the same for them). Each count's ratio is
the path's per-pod count over the single GPUs' per-pod count; ``items`` adds devices converted,
consumptions validated, CEL evaluations and counter checks, unweighted (single GPUs validate
and check no counters: those two are per-pod counts; slices scanned, a name comparison each,
are apart).

``est. CPU x``: the real scheduler's CPU per pod over single GPUs', estimated by weighing the
same counts with costs fitted to the real kube-scheduler's measurements of issue 25
(``bench/dra_cost_model.py``: which figures are fitted, which held out, the residuals); a
range, least to most over the weights those figures leave open. Run ``dra_cost_model.py``
alone for the fit and its checks.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tables import print_table  # noqa: E402

from agent.dra.devices import set_name  # noqa: E402
from agent.topology.allocator import AllocationEngine  # noqa: E402
from agent.topology.model import Topology  # noqa: E402
from tests.testbed.allocation_support import best_set, synthetic_islands_topology  # noqa: E402
from tests.testbed.dra_allocator_model import AllocatorModel, ClusterGather, Work, gather_pools  # noqa: E402
from tests.testbed.dra_publishers import (  # noqa: E402
    Publisher,
    agent_publisher,
    device_names,
    load_publisher,
    set_names,
    single_gpus,
    singles_publisher,
    withdrawing,
)
from tests.testbed.dra_shipped_classes import CEL as SHIPPED_CEL  # noqa: E402
from tests.testbed.dra_shipped_classes import CLASSES as SHIPPED_CLASSES  # noqa: E402
from tests.testbed.dra_shipped_classes import count_expr, set_alone  # noqa: E402

DRIVER = "gpu.gpu-agent.io"
MIX = ((1, 0.4), (2, 0.3), (4, 0.2), (8, 0.1))

# the shipped DeviceClasses (daemonset/dra/deviceclass.yaml) and their CEL as predicates
CLASSES, CEL = SHIPPED_CLASSES, SHIPPED_CEL


def pod_claim(k: int, shape: str) -> dict[str, Any]:
    """One pod's ResourceClaim: ``shape`` is ``list``, ``set-of-k``, ``set alone`` or ``singles``."""
    singles = {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": k}
    if k == 1 or shape == "singles":
        request: dict[str, Any] = {"name": "gpus", "exactly": singles}
    elif shape == "set alone":
        request = set_alone(k)
    elif shape == "list":
        request = {"name": "gpus", "firstAvailable": [
            {"name": "set", "deviceClassName": f"gpuset.{DRIVER}", "allocationMode": "ExactCount", "count": 1,
             "selectors": [{"cel": {"expression": count_expr(k)}}]},
            {"name": "singles", **singles}]}
    else:
        request = {"name": "gpus", "firstAvailable": [
            {"name": "set", "deviceClassName": f"set-of-{k}.{DRIVER}", "allocationMode": "ExactCount", "count": 1},
            {"name": "singles", **singles}]}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"pod-{k}", "namespace": "default"},
            "spec": {"devices": {"requests": [request], "constraints": []}}}


# ----------------------------------------------------------------------- the cluster
def num_feasible_nodes_to_find(n: int) -> int:
    """kube-scheduler's ``numFeasibleNodesToFind`` with the default ``percentageOfNodesToScore``."""
    if n < 100:
        return n
    pct = max(50 - n // 125, 5)
    return max(n * pct // 100, 100)


def pod_sizes(gpus: int) -> list[tuple[int, float]]:
    mix = [(k, w) for k, w in MIX if k <= gpus]
    total = sum(w for _, w in mix)
    return [(k, w / total) for k, w in mix]


def occupancy_states(topo: Topology, count: int, rng: random.Random) -> list[frozenset[int]]:
    """``count`` node states: GPUs held after placing pods of the mix (the device plugin's
    choice) up to a random occupancy in [0, 0.9)."""
    engine, sizes = AllocationEngine(topo), pod_sizes(topo.gpu_count)
    out = []
    for _ in range(count):
        target, held = rng.uniform(0, 0.9) * topo.gpu_count, set()
        for _ in range(4 * topo.gpu_count):
            if len(held) >= target:
                break
            k = rng.choices([k for k, _ in sizes], [w for _, w in sizes])[0]
            free = [i for i in range(topo.gpu_count) if i not in held]
            if len(free) >= k:
                held.update(best_set(engine, free, [], k))
        out.append(frozenset(held))
    return out


@dataclass
class History:
    """A node state reached through a history of pods arriving and leaving: the devices its
    pods hold (a multi-GPU pod its set where the agent published it, else single GPUs) and what
    the agent published after the last of them (kept sets and sets being withdrawn included)."""

    held: dict[str, tuple[int, ...]]
    published: tuple[str, ...]  # the devices published before the last rendering
    tainted: tuple[str, ...]  # of those, the ones carrying the withdrawal taint


def churned_states(topo: Topology, states: Sequence[frozenset[int]], rng: random.Random, publisher: Publisher,
                   events: int, settled: bool = False) -> list[History]:
    """Per state, ``events`` pods arriving and leaving around its occupancy (the device plugin's
    choice, which is the first free set of its size in the agent's rendering at lag 0), the agent
    re-rendering after each with what it published before (a set being withdrawn goes at the next
    rendering, as in ``quality_dra.py``); then pods arrive or leave until about as many GPUs are
    held as in the state (every path is then measured on the GPUs the history ended with).
    ``settled``: measured once the node was quiet for longer than the grace (what the last pod
    made due is gone); else right after the last pod (still tainted)."""
    engine, sizes, out = AllocationEngine(topo), pod_sizes(topo.gpu_count), []
    for target in states:
        pods: list[dict[str, tuple[int, ...]]] = []
        last = publisher(topo, "n", {}, (), "1.37")
        for step in range(events + 4 * topo.gpu_count):
            busy = {g for pod in pods for gpus in pod.values() for g in gpus}
            if step >= events and len(busy) >= len(target):
                break
            if pods and (len(busy) > len(target) or (step < events and rng.random() < 0.5)):
                pods.pop(rng.randrange(len(pods)))
            else:
                k = rng.choices([k for k, _ in sizes], [w for _, w in sizes])[0]
                free = [i for i in range(topo.gpu_count) if i not in busy]
                if len(free) < k:
                    continue
                members = tuple(sorted(best_set(engine, free, [], k)))
                name = set_name(members) if k >= 2 else ""
                pods.append({name: members} if name in set_names(last) else single_gpus(members))
            held = {name: gpus for pod in pods for name, gpus in pod.items()}
            inputs = (tuple(device_names(last)), tuple(withdrawing(last)))
            last = publisher(topo, "n", held, inputs[0], "1.37", expired=inputs[1], tainted=inputs[1])
        if settled:  # quiet for longer than the grace: the last withdrawals are done
            inputs = (tuple(device_names(last)), tuple(withdrawing(last)))
        out.append(History({name: gpus for pod in pods for name, gpus in pod.items()}, *inputs))
    return out


@dataclass
class PathSpec:
    name: str
    publisher: Publisher
    server_version: str
    gather: str  # "1.36" / "1.37"


@dataclass
class Result:
    work: Work
    filters: int
    pods: int
    unschedulable: int
    own_devices: int  # devices of the Filtered node's own pool, over all Filters
    fits: frozenset[tuple[int, int]]  # the (node state, pod size) pairs where the pod fits the node


def search_costs(allocated: Sequence[Collection[str]], published: Sequence[list[dict[str, Any]]], path: PathSpec,
                 shape: str, sizes: Sequence[int]) -> dict[tuple[int, int], tuple[Work, bool]]:
    """Per (state, pod size): the search's work (``allocate``'s less its gathering, which
    :class:`ClusterGather` charges) and whether the pod fits; ``allocated``: each state's
    allocated devices."""
    search: dict[tuple[int, int], tuple[Work, bool]] = {}
    for s, (held, slices) in enumerate(zip(allocated, published)):
        node = f"state-{s}"
        model = AllocatorModel(slices, CLASSES, CEL, version=path.gather,
                               allocated={(DRIVER, node, name) for name in held})
        own = Work()
        gather_pools(slices, node, version=path.gather, work=own)
        for k in sizes:
            got = model.allocate([pod_claim(k, shape)], node)
            search[(s, k)] = (model.work + own.times(-1), got is not None)
    return search


def run_path(topo: Topology, nodes: int, states: Sequence[frozenset[int]], path: PathSpec, shape: str,
             pods: Sequence[int], history: Sequence[History] = ()) -> Result:
    """``history``: node states reached through pods arriving and leaving, for a path whose
    publisher publishes sets (server version 1.37); else each state's GPUs held one by one with
    nothing published before."""
    if history and path.server_version == "1.37" and path.publisher is not singles_publisher:
        published = [path.publisher(topo, f"state-{s}", h.held, h.published, "1.37", expired=h.tainted,
                                    tainted=h.tainted) for s, h in enumerate(history)]
        allocated: list[Collection[str]] = [set(h.held) for h in history]
    else:
        published = [path.publisher(topo, f"state-{s}", single_gpus(held), (), path.server_version)
                     for s, held in enumerate(states)]
        allocated = [{f"gpu-{i}" for i in held} for held in states]
    search = search_costs(allocated, published, path, shape, sorted(set(pods)))
    cluster = ClusterGather(path.gather)
    node_state = [i % len(states) for i in range(nodes)]
    for s, slices in enumerate(published):
        cluster.set_node(f"state-{s}", slices, copies=node_state.count(s))
    gather = [cluster.filter_work(f"state-{s}") for s in range(len(states))]
    own = [Work() for _ in published]
    for s, slices in enumerate(published):
        gather_pools(slices, f"state-{s}", version="1.37", work=own[s])  # the node's own pool alone
    want, start, total, filters, unschedulable = num_feasible_nodes_to_find(nodes), 0, Work(), 0, 0
    visits: dict[tuple[int, int], int] = {}
    for k in pods:
        feasible = seen = 0
        while seen < nodes and feasible < want:
            s = node_state[(start + seen) % nodes]
            visits[(s, k)] = visits.get((s, k), 0) + 1
            feasible += search[(s, k)][1]
            seen += 1
        start = (start + seen) % nodes
        filters += seen
        unschedulable += feasible == 0
    mine = 0
    for (s, k), n in visits.items():
        total = total + (gather[s] + search[(s, k)][0]).times(n)
        mine += own[s].devices_converted * n
    return Result(total, filters, len(pods), unschedulable, mine, frozenset(key for key, (_, fit) in search.items() if fit))


def items(w: Work) -> int:
    """Per-device and per-counter work, unweighted (a slice scanned is a name comparison: apart)."""
    return w.devices_converted + w.consumptions_validated + w.cel_evaluations + w.counter_checks


def measure(nodes: int, gpus: int, n_pods: int, n_states: int, seed: int, publisher: Publisher,
            events: int = 0, settled: bool = False) -> dict[str, Result]:
    topo = synthetic_islands_topology(max(gpus // 8, 1), min(gpus, 8))
    rng = random.Random(seed * 1_000_003 + gpus)
    states = occupancy_states(topo, n_states, rng)
    sizes = pod_sizes(gpus)
    pods = rng.choices([k for k, _ in sizes], [w for _, w in sizes], k=n_pods)
    history = churned_states(topo, states, random.Random(seed), publisher, events, settled) if events else []
    if history:  # every path sees the same GPUs held: those the history ended with
        states = [frozenset(g for gpus in h.held.values() for g in gpus) for h in history]
    paths = {
        "agent": (PathSpec("agent", publisher, "1.37", "1.37"), "list"),
        "agent set-of-k": (PathSpec("agent", publisher, "1.37", "1.37"), "set-of-k"),
        "agent set alone": (PathSpec("agent", publisher, "1.37", "1.37"), "set alone"),
        "agent@1.36": (PathSpec("agent@1.36", publisher, "1.36", "1.36"), "list"),
        "agent@1.36 set-of-k": (PathSpec("agent@1.36", publisher, "1.36", "1.36"), "set-of-k"),
        "sets forced@1.36": (PathSpec("sets forced@1.36", publisher, "1.37", "1.36"), "list"),
        "singles": (PathSpec("singles", singles_publisher, "1.37", "1.37"), "singles"),
    }
    return {name: run_path(topo, nodes, states, spec, shape, pods, history) for name, (spec, shape) in paths.items()}


def ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,500,1000")
    parser.add_argument("--gpus", default="8,16,64")
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--states", type=int, default=24)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--publisher", default="", help="MODULE:FUNCTION (default: the agent's render_slices)")
    parser.add_argument("--history", type=int, default=0, metavar="EVENTS",
                        help="reach each node state through EVENTS pods arriving and leaving, so that what the "
                             "agent publishes holds kept sets and sets being withdrawn (default 0: nothing "
                             "published before)")
    parser.add_argument("--settled", action="store_true",
                        help="with --history: measure each state once the node was quiet for longer than the "
                             "withdrawal grace (default: right after the last pod, its withdrawals still tainted)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if args.settled and not args.history:
        parser.error("--settled needs --history EVENTS")
    publisher = load_publisher(args.publisher) if args.publisher else agent_publisher()
    import dra_cost_model  # imports this module: here, not at the top

    _, family = dra_cost_model.calibrate()

    def cpu(r: Result, b: Result) -> str:
        lo, hi = dra_cost_model.estimate_ratio(
            *(dra_cost_model.Counts(x.work, x.filters, x.pods, x.own_devices) for x in (r, b)), family)
        return f"{lo:.2f}-{hi:.2f}"

    head = ("nodes", "GPUs", "path", "Filters/pod", "items/pod", "items x", "converted x", "CEL x",
            "consumptions/pod", "counter checks/pod", "scanned/pod", "items/Filter", "est. CPU x")
    rows: list[tuple[str, ...]] = [head]
    verdicts = []
    started = time.monotonic()
    for gpus in (int(g) for g in args.gpus.split(",")):
        per_filter: dict[str, list[float]] = {}
        for nodes in (int(n) for n in args.nodes.split(",")):
            results = measure(nodes, gpus, args.pods, args.states, args.seed, publisher, args.history, args.settled)
            base = results["singles"]
            for name, r in results.items():
                w, b = r.work, base.work
                per_filter.setdefault(name, []).append(items(w) / r.filters)
                rows.append((str(nodes), str(gpus), name, f"{r.filters / r.pods:.0f}", f"{items(w) / r.pods:,.0f}",
                             ratio(items(w), items(b)), ratio(w.devices_converted, b.devices_converted),
                             ratio(w.cel_evaluations, b.cel_evaluations),
                             *(f"{v / r.pods:,.0f}" for v in (w.consumptions_validated, w.counter_checks, w.slices_scanned)),
                             f"{items(w) / r.filters:,.0f}", cpu(r, base)))
                if name in ("agent", "agent set alone") and nodes in (100, 500) and gpus in (8, 16):
                    x = items(r.work) / items(base.work)
                    verdicts.append(f"{nodes} x {gpus} GPUs, 1.37: {name} {x:.2f}x single GPUs' items per pod, "
                                    f"estimated CPU {cpu(r, base)}x (dra_cost_model.py; goal: at most 2x); "
                                    f"pods no node fits {r.unschedulable} (single GPUs: {base.unschedulable}), "
                                    f"fits a node where single GPUs do not, or the reverse, in {len(r.fits ^ base.fits)} "
                                    f"of {args.states * len(pod_sizes(gpus))} (node state, pod size) pairs")
        for name in ("agent@1.36", "sets forced@1.36", "agent"):
            f = per_filter[name]
            verdicts.append(f"{gpus} GPUs, {name}: work per Filter {f[0]:,.0f} -> {f[-1]:,.0f} items from "
                            f"{args.nodes.split(',')[0]} to {args.nodes.split(',')[-1]} nodes "
                            f"({f[-1] / f[0]:.1f}x; grows with the node count: "
                            f"{'yes, quadratic per pod' if f[-1] / f[0] > 2 else 'no'})")
    print_table(rows, args.markdown, 3)
    print(f"\n== goals (seed {args.seed}, {args.pods} pods, {args.states} node states, "
          f"{time.monotonic() - started:.0f} s) ==")
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
