"""The agent in ``mode: dra``: the daemon serves the GPUs through the DRA kubelet plugin and
ResourceSlices instead of device plugins. Against the stand-in API server (through a
kubeconfig file, as on a node) and a stand-in kubelet that registers over the -reg.sock."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest
from agent_run import AgentRun, reap
from prometheus_client import CollectorRegistry
from waiting import eventually

from agent._proto import dra_v1_pb2, dra_v1_pb2_grpc
from agent._proto import pluginregistration_v1_pb2 as reg_pb
from agent._proto import pluginregistration_v1_pb2_grpc as reg_pb_grpc
from agent.config import Config
from agent.daemon import Daemon
from agent.dra.claims import KubernetesClaimReader
from agent.dra.plugin import DraPlugin
from agent.dra.publish_settings import PublishSettings
from agent.dra.publisher import SlicePublisher
from agent.dra.servers import DraServers
from agent.dra.view import DraView
from agent.labels.publishing import LabelPublisher
from agent.labels.sinks import FeatureFileSink
from agent.metrics.self_metrics import AgentMetrics
from tests.testbed.apiserver_stub import ApiServerStub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = "gpu.gpu-agent.io"
NODE = "node-1"


# ---------------------------------------------------------------------- helpers
class Node:
    """Short directories under /tmp (unix socket paths < 108 bytes), the API server stand-in
    and a kubeconfig file pointing at it."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="drd", dir="/tmp")
        self.dirs = {n: os.path.join(self.root, n) for n in ("reg", "plugins", "cdi", "k", "features")}
        for d in self.dirs.values():
            os.makedirs(d)
        self.api = ApiServerStub(served_versions=("v1", "v1beta1")).start()
        self.node_uid = self.api.add_node(NODE)
        self.kubeconfig = os.path.join(self.root, "kubeconfig")
        with open(self.kubeconfig, "w", encoding="utf-8") as fh:
            fh.write(
                "apiVersion: v1\nkind: Config\ncurrent-context: stub\n"
                f"clusters:\n- name: stub\n  cluster:\n    server: {self.api.url}\n"
                "users:\n- name: stub\n  user:\n    token: test-token\n"
                "contexts:\n- name: stub\n  context:\n    cluster: stub\n    user: stub\n"
            )
        self._channels: list[grpc.Channel] = []
        #: topologies the daemon's next reads return (then the simulated machine's again)
        self.rereads: list = []

    @property
    def registration_socket(self) -> str:
        return os.path.join(self.dirs["reg"], f"{DRIVER}-reg.sock")

    @property
    def dra_socket(self) -> str:
        return os.path.join(self.dirs["plugins"], DRIVER, "dra.sock")

    def config(self, **kw) -> Config:
        return replace(Config(), mode="dra", node_name=NODE, kubeconfig=self.kubeconfig,
                       plugins_registry_dir=self.dirs["reg"], plugins_dir=self.dirs["plugins"],
                       cdi_dir=self.dirs["cdi"], kubelet_dir=self.dirs["k"], features_dir=self.dirs["features"],
                       pod_resources_socket=os.path.join(self.dirs["k"], "podres.sock"), **kw)

    def args(self) -> list[str]:
        return ["--mode", "dra", "--node-name", NODE, "--kubeconfig", self.kubeconfig,
                "--plugins-registry-dir", self.dirs["reg"], "--plugins-dir", self.dirs["plugins"],
                "--cdi-dir", self.dirs["cdi"], "--kubelet-dir", self.dirs["k"],
                "--features-dir", self.dirs["features"],
                "--pod-resources-socket", os.path.join(self.dirs["k"], "podres.sock")]

    def channel(self, path: str) -> grpc.Channel:
        ch = grpc.insecure_channel(f"unix:{path}")
        self._channels.append(ch)
        return ch

    def kubelet_registers(self, timeout_s: float = 20.0) -> reg_pb.PluginInfo:
        """What the kubelet's plugin watcher does: wait for the -reg.sock, GetInfo, then
        NotifyRegistrationStatus(registered)."""
        assert eventually(lambda: os.path.exists(self.registration_socket), timeout_s), "no -reg.sock"
        stub = reg_pb_grpc.RegistrationStub(self.channel(self.registration_socket))
        # the kubelet dials blocking until the socket answers (the file appears at bind time,
        # a moment before the server accepts calls)
        info = stub.GetInfo(reg_pb.InfoRequest(), timeout=10, wait_for_ready=True)
        stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=10,
                                      wait_for_ready=True)
        return info

    def devices(self) -> list[str]:
        return single_gpus(self.api.slices())

    def generation(self) -> int:
        return int(self.api.slices()[0]["spec"]["pool"]["generation"])

    def put_claim(self, name: str, devices: list[str]) -> dict:
        return self.api.put_claim({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "default", "name": name},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                "deviceClassName": DRIVER, "count": len(devices)}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]}}},
        })

    def prepare(self, claim: dict) -> dra_v1_pb2.NodePrepareResourcesResponse:
        m = claim["metadata"]
        stub = dra_v1_pb2_grpc.DRAPluginStub(self.channel(self.dra_socket))
        req = dra_v1_pb2.NodePrepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])])
        return stub.NodePrepareResources(req, timeout=10, wait_for_ready=True)

    def unprepare(self, claim: dict) -> dra_v1_pb2.NodeUnprepareResourcesResponse:
        m = claim["metadata"]
        stub = dra_v1_pb2_grpc.DRAPluginStub(self.channel(self.dra_socket))
        req = dra_v1_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])])
        return stub.NodeUnprepareResources(req, timeout=10, wait_for_ready=True)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self.api.stop()
        shutil.rmtree(self.root, ignore_errors=True)



