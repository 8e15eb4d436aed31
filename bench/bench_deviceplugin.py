"""Device-plugin latency over the real unix socket, and start-to-registration time.

    .venv/bin/python bench/bench_deviceplugin.py [--machines dgx-h100,dgx2] [--calls 2000]
                                                [--no-process]

For each machine: round-trip p50/p99 of GetPreferredAllocation (a kubelet-like request:
all devices available, half the GPUs asked for, one must-include) and of Allocate, one
client, sequential calls, after a warm-up. Then the time from starting
``python -m agent run --simulate <machine>`` to its Register call reaching a stand-in
kubelet. Goals (issue 4): p99 <= 5 ms on 8 GPUs; registration within 2 s of start.
Timings vary by machine and load: report them as one run's figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the stand-in kubelet


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def bench_calls(machine: str, calls: int) -> dict[str, float]:
    from kubelet_stub import PluginClient
    from prometheus_client import CollectorRegistry

    from agent.config import Config
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.discovery import load_topology
    from agent.health import HealthState
    from agent.metrics.self_metrics import AgentMetrics

    topology = load_topology(machine)
    kdir = tempfile.mkdtemp(prefix="bdp", dir="/tmp")
    # the agent's own metrics observe every GetPreferredAllocation, as in the running agent
    manager = DevicePluginManager(topology, Config(kubelet_dir=kdir), HealthState(topology.gpu_count),
                                  events=AgentMetrics(CollectorRegistry()))
    manager.start()
    try:
        resource = manager.resources[0]
        client = PluginClient(os.path.join(kdir, resource.socket_name))
        ids = [d.id for d in resource.devices]
        size = max(1, topology.gpu_count // 2)
        results: dict[str, float] = {"gpus": topology.gpu_count}
        for name, call in (
            ("preferred", lambda i: client.preferred(ids, [ids[i % len(ids)]], size)),
            ("allocate", lambda i: client.allocate(ids[:size])),
        ):
            for i in range(min(200, calls)):  # warm-up: channel, caches, engine
                call(i)
            samples = []
            for i in range(calls):
                t0 = time.perf_counter()
                call(i)
                samples.append((time.perf_counter() - t0) * 1000)
            results[f"{name}_p50_ms"] = statistics.median(samples)
            results[f"{name}_p99_ms"] = percentile(samples, 99)
        client.close()
        return results
    finally:
        manager.stop(0.2)
        shutil.rmtree(kdir, ignore_errors=True)


def bench_registration(machine: str) -> float:
    """Seconds from spawning the agent process to its Register call arriving."""
    from kubelet_stub import KubeletStub

    base = tempfile.mkdtemp(prefix="bdr", dir="/tmp")
    kdir, fdir = os.path.join(base, "k"), os.path.join(base, "f")
    os.makedirs(fdir)
    kubelet = KubeletStub(kdir, watch=False).start()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--simulate", machine, "--kubelet-dir", kdir,
         "--features-dir", fdir, "--metrics-address", "127.0.0.1:0", "--log-level", "WARNING",
         "--pod-resources-socket", os.path.join(base, "podres.sock")],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        if not kubelet.wait_for(lambda: kubelet.registrations, 30.0):
            raise SystemExit(f"{machine}: no registration within 30 s")
        return kubelet.registrations[0].at_s - t0
    finally:
        proc.terminate()
        proc.wait(20)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", default="dgx-h100,dgx2")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--no-process", action="store_true", help="skip the start-to-registration timing")
    args = parser.parse_args()
    print(f"{'machine':<12} {'gpus':>4} {'pref p50':>9} {'pref p99':>9} {'alloc p50':>10} {'alloc p99':>10} {'register':>9}")
    for machine in args.machines.split(","):
        r = bench_calls(machine, args.calls)
        reg = "-" if args.no_process else f"{bench_registration(machine):.2f}s"
        print(
            f"{machine:<12} {int(r['gpus']):>4} {r['preferred_p50_ms']:>7.2f}ms {r['preferred_p99_ms']:>7.2f}ms"
            f" {r['allocate_p50_ms']:>8.2f}ms {r['allocate_p99_ms']:>8.2f}ms {reg:>9}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
