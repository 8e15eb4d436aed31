"""Metrics benchmark: scrape latency, and the sampler's memory and CPU cost.

    .venv/bin/python bench/bench_metrics.py [--scrapes 1000] [--duration-s 30] [--json FILE]

1. Scrape latency: the metrics service on a simulated ``dgx2`` (16 GPUs, every counter), 16
   pods attributed through the demo's stand-in kubelet pod-resources server; ``--scrapes`` HTTP GETs
   of ``/metrics`` over loopback, p50/p99/max. Goal: p99 <= 10 ms.
2. Resident memory and CPU: the service on a simulated ``dgx-h100`` (8 GPUs) sampling
   every second for ``--duration-s``, with Prometheus-like scrapes every 15 s; RSS at the
   end (psutil) and process CPU time over wall time. Goals: RSS <= 80 MiB, CPU <= 2 % of
   one core. (The process is the metrics service alone plus this driver; the full agent
   adds the device plugin, which idles.)

Prints one JSON object; numbers are from one run on this machine, not a guarantee.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.config import Config  # noqa: E402
from agent.demo.kubelet import PodResourcesStub  # noqa: E402
from agent.metrics.service import MetricsService  # noqa: E402
from agent.metrics.self_metrics import AgentMetrics  # noqa: E402
from tests.testbed.metrics_support import listing, pod  # noqa: E402


def simulated(machine: str):
    """(backend, topology, source) for a built-in simulated machine."""
    from agent.discovery import read_topology
    from agent.hw.sim.machines import open_simulated

    m = open_simulated(machine)
    backend = m.backend()
    backend.init()
    return backend, read_topology(backend, m), f"simulated:{machine}"


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[k]


def bench_scrape(scrapes: int, workdir: str) -> dict:
    backend, topology, source = simulated("dgx2")
    kubelet = PodResourcesStub(os.path.join(workdir, "kubelet.sock"), listing(*(
        pod("bench", f"job-{i}", {"main": [("nvidia.com/gpu", [g.uuid])]})
        for i, g in enumerate(topology.gpus)
    ))).start()
    try:
        config = Config(metrics_address="127.0.0.1:0", pod_resources_socket=kubelet.socket_path,
                        sample_interval_s=3600, pod_resources_refresh_s=3600)
        service = MetricsService(backend, topology, config, hostname="bench", ready=lambda: True,
                                 agent_metrics=AgentMetrics(CollectorRegistry(), backend))
        service.sampler.sample_once()  # before start: rounds have one caller at a time
        service.pod_resources.refresh_once()
        service.start()
        try:
            # one kept-alive connection, as Prometheus scrapes
            conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=5)

            def scrape() -> bytes:
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                data = response.read()
                assert response.status == 200
                return data

            body = b""
            for _ in range(20):  # warm-up
                body = scrape()
            times_ms = []
            for _ in range(scrapes):
                t0 = time.perf_counter()
                body = scrape()
                times_ms.append((time.perf_counter() - t0) * 1000)
            conn.close()
            render_ms = []  # a fresh snapshot before each: the uncached worst case
            # the thread's first round done, its next is an hour away: these rounds have the source alone
            deadline = time.monotonic() + 10
            while service.sampler.snapshot.rounds < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(min(scrapes, 100)):
                service.sampler.sample_once()
                t0 = time.perf_counter()
                service.render()
                render_ms.append((time.perf_counter() - t0) * 1000)
        finally:
            service.stop()
    finally:
        kubelet.stop()
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    return {
        "machine": source, "gpus": topology.gpu_count, "pods": len(topology.gpus),
        "series": len(lines), "body_bytes": len(body), "scrapes": scrapes,
        "http_p50_ms": round(statistics.median(times_ms), 3),
        "http_p99_ms": round(percentile(times_ms, 99), 3),
        "http_max_ms": round(max(times_ms), 3),
        "render_after_new_snapshot_p50_ms": round(statistics.median(render_ms), 3),
        "render_after_new_snapshot_p99_ms": round(percentile(render_ms, 99), 3),
        "goal_p99_ms": 10.0,
    }


def bench_resources(duration_s: float) -> dict:
    backend, topology, source = simulated("dgx-h100")
    proc = psutil.Process()
    config = Config(metrics_address="127.0.0.1:0", pod_resources_socket="/nonexistent/kubelet.sock",
                    sample_interval_s=1.0, pod_resources_refresh_s=10.0)
    service = MetricsService(backend, topology, config, hostname="bench", ready=lambda: True,
                             agent_metrics=AgentMetrics(CollectorRegistry(), backend))
    service.start()
    try:
        time.sleep(2.0)  # first rounds, imports settled
        cpu0 = proc.cpu_times()
        t0 = time.monotonic()
        url = f"http://127.0.0.1:{service.port}/metrics"
        next_scrape = t0
        while time.monotonic() - t0 < duration_s:
            if time.monotonic() >= next_scrape:
                urllib.request.urlopen(url, timeout=5).read()
                next_scrape += 15.0
            time.sleep(0.2)
        wall = time.monotonic() - t0
        cpu1 = proc.cpu_times()
        rounds = service.sampler.snapshot.rounds
        last_round_ms = service.sampler.snapshot.duration_s * 1000
    finally:
        service.stop()
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "machine": source, "gpus": topology.gpu_count, "interval_s": 1.0,
        "duration_s": round(wall, 1), "sampling_rounds": rounds,
        "last_round_ms": round(last_round_ms, 3),
        "rss_mib": round(proc.memory_info().rss / 2**20, 1),
        "cpu_pct_of_one_core": round(100 * cpu_s / wall, 2),
        "goal_rss_mib": 80, "goal_cpu_pct": 2.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scrapes", type=int, default=1000)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--json", metavar="FILE", help="also write the result here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        result = {"resources": bench_resources(args.duration_s),
                  "scrape": bench_scrape(args.scrapes, workdir)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
