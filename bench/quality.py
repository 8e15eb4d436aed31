"""Allocation quality on a busy node: our policy vs partition-only vs naive lowest-index.

Run: ``.venv/bin/python bench/quality.py`` (``--events N``, ``--seed S``).

A seeded trace of pods of sizes 1, 2, 4 and 8 (sizes above the node's GPU count are left
out) arrives and leaves; a pod that does not fit in the free GPUs is turned away. Whether a
pod fits depends only on how many GPUs are free, so every policy sees the same trace.
Policies:

* ``ours``: the device plugin's answer (criteria 1-5, issue 3): the request checked and
  mapped at its edge, then ``AllocationEngine.gpus``;
* ``partition-only``: go-gpuallocator's choice (``agent.demo.comparisons.GpuallocatorChoice``, what
  the demo shows): the
  first best partition of the free GPUs into groups of the request size that
  go-gpuallocator's enumeration finds, then that partition's best group (exact where the size
  divides the free count; otherwise the set with the best criterion 1, then set score, then
  the lowest indices stands in);
* ``naive``: the lowest free indices.

Per machine and policy, over multi-GPU pods: the mean set score relative to the best
possible for its size on that node, the share of pods entirely on NVLink (every pair linked),
and the share on one NUMA node ("-" where the machine reports no NUMA nodes).

Machines: every built-in machine (``agent.hw.sim.machines``) and the real ``nvidia-smi topo -m``
outputs in ``tests/fixtures/topo/`` (copied from ``../shared/data/topo/``).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.demo.comparisons import GpuallocatorChoice, naive_choice  # noqa: E402
from agent.topology.allocator import AllocationEngine  # noqa: E402
from agent.topology.model import Topology  # noqa: E402
from tests.testbed.allocation_support import best_set  # noqa: E402

REAL_MATRICES = (
    "dgx1-v100-8gpu-4nic.txt",
    "a100-80gb-pcie-4gpu-nv12-bridge-pairs-4numa-vm.txt",
    "h200-8gpu-8nic-epyc9534.txt",
    "l40s-4gpu-2socket-2nic.txt",
    "gb200-4gpu-8nic.txt",
)
POD_SIZES = (1, 2, 4, 8)
POD_WEIGHTS = (4, 3, 2, 1)


def machines() -> list[tuple[str, Topology]]:
    from agent.discovery import load_topology
    from agent.hw.sim.machines import BUILTIN_MACHINES

    out = [(name, load_topology(name)) for name in BUILTIN_MACHINES]
    from agent.discovery import load_topology as read_topo_matrix  # the one path

    for name in REAL_MATRICES:
        out.append(
            (f"topo:{name}", read_topo_matrix(str(ROOT / "tests" / "fixtures" / "topo" / name)))
        )
    return out


def trace(n_gpus: int, events: int, seed: int) -> list[tuple[str, int]]:
    """('arrive', size) or ('leave', which running pod, as a random draw)."""
    rng = random.Random(seed)
    sizes = [s for s in POD_SIZES if s <= n_gpus]
    weights = POD_WEIGHTS[: len(sizes)]
    out = []
    for _ in range(events):
        if rng.random() < 0.6:
            out.append(("arrive", rng.choices(sizes, weights)[0]))
        else:
            out.append(("leave", rng.randrange(1 << 30)))
    return out


class Ours:
    """The device plugin's answer for the free GPUs."""

    def __init__(self, topo: Topology) -> None:
        self.engine = AllocationEngine(topo)

    def best_set(self, free: list[int], must: list[int], k: int) -> list[int]:
        return best_set(self.engine, free, must, k)


class PartitionOnly:
    """go-gpuallocator's choice: first best partition, then its best group."""

    def __init__(self, topo: Topology) -> None:
        self.gpuallocator = GpuallocatorChoice(topo)

    def best_set(self, free: list[int], must: list[int], k: int) -> list[int]:
        return self.gpuallocator.choose(free, k)


class Naive:
    def best_set(self, free: list[int], must: list[int], k: int) -> list[int]:
        return naive_choice(free, k)


def replay(topo: Topology, policy, events: list[tuple[str, int]]) -> dict[str, float | None]:
    reference = AllocationEngine(topo)
    free = list(range(topo.gpu_count))
    running: list[list[int]] = []
    ratios: list[float] = []
    nvlink = numa_one = multi = 0
    has_numa = any(g.numa_node is not None for g in topo.gpus)
    for kind, value in events:
        if kind == "arrive":
            if value > len(free):
                continue
            got = policy.best_set(free, [], value)
            assert len(set(got)) == value and set(got) <= set(free)
            free = [g for g in free if g not in got]
            running.append(got)
            if value >= 2:
                multi += 1
                best = reference.best_score_for_size(value)
                ratios.append(topo.set_score(got) / best if best else 1.0)
                nvlink += all(
                    topo.link(a, b).nvlinks > 0 for a, b in itertools.combinations(got, 2)
                )
                numa_one += len({topo.gpus[g].numa_node for g in got}) == 1
        elif running:
            pod = running.pop(value % len(running))
            free = sorted(free + pod)
    return {
        "pods": multi,
        "score_ratio": sum(ratios) / len(ratios) if ratios else None,
        "nvlink_share": nvlink / multi if multi else None,
        "numa_share": (numa_one / multi if multi else None) if has_numa else None,
    }


def pct(x: float | None) -> str:
    return "     -" if x is None else f"{100 * x:5.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=600)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args(argv)
    verdicts = []
    print(
        f"{'machine':<58} {'policy':<15} {'pods':>5} {'score/best':>10} {'NVLink':>7} {'1 NUMA':>7}"
    )
    for name, topo in machines():
        if topo.gpu_count < 2:
            print(f"{name:<58} (one GPU: nothing to compare)")
            continue
        events = trace(topo.gpu_count, args.events, args.seed)
        rows = {
            "ours": replay(topo, Ours(topo), events),
            "partition-only": replay(topo, PartitionOnly(topo), events),
            "naive": replay(topo, Naive(), events),
        }
        for policy, r in rows.items():
            print(
                f"{name:<58} {policy:<15} {r['pods']:>5} {pct(r['score_ratio']):>10} "
                f"{pct(r['nvlink_share']):>7} {pct(r['numa_share']):>7}"
            )
        ours, part = rows["ours"], rows["partition-only"]
        worse = [
            m
            for m in ("score_ratio", "nvlink_share", "numa_share")
            if ours[m] is not None and part[m] is not None and ours[m] < part[m] - 1e-9
        ]
        verdicts.append(
            f"{name}: ours {'>=' if not worse else 'BELOW'} partition-only"
            + (f" on {', '.join(worse)}" if worse else " on every measure")
        )
    print("\n== ours vs partition-only (one run, seed %d, %d events) ==" % (args.seed, args.events))
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
