"""A SIGHUP that changes what applies at start only (issue 20, defect 5).

The mode and the DRA settings are read once, at start. A reload whose file asks for another
mode (either way) or other DRA settings keeps the running ones, says so in one warning, and
the configuration it then logs as effective is the one that runs: the kubelet still sees
the same servers (device-plugin sockets, or the DRA plugin's), never both. Everything else
in the same file is applied. Real agent processes, seen through their logs and their
kubelet-facing sockets. Both tests failed before the fix: the reloaded configuration said
the mode asked for while the other one kept serving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

from agent_run import AgentRun
from kubelet_stub import KubeletStub
from test_dra_daemon import DRIVER, Node
from waiting import eventually

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
