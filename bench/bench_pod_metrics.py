"""Per-pod GPU use benchmark: what sampling the GPUs' processes costs, side by side.

    .venv/bin/python bench/bench_pod_metrics.py [--rounds 200] [--requests 1000]
                                                [--agent-seconds 20] [--json FILE]

The node is the built-in ``dgx-h100`` (8 GPUs) with 16 processes on every GPU (two pods of
8 processes each per GPU, time-sliced; cgroup v2, systemd driver, containerd spelling), the
containers listed by the stand-in containerd of ``tests/testbed/cri_stub.py``.

1. Sampler round, with against without process sampling: one sampler reads the GPUs and
   maps their processes to pods (NVML process listing and per-process utilisation, 128
   cgroup reads, the CRI answer cached after the first round); the other is the same
   sampler with the processes step left out (what it cost before per-pod metrics). Rounds
   alternate, ``--rounds`` each; medians of wall time and thread CPU time, and their ratio.
   The NVML is the simulator's fake: its calls cost Python, not a driver round trip.
2. ``/metrics`` against a bare ``/health``: the metrics service with the per-pod series
   (16 pods attributed through the stand-in pod-resources server), ``--requests`` GETs of
   each, alternating, a new connection each; p50/p99 and the p99 ratio. Goal: <= 2.
3. The agent's resident memory: a real ``gpu-topology-agent run --simulate`` subprocess
   (stand-in kubelet, pod-resources and containerd; sampling every second, scraped every
   second for ``--agent-seconds``), with the 128 processes and, beside it, the same machine
   without processes; RSS (psutil) at the end. Goal: <= 64 MiB.

Prints one JSON object; numbers are from one run on this machine, not a guarantee.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.attribution.cgroups import CgroupReader  # noqa: E402
from agent.attribution.pod_processes import ContainerDirectory, PodProcesses  # noqa: E402
from agent.config import Config  # noqa: E402
from agent.demo.kubelet import KubeletStub, PodResourcesStub  # noqa: E402
from agent.discovery import read_topology  # noqa: E402
from agent.hw.nvml.telemetry import NvmlSampler  # noqa: E402
from agent.hw.sim.machines import SimulatedMachine  # noqa: E402
from agent.hw.sim.spec import load_machine_spec  # noqa: E402
from agent.kubelet.cri import CriClient  # noqa: E402
from agent.metrics.sampler import Sampler  # noqa: E402
from agent.metrics.self_metrics import AgentMetrics  # noqa: E402
from agent.metrics.service import MetricsService  # noqa: E402
from tests.testbed.cri_stub import CriStub, pod_container  # noqa: E402
from tests.testbed.metrics_support import listing, pod  # noqa: E402

SPECS = ROOT / "agent" / "hw" / "sim" / "specs"
PROCESSES_PER_GPU = 16
PODS_PER_GPU = 2


def uid(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-{n:012x}"


def cgroup(n: int) -> str:
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{uid(n).replace('-', '_')}.slice/cri-containerd-{n:064x}.scope")


def write_specs(workdir: str) -> tuple[str, str]:
    """(dgx-h100 with 16 processes per GPU, the same without) as spec files."""
    doc = yaml.safe_load((SPECS / "dgx-h100.yaml").read_text())
    bare = os.path.join(workdir, "dgx-h100-bare.yaml")
    Path(bare).write_text(yaml.safe_dump({**doc, "name": "dgx-h100-bare"}))
    per_pod = PROCESSES_PER_GPU // PODS_PER_GPU
    for i, gpu in enumerate(doc["gpus"]):
        gpu["processes"] = [
            {"pid": 100_000 + i * 100 + k, "used_memory_mib": 1024 + 64 * k,
             "sm_util": (7 * k + i) % 40, "mem_util": (3 * k) % 20,
             "cgroup": cgroup(1 + i * PODS_PER_GPU + k // per_pod)}
            for k in range(PROCESSES_PER_GPU)
        ]
    shared = os.path.join(workdir, "dgx-h100-shared.yaml")
    Path(shared).write_text(yaml.safe_dump({**doc, "name": "dgx-h100-shared"}))
    return shared, bare


def containers() -> list[Any]:
    return [pod_container(f"{n:064x}", f"job-{n}", "bench", "main", uid(n))
            for n in range(1, 1 + 8 * PODS_PER_GPU)]


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))]


class _WithoutProcesses(NvmlSampler):
    """The sampler as it was before per-pod metrics: every step but the processes'."""

    def _process_step(self, index: int, h: Any, state: Any) -> None:
        return None


