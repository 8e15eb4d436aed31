"""The DRA kubelet plugin over real unix sockets: registration, NodePrepareResources and
NodeUnprepareResources (v1 and v1beta1), CDI specs, the checkpoint across restarts, and
bad input. ResourceClaims come from the stand-in API server through the official client."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import replace

import grpc
import pytest
from killed_write import killed_write
from waiting import eventually

from agent._proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from agent._proto import pluginregistration_v1_pb2 as reg_pb
from agent._proto import pluginregistration_v1_pb2_grpc as reg_pb_grpc
from agent.config import Config
from agent.dra.cdi import spec_path
from agent.dra.claims import KubernetesClaimReader
from agent.dra.plugin import DraPlugin
from agent.dra.view import DraView
from agent.health import HealthState
from tests.testbed.apiserver_stub import ApiServerStub
from tests.testbed.kubelet_stub import hgx8_topology

DRIVER = "gpu.gpu-agent.io"
NODE = "node-1"


class Node:
    """Directories (short, under /tmp: unix socket paths must stay < 108 bytes), the API
    server stand-in, and a plugin started on them."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="dra", dir="/tmp")
        self.config = Config(
            mode="dra", node_name=NODE,
            plugins_registry_dir=os.path.join(self.root, "reg"),
            plugins_dir=os.path.join(self.root, "plugins"),
            cdi_dir=os.path.join(self.root, "cdi"),
        )
        self.api = ApiServerStub(served_versions=("v1",)).start()
        self.health = HealthState(8)
        self.plugin: DraPlugin | None = None
        self.placements: list[str] = []  # what the plugin told on_placement, in order
        self._channels: list[grpc.Channel] = []

    def start(self, topology=None, config: Config | None = None, poll_s: float = 0.05,
              on_kubelet_restart=None) -> DraPlugin:
        self.topology = topology or hgx8_topology()
        reader = KubernetesClaimReader(self.api.api_client(), timeout_s=2.0)
        self.plugin = DraPlugin(config or self.config, DraView(self.topology), self.health, reader, poll_s=poll_s,
                                on_kubelet_restart=on_kubelet_restart, on_placement=self.placements.append)
        self.plugin.start()
        return self.plugin

    def restart(self) -> DraPlugin:
        """A new agent process: a new plugin over the same directories (and checkpoint)."""
        assert self.plugin is not None
        self.plugin.stop()
        return self.start(self.topology)

    def channel(self, path: str) -> grpc.Channel:
        ch = grpc.insecure_channel(f"unix:{path}")
        self._channels.append(ch)
        return ch

    def v1(self) -> dra_v1_pb2_grpc.DRAPluginStub:
        assert self.plugin is not None
        return dra_v1_pb2_grpc.DRAPluginStub(self.channel(self.plugin.endpoint))

    def v1beta1(self) -> dra_v1beta1_pb2_grpc.DRAPluginStub:
        assert self.plugin is not None
        return dra_v1beta1_pb2_grpc.DRAPluginStub(self.channel(self.plugin.endpoint))

    def registration(self) -> reg_pb_grpc.RegistrationStub:
        assert self.plugin is not None
        return reg_pb_grpc.RegistrationStub(self.channel(self.plugin.registration_socket))

    def put_claim(self, name: str, devices: list[str], *, pool: str = NODE, driver: str = DRIVER,
                  namespace: str = "default", request: str = "gpus") -> dict:
        return self.api.put_claim(claim_object(name, devices, pool=pool, driver=driver,
                                               namespace=namespace, request=request))

    def prepare(self, *claims: dict, api=None) -> dra_v1_pb2.NodePrepareResourcesResponse:
        api = api or self.v1()
        pb = dra_v1beta1_pb2 if isinstance(api, dra_v1beta1_pb2_grpc.DRAPluginStub) else dra_v1_pb2
        req = pb.NodePrepareResourcesRequest(claims=[ref(c, pb) for c in claims])
        return api.NodePrepareResources(req, timeout=10)

    def unprepare(self, *claims: dict) -> dra_v1_pb2.NodeUnprepareResourcesResponse:
        req = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[ref(c, dra_v1_pb2) for c in claims])
        return self.v1().NodeUnprepareResources(req, timeout=10)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        if self.plugin is not None:
            self.plugin.stop(0)
        self.api.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def claim_object(name, devices, *, pool=NODE, driver=DRIVER, namespace="default", request="gpus") -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": "gpu.gpu-agent.io",
                                                                         "count": len(devices)}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": request, "driver": driver, "pool": pool, "device": d} for d in devices
        ]}}},
    }


def ref(claim: dict, pb=dra_v1_pb2):
    m = claim["metadata"]
    return pb.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


def spec_of(node: Node, uid: str) -> dict:
    with open(spec_path(node.config.cdi_dir, DRIVER, uid), encoding="utf-8") as fh:
        return json.load(fh)


def env_of(spec: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec["containerEdits"]["env"])


