"""``doctor``'s wall time on every built-in machine, with a healthy stand-in kubelet (the
issue's goal: under 10 s on a healthy node).

    .venv/bin/python bench/bench_doctor.py [--rounds N] [--json FILE]

Each round runs ``gpu-topology-agent doctor --format json --simulate MACHINE`` as a new
process (interpreter start included, as an operator meets it) against the stand-in kubelet
of ``agent/demo/kubelet.py`` (``kubelet.sock``, the pod-resources socket) and a kubelet
configuration file; ``a100-mig`` with ``--mig-strategy mixed``. Prints per machine the
median wall time, the checks' own time (the report's ``duration_s``), the slowest check and
the PASS/WARN/FAIL counts, as one JSON object. One run's figures, not a guarantee.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent.demo.kubelet import KubeletStub, PodResourcesStub  # noqa: E402
from agent.hw.sim.machines import BUILTIN_MACHINES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    out: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="gta-bench-doctor-") as tmp:
        kubelet = KubeletStub(os.path.join(tmp, "device-plugins")).start()
        pod_resources = PodResourcesStub(os.path.join(tmp, "pod-resources.sock")).start()
        config = os.path.join(tmp, "kubelet-config.yaml")
        with open(config, "w", encoding="utf-8") as f:
            f.write("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n")
        try:
            for machine in BUILTIN_MACHINES:
                walls, checks = [], []
                report: dict = {}
                for _ in range(args.rounds):
                    started = time.monotonic()
                    result = subprocess.run(
                        [sys.executable, "-m", "agent", "doctor", "--format", "json", "--simulate", machine,
                         "--kubelet-dir", kubelet.kubelet_dir, "--pod-resources-socket", pod_resources.socket_path,
                         "--kubelet-config", config, *(["--mig-strategy", "mixed"] if machine == "a100-mig" else [])],
                        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
                    walls.append(time.monotonic() - started)
                    report = json.loads(result.stdout)
                    checks.append(report["duration_s"])
                slowest = max(report["checks"], key=lambda c: c["duration_s"])
                out[machine] = {"wall_s_median": round(statistics.median(walls), 2),
                                "checks_s_median": round(statistics.median(checks), 2),
                                "slowest_check": slowest["check"], "summary": report["summary"]}
        finally:
            pod_resources.stop()
            kubelet.stop()
    text = json.dumps({"rounds": args.rounds, "load_average": os.getloadavg()[0], "machines": out}, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
