"""Soak: a real agent under kubelet restarts, concurrent scrapes, open streams, slow clients
and gRPC traffic, all at once, for ``--seconds``.

    .venv/bin/python bench/soak.py [--seconds 60] [--machine dgx2] [--scrapers 50] [--json FILE]

The agent is a real ``gpu-topology-agent run --simulate MACHINE`` subprocess; the kubelet
is the stand-in of ``agent/demo/kubelet.py`` (registration server, one ListAndWatch stream
per resource) with a stand-in pod-resources server. Everything is on loopback and unix
sockets in a temporary directory, bounded in count and time. Load, in threads:

- a kubelet restart every ``--restart-every`` s (directory cleared, new ``kubelet.sock``);
  the time until the agent is registered again is recorded;
- ``--scrapers`` clients scraping ``/metrics`` back to back (a new connection each);
- ``--streams`` extra ListAndWatch streams held open (beyond the agent's limit they are
  refused with RESOURCE_EXHAUSTED, which is counted, not an error);
- ``--slow-clients`` connections sending half a request and waiting (the server's read
  timeout closes them; they reconnect);
- GetDevicePluginOptions, GetPreferredAllocation and Allocate back to back.

Before the load, ``/metrics`` is scraped alone 100 times (the single-scrape p99 the goal is
measured against: concurrent p99 within 10x of it, no error). Reports the agent's RSS, open
fds and threads once it is ready and at the end, p50/p99 per kind of traffic, and errors.
Prints one JSON object; numbers are from one run on this machine, not a guarantee.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent._proto import deviceplugin_v1beta1_pb2 as pb  # noqa: E402
from agent.demo.kubelet import PluginClient, PodResourcesStub  # noqa: E402
from tests.testbed.kubelet_stub import KubeletStub  # noqa: E402


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))]


def ms(values: list[float]) -> dict[str, float | int | None]:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {
        "count": len(values),
        "p50_ms": round(p50 * 1000, 2) if p50 is not None else None,
        "p99_ms": round(p99 * 1000, 2) if p99 is not None else None,
        "max_ms": round(max(values) * 1000, 2) if values else None,
    }


class Recorder:
    """Latencies and errors per kind of traffic, from many threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: dict[str, list[float]] = {}
        self.errors: dict[str, dict[str, int]] = {}

    def ok(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault(kind, []).append(seconds)

    def error(self, kind: str, what: str) -> None:
        with self.lock:
            bucket = self.errors.setdefault(kind, {})
            bucket[what] = bucket.get(what, 0) + 1


def process_stats(proc: psutil.Process) -> dict[str, float | int]:
    return {
        "rss_mib": round(proc.memory_info().rss / 2**20, 1),
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
    }


def scrape(port: int, path: str = "/metrics", timeout_s: float = 10.0) -> tuple[int, float]:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - started
    finally:
        conn.close()


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: str) -> None:
        self.args = args
        self.kubelet_dir = os.path.join(workdir, "k")
        self.features_dir = os.path.join(workdir, "f")
        self.podres_socket = os.path.join(workdir, "podres.sock")
        os.makedirs(self.kubelet_dir)
        self.stop = threading.Event()
        self.rec = Recorder()
        self.restart_lock = threading.Lock()  # restarts vs. the clients' socket lookup
        self.stderr_lines: list[str] = []
        self.port: int | None = None
        self.probe_port: int | None = None  # /health and /ready: the kubelet's probes' port
        self.port_found = threading.Event()

    # ------------------------------------------------------------------ the agent
    def start_agent(self) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("CONFIG_FILE", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--simulate", self.args.machine,
             "--kubelet-dir", self.kubelet_dir, "--features-dir", self.features_dir,
             "--pod-resources-socket", self.podres_socket, "--metrics-address", "127.0.0.1:0"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        threading.Thread(target=self._read_stderr, args=(proc,), daemon=True).start()
        return proc

    def _read_stderr(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.stderr_lines.append(line.rstrip("\n"))
            m = re.search(r"metrics on [^ ]*:(\d+) .*probes on [^ ]*:(\d+) ", line)
            if m and self.port is None:
                self.port, self.probe_port = int(m.group(1)), int(m.group(2))
                self.port_found.set()

    def socket_path(self) -> str:
        return os.path.join(self.kubelet_dir, "nvidia-gpu.sock")

    # ------------------------------------------------------------------ load
    def restarts(self, kubelet: KubeletStub) -> None:
        while not self.stop.wait(self.args.restart_every):
            before = len(kubelet.registered("nvidia.com/gpu"))
            started = time.perf_counter()
            with self.restart_lock:
                kubelet.restart()
            if kubelet.wait_for(lambda n=before: len(kubelet.registered("nvidia.com/gpu")) > n, 10.0):
                self.rec.ok("reregistration", time.perf_counter() - started)
            else:
                self.rec.error("reregistration", "not within 10 s")

    def scraper(self) -> None:
        assert self.port is not None
        interval = self.args.scrape_interval
        if interval:  # staggered, as independent Prometheus servers would be
            self.stop.wait(random.uniform(0, interval))
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                status, seconds = scrape(self.port)
            except OSError as exc:
                self.rec.error("scrape", type(exc).__name__)
                continue
            if status == 200:
                self.rec.ok("scrape", seconds)
            else:
                self.rec.error("scrape", f"HTTP {status}")
            if interval:
                self.stop.wait(max(0.0, interval - (time.monotonic() - began)))

    def prober(self) -> None:
        assert self.probe_port is not None
        while not self.stop.wait(0.2):
            for path in ("/health", "/ready"):
                try:
                    status, seconds = scrape(self.probe_port, path)
                except OSError as exc:
                    self.rec.error(path, type(exc).__name__)
                    continue
                self.rec.ok(path, seconds) if status in (200, 503) else self.rec.error(path, f"HTTP {status}")

    def slow_client(self) -> None:
        assert self.port is not None
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as conn:
                    conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: soak\r\n")  # never finished
                    while not self.stop.is_set():
                        try:
                            if conn.recv(1024) == b"":
                                self.rec.ok("slow_client_closed_by_server", 0.0)
                                break
                        except socket.timeout:
                            continue
            except OSError as exc:
                self.rec.error("slow_client", type(exc).__name__)
                self.stop.wait(0.2)

    def streams(self) -> None:
        while not self.stop.is_set():
            client = PluginClient(self.socket_path())
            calls = [client.stub.ListAndWatch(pb.Empty()) for _ in range(self.args.streams)]
            self.stop.wait(3.0)
            for call in calls:
                if call.done():
                    code = call.code()
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self.rec.ok("stream_refused", 0.0)
                    elif code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                        self.rec.error("stream", code.name)
                else:
                    self.rec.ok("stream_open", 0.0)
                call.cancel()
            client.close()

    def grpc_traffic(self, ids: list[str]) -> None:
        client = PluginClient(self.socket_path())
        calls = (
            ("GetDevicePluginOptions", lambda: client.options(timeout_s=5.0)),
            ("GetPreferredAllocation", lambda: client.preferred(ids, [], 4, timeout_s=5.0)),
            ("Allocate", lambda: client.allocate(ids[:2], timeout_s=5.0)),
        )
        try:
            while not self.stop.is_set():
                for name, call in calls:
                    started = time.perf_counter()
                    try:
                        call()
                    except grpc.RpcError as exc:
                        # UNAVAILABLE while a kubelet restart has removed the socket is expected
                        self.rec.error(name, exc.code().name)
                        self.stop.wait(0.05)
                        continue
                    self.rec.ok(name, time.perf_counter() - started)
        finally:
            client.close()

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, object]:
        podres = PodResourcesStub(self.podres_socket).start()
        kubelet = KubeletStub(self.kubelet_dir).start()
        proc = self.start_agent()
        threads: list[threading.Thread] = []
        try:
            if not self.port_found.wait(60.0):
                raise SystemExit("the agent did not start:\n" + "\n".join(self.stderr_lines[-20:]))
            assert self.port is not None
            started = time.monotonic()
            while scrape(self.port, "/ready")[0] != 200:
                if time.monotonic() - started > 30:
                    raise SystemExit("the agent never became ready")
                time.sleep(0.1)
            assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") is not None, 10.0)
            latest = kubelet.latest("nvidia.com/gpu")
            assert latest is not None
            ids = [d.ID for d in latest.devices]
            agent = psutil.Process(proc.pid)
            time.sleep(1.0)  # past the first sampling round
            single = [scrape(self.port)[1] for _ in range(100)]
            at_start = process_stats(agent)

            def spawn(name: str, target, *a) -> None:  # type: ignore[no-untyped-def]
                t = threading.Thread(target=target, args=a, name=name, daemon=True)
                threads.append(t)
                t.start()

            spawn("restarts", self.restarts, kubelet)
            spawn("prober", self.prober)
            spawn("streams", self.streams)
            for i in range(self.args.scrapers):
                spawn(f"scraper-{i}", self.scraper)
            for i in range(self.args.slow_clients):
                spawn(f"slow-{i}", self.slow_client)
            for i in range(self.args.grpc_clients):
                spawn(f"grpc-{i}", self.grpc_traffic, ids)
            self.stop.wait(self.args.seconds)
            self.stop.set()
            for t in threads:
                t.join(15.0)
            time.sleep(1.0)  # let the agent close what the clients left
            at_end = process_stats(agent)
            alive = proc.poll() is None
        finally:
            self.stop.set()
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            kubelet.stop()
            podres.stop()
        rec = self.rec
        single_p99 = percentile(single, 99) or 0.0
        concurrent_p99 = percentile(rec.latencies.get("scrape", []), 99) or 0.0
        tracebacks = sum("Traceback" in line for line in self.stderr_lines)
        return {
            "machine": self.args.machine,
            "seconds": self.args.seconds,
            "load": {
                "scrapers": self.args.scrapers, "scrape_interval_s": self.args.scrape_interval,
                "slow_clients": self.args.slow_clients,
                "extra_streams": self.args.streams, "grpc_clients": self.args.grpc_clients,
                "restart_every_s": self.args.restart_every,
            },
            "agent_at_start": at_start,
            "agent_at_end": at_end,
            "agent_alive_at_end": alive,
            "exit_code": proc.returncode,
            "single_scrape": ms(single),
            "latency": {kind: ms(v) for kind, v in sorted(rec.latencies.items())},
            "errors": rec.errors,  # gRPC UNAVAILABLE: calls while a restarted kubelet had removed the socket
            "scrape_p99_over_single_p99": round(concurrent_p99 / single_p99, 1) if single_p99 else None,
            "tracebacks_in_agent_log": tracebacks,
            "agent_log_lines": len(self.stderr_lines),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the load runs (default: 60)")
    parser.add_argument("--machine", default="dgx2", help="simulated machine (default: dgx2, 16 GPUs)")
    parser.add_argument("--scrapers", type=int, default=50, help="concurrent /metrics scrapers (default: 50)")
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="seconds between one scraper's scrapes; 0: back to back (default: 1)")
    parser.add_argument("--slow-clients", type=int, default=20, help="half-sent HTTP requests held (default: 20)")
    parser.add_argument("--streams", type=int, default=8, help="extra ListAndWatch streams (default: 8)")
    parser.add_argument("--grpc-clients", type=int, default=4, help="unary gRPC callers (default: 4)")
    parser.add_argument("--restart-every", type=float, default=5.0, help="seconds between kubelet restarts")
    parser.add_argument("--json", metavar="FILE", help="also write the result here")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="soak", dir="/tmp")  # unix socket paths stay short
    try:
        result = Soak(args, workdir).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
