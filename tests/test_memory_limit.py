"""A configuration that would not fit the agent's memory (issue 20, defect 3): a replica
count too large for the node's device lists, a YAML alias bomb. The agent runs as a real
process under the DaemonSet's memory limit, set by the test: at start it exits 2 with one
line naming the file, the field and the limit; on SIGHUP it keeps serving what it served.

The limit is ``RLIMIT_DATA`` (private writable memory) at the DaemonSet's
``limits.memory``. It is stricter than the container's cgroup limit, which counts resident
pages only (an idle agent has ~125 MiB of data mappings for ~50 MiB resident), and unlike
``RLIMIT_AS`` it does not count the address space reserved for thread stacks (the agent's
threads alone reserve more than 256 MiB of it, without touching it). Each test failed
before its fix: the agent died with a MemoryError traceback (exit 1), at start or on SIGHUP.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import yaml

from agent.config import Config, TimeSlicingResource
from agent.deviceplugin.resources import MAX_MESSAGE_BYTES, build_resources
from agent.errors import ConfigError
from tests.testbed.kubelet_stub import KubeletStub, hgx8_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def _daemonset_memory_limit() -> int:
    """``limits.memory`` of the agent's container in the shipped DaemonSet, in bytes."""
    with open(os.path.join(ROOT, "daemonset", "base", "daemonset.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    container = doc["spec"]["template"]["spec"]["containers"][0]
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", container["resources"]["limits"]["memory"]).groups()
    return int(number) * _UNITS[unit]


LIMIT = _daemonset_memory_limit()


def _under_limit(*argv: str) -> list[str]:
    """A command running ``python argv...`` under the limit. The child sets it and execs (no
    ``preexec_fn``: forking a process that runs gRPC threads is what gRPC warns against)."""
    launcher = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_DATA, ({LIMIT}, {LIMIT})); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    return [sys.executable, "-c", launcher, *argv]


@pytest.fixture(scope="module", autouse=True)
def _memory_limit_is_enforced():
    """Skip, saying why, where the machine does not enforce RLIMIT_DATA."""
    if not sys.platform.startswith("linux") or not hasattr(resource, "RLIMIT_DATA"):
        pytest.skip("RLIMIT_DATA limits the agent's memory on Linux only")
    probe = subprocess.run(_under_limit("-c", f"b = bytearray({LIMIT + (64 << 20)})"), capture_output=True, text=True)
    if "MemoryError" not in probe.stderr:
        pytest.skip(f"this machine does not enforce RLIMIT_DATA (a {LIMIT + (64 << 20)}-byte allocation worked)")


@pytest.fixture
def dirs():
    base = tempfile.mkdtemp(prefix="ml", dir="/tmp")  # unix socket paths: keep it short
    paths = {name: os.path.join(base, name) for name in ("k", "features")}
    for p in paths.values():
        os.makedirs(p)
    paths["config"] = os.path.join(base, "config.yaml")
    yield paths
    shutil.rmtree(base, ignore_errors=True)


class Agent:
    """``python -m agent run`` on the simulated dgx-h100 under the memory limit; its stderr
    lines are collected as they come."""

    def __init__(self, dirs: dict[str, str]) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("CONFIG_FILE", None)
        self.proc = subprocess.Popen(
            _under_limit(
                "-m", "agent", "run", "--simulate", "dgx-h100", "--config", dirs["config"],
                "--kubelet-dir", dirs["k"], "--features-dir", dirs["features"], "--metrics-address", "127.0.0.1:0",
                "--pod-resources-socket", os.path.join(dirs["k"], "podres.sock"),
            ),
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, text: str, count: int = 1, timeout_s: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in self.lines if text in line]
            if len(found) >= count or self.proc.poll() is not None:
                return found
            time.sleep(0.05)
        return [line for line in self.lines if text in line]

    def finish(self, timeout_s: float = 30.0) -> int:
        try:
            rc = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(5.0)
            assert self.proc.stderr is not None
            self.proc.stderr.close()
        return rc


def _replicas(n: int) -> str:
    return f"version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {n}\n"


#: The classic "billion laughs": 9 levels of 9 aliases, 9^9 strings once expanded, in the
#: one key the parser echoes when it is wrong.
ALIAS_BOMB = "version: v1\nflags:\n  migStrategy:\n  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"  - &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def test_too_many_replicas_at_start_exit_2_naming_the_file_the_field_and_the_limit(dirs):
    _write(dirs["config"], _replicas(100_000))  # 800,000 devices on 8 GPUs
    agent = Agent(dirs)
    assert agent.finish() == 2, agent.lines[-5:]
    last = agent.lines[-1]
    assert dirs["config"] in last and "sharing.timeSlicing.resources[0].replicas" in last, last
    assert "4194304 bytes (4 MiB)" in last and len(last) < 400, last
    assert not [line for line in agent.lines if "Traceback" in line or "MemoryError" in line]


def test_an_alias_bomb_at_start_exits_2_with_one_short_line_naming_the_file(dirs):
    _write(dirs["config"], ALIAS_BOMB)
    agent = Agent(dirs)
    assert agent.finish() == 2, agent.lines[-5:]
    assert len(agent.lines) == 1, agent.lines  # refused before logging starts
    assert dirs["config"] in agent.lines[0] and "50000 values" in agent.lines[0] and len(agent.lines[0]) < 300


def test_a_sighup_with_a_config_too_large_keeps_the_running_one_served(dirs):
    _write(dirs["config"], _replicas(2))
    kubelet = KubeletStub(dirs["k"]).start()
    agent = Agent(dirs)
    try:
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") is not None, 30.0), agent.lines[-5:]
        assert len(kubelet.latest("nvidia.com/gpu").devices) == 16
        for n, bad in enumerate((_replicas(100_000), ALIAS_BOMB), start=1):
            _write(dirs["config"], bad)
            agent.proc.send_signal(signal.SIGHUP)
            failed = agent.wait_line("reload failed, keeping the running configuration", count=n)
            assert len(failed) == n and agent.proc.poll() is None, agent.lines[-5:]
            assert dirs["config"] in failed[-1] and len(failed[-1]) < 500, failed[-1]
        assert "sharing.timeSlicing.resources[0].replicas" in failed[0] and "4194304 bytes" in failed[0]
        assert len(kubelet.registered("nvidia.com/gpu")) == 1  # nothing was torn down or re-registered
        assert len(kubelet.latest("nvidia.com/gpu").devices) == 16
        _write(dirs["config"], _replicas(3))  # a good file is taken again
        agent.proc.send_signal(signal.SIGHUP)
        assert kubelet.wait_for(lambda: len(kubelet.latest("nvidia.com/gpu").devices) == 24, 20.0)
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.finish() == 0, agent.lines[-5:]
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
        agent.finish()
        kubelet.stop()
    assert not [line for line in agent.lines if "Traceback" in line or "MemoryError" in line]


def test_the_largest_replica_count_accepted_is_the_largest_whose_device_list_fits_a_message():
    """The check is arithmetic on the plan; here the sizes come from protobuf itself."""
    from agent._proto import deviceplugin_v1beta1_pb2 as pb

    topology = hgx8_topology()

    def message_bytes(replicas: int) -> int:
        return pb.ListAndWatchResponse(devices=[
            pb.Device(ID=f"{g.uuid}::{n}", health="Unhealthy",
                      topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=g.numa_node)]))
            for g in topology.gpus for n in range(replicas)
        ]).ByteSize()

    low, high = 1, 10_000  # fits, does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if message_bytes(middle) <= MAX_MESSAGE_BYTES else (low, middle)
    config = Config(time_slicing=(TimeSlicingResource(replicas=low),))
    assert len(build_resources(topology, config)[0].devices) == 8 * low
    with pytest.raises(ConfigError, match=rf"{8 * high} devices, a ListAndWatch message of {message_bytes(high)} bytes"):
        build_resources(topology, Config(time_slicing=(TimeSlicingResource(replicas=high),)))


def test_many_resources_each_within_a_message_are_refused_together_beyond_the_memory_budget():
    topology = hgx8_topology()
    per_gpu = tuple(TimeSlicingResource(replicas=10_000, rename=f"gpu-{i}", devices=(str(i),)) for i in range(8))
    with pytest.raises(ConfigError) as refused:  # each list 0.6 MiB, 5.2 MiB together
        build_resources(topology, Config(time_slicing=per_gpu))
    message = str(refused.value)
    assert message.startswith("configuration: sharing.timeSlicing.resources[0,1,2,3,4,5,6,7].replicas: ")
    assert "80000 devices in 8 resources" in message and "4194304 bytes (4 MiB)" in message
    assert len(build_resources(topology, Config(time_slicing=per_gpu[:4]))) == 5  # 4 shared + the rest
