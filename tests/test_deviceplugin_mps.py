"""MPS sharing as the kubelet sees it: the agent's device plugins, driven by the stand-in
kubelet over real unix sockets, with the MPS control program played by
``tests/mps_control_standin.py`` (which records what it was told)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry
from waiting import eventually

from agent.config import Config, TimeSlicingResource
from agent.deviceplugin.manager import DevicePluginManager
from agent.health import HealthState
from agent.metrics.self_metrics import AgentMetrics
from tests.testbed.kubelet_stub import KubeletStub, PluginClient, hgx8_topology

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mps_control_standin.py")
H100_MIB = 81559  # hgx8_topology's GPUs
RESOURCE = "nvidia.com/gpu"


def write_program(path: str, body: str) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(body)
    os.chmod(path, stat.S_IRWXU)
    return path


def standin_program(directory: str) -> str:
    """An executable that runs the stand-in (what --mps-control-binary would name)."""
    return write_program(
        os.path.join(directory, "nvidia-cuda-mps-control"),
        f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n',
    )


class MpsNode:
    """A device-plugin manager with an MPS configuration, the stand-in kubelet and the
    stand-in control program, all under one short temporary directory."""

    def __init__(self) -> None:
        # unix socket paths are limited to 108 bytes: keep the directory short
        self.base = tempfile.mkdtemp(prefix="mps", dir="/tmp")
        self.kubelet_dir = os.path.join(self.base, "k")
        self.mps_root = os.path.join(self.base, "r")
        os.makedirs(self.kubelet_dir)
        self.program = standin_program(self.base)
        self.kubelet: KubeletStub | None = None
        self.manager: DevicePluginManager | None = None
        self.clients: list[PluginClient] = []

    def config(self, replicas: int = 4, **kwargs) -> Config:
        sharing = kwargs.pop("mps", (TimeSlicingResource(RESOURCE, replicas),))
        defaults = {"fail_requests_greater_than_one": True, "mps_control_binary": self.program}
        return replace(
            Config(), mps=sharing, kubelet_dir=self.kubelet_dir, mps_root=self.mps_root, **{**defaults, **kwargs}
        )

    def start(self, config: Config, topology=None) -> MpsNode:
        self.topology = topology or hgx8_topology()
        self.kubelet = KubeletStub(self.kubelet_dir).start()
        self.health = HealthState(self.topology.gpu_count)
        # the agent's own metrics, built first and passed in (as the daemon does)
        self.metrics = AgentMetrics(CollectorRegistry())
        self.manager = DevicePluginManager(
            self.topology, config, self.health, events=self.metrics, poll_s=0.05, supervisor_probe_s=0.1
        )
        self.manager.start()
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        return eventually(self.manager.ready, timeout_s)

    def device_metric(self, device: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "gpu_agent_device_healthy", {"resource": RESOURCE, "device": device}
        )

    def client(self, resource: str = RESOURCE) -> PluginClient:
        res = next(r for r in self.manager.resources if r.name == resource)
        c = PluginClient(os.path.join(self.kubelet_dir, res.socket_name))
        self.clients.append(c)
        return c

    def pipe_dir(self, resource: str = RESOURCE) -> str:
        return os.path.join(self.mps_root, resource, "pipe")

    def record(self, resource: str = RESOURCE) -> list[dict]:
        path = os.path.join(self.mps_root, resource, "log", "standin.jsonl")
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]

    def commands(self, resource: str = RESOURCE) -> list[str]:
        return [e["command"] for e in self.record(resource) if "command" in e]

    def starts(self, resource: str = RESOURCE) -> list[dict]:
        return [e for e in self.record(resource) if "start" in e]

    def daemon_pid(self, resource: str = RESOURCE) -> int | None:
        try:
            with open(os.path.join(self.pipe_dir(resource), "nvidia-cuda-mps-control.pid"), encoding="ascii") as fh:
                return int(fh.read())
        except (OSError, ValueError):
            return None

    def device_health(self, resource: str = RESOURCE) -> list[str] | None:
        latest = self.kubelet.latest(resource)
        return [d.health for d in latest.devices] if latest is not None else None

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        if self.manager is not None:
            self.manager.stop(0.5)
        if self.kubelet is not None:
            self.kubelet.stop()
        for root, _, files in os.walk(self.mps_root):  # a daemon a failed test left behind
            if "nvidia-cuda-mps-control.pid" in files:
                pid = self.daemon_pid(os.path.relpath(os.path.dirname(root), self.mps_root))
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def node():
    n = MpsNode()
    yield n
    n.stop()


# ---------------------------------------------------------------------- the control daemon
def test_mps_resource_registers_its_replicas_once_the_control_daemon_answers(node):
    node.start(node.config(replicas=4))
    assert node.kubelet.wait_for(lambda: node.kubelet.registered(RESOURCE), 10.0)
    assert node.kubelet.wait_for(lambda: node.device_health() == ["Healthy"] * 32, 5.0)
    ids = [d.ID for d in node.kubelet.latest(RESOURCE).devices]
    assert ids[:4] == [f"{node.topology.gpus[0].uuid}::{n}" for n in range(4)]
    assert node.wait_ready(2.0)


def test_control_daemon_gets_the_shared_gpus_its_directories_and_nvidias_default_limits(node):
    node.start(node.config(replicas=4))
    assert node.wait_ready(10.0)
    (start,) = node.starts()
    uuids = [g.uuid for g in node.topology.gpus]
    assert start["start"] == {
        "CUDA_VISIBLE_DEVICES": ",".join(uuids),
        "CUDA_MPS_PIPE_DIRECTORY": node.pipe_dir(),
        "CUDA_MPS_LOG_DIRECTORY": os.path.join(node.mps_root, RESOURCE, "log"),
    }
    # nothing of the agent's own environment reaches the daemon, as in NVIDIA's
    assert "PYTEST_CURRENT_TEST" not in start["environment"]
    told = node.commands()
    settings = told[: told.index("get_default_active_thread_percentage")]
    assert settings == [
        *(f"set_default_device_pinned_mem_limit {i} {H100_MIB // 4}M" for i in range(8)),
        "set_default_active_thread_percentage 25",
    ]
    assert os.path.isdir(os.path.join(node.mps_root, "shm"))


def test_mps_resource_is_not_advertised_while_the_control_daemon_cannot_start(node):
    failing = write_program(os.path.join(node.base, "broken-mps-control"), "#!/bin/sh\necho no GPU here >&2\nexit 1\n")
    node.start(node.config(replicas=2, mps_control_binary=failing))
    time.sleep(0.5)
    assert node.kubelet.registered(RESOURCE) == [] and not node.manager.ready()
    # the program comes back (a driver container finished installing it): retried with backoff.
    # Installed as installers do, by renaming a finished copy over it: writing into the file
    # in place races the agent's retry executing it (ETXTBSY, seen in CI)
    shutil.copy(node.program, failing + ".new")
    os.replace(failing + ".new", failing)
    assert node.kubelet.wait_for(lambda: node.kubelet.registered(RESOURCE), 10.0)
    assert node.kubelet.wait_for(lambda: node.device_health() == ["Healthy"] * 16, 5.0)


def test_killed_control_daemon_makes_the_replicas_unhealthy_until_it_is_restarted(node):
    node.start(node.config(replicas=2))
    assert node.kubelet.wait_for(lambda: node.device_health() == ["Healthy"] * 16, 10.0)
    first = node.daemon_pid()
    os.kill(first, signal.SIGKILL)
    assert node.kubelet.wait_for(lambda: node.device_health() == ["Unhealthy"] * 16, 10.0)
    assert node.kubelet.wait_for(lambda: node.device_health() == ["Healthy"] * 16, 10.0)
    assert len(node.starts()) == 2 and node.daemon_pid() not in (None, first)
    assert node.manager.ready()
    # the restarted daemon got its settings again
    assert node.commands().count("set_default_active_thread_percentage 50") == 2


def test_a_daemon_left_by_an_earlier_agent_is_told_to_quit_and_replaced(node):
    import subprocess

    env = {"CUDA_MPS_PIPE_DIRECTORY": node.pipe_dir(), "CUDA_MPS_LOG_DIRECTORY": os.path.join(node.mps_root, RESOURCE, "log"),
           "CUDA_VISIBLE_DEVICES": "GPU-old"}
    for path in env.values():
        if path.startswith("/"):
            os.makedirs(path, exist_ok=True)
    subprocess.run([node.program, "-d"], env=env, check=True, timeout=10)
    assert eventually(lambda: node.daemon_pid() is not None, 5.0)
    left = node.daemon_pid()
    node.start(node.config(replicas=2))
    assert node.wait_ready(10.0)
    old, new = node.starts()
    assert old["start"]["CUDA_VISIBLE_DEVICES"] == "GPU-old"
    assert new["start"]["CUDA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in node.topology.gpus)
    assert node.record().index({"command": "quit"}) < node.record().index(new)
    assert node.daemon_pid() != left


def test_stopping_the_plugins_tells_the_control_daemon_to_quit(node):
    node.start(node.config(replicas=2))
    assert node.wait_ready(10.0)
    node.manager.stop(0.5)
    assert node.commands()[-1] == "quit"
    assert node.daemon_pid() is None


def test_reload_keeps_a_daemon_whose_gpus_and_limits_stay_and_restarts_a_changed_one(node):
    config = node.config(replicas=2)
    node.start(config)
    assert node.wait_ready(10.0)
    node.manager.set_topology(node.topology, replace(config, log_level="DEBUG"))
    assert node.wait_ready(10.0) and len(node.starts()) == 1
    node.manager.set_topology(node.topology, node.config(replicas=4))
    assert node.kubelet.wait_for(lambda: node.device_health() == ["Healthy"] * 32, 10.0)
    record = node.record()
    second = [i for i, e in enumerate(record) if "start" in e][1]
    assert {"command": "quit"} in record[:second]  # the old daemon quit first
    after = [e["command"] for e in record[second:] if "command" in e]
    assert f"set_default_device_pinned_mem_limit 7 {H100_MIB // 4}M" in after
    assert "set_default_active_thread_percentage 25" in after


# ---------------------------------------------------------------------- Allocate
def test_allocate_hands_the_container_the_pipe_directory_shm_and_its_limits(node):
    node.start(node.config(replicas=4))
    assert node.wait_ready(10.0)
    gpu2 = node.topology.gpus[2].uuid
    resp = node.client().allocate([f"{gpu2}::3"]).container_responses[0]
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == gpu2
    assert resp.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu/pipe"
    assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={H100_MIB // 4}M"
    # besides the container's NCCL topology file (tests/test_nccl_pods.py)
    mounts = {(m.container_path, m.host_path, m.read_only) for m in resp.mounts
              if m.container_path != "/etc/nccl/topology.xml"}
    assert mounts == {
        ("/mps/nvidia.com/gpu/pipe", node.pipe_dir(), False),
        ("/dev/shm", os.path.join(node.mps_root, "shm"), False),
    }


def test_replicas_held_together_add_up_their_shares(node):
    node.start(node.config(replicas=4, fail_requests_greater_than_one=False))
    assert node.wait_ready(10.0)
    g0, g5 = node.topology.gpus[0].uuid, node.topology.gpus[5].uuid
    resp = node.client().allocate([f"{g5}::0", f"{g0}::1", f"{g5}::2"]).container_responses[0]
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == f"{g5},{g0}"
    assert resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={2 * (H100_MIB // 4)}M,1={H100_MIB // 4}M"
    # one percentage for the container: the smallest of its GPUs' shares
    assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_mps_requests_above_one_replica_are_refused_by_default(node):
    import grpc

    node.start(node.config(replicas=4))
    assert node.wait_ready(10.0)
    g0 = node.topology.gpus[0].uuid
    with pytest.raises(grpc.RpcError) as info:
        node.client().allocate([f"{g0}::0", f"{g0}::1"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum request size for shared resources is 1" in info.value.details()


def test_gpus_left_out_of_mps_are_served_whole_without_mps_settings(node):
    node.start(node.config(mps=(TimeSlicingResource(RESOURCE, 2, rename="gpu-mps", devices=("0", "1")),)))
    assert node.kubelet.wait_for(lambda: node.kubelet.registered("nvidia.com/gpu-mps"), 10.0)
    assert node.kubelet.wait_for(lambda: node.kubelet.registered(RESOURCE), 5.0)
    (start,) = node.starts("nvidia.com/gpu-mps")
    assert start["start"]["CUDA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in node.topology.gpus[:2])
    whole = node.client(RESOURCE).allocate([node.topology.gpus[4].uuid]).container_responses[0]
    assert not any(k.startswith("CUDA_MPS") for k in whole.envs)
    assert [m.container_path for m in whole.mounts] == ["/etc/nccl/topology.xml"]  # its NCCL file only
    shared = node.client("nvidia.com/gpu-mps").allocate([f"{node.topology.gpus[1].uuid}::1"]).container_responses[0]
    assert shared.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu-mps/pipe"


@pytest.mark.parametrize("policy, gpus_used", [("distributed", 2), ("packed", 1)])
def test_preferred_allocation_spreads_or_packs_mps_replicas_by_policy(node, policy, gpus_used):
    node.start(node.config(replicas=4, fail_requests_greater_than_one=False,
                           shared_devices_allocation_policy=policy))
    assert node.wait_ready(10.0)
    # ready = registered; the first device list reaches the kubelet on its ListAndWatch
    assert eventually(lambda: node.kubelet.latest(RESOURCE) is not None, 10.0)
    devices = [d.ID for d in node.kubelet.latest(RESOURCE).devices]
    chosen = node.client().preferred(devices, [], 2)
    assert len({c.split("::")[0] for c in chosen}) == gpus_used


def test_device_health_metric_follows_the_control_daemon(node):
    node.start(node.config(replicas=2))
    assert node.wait_ready(10.0)
    # ready = registered; the first device list reaches the kubelet on its ListAndWatch
    assert eventually(lambda: node.kubelet.latest(RESOURCE) is not None, 10.0)
    ids = [d.ID for d in node.kubelet.latest(RESOURCE).devices]
    assert eventually(lambda: [node.device_metric(i) for i in ids] == [1.0] * 16, 10.0)
    os.kill(node.daemon_pid(), signal.SIGKILL)
    assert eventually(lambda: [node.device_metric(i) for i in ids] == [0.0] * 16, 10.0)
    assert eventually(lambda: [node.device_metric(i) for i in ids] == [1.0] * 16, 10.0)