def bench_rounds(spec_path: str, cri_socket: str, rounds: int) -> dict[str, Any]:
    sim = SimulatedMachine(load_machine_spec(spec_path))
    backend = sim.backend()
    backend.init()
    try:
        topology = read_topology(backend, sim)
        pods = PodProcesses(CgroupReader(sim.proc_root), ContainerDirectory(CriClient(cri_socket)))
        with_ = Sampler(backend.sample_source(), topology, interval_s=1.0, pods=pods)
        without = Sampler(_WithoutProcesses(backend), topology, interval_s=1.0)
        times: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
        for k in range(rounds + 10):
            for name, sampler in (("with", with_), ("without", without)):
                c0, t0 = time.thread_time(), time.perf_counter()
                sampler.sample_once()
                if k >= 10:  # warm-up: first CRI answer, GPM's first sample
                    times[name].append((time.perf_counter() - t0, time.thread_time() - c0))
        assert sum(len(u) for u in with_.snapshot.pods.values()) == 8 * PODS_PER_GPU
        with_.stop()
        without.stop()
    finally:
        backend.shutdown()
        sim.close()
    med = {name: (statistics.median(w for w, _ in v) * 1000, statistics.median(c for _, c in v) * 1000)
           for name, v in times.items()}
    return {
        "gpus": topology.gpu_count, "processes_per_gpu": PROCESSES_PER_GPU, "rounds_each": rounds,
        "with_processes_wall_ms_p50": round(med["with"][0], 3),
        "without_processes_wall_ms_p50": round(med["without"][0], 3),
        "wall_ratio": round(med["with"][0] / med["without"][0], 2),
        "with_processes_cpu_ms_p50": round(med["with"][1], 3),
        "without_processes_cpu_ms_p50": round(med["without"][1], 3),
        "cpu_ratio": round(med["with"][1] / med["without"][1], 2),
    }


def bench_scrape(spec_path: str, cri_socket: str, workdir: str, requests: int) -> dict[str, Any]:
    sim = SimulatedMachine(load_machine_spec(spec_path))
    backend = sim.backend()
    backend.init()
    topology = read_topology(backend, sim)
    kubelet = PodResourcesStub(os.path.join(workdir, "podres-scrape.sock"), listing(*(
        pod("bench", f"job-{1 + g.index * PODS_PER_GPU + j}",
            {"main": [("nvidia.com/gpu", [f"{g.uuid}::{j}"])]})
        for g in topology.gpus for j in range(PODS_PER_GPU)
    ))).start()
    config = Config(metrics_address="127.0.0.1:0", pod_resources_socket=kubelet.socket_path,
                    proc_root=sim.proc_root, cri_socket=cri_socket,
                    sample_interval_s=3600, pod_resources_refresh_s=3600)
    service = MetricsService(backend, topology, config, hostname="bench", ready=lambda: True,
                             agent_metrics=AgentMetrics(CollectorRegistry(), backend))
    service.sampler.sample_once()  # before start: rounds have one caller at a time
    service.pod_resources.refresh_once()
    service.start()  # the thread's first round is the second sample
    try:
        deadline = time.monotonic() + 10
        while service.sampler.snapshot.rounds < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        def get(path: str) -> bytes:
            # a connection per request, as the kubelet's probes make (a kept-alive one
            # measures the server's two writes per small reply meeting delayed ACKs)
            conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=5)
            try:
                conn.request("GET", path)
                response = conn.getresponse()
                data = response.read()
            finally:
                conn.close()
            assert response.status == 200
            return data

        for _ in range(20):
            body = get("/metrics")
            get("/health")
        times: dict[str, list[float]] = {"/metrics": [], "/health": []}
        for _ in range(requests):
            for path in ("/metrics", "/health"):
                t0 = time.perf_counter()
                get(path)
                times[path].append((time.perf_counter() - t0) * 1000)
    finally:
        service.stop()
        kubelet.stop()
        backend.shutdown()
        sim.close()
    text = body.decode()
    per_pod = len(re.findall(r"^gpu_agent_pod_\w+\{", text, re.M))
    series = len([ln for ln in text.splitlines() if ln and not ln.startswith("#")])
    p99 = {p: percentile(v, 99) for p, v in times.items()}
    return {
        "requests_each": requests, "series": series, "per_pod_series": per_pod,
        "body_bytes": len(body),
        "metrics_p50_ms": round(statistics.median(times["/metrics"]), 3),
        "metrics_p99_ms": round(p99["/metrics"], 3),
        "health_p50_ms": round(statistics.median(times["/health"]), 3),
        "health_p99_ms": round(p99["/health"], 3),
        "p99_ratio": round(p99["/metrics"] / p99["/health"], 2), "goal_p99_ratio": 2.0,
    }


