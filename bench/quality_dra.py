"""Allocation quality through the scheduler's own DRA allocator, beside the device plugin's.

Run: ``.venv/bin/python bench/quality_dra.py`` (``--events N``, ``--seed S``, ``--markdown``;
needs ``../shared/tools/k8s-v1.32/draalloc``, see ``../shared/tools/README.md``).

The busy-node trace and the scoring are ``bench/quality.py``'s (``trace()``, ``replay()``):
pods of 1, 2, 4 and 8 GPUs arrive and leave; a pod that does not fit in the free GPUs is
turned away. Here each pod is a ResourceClaim that ``draalloc`` (Kubernetes v1.32's
``k8s.io/dynamic-resource-allocation/structured``, the allocator kube-scheduler runs)
allocates over the agent's ResourceSlices (``render_slices(..., api_version="v1beta1")``),
with the GPUs held by the pods still running passed as ``--allocated``. Paths per machine:

* ``device-plugin``: the device plugin's answer (what quality.py calls "ours");
* ``DRA (a)``: claims without constraints over the agent's slices (the allocator walks the
  agent's device order, first fit);
* ``DRA (b)``: claims with ``matchAttribute: <driver>/nvlinkIsland`` where the size fits
  the node's largest NVLink island (larger pods: no constraint). When the constrained claim
  is unschedulable although enough GPUs are free, the pod is claimed again without the
  constraint (as a ``firstAvailable`` fallback would; counted in the ``fallback`` column),
  so every path sees the same pods;
* ``naive slice``: the same GPUs in index order without topology attributes (``numaNode``,
  ``nvlinkIsland``, ``nvlinkClique``, ``pcieRoot``), claims without constraints;
* ``DRA (a) occ`` and ``DRA (b) occ``: (a) and (b) over the slices an agent would publish
  if it re-published after every NodePrepareResources / NodeUnprepareResources with the
  device order following occupancy (``render_slices(..., in_use=...)``, the GPUs held by
  prepared claims: groups with fewest free GPUs first). Emulated as the agent would do it:
  before each claim the slices are rendered again from the GPUs of the pods still running
  (what the agent's checkpoint holds). This assumes the scheduler has seen the re-published
  slice before it allocates the next claim (in a cluster it may still use the previous
  order). Measured worse than the static order (bench/README.md), so the agent does not.

Measures, over multi-GPU pods (as quality.py): share entirely on NVLink (every pair
linked), share on one NUMA node, mean set score / best possible score for that size.
``a100-mig`` is measured with MIG off (full GPUs, as quality.py sees it); ``single-gpu`` has
nothing to compare.

Speed: every (machine, path) replays in a thread of its own; each arrival submits one claim
and the main thread allocates all pending claims of all replays in one ``draalloc`` run
(each replay has its own driver name, so its claims see only its own devices and
``--allocated`` list). About one ``draalloc`` run per arrival of the trace, not per path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402

from agent.dra.slices import PCIE_ROOT_ATTRIBUTE, dump_yaml, island_ids, render_slices  # noqa: E402
from agent.topology.model import Topology  # noqa: E402

DRAALLOC = ROOT.parent / "shared" / "tools" / "k8s-v1.32" / "draalloc"
NODE = "node-1"
GROUP = "resource.k8s.io/v1beta1"
TOPOLOGY_ATTRIBUTES = ("numaNode", "nvlinkIsland", "nvlinkClique")
PATHS = ("device-plugin", "DRA (a)", "DRA (b)", "naive slice", "DRA (a) occ", "DRA (b) occ")
OCCUPANCY_PATHS = ("DRA (a) occ", "DRA (b) occ")
ISLAND_PATHS = ("DRA (b)", "DRA (b) occ")


# ----------------------------------------------------------------------- objects
def naive_slices(slices: list[dict[str, Any]], driver: str) -> list[dict[str, Any]]:
    """``slices`` with devices in index order and no topology attributes."""
    out = []
    for s in slices:
        s = json.loads(json.dumps(s))
        drop = {f"{driver}/{a}" for a in TOPOLOGY_ATTRIBUTES} | {PCIE_ROOT_ATTRIBUTE}
        for d in s["spec"]["devices"]:
            attrs = d["basic"]["attributes"]
            for key in drop & set(attrs):
                del attrs[key]
        s["spec"]["devices"].sort(key=lambda d: d["basic"]["attributes"][f"{driver}/index"]["int"])
        out.append(s)
    return out


def device_class(driver: str) -> dict[str, Any]:
    return {
        "apiVersion": GROUP, "kind": "DeviceClass", "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": (
            f'device.driver == "{driver}" && device.attributes["{driver}"].type == "gpu"')}}]},
    }


def claim(driver: str, name: str, count: int, island: bool) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{
        "name": "gpus", "deviceClassName": driver, "allocationMode": "ExactCount", "count": count}]}
    if island:
        devices["constraints"] = [{"requests": ["gpus"], "matchAttribute": f"{driver}/nvlinkIsland"}]
    return {"apiVersion": GROUP, "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": devices}}


# ----------------------------------------------------------------------- batching
class Batcher:
    """Collects one pending claim per replay thread; the main thread allocates them all in
    one ``draalloc`` run whenever every live replay is waiting."""

    def __init__(self, workdir: Path, slices: list[dict[str, Any]], classes: list[dict[str, Any]]):
        self.workdir = workdir
        self.slices: dict[str, list[dict[str, Any]]] = {}  # driver -> its slices now
        for s in slices:
            self.slices.setdefault(s["spec"]["driver"], []).append(s)
        (workdir / "classes.yaml").write_text(dump_yaml(classes))
        self.cond = threading.Condition()
        self.live = 0
        self.pending: dict[str, tuple[dict[str, Any], list[str]]] = {}  # claim name -> (claim, held)
        self.answers: dict[str, dict[str, Any]] = {}
        self.runs = 0
        self.failure: BaseException | None = None

    def allocate(self, obj: dict[str, Any], held: list[str],
                 slices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Blocks until the claim is allocated; draalloc's answer for it. ``slices``: the
        claim's driver publishes these now (the occupancy paths re-render them per claim)."""
        name = obj["metadata"]["name"]
        with self.cond:
            if slices is not None:
                self.slices[slices[0]["spec"]["driver"]] = slices
            self.pending[name] = (obj, held)
            self.cond.notify_all()
            while name not in self.answers:
                if self.failure is not None:
                    raise RuntimeError("draalloc failed") from self.failure
                self.cond.wait()
            return self.answers.pop(name)

    def run(self, jobs: list[Callable[[], None]]) -> None:
        def wrap(job: Callable[[], None]) -> None:
            try:
                job()
            except BaseException as e:  # reported by the main thread
                with self.cond:
                    self.failure = self.failure or e
            finally:
                with self.cond:
                    self.live -= 1
                    self.cond.notify_all()

        self.live = len(jobs)
        threads = [threading.Thread(target=wrap, args=(j,), daemon=True) for j in jobs]
        for t in threads:
            t.start()
        while True:
            with self.cond:
                while self.live and len(self.pending) < self.live and self.failure is None:
                    self.cond.wait()
                if self.failure is not None:
                    raise self.failure
                if not self.live:
                    break
                batch, self.pending = self.pending, {}
            answers = self._draalloc(batch)
            with self.cond:
                self.answers.update(answers)
                self.cond.notify_all()
        for t in threads:
            t.join()

    def _draalloc(self, batch: dict[str, tuple[dict[str, Any], list[str]]]) -> dict[str, dict[str, Any]]:
        self.runs += 1
        with self.cond:
            current = [s for objs in self.slices.values() for s in objs]
        (self.workdir / "slices.yaml").write_text(dump_yaml(current))
        claims = self.workdir / "claims.yaml"
        claims.write_text(dump_yaml(obj for obj, _ in batch.values()))
        held = [h for _, hs in batch.values() for h in hs]
        args = [str(DRAALLOC), "--slices", str(self.workdir / "slices.yaml"),
                "--classes", str(self.workdir / "classes.yaml"), "--claims", str(claims),
                "--node", NODE]
        if held:
            args += ["--allocated", ",".join(held)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"draalloc exited {proc.returncode}: {proc.stderr.strip()}")
        return {c["claim"].split("/", 1)[1]: c for c in json.loads(proc.stdout)["claims"]}


