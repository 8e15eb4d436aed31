"""Allocation quality through the scheduler's DRA allocator, beside the device plugin's.

Run: ``.venv/bin/python bench/quality_dra.py`` (``--events N``, ``--seed S``, ``--markdown``,
``--machines a,b``).

The scheduler's allocator is ``tests/dra_allocator_model.py``, a model of Kubernetes 1.36's
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

Measures, over multi-GPU pods (as ``quality.py``): share entirely on NVLink (every pair
linked), share on one NUMA node, mean set score / best possible score for that size. For
``DRA sets`` also what the static order and the pruning cost: on each set claim the device
plugin's choice for the same free GPUs is computed; ``pruned`` counts the claims where that
choice is no published set (and the mean score lost on them, points of the best score),
``below`` the claims that landed on a lower-scoring set than it for any reason. Per machine,
what is published: slices, devices (single GPUs + sets) and the time to render them.

Machines: every built-in machine with two or more GPUs (``a100-mig`` with MIG off: full GPUs,
as ``quality.py`` sees it) and synthetic 16, 32 and 64-GPU nodes (NVSwitch islands of 8 on two
NUMA nodes, ``synthetic_islands_topology``). The occupancy-ordered paths of earlier versions
(re-publishing the device order from the GPUs in use) were measured worse than the static
order (bench/README.md) and are gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # the allocator model, beside the other stand-ins

import quality  # noqa: E402
from allocation_support import best_set, synthetic_islands_topology  # noqa: E402
from dra_allocator_model import AllocatorModel  # noqa: E402

from agent.dra.gpusets import island_ids  # noqa: E402
from agent.dra.slices import PCIE_ROOT_ATTRIBUTE, dump_yaml, render_slices  # noqa: E402
from agent.topology.allocator import AllocationEngine  # noqa: E402
from agent.topology.model import Topology  # noqa: E402

DRIVER = "gpu.gpu-agent.io"
NODE = "node-1"
PATHS = ("device-plugin", "DRA sets", "DRA sets+island", "DRA singles", "DRA island", "naive slice")
PRIORITIZED = ("DRA sets", "DRA sets+island", "DRA island")
TOPOLOGY_ATTRIBUTES = ("numaNode", "nvlinkIsland", "nvlinkClique")
GPU_EXPR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
SET_EXPR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpuset"'
CLASSES = [
    {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
     "spec": {"selectors": [{"cel": {"expression": expr}}]}}
    for name, expr in ((DRIVER, GPU_EXPR), (f"gpuset.{DRIVER}", SET_EXPR))
]


def count_expr(k: int) -> str:
    return f'device.attributes["{DRIVER}"].gpuCount == {k}'


CEL = {
    GPU_EXPR: lambda d: d.driver == DRIVER and d.attributes[DRIVER]["type"] == "gpu",
    SET_EXPR: lambda d: d.driver == DRIVER and d.attributes[DRIVER]["type"] == "gpuset",
    **{count_expr(k): (lambda d, k=k: d.attributes[DRIVER]["gpuCount"] == k) for k in range(2, 65)},
}


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
class DraPolicy:
    """A ``quality.replay()`` policy whose choice is the allocator model's over one pool."""

    def __init__(self, topo: Topology, slices: list[dict[str, Any]], path: str) -> None:
        self.topo, self.path = topo, path
        self.model = AllocatorModel(slices, CLASSES, CEL, leak_rejected_counters=path != "DRA sets+island")
        self.leaky = AllocatorModel(slices, CLASSES, CEL)  # v0.36.2: counters of rejected devices stay reserved
        self.leak_unschedulable = 0
        self.members: dict[str, tuple[int, ...]] = {}
        for s in slices:
            for d in s["spec"].get("devices", []):
                a = d["attributes"]
                self.members[d["name"]] = (tuple(int(c[4:]) for u in d["consumesCounters"] for c in u["counters"])
                                           if a[f"{DRIVER}/type"]["string"] == "gpuset"
                                           else (a[f"{DRIVER}/index"]["int"],))
        self.sets: dict[int, set[tuple[int, ...]]] = {}  # the sets these slices publish, by size
        for name, members in self.members.items():
            if name.startswith("gpuset-"):
                self.sets.setdefault(len(members), set()).add(tuple(sorted(members)))
        self.largest_island = max(collections_count(island_ids(topo).values()))
        self.engine = AllocationEngine(topo)
        self.n = self.claims = self.fallbacks = self.pruned = self.below = 0
        self.pruned_loss: list[float] = []

    def best_set(self, free: list[int], must: list[int], k: int) -> list[int]:
        self.model.allocated = {(DRIVER, NODE, f"gpu-{i}") for i in range(self.topo.gpu_count) if i not in free}
        self.n += 1
        constraints: list[dict[str, Any]] = []
        if self.path == "DRA sets" and k > 1:
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
        if got is None:
            raise RuntimeError(f"{self.path}: {k} of {len(free)} free GPUs unschedulable")
        (result,) = got
        gpus = sorted(g for _, (_, _, name) in result for g in self.members[name])
        if k > 1 and self.path in PRIORITIZED and (self.path != "DRA island" or constraints):
            self.claims += 1
            self.fallbacks += result[0][0] != "gpus/set" and (self.path != "DRA island" or result[0][0] != "gpus/island")
        if k > 1 and self.path in ("DRA sets", "DRA sets+island"):
            self._against_device_plugin(free, k, gpus)
        return gpus

    def _against_device_plugin(self, free: list[int], k: int, gpus: list[int]) -> None:
        dp = best_set(self.engine, free, [], k)
        best = self.engine.best_score_for_size(k) or 1
        loss = (self.topo.set_score(dp) - self.topo.set_score(gpus)) / best
        self.below += loss > 0
        if tuple(dp) not in self.sets.get(k, ()):
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