# ---------------------------------------------------------------------- registration
def test_get_info_names_the_driver_its_endpoint_and_both_dra_services(node):
    plugin = node.start()
    assert plugin.registration_socket == os.path.join(node.root, "reg", f"{DRIVER}-reg.sock")
    info = node.registration().GetInfo(reg_pb.InfoRequest(), timeout=5)
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == os.path.join(node.root, "plugins", DRIVER, "dra.sock")
    assert list(info.supported_versions) == [
        "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]


def test_a_refused_registration_is_logged_with_the_kubelets_reason_and_serving_goes_on(node, caplog):
    plugin = node.start()
    reg = node.registration()
    assert not plugin.ready()
    with caplog.at_level(logging.ERROR, logger="agent.dra.plugin"):
        reg.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=False,
                                                               error="driver name conflicts"), timeout=5)
        reg.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=False,
                                                               error="driver name conflicts"), timeout=5)
    refusals = [r for r in caplog.records if "kubelet refused" in r.getMessage()]
    assert [r.getMessage().split(" (")[0] for r in refusals] == [
        "registering DRA driver gpu.gpu-agent.io failed: the kubelet refused it: driver name conflicts"
    ], "once per reason"
    assert not plugin.ready()
    assert reg.GetInfo(reg_pb.InfoRequest(), timeout=5).name == DRIVER
    reg.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
    assert plugin.ready()


def test_a_vanished_registration_socket_is_served_again_and_needs_a_new_registration(node):
    restarts: list[int] = []
    plugin = node.start(poll_s=0.02, on_kubelet_restart=lambda: restarts.append(1))
    node.registration().NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
    assert plugin.ready()
    os.unlink(plugin.registration_socket)  # a restarted kubelet cleared its directory
    assert eventually(lambda: restarts == [1], 5.0), "the kubelet restart is reported once"
    assert os.path.exists(plugin.registration_socket) and not plugin.ready()
    reg = reg_pb_grpc.RegistrationStub(node.channel(plugin.registration_socket))
    assert reg.GetInfo(reg_pb.InfoRequest(), timeout=5).name == DRIVER
    reg.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
    assert plugin.ready()


def test_a_vanished_dra_socket_is_served_again(node):
    plugin = node.start(poll_s=0.02)
    os.unlink(plugin.endpoint)
    deadline = time.monotonic() + 5
    while not os.path.exists(plugin.endpoint) and time.monotonic() < deadline:
        time.sleep(0.01)
    c = node.put_claim("c", ["gpu-0"])
    assert node.prepare(c).claims[c["metadata"]["uid"]].error == ""


def test_a_plugin_directory_replaced_by_a_file_is_said_once_and_served_again_once_it_can_be_made(node, caplog):
    plugin = node.start(poll_s=0.02)
    plugin_dir = os.path.dirname(plugin.endpoint)
    with caplog.at_level(logging.INFO, logger="agent"):
        caplog.clear()
        shutil.rmtree(plugin_dir)
        with open(plugin_dir, "w", encoding="utf-8") as fh:  # nothing can be served under it now
            fh.write("not a directory\n")
        time.sleep(2.0)  # about 100 watch rounds at poll_s
        blocked = len(caplog.records)
        while_blocked = [r for r in caplog.records[:blocked] if r.levelno >= logging.INFO]
        os.unlink(plugin_dir)  # the directory can be made again
        assert eventually(lambda: os.path.exists(plugin.endpoint), 10.0), "the DRA socket is served again"
        assert eventually(lambda: any("again" in r.getMessage() for r in caplog.records[blocked:])), \
            "the recovery is said"
        lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    c = node.put_claim("c", ["gpu-0"])
    assert node.prepare(c).claims[c["metadata"]["uid"]].error == ""
    assert while_blocked, "the blocked socket is said"
    assert len(while_blocked) <= 2, f"said once, not per round: {len(while_blocked)} lines in 2 s"
    assert not [r for r in lines if r.exc_info], "no traceback for a directory we cannot use"
    assert any(plugin_dir in r.getMessage() for r in while_blocked), "the line names the directory"
    assert len(lines) <= len(while_blocked) + 2, [r.getMessage() for r in lines]


def test_a_dra_socket_another_live_server_took_is_left_alone_said_once_and_served_once_free(node, caplog):
    plugin = node.start(poll_s=0.02)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a second driver on the same directory
    other.bind(plugin.endpoint + ".new")
    other.listen()
    theirs = os.stat(plugin.endpoint + ".new").st_ino
    try:
        with caplog.at_level(logging.INFO, logger="agent"):
            caplog.clear()
            os.rename(plugin.endpoint + ".new", plugin.endpoint)  # it takes the name over ours
            time.sleep(1.0)  # about 50 watch rounds
            said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
            assert os.stat(plugin.endpoint).st_ino == theirs, "another live server's socket is never removed"
            other.close()
            os.unlink(plugin.endpoint)  # it is gone
            assert eventually(lambda: os.path.exists(plugin.endpoint), 10.0)
    finally:
        other.close()
    assert said, "the taken socket is said"
    assert len(said) <= 2 and any("another server is serving on this socket" in m for m in said), said
    c = node.put_claim("c", ["gpu-0"])
    assert node.prepare(c).claims[c["metadata"]["uid"]].error == ""


