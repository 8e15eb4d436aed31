"""Allocation quality through the scheduler's DRA allocator, beside the device plugin's.

Run: ``.venv/bin/python bench/quality_dra.py`` (``--events N``, ``--seed S``, ``--markdown``,
``--machines a,b``, ``--oracle-singles``, ``--lag-probability P``).

The scheduler's allocator is ``tests/testbed/dra_allocator_model.py``, a model of Kubernetes 1.36's
``k8s.io/dynamic-resource-allocation/structured`` (the ``incubating`` allocator, v0.36.2),
documented against that code; nothing built from Kubernetes can run here. The busy-node trace
and the scoring are ``bench/quality.py``'s (``trace()``, ``replay()``): pods of 1, 2, 4 and 8
GPUs arrive and leave; a pod that does not fit in the free GPUs is turned away. Each pod is a
ResourceClaim allocated by the model over the agent's ``resource.k8s.io/v1`` slices, with
the devices of the pods still running as the allocated state (their single GPUs: a set's
counters are its members', so this is the same state for the counters). Paths:

* ``device-plugin``: the agent's request path (``quality.Ours``) (``quality.py``'s "ours");
* ``DRA sets``: the slices the agent publishes (counters, single GPUs, GPU sets); a pod of k
  >= 2 GPUs is a prioritized list ``[one gpuset device with gpuCount == k -> k single GPUs]``
  (``fallback`` counts the claims that got singles), a pod of one GPU one single GPU;
* ``DRA re-render lag L`` (L = 0, 1, 4): the claims of ``DRA sets``, but the slices are
  the publisher's (``tests/testbed/dra_publishers.py``; default: the agent's ``render_slices`` for
  the devices the agent's prepared claims hold) re-rendered after every prepare and
  unprepare, as the agent does, but the agent has not yet prepared the last L claims
  allocated (the kubelet prepares after the pod is bound): they are allocated in the
  scheduler's state (their real devices, sets or singles) and unknown to the rendering. A set
  that must go (a GPU of it held through another device) is published tainted for one
  rendering and dropped at the next (the grace, at least G, modelled as "at the next rendering
  after the taint"; ``--withdrawal at-once``: dropped at once, the rule without the grace). A
  double allocation would stop the run (``replay`` checks every choice against the free GPUs);
  ``tests/test_dra_safety.py`` explores the orders this replay does not;
* ``DRA set alone lag L``: the same re-rendering, but a pod of k >= 2 GPUs is one device of the
  ``set-of-k`` class alone (``daemonset/dra/examples``' ``best-set-of-4``; ``fallback`` counts
  the claims that waited). Where the scheduler's view has no free set of k, the pod waits,
  unschedulable, until a ResourceSlice update requeues it (the DynamicResources plugin registers
  slice adds and updates); by then the kubelet has prepared the claims allocated before it, so
  the agent renders for all of them and the pod is allocated from that rendering (the agent
  publishes a free set of every size of ``set_sizes`` wherever that many GPUs are free, so it
  then fits: a miss stops the run). The claims after it count their lag from there;
* ``DRA sets+island``: the same slices, the list ``[set -> k singles with matchAttribute
  nvlinkIsland -> k singles]`` where the size fits the largest NVLink island (``fallback``:
  claims that got singles, on one island or not). Allocated as upstream's fix
  (kubernetes#140431) would: in v0.36.2 a single rejected by the island constraint keeps its
  counter reserved for the rest of that search (kubernetes#140436, the model's
  ``leak_rejected_counters``), so the last tier can miss GPUs that are free; the verdicts
  count the claims v0.36.2 would leave unschedulable;
* ``DRA singles``: the single GPUs only (``render_slices(..., with_sets=False)``), claims of k
  single GPUs without constraints (first fit in the agent's device order);
* ``DRA island``: the same single GPUs, a pod whose size fits the largest NVLink island a
  prioritized list ``[k singles with matchAttribute nvlinkIsland -> k singles]``
  (``fallback``: the constrained claims that got the unconstrained singles);
* ``naive slice``: the same GPUs in index order without topology attributes.

``--lag-probability P``: the lag-L paths lag by L claims only before a claim drawn with
probability P (seeded from ``--seed`` and the claim's number, so both claim shapes lag before
the same claims), and by none before the others: how the gaps under lag
scale with how often a node is given a claim within one allocation-to-prepare window of the
claims before it (the default, 1, is every claim).

``--oracle-singles`` (a diagnostic, not a path anyone can run): on the re-rendering paths a
one-GPU claim gets the device plugin's choice on the GPUs free in the scheduler's state,
where it would get the first free single of a rendering that may lag. What the gaps under lag
shrink by is what first fit over the single GPUs costs them: the agent renders the singles
for what it knows, and a claim it has not heard of (a set, most often) can move the device
plugin's choice for one GPU to a GPU after the first free single.

Measures, over multi-GPU pods (as ``quality.py``): share entirely on NVLink (every pair
linked), share on one NUMA node, mean set score / best possible score for that size. For
``DRA sets`` and the re-rendering paths also what the order and the pruning cost: on each set claim the device
plugin's choice for the same free GPUs is computed; ``pruned`` counts the claims where that
choice is no published set (and the mean score lost on them, points of the best score),
``below`` the claims that landed on a lower-scoring set than it for any reason. On the
set-alone paths under lag, the one-GPU claims too: how many got the device plugin's choice,
and how many of the others got the rendering's first single GPU (:func:`singles_table`). Per
machine, what is published: slices, devices (single GPUs + sets) and the time to render them.

Machines: every built-in machine with two or more GPUs (``a100-mig`` with MIG off: full GPUs,
as ``quality.py`` sees it) and synthetic 16, 32 and 64-GPU nodes (NVSwitch islands of 8 on two
NUMA nodes, ``synthetic_islands_topology``). The occupancy-ordered paths of earlier versions
(re-publishing the device order from the GPUs in use) were measured worse than the static
order (docs/benchmarks/dra-scheduler.md) and were removed; the re-rendering paths are back to measure the
agent's re-rendering at prepare (issue 25). Goal (issue 25): within 0.5 points of the device
plugin's world on both shares, and mean set score >= 0.995x its world's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402
from tables import print_table  # noqa: E402

from agent.dra.gpusets import island_ids  # noqa: E402
from agent.dra.slices import PCIE_ROOT_ATTRIBUTE, render_slices  # noqa: E402
from agent.dra.yaml_stream import dump_yaml  # noqa: E402
from agent.topology.allocator import AllocationEngine  # noqa: E402
from agent.topology.model import Topology  # noqa: E402
from tests.testbed.allocation_support import best_set, synthetic_islands_topology  # noqa: E402
from tests.testbed.dra_allocator_model import AllocatorModel  # noqa: E402
from tests.testbed.dra_publishers import (  # noqa: E402
    Publisher,
    agent_publisher,
    device_names,
    load_publisher,
    set_names,
    withdrawing,
)
from tests.testbed.dra_shipped_classes import CEL as SHIPPED_CEL  # noqa: E402
from tests.testbed.dra_shipped_classes import CLASSES as SHIPPED_CLASSES  # noqa: E402
from tests.testbed.dra_shipped_classes import count_expr, set_alone  # noqa: E402
from tests.testbed.dra_views import stands_for  # noqa: E402

DRIVER = "gpu.gpu-agent.io"
NODE = "node-1"
LAGS = (0, 1, 4)
RERENDER = tuple(f"DRA re-render lag {lag}" for lag in LAGS)
SET_ALONE = tuple(f"DRA set alone lag {lag}" for lag in LAGS)
PATHS = ("device-plugin", "DRA sets", *RERENDER, *SET_ALONE, "DRA sets+island", "DRA singles", "DRA island",
         "naive slice")
SET_PATHS = ("DRA sets", *RERENDER, *SET_ALONE, "DRA sets+island")
PRIORITIZED = (*SET_PATHS, "DRA island")
#: the paths whose slices are re-rendered as the agent does (the others keep the first rendering)
RENDERED = (*RERENDER, *SET_ALONE)
TOPOLOGY_ATTRIBUTES = ("numaNode", "nvlinkIsland", "nvlinkClique")
CLASSES, CEL = SHIPPED_CLASSES, SHIPPED_CEL  # daemonset/dra/deviceclass.yaml, as predicates


# ----------------------------------------------------------------------- claims
def claim(name: str, requests: list[dict[str, Any]], constraints: list[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": requests, "constraints": list(constraints)}}}


def singles(k: int) -> dict[str, Any]:
    return {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": k}}


def set_or_singles(k: int) -> dict[str, Any]:
    return {"name": "gpus", "firstAvailable": [
        {"name": "set", "deviceClassName": f"gpuset.{DRIVER}", "allocationMode": "ExactCount", "count": 1,
         "selectors": [{"cel": {"expression": count_expr(k)}}]},
        {"name": "singles", "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": k}]}


def island_or_singles(k: int, gpu_set: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``[k singles on one NVLink island -> k singles]``, after one set of k when ``gpu_set``."""
    sub = {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": k}
    first = set_or_singles(k)["firstAvailable"][:1] if gpu_set else []
    return ({"name": "gpus", "firstAvailable": [*first, {"name": "island", **sub}, {"name": "singles", **sub}]},
            [{"requests": ["gpus/island"], "matchAttribute": f"{DRIVER}/nvlinkIsland"}])


def naive_slices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``slices`` (single GPUs only) with devices in index order and no topology attributes."""
    out = []
    for s in slices:
        s = {**s, "spec": {**s["spec"], "devices": [dict(d) for d in s["spec"]["devices"]]}}
        drop = {f"{DRIVER}/{a}" for a in TOPOLOGY_ATTRIBUTES} | {PCIE_ROOT_ATTRIBUTE, "resource.kubernetes.io/numaNode"}
        for d in s["spec"]["devices"]:
            d["attributes"] = {k: v for k, v in d["attributes"].items() if k not in drop}
        s["spec"]["devices"].sort(key=lambda d: d["attributes"][f"{DRIVER}/index"]["int"])
        out.append(s)
    return out


# ----------------------------------------------------------------------- policies
def members(slices: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Device name -> the GPU indices it holds (``tests/testbed/dra_views.py``'s ``stands_for``: a
    single's index, a set's members as its name says)."""
    return {d["name"]: tuple(sorted(stands_for(d["name"]))) for s in slices for d in s["spec"].get("devices", [])
            if stands_for(d["name"])}


class DraPolicy:
    """A ``quality.replay()`` policy whose choice is the allocator model's over one pool.
    With a ``publisher`` the agent re-renders before every claim from what it knows (the
    devices of the running claims it has prepared: all but the last ``lag`` allocated, whose
    pods are not bound and prepared yet) and what it published last, and the scheduler sees
    that rendering; its allocated state is always current (every running claim's devices, sets
    or singles, as allocated). A claim has left when its GPUs are free again."""

    def __init__(self, topo: Topology, slices: list[dict[str, Any]], path: str,
                 publisher: Publisher | None = None, lag: int = 0, grace: bool = True,
                 oracle_singles: bool = False, lag_probability: float = 1.0, seed: int = 0) -> None:
        self.topo, self.path, self.publisher, self.lag, self.grace = topo, path, publisher, lag, grace
        self.lag_probability, self.seed = lag_probability, seed
        self.oracle_singles = oracle_singles and publisher is not None
        self.renderings: list[list[dict[str, Any]]] = [slices]
        self.seen = slices
        self.running: list[tuple[tuple[str, ...], tuple[int, ...], int]] = []  # devices, GPUs, number per claim
        self.model = AllocatorModel(slices, CLASSES, CEL, leak_rejected_counters=path != "DRA sets+island")
        self.leaky = AllocatorModel(slices, CLASSES, CEL)  # v0.36.2: counters of rejected devices stay reserved
        self.leak_unschedulable = 0
        self.members = members(slices)
        self.largest_island = max(collections_count(island_ids(topo).values()))
        self.engine = AllocationEngine(topo)
        self.n = self.claims = self.fallbacks = self.pruned = self.below = self.matched = 0
        self.single_claims = self.single_matched = self.single_lead_missed = 0
        self.known_through = 0  # claims up to this number are prepared whatever the lag (a pod waited)
        self.set_devices: list[int] = []  # set devices in each rendering the scheduler saw
        # ... and in the same rendering with nothing published before (no kept or tainted sets:
        # what bench_dra_scheduler.py's node states publish)
        self.fresh_set_devices: list[int] = []
        self.pruned_loss: list[float] = []

    def _republish(self, free: list[int]) -> None:
        """Re-render for the claims the agent knows (all running claims but the last ``lag``
        allocated) and what it published last; the scheduler's model over that rendering,
        with every running claim's devices allocated."""
        self.running = [c for c in self.running if not set(c[1]) & set(free)]
        if self.publisher is None:
            self.model.allocated = {(DRIVER, NODE, f"gpu-{i}") for i in range(self.topo.gpu_count) if i not in free}
            return
        # drawn per claim number: both claim shapes lag before the same claims
        draw = random.Random(f"{self.seed}/{self.lag}/{self.n}").random() if self.lag_probability < 1 else 0.0
        lag = self.lag if draw < self.lag_probability else 0
        known = [c for c in self.running if c[2] <= max(self.n - lag, self.known_through)]  # self.n: claims so far
        held = {name: self.members[name] for devices, _, _ in known for name in devices}
        # the withdrawal grace (at least G) modelled as "at the next rendering after the taint"
        last = self.renderings[-1]
        rendered = self.publisher(self.topo, NODE, held, device_names(last), "1.37",
                                  expired=withdrawing(last) if self.grace else None,
                                  **({"tainted": withdrawing(last)} if self.grace else {}))
        self.renderings.append(rendered)
        self.members.update(members(rendered))
        self.model, self.seen = AllocatorModel(rendered, CLASSES, CEL), rendered
        self.set_devices.append(len(set_names(rendered)))
        self.fresh_set_devices.append(len(set_names(self.publisher(self.topo, NODE, held, (), "1.37"))))
        self.model.allocated = {(DRIVER, NODE, name) for devices, _, _ in self.running for name in devices}

    def best_set(self, free: list[int], must: list[int], k: int) -> list[int]:
        self._republish(free)
        self.n += 1
        if k == 1 and self.oracle_singles:  # --oracle-singles: the device plugin's choice
            (gpu,) = best_set(self.engine, free, [], 1)
            self.running.append(((f"gpu-{gpu}",), (gpu,), self.n))
            return [gpu]
        constraints: list[dict[str, Any]] = []
        if self.path in SET_ALONE and k > 1:
            request = set_alone(k)
        elif (self.path == "DRA sets" or self.path in RERENDER) and k > 1:
            request = set_or_singles(k)
        elif self.path in ("DRA island", "DRA sets+island") and 1 < k <= self.largest_island:
            request, constraints = island_or_singles(k, gpu_set=self.path == "DRA sets+island")
        elif self.path == "DRA sets+island" and k > 1:
            request = set_or_singles(k)
        else:
            request = singles(k)
        got = self.model.allocate([claim(f"c{self.n}", [request], constraints)], NODE)
        if self.model.leak != self.leaky.leak:
            self.leaky.allocated = self.model.allocated
            self.leak_unschedulable += self.leaky.allocate([claim(f"c{self.n}", [request], constraints)], NODE) is None
        if got is None and self.path in SET_ALONE:
            # No free set in the scheduler's view (claims it allocated took them, and the agent
            # has not heard of those yet). The pod stays unschedulable until a ResourceSlice
            # update requeues it (the DynamicResources plugin registers slice adds and updates);
            # by then the kubelet has prepared the claims allocated before it and the agent has
            # re-rendered for them. Counted in ``fallbacks`` for these paths.
            self.fallbacks += 1
            self.known_through = self.n - 1
            self._republish(free)
            got = self.model.allocate([claim(f"c{self.n}", [request], constraints)], NODE)
        if got is None:
            raise RuntimeError(f"{self.path}: {k} of {len(free)} free GPUs unschedulable")
        (result,) = got
        gpus = sorted(g for _, (_, _, name) in result for g in self.members[name])
        if k == 1 and self.publisher is not None:
            self._single_against_device_plugin(free, gpus[0])
        self.running.append((tuple(name for _, (_, _, name) in result), tuple(gpus), self.n))
        if k > 1 and self.path in PRIORITIZED and (self.path != "DRA island" or constraints):
            self.claims += 1
            self.fallbacks += self.path not in SET_ALONE and result[0][0] != "gpus/set" and (self.path != "DRA island" or result[0][0] != "gpus/island")
        if k > 1 and self.path in SET_PATHS:
            self._against_device_plugin(free, k, gpus)
        return gpus

    def _single_against_device_plugin(self, free: list[int], gpu: int) -> None:
        """A one-GPU claim: did it get the device plugin's choice, and if not, was what it got
        the first single GPU of the rendering (free in the scheduler's state, so no order that
        keeps the lag-0 answer first could have given it another)?"""
        self.single_claims += 1
        if [gpu] == best_set(self.engine, free, [], 1):
            self.single_matched += 1
            return
        lead = next((stands_for(d["name"]) for s in self.seen for d in s["spec"].get("devices", ())
                     if d["name"].startswith("gpu-") and stands_for(d["name"]) and not d.get("taints")), frozenset())
        self.single_lead_missed += lead == {gpu}

    def _against_device_plugin(self, free: list[int], k: int, gpus: list[int]) -> None:
        dp = best_set(self.engine, free, [], k)
        best = self.engine.best_score_for_size(k) or 1
        loss = (self.topo.set_score(dp) - self.topo.set_score(gpus)) / best
        self.below += loss > 0
        self.matched += sorted(dp) == sorted(gpus)
        names = {d["name"] for s in self.seen for d in s["spec"].get("devices", ()) if d["name"].startswith("gpuset-")}
        if tuple(dp) not in {tuple(self.members[n]) for n in names}:  # the sets the scheduler saw
            self.pruned += 1
            self.pruned_loss.append(max(loss, 0.0))


def collections_count(values: Any) -> list[int]:
    counts: dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return list(counts.values())


# ----------------------------------------------------------------------- machines
def dra_machines(names: list[str] | None = None) -> list[tuple[str, Topology]]:
    from agent.discovery import load_topology
    from agent.hw.sim.machines import BUILTIN_MACHINES

    out = []
    for name in BUILTIN_MACHINES:
        topo = load_topology(name)
        if topo.gpu_count < 2:
            continue
        if any(g.mig_enabled for g in topo.gpus):  # full GPUs, as quality.py sees the node
            gpus = tuple(dataclasses.replace(g, mig_enabled=False, mig_devices=()) for g in topo.gpus)
            topo = dataclasses.replace(topo, gpus=gpus)
        out.append((name, topo))
    out += [(f"synthetic-{8 * i}", synthetic_islands_topology(i, 8)) for i in (2, 4, 8)]
    return [(n, t) for n, t in out if not names or n in names]


def published(topo: Topology) -> dict[str, Any]:
    """What the agent publishes for ``topo`` in v1, and how long rendering it takes."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        objs = render_slices(topo, node_name=NODE)
        times.append(time.perf_counter() - t0)
    devices = [d for o in objs for d in o["spec"].get("devices", [])]
    sets = sum(1 for d in devices if d["name"].startswith("gpuset-"))
    return {"slices": len(objs), "singles": len(devices) - sets, "sets": sets,
            "render_ms": 1000 * statistics.median(times), "yaml_kib": len(dump_yaml(objs)) / 1024}


def measure(topo: Topology, events: list[tuple[str, int]], publisher: Publisher,
            grace: bool = True, oracle_singles: bool = False, lag_probability: float = 1.0,
            seed: int = 0) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {"device-plugin": dict(quality.replay(topo, quality.Ours(topo), events))}
    full = render_slices(topo, node_name=NODE)
    plain = render_slices(topo, node_name=NODE, with_sets=False)
    for path, slices in (("DRA sets", full), *((p, full) for p in RENDERED), ("DRA sets+island", full),
                         ("DRA singles", plain), ("DRA island", plain), ("naive slice", naive_slices(plain))):
        lag = LAGS[(RERENDER if path in RERENDER else SET_ALONE).index(path)] if path in RENDERED else 0
        policy = DraPolicy(topo, slices, path, publisher if path in RENDERED else None, lag, grace,
                           oracle_singles, lag_probability, seed)
        r: dict[str, Any] = dict(quality.replay(topo, policy, events))
        r.update(claims=policy.claims, fallbacks=policy.fallbacks, pruned=policy.pruned, below=policy.below,
                 matched=policy.matched, set_devices=policy.set_devices, fresh_set_devices=policy.fresh_set_devices,
                 leak_unschedulable=policy.leak_unschedulable, single_claims=policy.single_claims,
                 single_matched=policy.single_matched, single_lead_missed=policy.single_lead_missed,
                 pruned_loss=statistics.mean(policy.pruned_loss) if policy.pruned_loss else 0.0)
        rows[path] = r
    return rows


KEYS = (("nvlink_share", "NVLink"), ("numa_share", "1 NUMA"), ("score_ratio", "score"))


def gaps(rows: dict[str, dict[str, Any]], path: str) -> tuple[bool, str]:
    """Whether ``path`` is within the goal of the device plugin's world (0.5 points on the
    shares, score >= 0.995x), and the gaps in words."""
    dp, got = rows["device-plugin"], rows[path]
    points = {label: 100 * (got[k] - dp[k]) for k, label in KEYS[:2] if got[k] is not None}
    score = got["score_ratio"] / dp["score_ratio"] if dp["score_ratio"] else 1.0
    ok = min(points.values(), default=0.0) >= -0.5 - 1e-9 and score >= 0.995 - 1e-9
    return ok, ", ".join(f"{label} {gap:+.1f}" for label, gap in points.items()) + f", score {score:.3f}x"


def verdict(name: str, rows: dict[str, dict[str, Any]]) -> str:
    sets = rows["DRA sets"]
    lines = []
    for path in ("DRA sets", *RENDERED):
        ok, words = gaps(rows, path)
        lines.append(f"{path} {'within' if ok else 'OUTSIDE'} ({words})")
    return (f"{name}: vs device-plugin: " + "; ".join(lines)
            + f"; static set claims {sets['claims']}: fell back {sets['fallbacks']}, device plugin's choice pruned "
            f"{sets['pruned']} (mean loss {100 * sets['pruned_loss']:.1f} points), below its score {sets['below']}"
            f"; [set -> island -> singles] unschedulable in v0.36.2 (counter leak): "
            f"{rows['DRA sets+island']['leak_unschedulable']}/{rows['DRA sets+island']['claims']}")


def first_fit_table(results: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, ...]]:
    """Per machine, claim shape and lag: of the set claims, how many got exactly the device
    plugin's choice for the free GPUs (``dp``), landed below its score, fell back to singles (the
    set alone: waited for the re-render); and the set devices
    of each rendering the scheduler saw (mean, max: what the scheduler pays for on every Filter),
    and the mean of the same renderings with nothing published before (no kept or tainted sets)."""
    out = [("machine", "claims", *(f"lag {lag}: dp / below / fallback (waited) of claims; sets mean (max); fresh"
                                   for lag in LAGS))]
    for (name, rows), kind in itertools.product(results.items(), (RERENDER, SET_ALONE)):
        cells = ["[set -> singles]" if kind == RERENDER else "set alone"]
        for path in kind:
            r = rows[path]
            n, fresh = r["set_devices"] or [0], r["fresh_set_devices"] or [0]
            cells.append(f"{r['matched']} / {r['below']} / {r['fallbacks']} of {r['claims']}; "
                         f"{statistics.mean(n):.1f} ({max(n)}); {statistics.mean(fresh):.1f}")
        out.append((name, *cells))
    return out


def singles_table(results: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, ...]]:
    """Per machine and lag (the set-alone paths): of the one-GPU claims, how many got the
    device plugin's choice for the free GPUs, and of those that did not, how many got the
    rendering's first single GPU (free in the scheduler's state: a claim the agent has not
    heard of moved the device plugin's choice, and first fit over any order that keeps the
    lag-0 answer first takes the same GPU)."""
    out = [("machine", *(f"lag {lag}: one-GPU claims dp / of; missed on the first single" for lag in LAGS[1:]))]
    for name, rows in results.items():
        out.append((name, *(f"{rows[p]['single_matched']} / {rows[p]['single_claims']}; "
                            f"{rows[p]['single_lead_missed']} of {rows[p]['single_claims'] - rows[p]['single_matched']}"
                            for p in SET_ALONE[1:])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=600)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--machines", default="", help="comma-separated machine names (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--publisher", default="", help="MODULE:FUNCTION for the re-rendering paths "
                        "(tests/testbed/dra_publishers.py; default: the agent's render_slices for the GPUs in use)")
    parser.add_argument("--withdrawal", choices=("grace", "at-once"), default="grace",
                        help="a due set: tainted, dropped at the next rendering (grace: the agent's default,"
                             " at least G modelled as one rendering) or dropped at once (grace 0)")
    parser.add_argument("--oracle-singles", action="store_true",
                        help="diagnostic: on the re-rendering paths a one-GPU claim gets the device plugin's"
                             " choice instead of the first free single (what first fit over the singles costs)")
    parser.add_argument("--lag-probability", type=float, default=1.0, metavar="P",
                        help="the lag-L paths lag by L claims only before a claim drawn with probability P"
                             " (seeded), else by none (default 1: every claim)")
    args = parser.parse_args(argv)
    if not 0 <= args.lag_probability <= 1:
        parser.error(f"--lag-probability {args.lag_probability}: expected a probability from 0 to 1")
    publisher = load_publisher(args.publisher) if args.publisher else agent_publisher()
    machines = dra_machines([m for m in args.machines.split(",") if m])
    start = time.monotonic()
    results = {name: measure(topo, quality.trace(topo.gpu_count, args.events, args.seed), publisher,
                             args.withdrawal == "grace", args.oracle_singles, args.lag_probability, args.seed)
               for name, topo in machines}
    seconds = time.monotonic() - start
    head = ("machine", "path", "pods", "NVLink-complete", "single NUMA", "score / best", "fallback")
    table = [head]
    for name, rows in results.items():
        for path in PATHS:
            r = rows[path]
            fb = f"{r['fallbacks']}/{r['claims']}" if path in PRIORITIZED else ""
            table.append((name, path, str(r["pods"]), quality.pct(r["nvlink_share"]).strip(),
                          quality.pct(r["numa_share"]).strip(), quality.pct(r["score_ratio"]).strip(), fb))
    print_table(table, args.markdown, 2)
    print()
    pub = [("machine", "GPUs", "slices", "single devices", "set devices", "render ms", "YAML KiB")]
    for name, topo in machines:
        p = published(topo)
        pub.append((name, str(topo.gpu_count), str(p["slices"]), str(p["singles"]), str(p["sets"]),
                    f"{p['render_ms']:.1f}", f"{p['yaml_kib']:.0f}"))
    print_table(pub, args.markdown, 2)
    print()
    goal = [("machine", *(f"{p.removeprefix('DRA ')}: NVLink / 1 NUMA / score" for p in ("DRA sets", *RENDERED)))]
    for name, rows in results.items():
        goal.append((name, *(("" if gaps(rows, p)[0] else "OUT ") + gaps(rows, p)[1].replace("NVLink ", "")
                             .replace("1 NUMA ", "").replace("score ", "").replace(", ", " / ")
                             for p in ("DRA sets", *RENDERED))))
    print_table(goal, args.markdown, 2)
    print()
    print_table(first_fit_table(results), args.markdown, 2)
    print()
    print_table(singles_table(results), args.markdown, 2)
    oracle = ", one-GPU claims: the device plugin's choice (--oracle-singles)" if args.oracle_singles else ""
    oracle += f", lag before {args.lag_probability:.0%} of the claims" if args.lag_probability < 1 else ""
    print(f"\n== goals (seed {args.seed}, {args.events} events, {seconds:.0f} s{oracle}) ==")
    print("\n".join(verdict(name, rows) for name, rows in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
