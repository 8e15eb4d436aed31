"""The real-GPU kit: what the agent reads through NVML, against NVIDIA's own tools, on a
machine with NVIDIA GPUs and ``nvidia-smi``. One entry, within 8 minutes::

    python bench/real_gpu/run.py [--out DIR] [--soak-s 120]

Steps (each recorded in the report, a failing one does not stop the others):

1. ``doctor``: the node checks, as they come out (findings, not differences: a workstation
   has no kubelet);
2. ``topology``: ``discover --format json`` (NVML) against ``nvidia-smi topo -m`` read by
   the agent's own matrix reader (NVLinks and PCIe level per pair, NUMA nodes, NICs);
3. ``labels``: ``labels`` against ``nvidia-smi -q`` and ``--query-gpu=compute_cap``
   (product, memory, driver, compute capability, MIG capability, count);
4. ``allocate``: ``allocate --size K`` for every K from 1 to the GPU count;
5. ``soak``: the agent in ``run`` mode against the stand-in kubelet
   (``agent.demo.kubelet``) for ``--soak-s``: registration, ListAndWatch (every GPU
   discovered is advertised, all Healthy throughout), Allocate of each GPU, and a
   ``/metrics`` scrape against ``--query-gpu`` (utilisation, memory, temperature, power,
   within the tolerances of ``compare.py``), idle and again with GPU 0 busy (the workload of
   step 7, after one sampling round of the agent's);
6. ``nvml``: every NVML call the agent makes (discovery, telemetry, events, the doctor's
   per-GPU status) and each call's outcome, recorded by ``nvml_calls.py`` into
   ``nvml_calls.json`` in ``--out``: compare it with the fake's record of a like machine
   (``nvml_calls.py --compare``) to see where the simulator differs from this driver;
7. ``processes``: while a process uses GPU 0, the agent's per-process memory and SM
   utilisation against ``--query-compute-apps`` and ``pmon``. The process is a matrix
   multiply loop in PyTorch or CuPy, whichever is installed (``nvidia-smi`` holds no CUDA
   context); without either the step is skipped and says so;
8. ``mig``: where a GPU already has MIG mode on, one instance of its smallest profile made on
   a free placement through the agent's path (``NvmlBackend.create_mig``) and compared with
   ``nvidia-smi mig -lgi``, then destroyed and compared again. The kit never changes MIG
   mode, never resets a GPU and never touches an instance it did not make; elsewhere the step
   is skipped and says why.

It writes ``report.json`` and ``report.txt`` in ``--out`` listing every difference, and
exits 0 when there is none (and no step failed), 1 otherwise.

In the test suite the same script runs against a simulated machine (``--simulate MACHINE``,
``--nvidia-smi "python tests/fake_nvidia_smi.py"`` printing that machine), so a renamed flag,
label or metric breaks a test rather than the kit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import (  # noqa: E402
    compare_labels,
    compare_metrics,
    compare_processes,
    compare_topology,
    difference,
    parse_labels,
    parse_metrics,
    parse_pmon,
    parse_smi_query,
)
from nvml_calls import record_calls  # noqa: E402

#: A row of ``nvidia-smi mig -lgi``: GPU, name, profile id, instance id, start:size.
_LGI_ROW = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s*\|", re.MULTILINE)
#: The whole kit stays within this (the issue's 8 minutes, less a margin).
BUDGET_S = 450.0
#: The agent's sampling interval in run mode (``sample_interval_s``'s default).
_SAMPLE_INTERVAL_S = 10.0
_WORKLOADS = {
    "torch": "import time, torch\nx = torch.randn(4096, 4096, device='cuda:0')\nend = time.time() + {s}\n"
             "while time.time() < end:\n    y = x @ x\n    torch.cuda.synchronize()\n",
    "cupy": "import time, cupy\nx = cupy.random.rand(4096, 4096, dtype=cupy.float32)\nend = time.time() + {s}\n"
            "while time.time() < end:\n    y = x @ x\n    cupy.cuda.Device(0).synchronize()\n",
}


class Kit:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smi_cmd = shlex.split(args.nvidia_smi)
        self.agent_cmd = shlex.split(args.agent) if args.agent else [sys.executable, "-m", "agent"]
        self.sim = ["--simulate", args.simulate] if args.simulate else []
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        self.started = time.monotonic()
        self.discovered: dict[str, Any] = {}
        #: GPU 0's utilisation %, memory used MiB, temperature C, power W: agent and nvidia-smi
        self.compared: dict[str, dict[str, list[Any]]] = {}

    def left_s(self) -> float:
        return BUDGET_S - (time.monotonic() - self.started)

    def smi(self, *args: str) -> str:
        return subprocess.run([*self.smi_cmd, *args], capture_output=True, text=True, check=True,
                              timeout=60, env=self.env).stdout

    def agent(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.agent_cmd, *args], capture_output=True, text=True, check=check,
                              timeout=90, cwd=ROOT, env=self.env)

    # ------------------------------------------------------------------ steps
    def doctor(self) -> dict[str, Any]:
        result = self.agent("doctor", "--format", "json", *self.sim, check=False)
        report = json.loads(result.stdout)
        findings = [f"{c['status']} {c['check']}: {c['found']}" for c in report["checks"] if c["status"] != "PASS"]
        return {"details": {"summary": report["summary"], "duration_s": report["duration_s"], "findings": findings}}

    def topology(self) -> dict[str, Any]:
        self.discovered = json.loads(self.agent("discover", "--format", "json", *self.sim).stdout)
        return {"differences": compare_topology(self.discovered, self.smi("topo", "-m")),
                "details": {"gpus": len(self.discovered["gpus"]), "nics": len(self.discovered["nics"])}}

    def labels(self) -> dict[str, Any]:
        labels = parse_labels(self.agent("labels", *self.sim).stdout)
        query = parse_smi_query(self.smi("-q"))
        caps = [line.strip() for line in self.smi("--query-gpu=compute_cap", "--format=csv,noheader,nounits").splitlines()]
        return {"differences": compare_labels(labels, query, caps), "details": {"labels": len(labels)}}

    def allocate(self) -> dict[str, Any]:
        plain = [g for g in self.discovered.get("gpus", []) if not g.get("mig_enabled") and not g.get("lost")]
        out = []
        for size in range(1, len(plain) + 1):
            result = self.agent("allocate", "--size", str(size), "--format", "json", *self.sim, check=False)
            if result.returncode != 0:
                out.append(difference("allocate", f"size {size}", result.stderr.strip()[:300], "an allocation"))
                continue
            indices = json.loads(result.stdout)["indices"]
            if len(indices) != size or len(set(indices)) != size:
                out.append(difference("allocate", f"size {size}", indices, f"{size} distinct GPUs"))
        return {"differences": out, "details": {"sizes": len(plain)}}

    def soak(self) -> dict[str, Any]:
        from agent.demo.kubelet import KubeletStub, PluginClient, PodResourcesStub

        with tempfile.TemporaryDirectory(prefix="gta-real-gpu-") as tmp:
            kubelet = KubeletStub(os.path.join(tmp, "device-plugins")).start()
            pod_resources = PodResourcesStub(os.path.join(tmp, "pod-resources.sock")).start()
            port, probe_port = _free_port(), _free_port()
            with open(os.path.join(tmp, "agent.log"), "w", encoding="utf-8") as log:
                agent = subprocess.Popen(
                    [*self.agent_cmd, "run", *self.sim, "--kubelet-dir", kubelet.kubelet_dir,
                     "--pod-resources-socket", pod_resources.socket_path, "--features-dir", os.path.join(tmp, "f"),
                     "--metrics-address", f"127.0.0.1:{port}", "--probe-address", f"127.0.0.1:{probe_port}"],
                    cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
            try:
                return self._soak(kubelet, PluginClient, port)
            finally:
                agent.terminate()
                code = agent.wait(30)
                pod_resources.stop()
                kubelet.stop()
                if code != 0:
                    with open(os.path.join(tmp, "agent.log"), encoding="utf-8", errors="replace") as f:
                        raise RuntimeError(f"the agent exited {code}: {f.read()[-800:]}")

    def _soak(self, kubelet: Any, plugin_client: Callable[[str], Any], port: int) -> dict[str, Any]:
        out: list[dict[str, Any]] = []
        resource = "nvidia.com/gpu"
        expected = sorted(g["uuid"] for g in self.discovered["gpus"] if not g.get("mig_enabled"))
        registered_at = time.monotonic()
        if not kubelet.wait_for(lambda: kubelet.latest(resource) is not None, timeout_s=60):
            return {"differences": [difference("soak", "registration and first device list", None, expected)]}
        registered_s = time.monotonic() - registered_at
        devices = kubelet.latest(resource).devices
        advertised = sorted(d.ID for d in devices)
        if advertised != expected:
            out.append(difference("soak", "devices advertised", advertised, expected))
        client = plugin_client(os.path.join(kubelet.kubelet_dir, "nvidia-gpu.sock"))
        try:
            for device_id in advertised:
                envs = dict(client.allocate([device_id]).container_responses[0].envs)
                if envs.get("NVIDIA_VISIBLE_DEVICES") != device_id:
                    out.append(difference("soak", f"Allocate {device_id}", envs.get("NVIDIA_VISIBLE_DEVICES"), device_id))
        finally:
            client.close()
        time.sleep(1.0)  # the sampler's first round
        out += self._compare_scrape(port, "idle")
        worker = self._start_workload(40)
        if worker is not None:  # the same comparison with GPU 0 busy (utilisation, power, memory up)
            try:
                time.sleep(_SAMPLE_INTERVAL_S + 4.0)  # a sampling round of the agent's with the load on
                out += [dict(d, what=f"busy GPU0: {d['what']}") for d in self._compare_scrape(port, "busy")]
            finally:
                worker.kill()
                worker.wait()
        soak_s = max(0.0, min(self.args.soak_s, self.left_s() - 60))
        unhealthy: set[str] = set()
        end = time.monotonic() + soak_s
        while time.monotonic() < end:
            unhealthy |= {d.ID for d in kubelet.latest(resource).devices if d.health != "Healthy"}
            time.sleep(0.5)
        if unhealthy:
            out.append(difference("soak", "devices Unhealthy during the soak", sorted(unhealthy), []))
        return {"differences": out, "details": {"registered_s": round(registered_s, 2), "soak_s": round(soak_s, 1),
                                                "gpu0_util_mib_c_w": self.compared,
                                                "devices": len(advertised), "list_updates": len(
                                                    kubelet.device_lists.get(resource, []))}}

    def nvml(self) -> dict[str, Any]:
        record = record_calls(self.args.simulate)
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "nvml_calls.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        failed = {k: v for k, v in record["steps"].items() if v != "ok" and k != "sample fields"}
        errors = sorted(name for name, entry in record["calls"].items()
                        if any(o.startswith(("error", "raised")) for o in entry["outcomes"]))
        return {"details": {"library": record["library"], "functions": len(record["calls"]),
                            "functions_with_errors": errors, "paths_failed": failed}}

    def _compare_scrape(self, port: int, label: str) -> list[dict[str, Any]]:
        """One ``/metrics`` scrape against ``nvidia-smi --query-gpu`` right after it; GPU 0's
        values of both go into :attr:`compared` under ``label``."""
        metrics = parse_metrics(_scrape(port))
        rows = [line.split(",") for line in self.smi(
            "--query-gpu=index,utilization.gpu,memory.used,temperature.gpu,power.draw",
            "--format=csv,noheader,nounits").splitlines() if line.strip()]
        if rows:
            names = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE")
            self.compared[label] = {"agent": [metrics.get(n, {}).get(rows[0][0].strip()) for n in names],
                                    "nvidia_smi": [c.strip() for c in rows[0][1:]]}
        return compare_metrics(metrics, rows)

    def _start_workload(self, seconds: int) -> subprocess.Popen[bytes] | None:
        """A matrix-multiply loop on GPU 0 for ``seconds`` (PyTorch or CuPy), after its CUDA
        context is up; None on a simulated machine or with neither library."""
        library = next((m for m in _WORKLOADS if importlib.util.find_spec(m) is not None), None)
        if self.args.simulate or library is None:
            return None
        worker = subprocess.Popen([sys.executable, "-c", _WORKLOADS[library].format(s=seconds)])
        time.sleep(8.0)  # context creation and the first driver samples
        return worker

    def processes(self) -> dict[str, Any]:
        worker = self._start_workload(30)
        if worker is None and not self.args.simulate:
            return {"skipped": "no way to start a CUDA process here: neither torch nor cupy is installed"
                               " (nvidia-smi holds no context)"}
        try:
            mine = self._agent_processes()
            if not mine and self.args.simulate:
                return {"skipped": f"simulated machine {self.args.simulate} states no processes"}
            apps = {int(r.split(",")[0]): float(r.split(",")[2]) for r in self.smi(
                "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits").splitlines()
                if r.strip() and r.split(",")[0].strip().isdigit()}
            pmon = parse_pmon(self.smi("pmon", "-c", "1", "-s", "u"))
            return {"differences": compare_processes(mine, apps, pmon), "details": {"processes": len(mine)}}
        finally:
            if worker is not None:
                worker.kill()
                worker.wait()

    def mig(self) -> dict[str, Any]:
        """Where a GPU already has MIG on: one instance of its smallest profile on a free
        placement through the agent's path (``NvmlBackend.create_mig``), compared with
        ``nvidia-smi mig -lgi``, destroyed, compared again. MIG mode is never changed, no GPU
        reset, and no instance the kit did not create is touched."""
        from agent.discovery import open_backend

        if self.args.simulate:  # nvidia-smi runs in another process: it sees the layout there
            os.makedirs(self.args.out, exist_ok=True)
            state = os.path.join(os.path.abspath(self.args.out), "simulated-mig-state.json")
            os.environ["GPU_AGENT_SIM_STATE"] = self.env["GPU_AGENT_SIM_STATE"] = state
        backend, sim = open_backend(self.args.simulate)
        backend.init()
        try:
            gpus = backend.read_facts().gpus
            target = next((g for g in gpus if g.mig_enabled and g.mig_geometry is not None and not g.lost), None)
            if target is None:
                return {"skipped": "no GPU has MIG mode on (the kit never changes MIG mode)"
                        if not any(g.mig_enabled for g in gpus) else "the MIG GPUs offer no MIG profile to NVML here"}
            return self._mig_on(backend, target)
        finally:
            backend.shutdown()
            if sim is not None:
                sim.close()

    def _lgi(self, index: int) -> list[tuple[int, str, int, int]]:
        """``nvidia-smi mig -lgi -i N``: (GPU instance id, profile, start, size) of each."""
        result = subprocess.run([*self.smi_cmd, "mig", "-lgi", "-i", str(index)], capture_output=True, text=True,
                                timeout=60, env=self.env)
        return sorted((int(m[4]), m[2], int(m[5]), int(m[6])) for m in _LGI_ROW.finditer(result.stdout))

    def _mig_on(self, backend: Any, gpu: Any) -> dict[str, Any]:
        from agent.errors import MigError

        def agent_view() -> list[tuple[int, str, int, int]]:
            return sorted((m.gi_id, m.profile, m.placement.start, m.placement.size)
                          for m in backend.mig_instances(gpu.index))

        out: list[dict[str, Any]] = []
        before, smi_before = agent_view(), self._lgi(gpu.index)
        if before != smi_before:
            out.append(difference("mig", f"GPU {gpu.index} instances before", before, smi_before))
        smallest = min(gpu.mig_geometry.profiles, key=lambda p: (p.memory_mib, p.compute_slices, p.profile_id))
        used = {s for _, _, start, size in before for s in range(start, start + size)}
        made, refused = None, []
        for placement in smallest.placements:
            if used & set(placement.slices):
                continue
            try:
                made = backend.create_mig(gpu.index, smallest.name, placement.start)
                break
            except MigError as exc:  # taken by compute slices, or by another tool meanwhile
                refused.append(str(exc))
        if made is None:
            return {"skipped": f"GPU {gpu.index}: no free placement for {smallest.name}", "details": {
                "instances": before, "refused": refused}}
        try:
            row = (made.gi_id, made.profile, made.placement.start, made.placement.size)
            smi_during = self._lgi(gpu.index)
            if smi_during != sorted([*smi_before, row]):
                out.append(difference("mig", f"GPU {gpu.index} after creating {smallest.name}", row, smi_during))
        finally:
            backend.destroy_mig(gpu.index, made.gi_id)  # only the kit's own instance
        smi_after = self._lgi(gpu.index)
        if smi_after != smi_before or agent_view() != before:
            out.append(difference("mig", f"GPU {gpu.index} after destroying it", agent_view(), smi_after))
        return {"differences": out, "details": {"gpu": gpu.index, "profile": smallest.name,
                                                "placement": [made.placement.start, made.placement.size],
                                                "uuid": made.uuid, "instances_left_alone": len(before)}}

    def _agent_processes(self) -> dict[int, tuple[int | None, int | None]]:
        """pid -> (used MiB, SM %) of every GPU's processes, read by the agent's backend (two
        rounds, 1 s apart: per-process utilisation is a difference of samples)."""
        from agent.discovery import open_backend

        backend, sim = open_backend(self.args.simulate)
        backend.init()
        try:
            source = backend.sample_source()
            count = len(self.discovered["gpus"])
            for i in range(count):
                source.sample(i)
            time.sleep(1.0)
            out: dict[int, tuple[int | None, int | None]] = {}
            for i in range(count):
                sample = source.sample(i)
                for p in (sample.processes or ()) if sample is not None else ():
                    used = p.used_memory_bytes >> 20 if p.used_memory_bytes is not None else None
                    out[p.pid] = (used, p.sm_util_pct)
            source.close()
            return out
        finally:
            backend.shutdown()
            if sim is not None:
                sim.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def report_text(report: dict[str, Any]) -> str:
    lines = [f"real-GPU kit: {report['machine']}, {report['duration_s']:.0f} s,"
             f" {len(report['differences'])} differences"]
    for name, step in report["steps"].items():
        details = {k: v for k, v in (step.get("details") or {}).items() if k != "findings"}
        lines.append(f"{step['status']:<11} {name}: {json.dumps(details or step.get('reason') or '')}")
        for finding in (step.get("details") or {}).get("findings", []):
            lines.append(f"            {finding}")
    for d in report["differences"]:
        lines.append(f"DIFF {d['step']}: {d['what']}: agent {d['agent']!r}, nvidia-smi {d['nvidia_smi']!r}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare the agent's NVML path with nvidia-smi on this machine.")
    parser.add_argument("--out", default="real-gpu-report", help="where report.json and report.txt go")
    parser.add_argument("--soak-s", type=float, default=120.0, help="how long run mode is watched (default 120)")
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi command (default: nvidia-smi)")
    parser.add_argument("--agent", default="", help="the agent's command (default: this checkout's python -m agent)")
    parser.add_argument("--simulate", default=None, metavar="MACHINE", help="a simulated machine (the test suite)")
    args = parser.parse_args(argv)
    kit = Kit(args)
    steps: dict[str, dict[str, Any]] = {}
    differences: list[dict[str, Any]] = []
    for name in ("doctor", "topology", "labels", "allocate", "soak", "nvml", "processes", "mig"):
        started = time.monotonic()
        try:
            result = getattr(kit, name)()
        except Exception as exc:  # one step failing must not hide the others' results
            result = {"error": f"{type(exc).__name__}: {exc}"}
        found = result.get("differences", [])
        differences += found
        status = ("error" if "error" in result else "skipped" if "skipped" in result
                  else "differences" if found else "ok")
        steps[name] = {"status": status, "duration_s": round(time.monotonic() - started, 2),
                       "details": result.get("details"), "reason": result.get("error") or result.get("skipped"),
                       "differences": found}
    report = {"machine": args.simulate or socket.gethostname(), "duration_s": round(time.monotonic() - kit.started, 1),
              "steps": steps, "differences": differences}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    text = report_text(report)
    with open(os.path.join(args.out, "report.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    sys.stdout.write(text)
    return 1 if differences or any(s["status"] == "error" for s in steps.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