def http_status(port: int, path: str, timeout_s: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


@pytest.fixture
def simulated_daemon(node):
    """The real Daemon in mode dra on the simulated dgx-h100 (fake NVML, metrics included),
    with the DRA servers built over the stand-ins (short backoff); SIGHUP's configuration is
    the one it started with."""
    from agent.discovery import open_backend, read_topology
    from agent.metrics.service import MetricsService

    made = []

    def start(config: Config | None = None, backoff_max_s: float = 0.2) -> Daemon:
        config = config or node.config(metrics_address="127.0.0.1:0")
        backend, sim = open_backend("dgx-h100", config.sysfs_root)
        agent_metrics = AgentMetrics(CollectorRegistry(), backend)

        def servers(topology, cfg, health, on_kubelet_restart):
            view = DraView(topology)  # as DraServers.from_config: one view for both
            plugin = DraPlugin(cfg, view, health, KubernetesClaimReader(node.api.api_client(), timeout_s=2.0),
                               on_kubelet_restart=on_kubelet_restart, poll_s=0.05)
            publisher = SlicePublisher(node.api.api_client, view, replace(
                PublishSettings.from_config(cfg), backoff_initial_s=0.05, backoff_max_s=backoff_max_s), health=health,
                prepared=plugin.checkpoint)
            return DraServers(plugin, publisher)

        def metrics(topology, cfg, ready):
            return MetricsService(backend, topology, cfg, hostname=NODE, ready=ready, agent_metrics=agent_metrics)

        def read():
            return node.rereads.pop(0) if node.rereads else read_topology(backend, sim)

        labels = LabelPublisher(FeatureFileSink(config.features_dir, config.feature_file),
                                count_error=agent_metrics.label_write_error)
        daemon = Daemon(config, backend, servers=servers, read_topology=read, metrics=metrics, labels=labels,
                        config_loader=lambda: config, on_close=sim.close if sim is not None else None)
        made.append(daemon)
        assert daemon.start()
        if daemon.watcher is not None:
            daemon.watcher.poll_ms = 20
        return daemon

    yield start
    for daemon in made:
        daemon.shutdown()


# ---------------------------------------------------------------------- a real process
def agent_process(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    for var in ("CONFIG_FILE", "KUBECONFIG", "AGENT_MODE", "NODE_NAME", "DELETE_SLICES_ON_SHUTDOWN"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "agent", "run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def single_gpus(slices) -> list[str]:
    """The single-GPU devices of the pool (GPU sets and the counter slice aside)."""
    return [d["name"] for s in slices for d in s["spec"].get("devices", []) if not d["name"].startswith("gpuset-")]


#: dgx-h100 in v1: a counter slice, then 8 single GPUs and 7 GPU sets in one slice
DGX_H100_SLICES = 2


def test_a_real_agent_in_dra_mode_registers_publishes_prepares_and_keeps_its_slices_on_sigterm(node):
    agent = AgentRun(["--simulate", "dgx-h100", "--metrics-address", "127.0.0.1:0", *node.args()],
                     os.path.join(node.root, "agent.log"))
    try:
        port, _ = agent.ports()
        info = node.kubelet_registers()
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, node.dra_socket)
        assert list(info.supported_versions) == [
            "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
        assert node.api.wait_for(lambda s: len(s) == DGX_H100_SLICES and len(single_gpus(s)) == 8, 20.0)
        for obj in node.api.slices():
            assert obj["apiVersion"] == "resource.k8s.io/v1"
            assert obj["spec"]["pool"]["name"] == NODE
            assert obj["metadata"]["ownerReferences"][0]["uid"] == node.node_uid
        assert eventually(lambda: http_status(port, "/ready") == 200, 10.0)
        # in dra mode no device-plugin socket is served: a GPU is never handed out twice
        assert os.listdir(node.dirs["k"]) == []
        claim = node.put_claim("train", ["gpu-0", "gpu-1"])
        resp = node.prepare(claim)
        entry = resp.claims[claim["metadata"]["uid"]]
        assert entry.error == ""
        assert [d.device_name for d in entry.devices] == ["gpu-0", "gpu-1"]
        assert len(os.listdir(node.dirs["cdi"])) == 1
        assert os.listdir(node.dirs["features"]) != [], "labels are written in dra mode too"
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "DCGM_FI_DEV_GPU_TEMP" in metrics, "metrics are served in dra mode too"
        assert 'gpu_agent_dra_api_feature{feature="DRAPartitionableDevices"} 1.0' in metrics
        assert 'gpu_agent_dra_api_feature{feature="DRADeviceTaints"} 1.0' in metrics
        # GPUs 0 and 1 are the device plugin's pair on the empty dgx-h100 (`allocate --simulate
        # dgx-h100 --available 0,1,...,7 --size 2`); on the six left it gives 2 and 3, not 4 and 6.
        # Ranked after the prepare answered, on its own thread: counted soon after.
        def scraped() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

        assert eventually(lambda: 'gpu_agent_dra_claim_placements_total{placement="device_plugin_choice"} 1.0'
                          in scraped(), 10.0)
        other = node.put_claim("lagged", ["gpu-4", "gpu-6"])
        assert node.prepare(other).claims[other["metadata"]["uid"]].error == ""
        assert eventually(lambda: 'gpu_agent_dra_claim_placements_total{placement="other"} 1.0' in scraped(), 10.0)
        assert 'gpu_agent_dra_claim_placements_total{placement="device_plugin_choice"} 1.0' in scraped()
        assert agent.stop(20) == 0, agent.log()[-3000:]
    finally:
        agent.kill()
    assert not os.path.exists(node.registration_socket) and not os.path.exists(node.dra_socket)
    assert os.listdir(node.dirs["k"]) == []
    assert len(node.api.slices()) == DGX_H100_SLICES, "a restarting agent keeps its slices (deleteSlicesOnShutdown false)"
    assert node.api.count("DELETE", "resourceslices") == 0


def test_delete_slices_on_shutdown_removes_them_on_sigterm(node):
    proc = agent_process(["--simulate", "dgx-h100", "--metrics-address", "127.0.0.1:0",
                          "--delete-slices-on-shutdown", *node.args()])
    try:
        node.kubelet_registers()
        assert node.api.wait_for(lambda s: len(s) == DGX_H100_SLICES, 20.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        reap(proc)
    assert proc.returncode == 0, stderr
    assert node.api.slices() == []


# ---------------------------------------------------------------------- in-process
def test_ready_only_when_registered_and_slices_published(node, simulated_daemon):
    node.api.go_down()
    daemon = simulated_daemon()
    port = daemon.metrics.port
    assert isinstance(daemon.servers, DraServers) and os.listdir(node.dirs["k"]) == []
    node.kubelet_registers()
    assert eventually(daemon.servers.plugin.ready, 5)
    time.sleep(0.3)
    assert not daemon.ready() and http_status(port, "/ready") == 503, "registered but nothing published"
    node.api.come_up()
    assert node.api.wait_for(lambda s: len(s) == 1, 5)
    assert eventually(daemon.ready, 2.0) and http_status(port, "/ready") == 200


def test_unreachable_api_server_keeps_serving_the_kubelet_retries_with_capped_backoff_and_logs_once(
        node, simulated_daemon, caplog):
    node.api.go_down()
    caplog.set_level(logging.WARNING, logger="agent.dra.publisher")
    daemon = simulated_daemon(backoff_max_s=0.2)
    node.kubelet_registers()
    assert eventually(daemon.servers.plugin.ready, 5)
    time.sleep(1.5)  # 0.05, 0.1, 0.2, 0.2, ...: at least 6 tries in 1.5 s with the cap at 0.2 s
    failures = [r for r in caplog.records if "the ResourceSlices of node" in r.getMessage() and " failed: " in r.getMessage()]
    assert len(failures) == 1, "one log line per reason, not one per retry"
    assert "unreachable" in failures[0].getMessage()
    assert not daemon.ready()
    # the kubelet is still served: a claim that cannot be read fails per claim, nothing crashes
    claim = {"metadata": {"namespace": "default", "name": "c", "uid": "u-1"}}
    resp = node.prepare(claim)
    assert "cannot be read" in resp.claims["u-1"].error
    node.api.come_up()
    node.api.fail(403, method="POST", path_contains="resourceslices", times=2)
    assert node.api.wait_for(lambda s: len(s) == 1, 5)
    assert eventually(daemon.ready, 2.0)
    reasons = [r.getMessage() for r in caplog.records if "the ResourceSlices of node" in r.getMessage() and " failed: " in r.getMessage()]
    assert len(reasons) == 2 and "403" in reasons[1], reasons


def tainted_devices(slices) -> dict[str, list[tuple[str, str, str]]]:
    """Device name -> its taints (key, value, effect), for the devices that have any."""
    return {d["name"]: [(t["key"], t["value"], t["effect"]) for t in d["taints"]]
            for s in slices for d in s["spec"].get("devices", []) if d.get("taints")}


def first_devices(slices) -> dict[str, str]:
    """The first published device of each kind: ``gpu`` (a single), ``2``, ``4``, ``8`` (sets)."""
    out: dict[str, str] = {}
    for s in slices:
        for d in s["spec"].get("devices", []):
            kind = "gpu" if not d["name"].startswith("gpuset-") else d["name"].split("-")[1]
            out.setdefault(kind, d["name"])
    return out


def test_a_prepare_re_publishes_the_order_within_a_second_and_the_pool_is_never_incomplete_or_invalid(
        node, simulated_daemon):
    from agent.discovery import load_topology
    from agent.dra.devices import parse_set_name, set_name
    from agent.dra.gpusets import SetPolicy
    from tests.testbed.dra_allocator_model import gather_pools

    simulated_daemon()
    node.kubelet_registers()
    assert node.api.wait_for(lambda s: len(s) == DGX_H100_SLICES and len(single_gpus(s)) == 8, 5)
    empty = first_devices(node.api.slices())
    policy = SetPolicy(load_topology("dgx-h100"))
    assert empty["2"] == set_name(policy.choose(range(8), 2))
    pair = parse_set_name(empty["2"])
    c = node.put_claim("pair", [empty["2"]])
    assert node.prepare(c).claims[c["metadata"]["uid"]].error == ""
    free = [i for i in range(8) if i not in pair]
    want = {"gpu": f"gpu-{policy.choose(free, 1)[0]}", "2": set_name(policy.choose(free, 2)),
            "4": set_name(policy.choose(free, 4))}
    assert node.api.wait_for(lambda s: {k: first_devices(s)[k] for k in want} == want, 1.0), first_devices(
        node.api.slices())
    assert empty["2"] in device_names(node.api.slices())  # the prepared set stays published
    assert node.unprepare(c).claims[c["metadata"]["uid"]].error == ""
    assert node.api.wait_for(lambda s: first_devices(s) == empty, 1.0)
    history = node.api.slice_history()
    complete = next(i for i, state in enumerate(history) if len(state) == DGX_H100_SLICES)
    assert len(history) - complete >= 3  # the first publication, the prepare's, the unprepare's
    for state in history[complete:]:
        (pool,) = gather_pools(state, NODE)
        assert not pool.incomplete and not pool.invalid


def device_names(slices) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"].get("devices", [])]


def test_an_xid_taints_the_gpu_and_every_set_holding_it_within_a_second(node, simulated_daemon):
    daemon = simulated_daemon(node.config(metrics_address="127.0.0.1:0", health_recovery_s=60))
    node.kubelet_registers()
    assert node.api.wait_for(lambda s: len(s) == DGX_H100_SLICES and len(single_gpus(s)) == 8, 5)
    before, updates = node.generation(), node.api.count("PUT", "resourceslices")
    daemon.backend.lib.inject_xid(3, 79)
    # every published set holding GPU 3 (a pair, a quad, the 8) stays, tainted: a claim may hold it
    assert node.api.wait_for(lambda s: len(tainted_devices(s)) == 1 + 1 + 1 + 1, 1.0)
    taints = tainted_devices(node.api.slices())
    assert taints["gpu-3"] == [("gpu.gpu-agent.io/xid", "79", "NoSchedule")]
    assert len(set(map(tuple, taints.values()))) == 1
    assert len(node.devices()) == 8 and node.generation() == before  # the device slice, in place
    assert node.api.count("PUT", "resourceslices") == updates + 1, "one publication: the device slice written once"
    # an unhealthy GPU is not prepared either
    resp = node.prepare(node.put_claim("late", ["gpu-3"]))
    assert "unhealthy" in next(iter(resp.claims.values())).error


def test_kubelet_restart_re_registers_and_sighup_hands_the_topology_to_plugin_and_publisher(
        node, simulated_daemon):
    daemon = simulated_daemon()
    node.kubelet_registers()
    assert eventually(daemon.ready, 5.0)
    os.unlink(node.registration_socket)  # the kubelet restarted and cleared its directory
    assert eventually(lambda: not daemon.ready(), 2.0)
    assert eventually(lambda: os.path.exists(node.registration_socket), 2.0)
    node.kubelet_registers()
    assert eventually(daemon.ready, 5.0)
    # GPU 0 was replaced meanwhile: the next read finds another UUID at index 0
    replaced = "GPU-feedface-0000-0000-0000-000000000000"
    node.rereads.append(replace(daemon.topology, gpus=tuple(
        replace(g, uuid=replaced) if g.index == 0 else g for g in daemon.topology.gpus)))
    assert daemon.reread(reload_config=True)  # what the main loop does on SIGHUP
    assert node.api.wait_for(lambda s: _attribute(s, "gpu-0", "uuid") == replaced, 5.0), "publisher"
    claim = node.put_claim("after-sighup", ["gpu-0"])
    assert node.prepare(claim).claims[claim["metadata"]["uid"]].error == ""
    (spec,) = os.listdir(node.dirs["cdi"])
    with open(os.path.join(node.dirs["cdi"], spec), encoding="utf-8") as fh:
        assert replaced in fh.read(), "plugin"


class StalledLog(logging.Handler):
    """A log stream that stalls (stderr into a full pipe) at the first record saying
    ``text``, until released: whatever logs it waits, and so does whatever holds a lock
    meanwhile."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.entered = threading.Event()
        self.release = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage() and not self.entered.is_set():
            self.entered.set()
            self.release.wait(10.0)


def test_ready_answers_at_once_while_the_dra_sockets_are_served_again(node, simulated_daemon):
    daemon = simulated_daemon()
    port = daemon.metrics.port
    node.kubelet_registers()
    assert eventually(lambda: http_status(port, "/ready") == 200, 5.0)
    stalled = StalledLog("vanished: serving it again")
    plugin_log = logging.getLogger("agent.dra.plugin")
    plugin_log.addHandler(stalled)
    try:
        os.unlink(node.registration_socket)  # the kubelet restarted and cleared its directory
        assert stalled.entered.wait(5.0), "the socket watch never noticed"
        # the watch is in the middle of serving the socket again: the probe must not wait
        assert http_status(port, "/ready", timeout_s=0.2) == 503
    finally:
        stalled.release.set()
        plugin_log.removeHandler(stalled)
    node.kubelet_registers()
    assert eventually(lambda: http_status(port, "/ready") == 200, 5.0)


def _attribute(slices: list, device: str, name: str):
    (d,) = [d for s in slices for d in s["spec"].get("devices", []) if d["name"] == device]
    value = d["attributes"][f"{DRIVER}/{name}"]
    return next(iter(value.values()))


def test_delete_slices_on_shutdown_is_a_flag_a_variable_and_a_config_key(tmp_path):
    from agent.config import load_config
    from agent.errors import ConfigError

    assert load_config(None, {}, {}).delete_slices_on_shutdown is False
    assert load_config(None, {"DELETE_SLICES_ON_SHUTDOWN": "true"}, {}).delete_slices_on_shutdown is True
    assert load_config(None, {}, {"delete_slices_on_shutdown": True}).delete_slices_on_shutdown is True
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nmode: dra\ndra:\n  deleteSlicesOnShutdown: true\n")
    assert load_config(str(path), {}, {}).delete_slices_on_shutdown is True
    path.write_text("version: v1\ndra:\n  deleteSlicesOnShutdown: sometimes\n")
    with pytest.raises(ConfigError, match=r"dra.deleteSlicesOnShutdown: expected true or false, got 'sometimes'"):
        load_config(str(path), {}, {})


def test_sighup_with_an_imex_channel_added_hands_it_to_claims_prepared_afterwards(node, tmp_path):
    """A real agent in DRA mode, its config file given an IMEX channel and SIGHUP: claims
    prepared afterwards get the channel (its variable and its node in their CDI spec), as
    the device plugin's containers do after the same reload; earlier claims keep theirs."""
    root = tmp_path / "driver"
    (root / "dev" / "nvidia-caps-imex-channels").mkdir(parents=True)
    os.symlink("/dev/null", root / "dev" / "nvidia-caps-imex-channels" / "channel0")  # a character device
    config_file = tmp_path / "config.yaml"
    config_file.write_text("version: v1\n")
    proc = agent_process(["--simulate", "dgx-h100", "--metrics-address", "127.0.0.1:0", "--config", str(config_file),
                          *node.args()], env={"NVIDIA_DRIVER_ROOT": str(root)})
    try:
        node.kubelet_registers()
        before = node.put_claim("before-sighup", ["gpu-0"])
        assert node.prepare(before).claims[before["metadata"]["uid"]].error == ""
        config_file.write_text("version: v1\nimex:\n  channelIDs: [0]\n")
        proc.send_signal(signal.SIGHUP)
        after = node.put_claim("after-sighup", ["gpu-1"])

        def prepared_with_channel() -> bool:
            spec = _spec_of(node, after)
            if spec is None:
                assert node.prepare(after).claims[after["metadata"]["uid"]].error == ""
                spec = _spec_of(node, after)
            if "NVIDIA_IMEX_CHANNELS=0" in spec["containerEdits"]["env"]:
                return True
            node.unprepare(after)  # prepared before the reload was applied: again
            return False

        assert eventually(prepared_with_channel, 10.0)
        new = _spec_of(node, after)
        assert {"path": "/dev/nvidia-caps-imex-channels/channel0", "permissions": "rw",
                "hostPath": f"{root}/dev/nvidia-caps-imex-channels/channel0"} in new["containerEdits"]["deviceNodes"]
        assert "NVIDIA_IMEX_CHANNELS=0" not in _spec_of(node, before)["containerEdits"]["env"]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    finally:
        reap(proc)


def _spec_of(node: Node, claim: dict) -> dict | None:
    for name in os.listdir(node.dirs["cdi"]):
        if claim["metadata"]["uid"] in name:
            with open(os.path.join(node.dirs["cdi"], name), encoding="utf-8") as fh:
                return json.load(fh)
    return None