class DraPolicy:
    """A quality.replay() policy whose choice is draalloc's over one driver's slices."""

    def __init__(self, batcher: Batcher, driver: str, slices: list[dict[str, Any]],
                 island_limit: int, occupancy: Topology | None = None) -> None:
        self.batcher, self.driver, self.island_limit = batcher, driver, island_limit
        self.occupancy = occupancy  # re-render the slices from the GPUs in use before each claim
        self.index_of = {
            d["name"]: d["basic"]["attributes"][f"{driver}/index"]["int"]
            for s in slices for d in s["spec"]["devices"]
        }
        self.name_of = {i: n for n, i in self.index_of.items()}
        self.n = 0
        self.constrained = self.fallbacks = 0

    def best_set(self, free: list[int], must: list[int], k: int) -> list[int]:
        held = [f"{self.driver}/{NODE}/{self.name_of[i]}" for i in self.name_of if i not in free]
        slices = None
        if self.occupancy is not None:  # what the agent publishes after the last (un)prepare
            in_use = [i for i in self.name_of if i not in free]
            slices = render_slices(self.occupancy, node_name=NODE, driver=self.driver,
                                   api_version="v1beta1", in_use=in_use)
        island = 1 < k <= self.island_limit
        self.constrained += island
        answer = self._ask(k, island, held, slices)
        if not answer["allocated"] and island:
            self.fallbacks += 1
            answer = self._ask(k, False, held, slices)
        if not answer["allocated"]:
            raise RuntimeError(f"{self.driver}: {k} of {len(free)} free GPUs: {answer.get('error')}")
        return [self.index_of[d["device"]] for d in answer["devices"]]

    def _ask(self, k: int, island: bool, held: list[str],
             slices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        self.n += 1
        return self.batcher.allocate(claim(self.driver, f"{self.driver}-{self.n}", k, island), held, slices)


# ----------------------------------------------------------------------- machines
def dra_machines() -> list[tuple[str, Topology]]:
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
    return out


def measure(events_n: int, seed: int) -> tuple[dict[str, dict[str, dict[str, Any]]], int, float]:
    """machine -> path -> replay() result (plus ``fallbacks``/``constrained`` for (b))."""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    slices: list[dict[str, Any]] = []
    classes: list[dict[str, Any]] = []
    plans = []
    for m, (name, topo) in enumerate(dra_machines()):
        events = quality.trace(topo.gpu_count, events_n, seed)
        results[name] = {"device-plugin": dict(quality.replay(topo, quality.Ours(topo), events))}
        largest_island = max(list(island_ids(topo).values()).count(i) for i in set(island_ids(topo).values()))
        for p, path in enumerate(PATHS[1:]):
            driver = f"m{m}p{p}.bench.gpu-agent.io"
            objs = render_slices(topo, node_name=NODE, driver=driver, api_version="v1beta1")
            if path == "naive slice":
                objs = naive_slices(objs, driver)
            slices += objs
            classes.append(device_class(driver))
            limit = largest_island if path in ISLAND_PATHS else 0
            plans.append((name, path, topo, events, driver, objs, limit))
    with tempfile.TemporaryDirectory(prefix="quality-dra-") as tmp:
        batcher = Batcher(Path(tmp), slices, classes)
        jobs = []
        for name, path, topo, events, driver, objs, limit in plans:
            policy = DraPolicy(batcher, driver, objs, limit, topo if path in OCCUPANCY_PATHS else None)

            def job(name=name, path=path, topo=topo, events=events, policy=policy) -> None:
                r: dict[str, Any] = dict(quality.replay(topo, policy, events))
                r.update(constrained=policy.constrained, fallbacks=policy.fallbacks)
                results[name][path] = r

            jobs.append(job)
        start = time.monotonic()
        batcher.run(jobs)
        return results, batcher.runs, time.monotonic() - start


def has_choice(topo: Topology) -> bool:
    numa = {g.numa_node for g in topo.gpus if g.numa_node is not None}
    return len(numa) > 1 or len(set(island_ids(topo).values())) > 1


def verdicts(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    topos = dict(dra_machines())
    out = []
    keys = (("nvlink_share", "NVLink"), ("numa_share", "1 NUMA"), ("score_ratio", "score"))
    for name, rows in results.items():
        dp, naive = rows["device-plugin"], rows["naive slice"]
        for tag, b in (("(b)", rows["DRA (b)"]), ("(b) occ", rows["DRA (b) occ"])):
            short = [f"{label} {100 * (b[k] - dp[k]):+.1f}" for k, label in keys
                     if b[k] is not None and b[k] < dp[k] - 0.01 + 1e-12]
            out.append(f"{name}: {tag} {'within one point of' if not short else 'MORE than one point below'}"
                       f" device-plugin" + (f" ({', '.join(short)} points)" if short else ""))
        if has_choice(topos[name]):
            for tag, a in (("(a)", rows["DRA (a)"]), ("(a) occ", rows["DRA (a) occ"])):
                better = [label for k, label in keys if a[k] is not None and a[k] > naive[k] + 1e-12]
                worse = [label for k, label in keys if a[k] is not None and a[k] < naive[k] - 1e-12]
                ok = better and not worse
                out.append(f"{name}: {tag} {'strictly better than' if ok else 'NOT strictly better than'} naive"
                           f" (better on: {', '.join(better) or 'none'}; worse on: {', '.join(worse) or 'none'})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=600)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    if not DRAALLOC.exists():
        print(f"{DRAALLOC} is absent: see ../shared/tools/README.md", file=sys.stderr)
        return 2
    results, runs, seconds = measure(args.events, args.seed)
    if args.markdown:
        print("| machine | path | pods | NVLink-complete | single NUMA | score / best | fallback |")
        print("|---|---|---:|---:|---:|---:|---:|")
    else:
        print(f"{'machine':<12} {'path':<14} {'pods':>5} {'NVLink':>7} {'1 NUMA':>7} "
              f"{'score/best':>10} {'fallback':>9}")
    for name, rows in results.items():
        for path in PATHS:
            r = rows[path]
            fb = f"{r['fallbacks']}/{r['constrained']}" if path in ISLAND_PATHS else ""
            cells = (name, path, r["pods"], quality.pct(r["nvlink_share"]).strip(),
                     quality.pct(r["numa_share"]).strip(), quality.pct(r["score_ratio"]).strip(), fb)
            if args.markdown:
                print("| " + " | ".join(str(c) for c in cells) + " |")
            else:
                print(f"{cells[0]:<12} {cells[1]:<14} {cells[2]:>5} {cells[3]:>7} {cells[4]:>7} "
                      f"{cells[5]:>10} {cells[6]:>9}")
    print(f"\n== goals (seed {args.seed}, {args.events} events; {runs} draalloc runs, {seconds:.0f} s) ==")
    print("\n".join(verdicts(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
