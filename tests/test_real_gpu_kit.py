"""The real-GPU kit (``bench/real_gpu/run.py``) end to end against a simulated machine and
the stand-in ``nvidia-smi`` (``tests/fake_nvidia_smi.py``): the same script a GPU machine
runs, so a renamed flag, label, metric or JSON field of the agent breaks here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "bench", "real_gpu", "run.py")
FAKE_SMI = os.path.join(ROOT, "tests", "fake_nvidia_smi.py")

#: Two NVLinked A100 pairs on two sockets, a NIC per socket, and processes on GPU 0 (so that
#: every step, the per-process one included, has something to compare).
MACHINE = {
    "name": "kit-node", "driver_version": "550.54.15", "cuda_driver_version": 12040,
    "product_name": "kit test node",
    "numa_nodes": {0: {"cpus": "0-15", "distances": [10, 20]}, 1: {"cpus": "16-31", "distances": [20, 10]}},
    "gpu_defaults": {"model": "NVIDIA A100-SXM4-80GB"},
    "gpus": [
        {"bus_id": "0000:17:00.0", "numa_node": 0, "host_bridge": "pci0000:16", "switches": ["sw0"],
         "processes": [{"pid": 4242, "used_memory_mib": 10240, "sm_util": 35, "mem_util": 12},
                       {"pid": 4343, "used_memory_mib": 2048, "sm_util": 5, "mem_util": 1}]},
        {"bus_id": "0000:31:00.0", "numa_node": 0, "host_bridge": "pci0000:30"},
        {"bus_id": "0000:97:00.0", "numa_node": 1, "host_bridge": "pci0000:96"},
        {"bus_id": "0000:b1:00.0", "numa_node": 1, "host_bridge": "pci0000:b0"},
    ],
    "nvlink": {"pairs": [[0, 1, 12], [2, 3, 12]]},
    "nics": [{"name": "mlx5_0", "bus_id": "0000:19:00.0", "numa_node": 0, "host_bridge": "pci0000:16",
              "switches": ["sw0"]},
             {"name": "mlx5_1", "bus_id": "0000:99:00.0", "numa_node": 1, "host_bridge": "pci0000:96"}],
}

# the kit's own limit is 400 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_kit(tmp_path, machine: dict | None = None, **env: str) -> tuple[int, dict, str]:
    spec = tmp_path / "kit-node.yaml"
    spec.write_text(yaml.safe_dump(machine or MACHINE))
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, KIT, "--simulate", str(spec), "--nvidia-smi", f"{sys.executable} {FAKE_SMI}",
         "--soak-s", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, FAKE_NVIDIA_SMI_MACHINE=str(spec), **env))
    with open(out / "report.json", encoding="utf-8") as f:
        report = json.load(f)
    return result.returncode, report, (out / "report.txt").read_text()


def test_the_kit_finds_no_difference_between_the_agent_and_nvidia_smi_on_a_simulated_machine(tmp_path):
    rc, report, text = run_kit(tmp_path)
    steps = report["steps"]
    assert report["differences"] == [], text
    assert rc == 0, text
    assert {name: s["status"] for name, s in steps.items()} == {
        "doctor": "ok", "topology": "ok", "labels": "ok", "allocate": "ok", "soak": "ok", "nvml": "ok",
        "processes": "ok", "mig": "skipped"}, text
    assert steps["mig"]["reason"] == "no GPU has MIG mode on (the kit never changes MIG mode)"
    assert steps["topology"]["details"] == {"gpus": 4, "nics": 2}
    assert steps["allocate"]["details"] == {"sizes": 4}
    assert steps["soak"]["details"]["devices"] == 4
    # GPU 0's scrape beside nvidia-smi's row, as compared (no busy round: no CUDA on a simulated machine)
    compared = steps["soak"]["details"]["gpu0_util_mib_c_w"]
    assert list(compared) == ["idle"] and len(compared["idle"]["agent"]) == len(compared["idle"]["nvidia_smi"]) == 4
    assert None not in compared["idle"]["agent"]
    assert steps["processes"]["details"] == {"processes": 2}
    assert text.startswith("real-GPU kit: ") and "0 differences" in text.splitlines()[0]
    # the NVML record: every path of the agent ran, and what each call gave is written down
    nvml = steps["nvml"]["details"]
    assert nvml["paths_failed"] == {} and nvml["library"] == f"simulated:{tmp_path / 'kit-node.yaml'}"
    with open(tmp_path / "report" / "nvml_calls.json", encoding="utf-8") as f:
        record = json.load(f)
    assert record["calls"]["nvmlDeviceGetCount"]["outcomes"] == ["ok int 4"]
    assert record["calls"]["nvmlDeviceGetName"]["outcomes"] == ["ok str 'NVIDIA A100-SXM4-80GB'"]
    assert "error NVMLError_Timeout" in record["calls"]["nvmlEventSetWait_v2"]["outcomes"]
    assert nvml["functions"] == len(record["calls"]) > 30


def test_nvml_records_are_compared_call_by_call(tmp_path):
    """``nvml_calls.py --compare REAL FAKE``: a function one side alone called, or a kind of
    outcome one side alone gave, is a difference; values alone (another GPU's name) are not."""
    tool = os.path.join(ROOT, "bench", "real_gpu", "nvml_calls.py")
    real = {"library": "pynvml", "calls": {
        "nvmlDeviceGetName": {"calls": 1, "outcomes": ["ok str 'NVIDIA H200'"]},
        "nvmlDeviceGetMigMode": {"calls": 1, "outcomes": ["ok list[2] of int"]},
        "nvmlDeviceGetSerial": {"calls": 1, "outcomes": ["ok str '1650'"]}}}
    fake = {"library": "simulated:x", "calls": {
        "nvmlDeviceGetName": {"calls": 1, "outcomes": ["ok str 'NVIDIA A10'"]},
        "nvmlDeviceGetMigMode": {"calls": 1, "outcomes": ["error NVMLError_NotSupported"]}}}
    (tmp_path / "real.json").write_text(json.dumps(real))
    (tmp_path / "fake.json").write_text(json.dumps(fake))
    result = subprocess.run([sys.executable, tool, "--compare", str(tmp_path / "real.json"), str(tmp_path / "fake.json")],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        "nvmlDeviceGetMigMode: real ['ok list[2]'], fake ['error NVMLError_NotSupported']",
        "nvmlDeviceGetSerial: called on the real GPU ([\"ok str '1650'\"]), not by the fake's run"]
    (tmp_path / "fake.json").write_text(json.dumps(real))
    same = subprocess.run([sys.executable, tool, "--compare", str(tmp_path / "real.json"), str(tmp_path / "fake.json")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (same.returncode, same.stdout) == (0, "no differences\n")


def test_the_kit_reports_where_nvidia_smi_and_the_agent_disagree(tmp_path):
    rc, report, text = run_kit(tmp_path, FAKE_NVIDIA_SMI_DRIVER="560.35.03")
    assert rc == 1
    assert {"step": "labels", "what": "nvidia.com/cuda.driver-version.full", "agent": "550.54.15",
            "nvidia_smi": "560.35.03"} in report["differences"]
    assert "DIFF labels: nvidia.com/cuda.driver-version.full: agent '550.54.15', nvidia-smi '560.35.03'" in text


def test_on_a_gpu_with_mig_on_the_kit_creates_and_destroys_one_instance_and_leaves_the_others(tmp_path):
    machine = {"name": "kit-mig", "driver_version": "550.54.15", "cuda_driver_version": 12040,
               "gpus": [{"bus_id": "0000:17:00.0", "model": "NVIDIA H100 80GB HBM3", "mig": ["3g.40gb", "1g.10gb"]},
                        {"bus_id": "0000:31:00.0", "model": "NVIDIA H100 80GB HBM3"}]}
    rc, report, text = run_kit(tmp_path, machine)
    mig = report["steps"]["mig"]
    assert (mig["status"], mig["differences"]) == ("ok", []), text
    # the smallest profile on the first free placement: the spec's 3g sits on 0-3, its 1g on 4
    assert {k: mig["details"][k] for k in ("gpu", "profile", "placement", "instances_left_alone")} == {
        "gpu": 0, "profile": "1g.10gb", "placement": [5, 1], "instances_left_alone": 2}