def test_stop_removes_both_sockets_and_keeps_the_checkpoint(node):
    plugin = node.start()
    c = node.put_claim("c", ["gpu-1"])
    node.prepare(c)
    plugin.stop()
    assert not os.path.exists(plugin.endpoint) and not os.path.exists(plugin.registration_socket)
    assert os.listdir(os.path.join(node.root, "plugins", DRIVER, "claims")) == [c["metadata"]["uid"] + ".json"]


def test_a_plugin_without_a_node_name_is_refused_with_a_clear_error(node):
    from agent.errors import AgentError

    with pytest.raises(AgentError, match="needs the node name"):
        node.start(config=replace(node.config, node_name=""))


# ---------------------------------------------------------------------- prepare
def test_prepare_writes_one_cdi_spec_for_the_claim_and_returns_its_cdi_device_ids(node):
    node.start()
    c = node.put_claim("train", ["gpu-2", "gpu-5"])
    uid = c["metadata"]["uid"]
    got = node.prepare(c).claims[uid]
    assert got.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in got.devices] == [
        (["gpus"], NODE, "gpu-2", [f"{DRIVER}/gpu={uid}-gpu-2"]),
        (["gpus"], NODE, "gpu-5", [f"{DRIVER}/gpu={uid}-gpu-5"]),
    ]
    spec = spec_of(node, uid)
    topo = node.topology
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == f"{DRIVER}/gpu"
    assert [(d["name"], [n["path"] for n in d["containerEdits"]["deviceNodes"]]) for d in spec["devices"]] == [
        (f"{uid}-gpu-2", ["/dev/nvidia2"]), (f"{uid}-gpu-5", ["/dev/nvidia5"]),
    ]
    env = env_of(spec)
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{topo.gpus[2].uuid},{topo.gpus[5].uuid}"
    assert env["GPU_TOPOLOGY_GPU_INDICES"] == "2,5"
    assert env["GPU_TOPOLOGY_NUMA_NODES"] == "0,1"
    assert env["GPU_TOPOLOGY_NVLINK_CONNECTED"] == "true"
    assert env["GPU_TOPOLOGY_SCORE"] == str(topo.set_score([2, 5]))
    assert [f for f in os.listdir(node.config.cdi_dir) if not f.endswith(".json")] == []  # no temp files left


def test_the_spec_carries_the_control_nodes_that_exist_on_the_host(node, tmp_path):
    (tmp_path / "dev").mkdir()
    for name in ("nvidiactl", "nvidia-uvm"):
        (tmp_path / "dev" / name).write_text("")
    node.start(config=replace(node.config, nvidia_driver_root=str(tmp_path)))
    c = node.put_claim("c", ["gpu-0"])
    node.prepare(c)
    spec = spec_of(node, c["metadata"]["uid"])
    assert [(n["path"], n["hostPath"]) for n in spec["containerEdits"]["deviceNodes"]] == [
        ("/dev/nvidiactl", f"{tmp_path}/dev/nvidiactl"), ("/dev/nvidia-uvm", f"{tmp_path}/dev/nvidia-uvm")]
    assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == ["/dev/nvidia0"]


def test_the_v1beta1_service_answers_as_v1_does(node):
    node.start()
    c1, c2 = node.put_claim("a", ["gpu-0"]), node.put_claim("b", ["gpu-0"])
    a = node.prepare(c1).claims[c1["metadata"]["uid"]]
    node.unprepare(c1)  # GPU 0 serves one prepared claim at a time
    b = node.prepare(c2, api=node.v1beta1()).claims[c2["metadata"]["uid"]]
    assert isinstance(b, dra_v1beta1_pb2.NodePrepareResourceResponse)
    assert b.error == "" and [d.device_name for d in b.devices] == [d.device_name for d in a.devices] == ["gpu-0"]
    unprep = node.v1beta1().NodeUnprepareResources(
        dra_v1beta1_pb2.NodeUnprepareResourcesRequest(claims=[ref(c2, dra_v1beta1_pb2)]), timeout=5)
    assert unprep.claims[c2["metadata"]["uid"]].error == ""
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, c2["metadata"]["uid"]))


def test_mig_devices_get_their_parent_node_and_only_their_own_uuid(node):
    topo = hgx8_topology(mig=True)
    node.start(topo)
    c = node.put_claim("mig", ["gpu-7-mig-1"])
    uid = c["metadata"]["uid"]
    assert node.prepare(c).claims[uid].error == ""
    spec = spec_of(node, uid)
    assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == ["/dev/nvidia7"]
    assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == topo.gpus[7].mig_devices[1].uuid


