"""The GPUHealthy Node condition end to end: an XID line appended to the kernel log of a
running agent (``run --simulate dgx-h100 --kernel-log FILE``) until the condition on the
stand-in API server (``tests/testbed/apiserver_stub.py``, with the RBAC and admission policy
of ``daemonset/nodefeature``) shows it; then a storm of XID lines on one GPU, counting the
API writes (condition patches, Event creates and patches) and the agent's RSS.

    python bench/bench_node_health.py            # 30 faults, a 10,000-line storm over 60 s (~2 min)
    python bench/bench_node_health.py --quick    # 6 faults, 10,000 lines over 5 s (~20 s)

Latency: each trial appends one line of a new fault (a fatal XID on a GPU, a pair not seen
before, so the condition's message must change) and polls the stand-in every 5 ms until the
stored condition differs; trials are 0.7 s apart (a message-only change is written at most
every 0.5 s). Goal: p99 <= 1 s. Nothing is asserted; the figures are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.testbed.apiserver_auth import Access, service_account  # noqa: E402
from tests.testbed.apiserver_stub import ApiServerStub  # noqa: E402

NODE = "node-1"
# dgx-h100's GPUs as the driver prints them in Xid lines
BUS = ["0000:1b:00", "0000:43:00", "0000:52:00", "0000:61:00", "0000:9d:00", "0000:c3:00", "0000:d1:00", "0000:df:00"]
FATAL_XIDS = (79, 48, 62, 64, 74, 95, 119, 120, 140)


def xid_line(gpu: int, number: int) -> str:
    return f"NVRM: Xid (PCI:{BUS[gpu]}): {number}, pid=4242, name=python3, Ch 00000008\n"


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def writes(api: ApiServerStub) -> int:
    return api.count("PATCH", "/status") + api.count("POST", "/events") + api.count("PATCH", "/events/")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 faults, the storm over 5 s")
    parser.add_argument("--trials", type=int, default=None, help="faults timed (default 30, quick 6)")
    parser.add_argument("--storm-lines", type=int, default=10_000)
    parser.add_argument("--storm-s", type=float, default=None, help="storm duration (default 60, quick 5)")
    args = parser.parse_args()
    trials = args.trials or (6 if args.quick else 30)
    storm_s = args.storm_s or (5.0 if args.quick else 60.0)

    root = tempfile.mkdtemp(prefix="bnh", dir="/tmp")
    access = Access.from_deploy("nodefeature")
    access.add_token("agent", service_account("gpu-topology-agent", "gpu-topology-agent", NODE))
    api = ApiServerStub(access=access).start()
    api.add_node(NODE)
    kernel_log = os.path.join(root, "kmsg.log")
    open(kernel_log, "w").close()
    proc_root = os.path.join(root, "proc")
    os.makedirs(os.path.join(proc_root, "sys/kernel/random"))
    with open(os.path.join(proc_root, "sys/kernel/random/boot_id"), "w", encoding="ascii") as f:
        f.write("bench-boot\n")
    kubeconfig = os.path.join(root, "kubeconfig")
    with open(kubeconfig, "w", encoding="utf-8") as f:
        f.write(f"apiVersion: v1\nkind: Config\ncurrent-context: s\nclusters:\n- name: s\n  cluster:\n    server: {api.url}\n"
                "users:\n- name: s\n  user:\n    token: agent\ncontexts:\n- name: s\n  context:\n    cluster: s\n"
                "    user: s\n")
    os.makedirs(os.path.join(root, "k"))
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "NODE_NAME", "CONFIG_FILE")}
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--simulate", "dgx-h100", "--kubelet-dir", os.path.join(root, "k"),
         "--features-dir", os.path.join(root, "f"), "--metrics-address", "127.0.0.1:0", "--pod-resources-socket", os.path.join(root, "podres.sock"),
         "--kernel-log", kernel_log, "--health-state-file", os.path.join(root, "state.json"),
         "--proc-root", proc_root, "--kubeconfig", kubeconfig, "--node-name", NODE, "--node-condition", "on"],
        cwd=ROOT, env={**env, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out: dict[str, object] = {"machine": "dgx-h100 (simulated)", "trials": trials}
    try:
        if not api.wait_until(lambda: (api.node_condition(NODE, "GPUHealthy") or {}).get("status") == "True", 60):
            raise SystemExit("the agent never wrote GPUHealthy=True")
        time.sleep(1.0)
        latencies = []
        pairs = [(g, x) for x in FATAL_XIDS for g in range(8)]
        for gpu, number in pairs[:trials]:
            before = api.node_condition(NODE, "GPUHealthy")
            with open(kernel_log, "a", encoding="utf-8") as f:
                start = time.monotonic()
                f.write(xid_line(gpu, number))
            while api.node_condition(NODE, "GPUHealthy") == before and time.monotonic() - start < 10:
                time.sleep(0.005)
            latencies.append(time.monotonic() - start)
            time.sleep(0.7)
        out["latency_s"] = {"p50": round(statistics.median(latencies), 3), "p99": round(percentile(latencies, 99), 3),
                            "max": round(max(latencies), 3)}
        time.sleep(1.0)
        rss_before = rss_kib(agent.pid)
        before = writes(api)
        batch = max(1, args.storm_lines // max(1, int(storm_s * 20)))
        start = time.monotonic()
        written = 0
        with open(kernel_log, "a", encoding="utf-8") as f:
            while written < args.storm_lines:
                n = min(batch, args.storm_lines - written)
                f.write(xid_line(7, 95) * n)
                f.flush()
                written += n
                time.sleep(max(0.0, start + storm_s * written / args.storm_lines - time.monotonic()))
        time.sleep(3.0)
        out["storm"] = {"lines": args.storm_lines, "over_s": storm_s, "api_writes": writes(api) - before,
                        "rss_kib_before": rss_before, "rss_kib_after": rss_kib(agent.pid)}
    finally:
        agent.terminate()
        try:
            agent.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
        api.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
