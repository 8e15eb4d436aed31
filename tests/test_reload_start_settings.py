"""A SIGHUP that changes what applies at start only (issue 20, defect 5).

The mode and the DRA settings are read once, at start. A reload whose file asks for another
mode (either way) or other DRA settings keeps the running ones, says so in one warning, and
the configuration it then logs as effective is the one that runs: the kubelet still sees
the same servers (device-plugin sockets, or the DRA plugin's), never both. Everything else
in the same file is applied. Real agent processes, seen through their logs and their
kubelet-facing sockets. Both tests failed before the fix: the reloaded configuration said
the mode asked for while the other one kept serving.

A reload's ``deviceIDStrategy`` reaches the metrics too (issue 26): the pods' GPUs on
``/metrics`` are attributed by the strategy in force, seen through a real process's
``/metrics``. That test failed before the fix: the attribution kept the start's strategy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.request

from agent_run import AgentRun
from test_dra_daemon import DRIVER, Node
from waiting import eventually

from tests.testbed.kubelet_stub import KubeletStub, PodResourcesStub
from tests.testbed.metrics_support import listing, pod

WARNING = "apply at start only"


def _tail(agent: AgentRun) -> str:
    return agent.log()[-3000:]


def test_a_reload_asking_for_dra_keeps_serving_device_plugins_and_says_so():
    base = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # unix socket paths: keep it short
    dirs = {n: os.path.join(base, n) for n in ("k", "features", "reg", "plugins")}
    for d in dirs.values():
        os.makedirs(d)
    config = os.path.join(base, "config.yaml")
    with open(config, "w", encoding="utf-8") as fh:
        fh.write("version: v1\n")
    kubelet = KubeletStub(dirs["k"]).start()
    agent = AgentRun([
        "--config", config, "--simulate", "dgx-h100", "--kubelet-dir", dirs["k"],
        "--features-dir", dirs["features"], "--metrics-address", "127.0.0.1:0",
        "--pod-resources-socket", os.path.join(dirs["k"], "podres.sock"),
        "--plugins-registry-dir", dirs["reg"], "--plugins-dir", dirs["plugins"],
    ], os.path.join(base, "agent.log"))
    try:
        assert kubelet.wait_for(lambda: kubelet.registered("nvidia.com/gpu"), 20.0), _tail(agent)
        with open(config, "w", encoding="utf-8") as fh:
            fh.write("version: v1\nmode: dra\ndra:\n  driverName: other.example.com\n"
                     "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n")
        agent.signal(signal.SIGHUP)
        assert eventually(lambda: agent.effective(), 10.0), _tail(agent)
        (effective,) = agent.effective()
        assert effective["mode"] == "device-plugin" and effective["driver_name"] == DRIVER, effective
        assert effective["time_slicing"][0]["replicas"] == 2, "the rest of the file is applied"
        (warning,) = agent.lines(WARNING)
        assert "mode 'dra' (running 'device-plugin')" in warning and "driver_name 'other.example.com'" in warning
        # the kubelet sees the device plugin, re-registered with the new replicas; no DRA plugin
        assert kubelet.wait_for(lambda: len(kubelet.registered("nvidia.com/gpu")) == 2, 10.0), _tail(agent)
        assert kubelet.wait_for(
            lambda: len(getattr(kubelet.latest("nvidia.com/gpu"), "devices", ())) == 16, 10.0), _tail(agent)
        assert os.listdir(dirs["reg"]) == [] and os.listdir(dirs["plugins"]) == []
        assert agent.stop() == 0, _tail(agent)
    finally:
        agent.kill()
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_reload_asking_for_device_plugins_keeps_serving_dra_and_applies_the_rest():
    node = Node()
    config = os.path.join(node.root, "config.yaml")
    with open(config, "w", encoding="utf-8") as fh:
        fh.write("version: v1\nmode: dra\n")
    args = [a for a in node.args() if a not in ("--mode", "dra")]  # the mode comes from the file
    agent = AgentRun(["--config", config, "--simulate", "dgx-h100", "--metrics-address", "127.0.0.1:0", *args],
                     os.path.join(node.root, "agent.log"))
    try:
        node.kubelet_registers()
        assert node.api.wait_for(lambda s: len(s) > 0, 20.0), _tail(agent)
        with open(config, "w", encoding="utf-8") as fh:
            fh.write("version: v1\nmode: device-plugin\ndra:\n  driverName: other.example.com\n"
                     "flags:\n  plugin:\n    deviceIDStrategy: index\n")
        agent.signal(signal.SIGHUP)
        assert eventually(lambda: agent.effective(), 10.0), _tail(agent)
        (effective,) = agent.effective()
        assert effective["mode"] == "dra" and effective["driver_name"] == DRIVER, effective
        assert effective["device_id_strategy"] == "index"
        (warning,) = agent.lines(WARNING)
        assert "mode 'device-plugin' (running 'dra')" in warning and "driver_name 'other.example.com'" in warning
        # still the DRA plugin, under its driver name; no device-plugin socket
        assert os.path.exists(node.registration_socket) and os.path.exists(node.dra_socket)
        assert os.listdir(node.dirs["k"]) == []
        # a claim prepared now follows what the reload did apply
        claim = node.put_claim("after-sighup", ["gpu-3"])
        assert node.prepare(claim).claims[claim["metadata"]["uid"]].error == ""
        (spec,) = os.listdir(node.dirs["cdi"])
        with open(os.path.join(node.dirs["cdi"], spec), encoding="utf-8") as fh:
            assert "NVIDIA_VISIBLE_DEVICES=3" in json.load(fh)["containerEdits"]["env"]
        assert agent.stop() == 0, _tail(agent)
    finally:
        agent.kill()
        node.close()


def _metrics_text(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def test_a_reload_changing_the_device_id_strategy_attributes_the_pods_gpus_by_it():
    # the kubelet lists the pod's GPU by index, as a device plugin with deviceIDStrategy:
    # index advertised it: under uuid that ID is no GPU of ours, under index it is GPU 3
    root = tempfile.mkdtemp(prefix="rld", dir="/tmp")
    kubelet_dir, features = os.path.join(root, "k"), os.path.join(root, "f")
    os.makedirs(kubelet_dir)
    config = os.path.join(root, "config.yaml")
    with open(config, "w", encoding="utf-8") as fh:
        fh.write("version: v1\nmetrics:\n  podResourcesRefreshSeconds: 0.1\n")
    socket_path = os.path.join(root, "podres.sock")
    pods = listing(pod("ml", "train-0", {"main": [("nvidia.com/gpu", ["3"])]}))
    stub = PodResourcesStub(socket_path, pods).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    agent = AgentRun(["--config", config, "--simulate", "dgx-h100", "--kubelet-dir", kubelet_dir,
                      "--features-dir", features, "--pod-resources-socket", socket_path,
                      "--metrics-address", f"127.0.0.1:{port}", "--probe-address", "127.0.0.1:0"],
                     os.path.join(root, "agent.log"))
    try:
        assert eventually(lambda: "DCGM_FI_DEV_GPU_UTIL{" in _metrics_text(port), 20.0), _tail(agent)
        time.sleep(0.5)  # several refreshes of the pod-resources answer
        assert 'pod="train-0"' not in _metrics_text(port)
        with open(config, "w", encoding="utf-8") as fh:
            fh.write("version: v1\nmetrics:\n  podResourcesRefreshSeconds: 0.1\n"
                     "flags:\n  plugin:\n    deviceIDStrategy: index\n")
        agent.signal(signal.SIGHUP)
        assert eventually(lambda: agent.effective(), 10.0), _tail(agent)
        assert agent.effective()[0]["device_id_strategy"] == "index"
        assert eventually(lambda: 'pod="train-0"' in _metrics_text(port), 10.0), _tail(agent)
        held = [line for line in _metrics_text(port).splitlines()
                if line.startswith("DCGM_FI_DEV_GPU_UTIL{") and 'pod="train-0"' in line]
        assert len(held) == 1 and 'gpu="3"' in held[0] and 'namespace="ml"' in held[0], held
        assert agent.stop() == 0, _tail(agent)
    finally:
        agent.kill()
        stub.stop()
        shutil.rmtree(root, ignore_errors=True)
