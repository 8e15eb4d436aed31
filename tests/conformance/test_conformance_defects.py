"""Defects the real kubelet showed (issue 11, section 2); each test failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from dmharness_cases import AGENT, CASES, Run, skip_reason

pytestmark = pytest.mark.conformance


def get(harness, name: str) -> Run:
    run = harness.run(name)
    assert run.returncode == 0 and run.summary, run.describe()
    return run


def discovered(machine: str) -> list[dict]:
    out = subprocess.run([str(AGENT), "discover", "--simulate", machine, "--format", "json"],
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)["gpus"]


@pytest.mark.parametrize("case", ["defect/lost-gpu-at-start"])
def test_gpu_lost_at_start_is_unhealthy_in_the_first_list_and_never_preferred_or_allocated(harness, case):
    run = get(harness, case)
    s = run.summary
    spec = Path(run.workdir, "machine.yaml")
    others = {g["uuid"] for g in discovered(str(spec)) if g["index"] != 3}
    unhealthy = s["endpointAfterRegistration"]["Unhealthy"]
    assert len(unhealthy) == 1 and unhealthy[0] not in others, run.describe()
    assert set(s["endpointAfterRegistration"]["Healthy"]) == others
    assert (s["capacity"], s["allocatable"]) == (8, 7), run.describe()
    lost = unhealthy[0]
    for pod in s["pods"]:
        assert lost not in (pod.get("devices") or []), pod
        assert lost not in (pod.get("pluginPreferredReconstructed") or []), pod
    # the other seven keep their NUMA node although GPU 3's is unknown
    numa = s["allocatableDeviceNUMA"]
    assert all(numa[u] for u in others), numa


@pytest.mark.parametrize("case", ["defect/numa-unknown-for-one-gpu"])
def test_one_gpu_without_numa_node_leaves_the_others_aligned(harness, case):
    """GPU 7's sysfs numa_node is -1: only its TopologyInfo is omitted; single-numa-node
    still places the other GPUs' pods on one node."""
    run = get(harness, case)
    s = run.summary
    gpus = discovered(str(Path(run.workdir, "machine.yaml")))
    numa = s["allocatableDeviceNUMA"]
    assert not numa[gpus[7]["uuid"]], numa
    assert {u: numa[g["uuid"]] for g in gpus[:7] for u in [g["uuid"]]} == {
        g["uuid"]: [g["numa_node"]] for g in gpus[:7]
    }, run.describe()
    admitted = [p for p in s["pods"] if p["phase"] == "new" and p["admit"]]
    assert [p["request"] for p in admitted] == [1, 2, 3, 1], run.describe()
    for pod in admitted:
        assert len(pod["numaSet"]) == 1 and pod["affinity"].endswith("*"), pod
        assert gpus[7]["uuid"] not in pod["devices"], pod


@pytest.mark.parametrize("case", ["defect/relative-paths"])
def test_relative_paths_are_made_absolute_and_logged_so(harness, case):
    run = get(harness, case)
    assert CASES[case].relative_paths
    work = os.path.realpath(run.workdir)
    line = next(ln for ln in run.agent_log.splitlines() if "effective configuration:" in ln)
    config = json.loads(line.split("effective configuration:", 1)[1])
    assert config["pod_resources_socket"] == f"{work}/podres/kubelet.sock", line
    assert config["features_dir"] == f"{work}/feat", line
    assert config["config_file"] is None or os.path.isabs(config["config_file"])
    assert f"{work}/podres/kubelet.sock" in run.agent_log.split(line, 1)[1]
    assert "unix://podres" not in run.agent_log and " podres/kubelet.sock" not in run.agent_log


# ----------------------------------------------------------------------------- two agents


def _agent_argv(work: str, *extra: str) -> list[str]:
    return [str(AGENT), "run", "--simulate", "dgx-h100", "--kubelet-dir", f"{work}/d",
            "--features-dir", f"{work}/feat", "--metrics-address", "127.0.0.1:0",
            "--pod-resources-socket", f"{work}/podres.sock", *extra]


def _agent(work: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(_agent_argv(work, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: str, proc: subprocess.Popen[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


@pytest.fixture
def agent_workdir():
    """A directory for agents run beside each other (no harness: runs on every backend's
    behalf, wherever the agent is installed)."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    work = tempfile.mkdtemp(dir="/tmp", prefix="c")
    yield work
    subprocess.run(["rm", "-rf", work], check=False)


def test_second_agent_on_the_same_socket_refuses_and_leaves_the_first_ones_files(agent_workdir):
    work = agent_workdir
    sock, labels = f"{work}/d/nvidia-gpu.sock", f"{work}/feat/gpu-topology-agent"
    first = _agent(work)
    try:
        _wait_for(sock, first)
        _wait_for(labels, first)
        before = (os.stat(sock).st_ino, os.stat(labels).st_ino)
        second = _agent(work)
        code, err = second.wait(timeout=30), second.communicate()[1]
        assert code == 1, err
        assert len([ln for ln in err.splitlines() if "error" in ln.lower() and sock in ln]) == 1, err
        time.sleep(0.5)  # the first agent's watch polls every 0.1 s: it must not "serve again"
        assert (os.stat(sock).st_ino, os.stat(labels).st_ino) == before
        assert first.poll() is None
    finally:
        code, err = _stop(first)
    assert code == 0, err
    assert "vanished" not in err, err
    assert not os.path.exists(sock) and not os.path.exists(labels)


def test_second_agent_with_its_own_socket_and_feature_file_names_runs_beside_the_first(agent_workdir):
    work = agent_workdir
    first = _agent(work)
    second = None
    try:
        _wait_for(f"{work}/d/nvidia-gpu.sock", first)
        _wait_for(f"{work}/feat/gpu-topology-agent", first)
        second = _agent(work, "--socket-name", "other-{resource}.sock", "--feature-file", "other-agent")
        _wait_for(f"{work}/d/other-gpu.sock", second)
        _wait_for(f"{work}/feat/other-agent", second)
        code, err = _stop(second)
        assert code == 0, err
        assert os.path.exists(f"{work}/d/nvidia-gpu.sock") and os.path.exists(f"{work}/feat/gpu-topology-agent")
        assert not os.path.exists(f"{work}/d/other-gpu.sock") and not os.path.exists(f"{work}/feat/other-agent")
    finally:
        if second is not None and second.poll() is None:
            _stop(second)
        code, err = _stop(first)
    assert code == 0, err