def measure(topo: Topology, events: list[tuple[str, int]]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {"device-plugin": dict(quality.replay(topo, quality.Ours(topo), events))}
    full = render_slices(topo, node_name=NODE)
    plain = render_slices(topo, node_name=NODE, with_sets=False)
    for path, slices in (("DRA sets", full), ("DRA sets+island", full), ("DRA singles", plain),
                         ("DRA island", plain), ("naive slice", naive_slices(plain))):
        policy = DraPolicy(topo, slices, path)
        r: dict[str, Any] = dict(quality.replay(topo, policy, events))
        r.update(claims=policy.claims, fallbacks=policy.fallbacks, pruned=policy.pruned, below=policy.below,
                 leak_unschedulable=policy.leak_unschedulable,
                 pruned_loss=statistics.mean(policy.pruned_loss) if policy.pruned_loss else 0.0)
        rows[path] = r
    return rows


KEYS = (("nvlink_share", "NVLink"), ("numa_share", "1 NUMA"), ("score_ratio", "score"))


def verdict(name: str, rows: dict[str, dict[str, Any]]) -> str:
    dp, sets = rows["device-plugin"], rows["DRA sets"]
    gaps = {label: 100 * (sets[k] - dp[k]) for k, label in KEYS if sets[k] is not None}
    worst = min(gaps.values())
    within = "within 0.5 points of" if worst >= -0.5 - 1e-9 else "MORE than 0.5 points below"
    return (f"{name}: DRA sets {within} device-plugin ("
            + ", ".join(f"{label} {gap:+.1f}" for label, gap in gaps.items())
            + f"); set claims {sets['claims']}: fell back {sets['fallbacks']}, device plugin's choice pruned "
            f"{sets['pruned']} (mean loss {100 * sets['pruned_loss']:.1f} points), below its score {sets['below']}"
            f"; [set -> island -> singles] unschedulable in v0.36.2 (counter leak): "
            f"{rows['DRA sets+island']['leak_unschedulable']}/{rows['DRA sets+island']['claims']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=600)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--machines", default="", help="comma-separated machine names (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args(argv)
    machines = dra_machines([m for m in args.machines.split(",") if m])
    start = time.monotonic()
    results = {name: measure(topo, quality.trace(topo.gpu_count, args.events, args.seed)) for name, topo in machines}
    seconds = time.monotonic() - start
    head = ("machine", "path", "pods", "NVLink-complete", "single NUMA", "score / best", "fallback")
    table = [head]
    for name, rows in results.items():
        for path in PATHS:
            r = rows[path]
            fb = f"{r['fallbacks']}/{r['claims']}" if path in PRIORITIZED else ""
            table.append((name, path, str(r["pods"]), quality.pct(r["nvlink_share"]).strip(),
                          quality.pct(r["numa_share"]).strip(), quality.pct(r["score_ratio"]).strip(), fb))
    print_table(table, args.markdown)
    print()
    pub = [("machine", "GPUs", "slices", "single devices", "set devices", "render ms", "YAML KiB")]
    for name, topo in machines:
        p = published(topo)
        pub.append((name, str(topo.gpu_count), str(p["slices"]), str(p["singles"]), str(p["sets"]),
                    f"{p['render_ms']:.1f}", f"{p['yaml_kib']:.0f}"))
    print_table(pub, args.markdown)
    print(f"\n== goals (seed {args.seed}, {args.events} events, {seconds:.0f} s) ==")
    print("\n".join(verdict(name, rows) for name, rows in results.items()))
    return 0


def print_table(rows: list[tuple[str, ...]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "|".join("---" if i < 2 else "---:" for i in range(len(rows[0]))) + "|")
        for r in rows[1:]:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    sys.exit(main())