def _placed(caplog) -> list[str]:
    """The placement lines logged so far (one per claim ranked, after its prepare)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("placed ")]


def test_each_prepare_logs_whether_the_claim_got_the_device_plugins_choice_on_the_gpus_free(node, caplog):
    from agent.dra.devices import set_name
    from agent.dra.gpusets import SetPolicy

    node.start()
    policy = SetPolicy(node.topology)  # the device plugin's policy, as allocate --available asks it
    first = policy.choose(range(8), 2)
    free = [i for i in range(8) if i not in first]
    best = policy.choose(free, 2)
    worse = next((a, b) for a in free for b in free if a < b and (a, b) != best)
    claims = [node.put_claim("first", [set_name(first)]), node.put_claim("lagged", [f"gpu-{i}" for i in worse])]
    single = node.put_claim("single", [f"gpu-{policy.choose([i for i in free if i not in worse], 1)[0]}"])
    with caplog.at_level(logging.INFO):
        for c in claims:
            assert node.prepare(c).claims[c["metadata"]["uid"]].error == ""
        assert node.prepare(claims[0]).claims[claims[0]["metadata"]["uid"]].error == ""  # answered again
        # ranked in order: once the claim after it is ranked, the one answered again would be too
        assert node.prepare(single).claims[single["metadata"]["uid"]].error == ""
        assert eventually(lambda: len(_placed(caplog)) >= 3), _placed(caplog)
    prepared = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepared ")]
    assert [line.split(":")[0] for line in prepared] == [
        f"prepared ResourceClaim default/{n} (uid {c['metadata']['uid']})"
        for n, c in [("first", claims[0]), ("lagged", claims[1]), ("single", single)]]
    lines = _placed(caplog)
    assert len(lines) == 3, lines  # a claim answered again from the checkpoint is not ranked again
    assert lines[0] == (f"placed ResourceClaim default/first (uid {claims[0]['metadata']['uid']}): the device"
                        " plugin's choice for 2 GPU(s) on the GPUs free")
    assert (f"GPUs {worse[0]}, {worse[1]}, where the device plugin would have given GPUs {best[0]}, {best[1]}"
            in lines[1]), lines[1]
    assert "default/single" in lines[2] and "the device plugin's choice for 1 GPU(s)" in lines[2], lines[2]
    assert node.placements == ["device_plugin_choice", "other", "device_plugin_choice"]


def test_a_mig_claim_is_prepared_and_said_to_be_unranked(node, caplog):
    node.start(hgx8_topology(mig=True))
    c = node.put_claim("mig", ["gpu-7-mig-1"])
    with caplog.at_level(logging.INFO):
        assert node.prepare(c).claims[c["metadata"]["uid"]].error == ""
        assert eventually(lambda: node.placements == ["unranked"]), node.placements
    assert any("prepared ResourceClaim default/mig" in r.getMessage() and r.getMessage().endswith(": gpu-7-mig-1")
               for r in caplog.records)
    assert [line.split(": ", 1)[1] for line in _placed(caplog)] == [
        "not ranked (a MIG device, or a GPU the device plugin does not offer)"]


def test_prepare_answers_while_the_ranking_of_an_earlier_claim_is_still_running(node, caplog, monkeypatch):
    import threading

    from agent.dra import placement

    release, ranking = threading.Event(), threading.Event()
    real_rank = placement.rank

    def slow_rank(*args, **kwargs):
        ranking.set()
        assert release.wait(30)
        return real_rank(*args, **kwargs)

    monkeypatch.setattr(placement, "rank", slow_rank)
    node.start()
    a, b = node.put_claim("a", ["gpu-0"]), node.put_claim("b", ["gpu-1"])
    with caplog.at_level(logging.INFO):
        assert node.prepare(a).claims[a["metadata"]["uid"]].error == ""
        assert ranking.wait(5)  # the ranking of a has begun and hangs
        began = time.monotonic()
        assert node.prepare(b).claims[b["metadata"]["uid"]].error == ""
        assert time.monotonic() - began < 2.0
        assert node.placements == [] and _placed(caplog) == []
        release.set()
        assert eventually(lambda: len(node.placements) == 2), node.placements
    assert [line.split(" (uid")[0] for line in _placed(caplog)] == ["placed ResourceClaim default/a",
                                                                  "placed ResourceClaim default/b"]


def test_a_ranking_that_fails_leaves_the_claim_prepared_and_unranked_and_the_next_claims_ranked(
        node, caplog, monkeypatch):
    from agent.dra import placement

    real_rank, calls = placement.rank, []

    def failing_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("engine exploded")
        return real_rank(*args, **kwargs)

    monkeypatch.setattr(placement, "rank", failing_once)
    node.start()
    a, b = node.put_claim("a", ["gpu-0"]), node.put_claim("b", ["gpu-1", "gpu-2"])
    with caplog.at_level(logging.INFO):
        assert node.prepare(a).claims[a["metadata"]["uid"]].error == ""
        assert node.prepare(b).claims[b["metadata"]["uid"]].error == ""
        assert eventually(lambda: len(node.placements) == 2), node.placements
    assert node.placements[0] == "unranked" and node.placements[1] in ("device_plugin_choice", "other")
    failed = _placed(caplog)[0]
    assert "default/a" in failed and failed.endswith("not ranked, the ranking failed: RuntimeError: engine exploded")
    assert os.path.exists(spec_path(node.config.cdi_dir, DRIVER, a["metadata"]["uid"]))


def test_results_of_other_drivers_in_the_claim_are_left_to_them(node):
    node.start()
    c = claim_object("mixed", ["gpu-3"])
    c["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": "rdma.example.com", "pool": NODE, "device": "mlx5-0"})
    c = node.api.put_claim(c)
    got = node.prepare(c).claims[c["metadata"]["uid"]]
    assert got.error == "" and [d.device_name for d in got.devices] == ["gpu-3"]


# ---------------------------------------------------------------------- bad input
def test_a_claim_that_does_not_exist_gets_its_own_error_and_the_others_are_served(node):
    node.start()
    good = node.put_claim("good", ["gpu-1"])
    ghost = {"metadata": {"namespace": "default", "name": "ghost", "uid": "0000-ghost"}}
    resp = node.prepare(ghost, good)
    assert resp.claims["0000-ghost"].error == \
        "ResourceClaim default/ghost (uid 0000-ghost): not found in the API server"
    assert list(resp.claims["0000-ghost"].devices) == []
    assert resp.claims[good["metadata"]["uid"]].error == ""
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, "0000-ghost"))


def test_a_uid_mismatch_is_refused(node):
    node.start()
    c = node.put_claim("reborn", ["gpu-1"])
    stale = {"metadata": dict(c["metadata"], uid="11111111-old")}
    err = node.prepare(stale).claims["11111111-old"].error
    assert "ResourceClaim default/reborn (uid 11111111-old)" in err
    assert f"the API server's claim has uid '{c['metadata']['uid']}'" in err


def test_devices_of_another_pool_are_refused_naming_the_pool(node):
    node.start()
    c = node.put_claim("elsewhere", ["gpu-1"], pool="node-2")
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert "device 'gpu-1' of pool 'node-2' (request 'gpus'): from another pool, this node serves pool 'node-1'" in err
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, c["metadata"]["uid"]))


def test_an_unknown_device_is_refused_listing_the_nodes_devices(node):
    node.start()
    c = node.put_claim("typo", ["gpu-0", "gpu-9"])
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert "device 'gpu-9' of pool 'node-1' (request 'gpus'): unknown, this node has gpu-0, gpu-1" in err
    assert "'gpu-0'" not in err


def test_an_unhealthy_device_is_refused_and_a_healthy_one_again_accepted(node):
    node.start()
    node.health.mark_unhealthy(4, "XID 79")
    c = node.put_claim("sick", ["gpu-4"])
    uid = c["metadata"]["uid"]
    err = node.prepare(c).claims[uid].error
    assert f"device 'gpu-4' of pool 'node-1' (request 'gpus'): GPU 4 ({node.topology.gpus[4].uuid}) is unhealthy" in err
    node.health.mark_healthy(4)
    assert node.prepare(c).claims[uid].error == ""


def test_an_unallocated_claim_is_refused(node):
    node.start()
    c = claim_object("pending", [])
    del c["status"]
    c = node.api.put_claim(c)
    assert node.prepare(c).claims[c["metadata"]["uid"]].error.endswith("not allocated (status.allocation is empty)")


def test_a_claim_without_devices_of_this_driver_is_refused_naming_the_drivers(node):
    node.start()
    c = node.put_claim("nic-only", ["mlx5-0"], driver="rdma.example.com")
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert "no device of driver gpu.gpu-agent.io is allocated (drivers in status.allocation.devices.results: rdma.example.com)" in err


def test_an_empty_request_gets_an_empty_answer_and_an_empty_claim_an_error(node):
    node.start()
    assert dict(node.prepare().claims) == {}
    assert dict(node.unprepare().claims) == {}
    resp = node.prepare({"metadata": {"namespace": "", "name": "", "uid": ""}})
    assert resp.claims[""].error.endswith("the claim's namespace, uid, name must not be empty")
    bad = {"metadata": {"namespace": "default", "name": "x", "uid": "../../etc/passwd"}}
    assert node.prepare(bad).claims["../../etc/passwd"].error.endswith(
        "not a claim UID (expected letters, digits, '-', '_' or '.')")
    assert node.unprepare(bad).claims["../../etc/passwd"].error.endswith("not a claim UID (expected letters, digits, '-', '_' or '.')")


def test_an_unreachable_api_server_is_a_per_claim_error_not_a_failed_call(node):
    node.start()
    c = node.put_claim("c", ["gpu-0"])
    node.api.go_down()
    err = node.prepare(c).claims[c["metadata"]["uid"]].error
    assert err.startswith("ResourceClaim default/c (uid ") and "cannot be read" in err


def test_a_forbidden_read_names_the_http_status(node):
    node.start()
    c = node.put_claim("c", ["gpu-0"])
    node.api.fail(403, path_contains="resourceclaims")
    assert "HTTP 403" in node.prepare(c).claims[c["metadata"]["uid"]].error


# ---------------------------------------------------------------------- idempotency and restarts
def test_a_repeated_prepare_returns_the_same_answer_without_reading_the_claim_again(node):
    node.start()
    c = node.put_claim("c", ["gpu-0", "gpu-1"])
    first = node.prepare(c)
    reads = node.api.count("GET", "/resourceclaims/")
    assert node.prepare(c) == first
    assert node.api.count("GET", "/resourceclaims/") == reads == 1


def test_a_prepare_after_an_agent_restart_answers_from_the_checkpoint(node):
    node.start()
    c = node.put_claim("c", ["gpu-6"])
    uid = c["metadata"]["uid"]
    first = node.prepare(c)
    node.restart()
    node.api.go_down()  # the answer must not need the API server
    os.unlink(spec_path(node.config.cdi_dir, DRIVER, uid))  # and a lost spec is written again
    assert node.prepare(c) == first
    assert spec_of(node, uid)["devices"][0]["name"] == f"{uid}-gpu-6"


def test_a_restart_removes_the_temp_files_of_killed_writes_and_leaves_other_tools_files(node, caplog):
    node.start()
    c = node.put_claim("c", ["gpu-6"])
    uid = c["metadata"]["uid"]
    first = node.prepare(c)
    node.plugin.stop()
    cdi, claims = node.config.cdi_dir, os.path.join(node.plugin.plugin_dir, "claims")
    nccl = os.path.join(node.plugin.plugin_dir, "nccl")  # nccl.hostDir's default in DRA mode
    ours = {  # an agent killed while writing a claim's spec, its checkpoint and its NCCL file
        (cdi, killed_write(f"from agent.files import write_json_atomic; write_json_atomic({spec_path(cdi, DRIVER, uid)!r},"
                           " {})", cdi)),
        (claims, killed_write(f"from agent.files import write_json_atomic; write_json_atomic({claims!r} + '/{uid}.json',"
                              " {})", claims)),
        (claims, ".k3j4h5g6.tmp"),  # an older version's temp file: the directory is the checkpoint's alone
        (nccl, killed_write(f"from agent.files import write_text_atomic; write_text_atomic({nccl!r} + '/claim-{uid}.xml',"
                            " '')", nccl)),
    }
    theirs = {  # the CDI directory is shared: another vendor's specs and temp files stay
        (cdi, "nvidia.com-gpu.json"), (cdi, ".nvidia.com-gpu.json.k3j4h5g6.tmp"), (cdi, ".k3j4h5g6.tmp"),
        (cdi, ".other.io-claim_x.json.k3j4h5g6.tmp"),
        (nccl, ".notes.txt.k3j4h5g6.tmp"),  # not a file the agent writes there
    }
    for directory, name in ours | theirs:
        with open(os.path.join(directory, name), "a", encoding="utf-8") as fh:
            fh.write("{")
    assert all(name.endswith(".tmp") for _, name in ours)
    with caplog.at_level(logging.INFO):
        node.start(node.topology)
    assert not any(os.path.exists(os.path.join(d, n)) for d, n in ours)
    assert all(os.path.exists(os.path.join(d, n)) for d, n in theirs)
    said = [r.getMessage() for r in caplog.records if "temp file(s) of interrupted writes" in r.getMessage()]
    assert sorted(said) == sorted([f"checkpoint {claims}: removed 2 temp file(s) of interrupted writes",
                                   f"CDI directory {cdi}: removed 1 temp file(s) of interrupted writes",
                                   f"NCCL files {nccl}: removed 1 temp file(s) of interrupted writes"]), said
    assert node.prepare(c) == first  # the claim's checkpoint and spec are untouched


def test_an_unprepare_after_an_agent_restart_removes_the_spec_and_forgets_the_claim(node):
    node.start()
    c = node.put_claim("c", ["gpu-2"])
    uid = c["metadata"]["uid"]
    node.prepare(c)
    assert os.path.exists(spec_path(node.config.cdi_dir, DRIVER, uid))
    plugin = node.restart()
    assert len(plugin.checkpoint) == 1
    assert node.unprepare(c).claims[uid].error == ""
    assert not os.path.exists(spec_path(node.config.cdi_dir, DRIVER, uid))
    assert len(plugin.checkpoint) == 0
    assert len(node.restart().checkpoint) == 0


def test_many_prepared_claims_survive_a_restart_each_in_its_own_file(node):
    node.start()
    claims = [node.put_claim(f"c{i}", [f"gpu-{i}"]) for i in range(8)]
    answers = [node.prepare(c) for c in claims]
    node.unprepare(claims[3])
    plugin = node.restart()
    assert sorted(c.uid for c in plugin.checkpoint) == sorted(c["metadata"]["uid"] for i, c in enumerate(claims) if i != 3)
    node.api.go_down()
    assert [node.prepare(c) for i, c in enumerate(claims) if i != 3] == [a for i, a in enumerate(answers) if i != 3]


def test_an_unprepare_of_an_unknown_claim_succeeds(node):
    node.start()
    resp = node.unprepare({"metadata": {"namespace": "default", "name": "never", "uid": "never-prepared"}})
    assert resp.claims["never-prepared"].error == ""


def test_a_corrupt_checkpoint_is_set_aside_and_the_claim_prepared_again(node, caplog):
    node.start()
    c = node.put_claim("c", ["gpu-3"])
    uid = c["metadata"]["uid"]
    node.prepare(c)
    node.plugin.stop()
    path = os.path.join(node.root, "plugins", DRIVER, "claims", f"{uid}.json")
    with open(path, "r+", encoding="utf-8") as fh:
        text = fh.read().replace("gpu-3", "gpu-4")
        fh.seek(0)
        fh.write(text)
    with caplog.at_level(logging.ERROR, logger="agent.dra.checkpoint"):
        plugin = node.start()
    assert f"checkpoint {path} is not a valid prepared-claim checkpoint (checksum mismatch)" in caplog.text
    assert os.path.exists(path + ".corrupt") and len(plugin.checkpoint) == 0
    assert [d.device_name for d in node.prepare(c).claims[uid].devices] == ["gpu-3"]


# ---------------------------------------------------------------------- settings
def test_dra_settings_come_from_flags_and_environment_with_clear_errors():
    from agent.config import load_config
    from agent.errors import ConfigError

    c = load_config(None, {"AGENT_MODE": "dra", "CDI_DIR": "/run/cdi", "KUBECONFIG": "/k"},
                    {"driver_name": "gpu.example.com", "plugins_dir": "/p"})
    assert (c.mode, c.driver_name, c.cdi_dir, c.plugins_dir, c.kubeconfig) == ("dra", "gpu.example.com", "/run/cdi", "/p", "/k")
    d = Config()
    assert (d.mode, d.driver_name, d.plugins_registry_dir, d.plugins_dir, d.cdi_dir, d.kubeconfig) == (
        "device-plugin", "gpu.gpu-agent.io", "/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins",
        "/var/run/cdi", "")
    with pytest.raises(ConfigError, match=r"--mode: expected one of device-plugin, dra, got 'gpus'"):
        load_config(None, {}, {"mode": "gpus"})
    with pytest.raises(ConfigError, match=r"environment DRA_DRIVER_NAME: expected a DRA driver name .* got 'GPU_Driver'"):
        load_config(None, {"DRA_DRIVER_NAME": "GPU_Driver"}, {})


def test_a_mig_device_carries_its_capability_nodes_with_host_paths_under_the_driver_root(node, tmp_path):
    root = tmp_path / "driver"
    gi = root / "proc/driver/nvidia/capabilities/gpu6/mig/gi2"
    (gi / "ci0").mkdir(parents=True)
    (gi / "access").write_text("DeviceFileMinor: 21\nDeviceFileMode: 292\n")
    (gi / "ci0" / "access").write_text("DeviceFileMinor: 22\nDeviceFileMode: 292\n")
    node.start(hgx8_topology(mig=True), config=replace(node.config, nvidia_driver_root=str(root)))
    c = node.put_claim("mig", ["gpu-6-mig-1", "gpu-7-mig-0"])
    uid = c["metadata"]["uid"]
    assert node.prepare(c).claims[uid].error == ""
    spec = spec_of(node, uid)
    assert [[(n["path"], n.get("hostPath")) for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]] == [
        [("/dev/nvidia6", f"{root}/dev/nvidia6"), ("/dev/nvidia-caps/nvidia-cap21", f"{root}/dev/nvidia-caps/nvidia-cap21"),
         ("/dev/nvidia-caps/nvidia-cap22", f"{root}/dev/nvidia-caps/nvidia-cap22")],
        [("/dev/nvidia7", f"{root}/dev/nvidia7")],
    ]


def test_concurrent_prepares_and_unprepares_of_many_claims_all_succeed(node):
    import threading

    node.start()
    # each thread its own pair of GPUs (two prepared claims never share one: test_dra_prepare_sets)
    claims = [node.put_claim(f"c{i}", [f"gpu-{2 * (i % 4)}", f"gpu-{2 * (i % 4) + 1}"]) for i in range(40)]
    errors: list[str] = []

    def worker(part: list[dict]) -> None:
        for c in part:
            uid = c["metadata"]["uid"]
            for resp in (node.prepare(c), node.prepare(c)):
                errors.extend(e for e in [resp.claims[uid].error] if e)
            errors.extend(e for e in [node.unprepare(c).claims[uid].error] if e)

    threads = [threading.Thread(target=worker, args=(claims[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert os.listdir(node.config.cdi_dir) == [] and len(node.plugin.checkpoint) == 0


# ---------------------------------------------------------------------- the claim reader
def test_the_reader_uses_the_newest_resource_version_the_server_serves():
    with ApiServerStub(served_versions=("v1beta2", "v1beta1")) as api:
        api.put_claim(claim_object("c", ["gpu-0"]))
        reader = KubernetesClaimReader(api.api_client())
        assert reader.get("default", "c")["metadata"]["name"] == "c"
        assert reader.version == "v1beta2"
        assert api.count("GET", "/apis/resource.k8s.io/v1beta2/namespaces/default/resourceclaims/c") == 1


def test_a_server_without_dra_is_a_clear_read_error():
    from agent.dra.claims import ClaimReadError

    with ApiServerStub(served_versions=()) as api:
        with pytest.raises(ClaimReadError, match=r"serves no resource.k8s.io version this agent reads \(served: none; "
                                                 r"expected one of v1, v1beta2, v1beta1\); is DynamicResourceAllocation enabled\?"):
            KubernetesClaimReader(api.api_client()).get("default", "c")


def test_a_bad_kubeconfig_is_a_config_error_naming_the_file(tmp_path):
    from agent.errors import ConfigError
    from agent.kube import api_client

    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"--kubeconfig {missing}: cannot load"):
        api_client(Config(kubeconfig=str(missing)))


def test_a_kubeconfig_file_configures_the_client(tmp_path):
    from agent.kube import api_client

    with ApiServerStub(served_versions=("v1",)) as api:
        api.put_claim(claim_object("c", ["gpu-0"]))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
            f"clusters: [{{name: t, cluster: {{server: '{api.url}'}}}}]\n"
            "users: [{name: t, user: {token: abc}}]\n"
            "contexts: [{name: t, context: {cluster: t, user: t}}]\n"
        )
        reader = KubernetesClaimReader(api_client(Config(kubeconfig=str(kubeconfig))))
        assert reader.get("default", "c")["metadata"]["name"] == "c"


def test_a_new_topology_serves_new_claims_and_keeps_prepared_ones(node):
    plugin = node.start(hgx8_topology())
    old = node.put_claim("old", ["gpu-7"])
    first = node.prepare(old)
    plugin.set_topology(DraView(hgx8_topology(mig=True)), plugin.config)  # GPU 7 is now split into MIG devices
    assert node.prepare(old) == first
    new = node.put_claim("new", ["gpu-7"])
    assert "device 'gpu-7' of pool 'node-1' (request 'gpus'): unknown" in node.prepare(new).claims[new["metadata"]["uid"]].error
    mig = node.put_claim("mig", ["gpu-6-mig-1"])  # GPU 7's wait for "old" (test_dra_prepare_sets)
    assert node.prepare(mig).claims[mig["metadata"]["uid"]].error == ""


def test_the_config_file_sets_the_dra_settings_and_names_a_bad_key(tmp_path):
    from agent.config import load_config
    from agent.errors import ConfigError

    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nmode: dra\ndra:\n  driverName: gpu.example.com\n  cdiDir: /run/cdi\n  kubeconfig:\n")
    c = load_config(str(path), {}, {})
    assert (c.mode, c.driver_name, c.cdi_dir, c.kubeconfig) == ("dra", "gpu.example.com", "/run/cdi", "")
    path.write_text("version: v1\ndra:\n  driver: gpu.example.com\n")
    with pytest.raises(ConfigError, match=r"config.yaml: dra.driver: unknown key \(expected one of driverName, "
                                          r"pluginsRegistryDir, pluginsDir, cdiDir, kubeconfig, deleteSlicesOnShutdown, taintEffect, gpuSets,"
                                          r" gpuSetWithdrawalGraceSeconds, dynamicMig, migPlacementsPerProfile\)"):
        load_config(str(path), {}, {})
    path.write_text("version: v1\nmode: DRA-please\n")
    with pytest.raises(ConfigError, match=r"config.yaml: mode: expected one of device-plugin, dra, got 'DRA-please'"):
        load_config(str(path), {}, {})


def test_a_claims_cdi_spec_carries_the_imex_channel_node_and_variable(node, tmp_path):
    root = tmp_path / "driver"
    (root / "dev" / "nvidia-caps-imex-channels").mkdir(parents=True)
    os.symlink("/dev/null", root / "dev" / "nvidia-caps-imex-channels" / "channel0")  # a character device
    node.start(config=replace(node.config, nvidia_driver_root=str(root), imex_channel_ids=(0,)))
    c = node.put_claim("imex", ["gpu-1"])
    uid = c["metadata"]["uid"]
    assert node.prepare(c).claims[uid].error == ""
    edits = spec_of(node, uid)["containerEdits"]
    assert "NVIDIA_IMEX_CHANNELS=0" in edits["env"]
    assert {"path": "/dev/nvidia-caps-imex-channels/channel0", "permissions": "rw",
            "hostPath": f"{root}/dev/nvidia-caps-imex-channels/channel0"} in edits["deviceNodes"]


def test_the_taint_effect_comes_from_the_file_the_environment_and_flags_with_clear_errors(tmp_path):
    from agent.config import load_config
    from agent.errors import ConfigError

    assert Config().taint_effect == "NoSchedule"
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\ndra:\n  taintEffect: NoExecute\n")
    assert load_config(str(path), {}, {}).taint_effect == "NoExecute"
    assert load_config(str(path), {"DRA_TAINT_EFFECT": "NoSchedule"}, {}).taint_effect == "NoSchedule"
    assert load_config(None, {"DRA_TAINT_EFFECT": "NoSchedule"}, {"taint_effect": "NoExecute"}).taint_effect == "NoExecute"
    with pytest.raises(ConfigError, match=r"environment DRA_TAINT_EFFECT: expected one of NoSchedule, NoExecute, got 'Evict'"):
        load_config(None, {"DRA_TAINT_EFFECT": "Evict"}, {})
    path.write_text("version: v1\ndra:\n  taintEffect: PreferNoSchedule\n")
    with pytest.raises(ConfigError, match=r"config.yaml: dra.taintEffect: expected one of NoSchedule, NoExecute"):
        load_config(str(path), {}, {})

