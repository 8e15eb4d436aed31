"""The cost of the containers' NCCL topology files (issue 24), short.

Run: ``.venv/bin/python bench/bench_nccl.py`` (``--calls N``, default 2000; ``--json PATH``).

What is measured, in one process, one run:

* **write**: ``NcclFiles.write`` as the writer thread and PreStartContainer call it (the
  text, rendered once per GPU set, a temp file, the rename) per call, into a directory on
  disk (the temp dir) and on tmpfs (``/dev/shm``), for the 8 GPUs of ``dgx-h100`` (every
  size 1-8, rotating sets) and a 64-GPU node (8 NVSwitch islands of 8, one NIC per island;
  sizes 1, 2, 4, 8, 16, 32, 64); and the text alone, uncached (``nccl_topology_xml``).
  Goal: p99 <= 1 ms per Allocate.
* **Allocate side by side**: ``RequestHandler.allocate`` (the request path below gRPC) on
  ``dgx-h100``, 2 and 8 GPUs, with the files (``nccl.topologyFile: auto``: Allocate names
  the file and queues it for the writer thread, which runs meanwhile, as in the agent) and
  without (``off``), calls alternating so both see the same machine state; and
  ``RequestHandler.preferred`` the same way (it writes nothing; shown to be unchanged).
  Goal: Allocate p50 with <= 1.05x without.

Figures are wall-clock (a file write is I/O, not only CPU) and the calling thread's CPU
time beside it; the machine is shared, so the p99 tails include scheduler ticks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.config import Config  # noqa: E402
from agent.deviceplugin.allocation import RequestHandler  # noqa: E402
from agent.deviceplugin.resources import build_resources  # noqa: E402
from agent.discovery import load_topology  # noqa: E402
from agent.nccl.container_file import nccl_topology_xml  # noqa: E402
from agent.nccl.host_dir import NcclFiles, allocation_key  # noqa: E402
from agent.records import Gpu, Link, Nic, PcieLevel  # noqa: E402
from agent.topology.model import Topology  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], object], calls: int) -> dict[str, float]:
    wall, cpu = [], []
    for _ in range(calls):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn()
        cpu.append((time.thread_time_ns() - c0) / 1000.0)
        wall.append((time.perf_counter_ns() - w0) / 1000.0)
    return {"p50_us": statistics.median(wall), "p99_us": percentile(wall, 0.99),
            "cpu_p50_us": statistics.median(cpu), "cpu_p99_us": percentile(cpu, 0.99), "calls": calls}


def islands_64() -> Topology:
    """64 GPUs: 8 NVSwitch islands of 8 on 2 NUMA nodes, a PCIe switch per island holding
    its GPUs and one NIC."""
    n, size = 64, 8
    gpus = [Gpu(i, f"GPU-bench-{i}", "bench", pci_bus_id=f"00000000:{i + 1:02X}:00.0", pci_class=0x030200,
                numa_node=(i // size) % 2) for i in range(n)]
    links = [Link(a, b, 18 if a // size == b // size else 0,
                  PcieLevel.PIX if a // size == b // size else
                  PcieLevel.NODE if (a // size) % 2 == (b // size) % 2 else PcieLevel.SYS,
                  nvswitch=a // size == b // size)
             for a in range(n) for b in range(a + 1, n)]
    nics = [Nic(f"mlx5_{k}", f"0000:{0x80 + k:02x}:00.0", k % 2,
                tuple(PcieLevel.PIX if g // size == k else PcieLevel.SYS for g in range(n))) for k in range(8)]
    return Topology.build(gpus, links, nics=nics, numa_cpulists={0: "0-63", 1: "64-127"})


def bench_write(calls: int, directories: dict[str, str]) -> dict[str, dict[str, float]]:
    out = {}
    for name, topo, sizes in (("8 GPUs", load_topology("dgx-h100"), range(1, 9)),
                              ("64 GPUs", islands_64(), (1, 2, 4, 8, 16, 32, 64))):
        sets = [list(range(start, start + k)) for k in sizes for start in range(0, topo.gpu_count - k + 1, k)]
        state = {"i": 0}

        def render(topo: Topology = topo, sets: list[list[int]] = sets, state: dict[str, int] = state) -> None:
            gpus = sets[state["i"] % len(sets)]  # the text alone, never cached
            state["i"] += 1
            nccl_topology_xml(topo, gpus)

        out[f"{name} render (uncached)"] = timed(render, calls)
        for where, directory in directories.items():
            files = NcclFiles(directory)

            def one(topo: Topology = topo, sets: list[list[int]] = sets, state: dict[str, int] = state,
                    files: NcclFiles = files) -> None:
                gpus = sets[state["i"] % len(sets)]
                state["i"] += 1
                files.write(allocation_key("nvidia.com/gpu", [str(g) for g in gpus]), topo, gpus)

            out[f"{name} write to {where}"] = timed(one, calls)
    return out


def bench_side_by_side(calls: int, directory: str) -> dict[str, dict[str, float]]:
    topo = load_topology("dgx-h100")
    out: dict[str, dict[str, float]] = {}
    for k in (2, 8):
        results: dict[str, list[float]] = {"allocate with": [], "allocate without": [],
                                           "preferred with": [], "preferred without": []}
        handlers = {}
        for mode in ("with", "without"):
            config = Config(nccl_pod_files="auto" if mode == "with" else "off", nccl_host_dir=directory)
            (resource,) = build_resources(topo, config)
            handlers[mode] = RequestHandler(resource, topo, config, NcclFiles.from_config(config))
        ids = [d.id for d in handlers["with"].resource.devices]
        requests = [ids[s:s + k] for s in range(0, len(ids) - k + 1, k)]
        for i in range(calls):  # alternating: both see the same machine state
            request = requests[i % len(requests)]
            for mode in ("with", "without") if i % 2 else ("without", "with"):
                handler = handlers[mode]
                t0 = time.perf_counter_ns()
                handler.allocate(request)
                results[f"allocate {mode}"].append((time.perf_counter_ns() - t0) / 1000.0)
                t0 = time.perf_counter_ns()
                handler.preferred(ids, [], k)
                results[f"preferred {mode}"].append((time.perf_counter_ns() - t0) / 1000.0)
        files = handlers["with"].nccl_files
        while files is not None and files.pending():  # the writer thread's queue drained
            time.sleep(0.01)
        for key, values in results.items():
            out[f"dgx-h100 k={k} {key}"] = {"p50_us": statistics.median(values), "p99_us": percentile(values, 0.99),
                                            "calls": len(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "nccl.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gta-nccl-bench-") as directory, \
            tempfile.TemporaryDirectory(prefix="gta-nccl-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm:
        write = bench_write(args.calls, {"disk": directory, "tmpfs": shm})
        side = bench_side_by_side(args.calls, directory)
    print("== writing the pod's NCCL topology file, per Allocate (wall clock; CPU beside) ==")
    for name, s in write.items():
        goal = "MET" if s["p99_us"] <= 1000 else "MISSED"
        print(f"{name:30s} p50 {s['p50_us']:7.1f} us  p99 {s['p99_us']:7.1f} us (cpu p99 {s['cpu_p99_us']:7.1f} us)"
              f"  goal p99 <= 1 ms: {goal}")
    print("\n== Allocate and GetPreferredAllocation with and without the files, side by side ==")
    for name, s in side.items():
        print(f"{name:40s} p50 {s['p50_us']:7.1f} us  p99 {s['p99_us']:7.1f} us")
    for k in (2, 8):
        ratio = side[f"dgx-h100 k={k} allocate with"]["p50_us"] / side[f"dgx-h100 k={k} allocate without"]["p50_us"]
        pref = side[f"dgx-h100 k={k} preferred with"]["p50_us"] / side[f"dgx-h100 k={k} preferred without"]["p50_us"]
        print(f"k={k}: Allocate p50 with/without {ratio:.2f}x (goal <= 1.05x: {'MET' if ratio <= 1.05 else 'MISSED'});"
              f" preferred {pref:.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"write": write, "side_by_side": side}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