def agent_rss(spec_path: str, cri_socket: str, workdir: str, seconds: float, tag: str) -> dict[str, Any]:
    kubelet_dir = os.path.join(workdir, f"k-{tag}")
    os.makedirs(kubelet_dir)
    podres = PodResourcesStub(os.path.join(workdir, f"podres-{tag}.sock")).start()
    kubelet = KubeletStub(kubelet_dir).start()
    env = dict(os.environ, PYTHONPATH=str(ROOT), SAMPLE_INTERVAL_S="1")
    env.pop("CONFIG_FILE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--simulate", spec_path,
         "--kubelet-dir", kubelet_dir, "--features-dir", os.path.join(workdir, f"f-{tag}"),
         "--pod-resources-socket", podres.socket_path, "--cri-socket", cri_socket,
         "--metrics-address", "127.0.0.1:0"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port: list[int] = []
    found = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"metrics on [^ ]*:(\d+) ", line)
            if m and not port:
                port.append(int(m.group(1)))
                found.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        if not found.wait(60.0):
            raise SystemExit(f"the agent ({tag}) did not start")
        agent = psutil.Process(proc.pid)
        conn = http.client.HTTPConnection("127.0.0.1", port[0], timeout=10)
        t0 = time.monotonic()
        body = b""
        while time.monotonic() - t0 < seconds:
            conn.request("GET", "/metrics")
            body = conn.getresponse().read()
            time.sleep(1.0)
        conn.close()
        rss = agent.memory_info().rss / 2**20
        threads = agent.num_threads()
    finally:
        proc.terminate()
        proc.wait(30)
        kubelet.stop()
        podres.stop()
    per_pod = len(re.findall(rb"^gpu_agent_pod_\w+\{", body, re.M))
    return {"rss_mib": round(rss, 1), "threads": threads, "per_pod_series": per_pod}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--agent-seconds", type=float, default=20.0)
    ap.add_argument("--json", metavar="FILE", help="also write the result here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        shared, bare = write_specs(workdir)
        cri = CriStub(os.path.join(workdir, "containerd.sock"), containers()).start()
        try:
            result = {
                "sampler_round": bench_rounds(shared, cri.socket_path, args.rounds),
                "scrape": bench_scrape(shared, cri.socket_path, workdir, args.requests),
                "agent": {
                    "with_processes": agent_rss(shared, cri.socket_path, workdir,
                                                args.agent_seconds, "shared"),
                    "without_processes": agent_rss(bare, cri.socket_path, workdir,
                                                   args.agent_seconds, "bare"),
                    "goal_rss_mib": 64,
                },
            }
        finally:
            cri.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
