"""The device plugin as the kubelet sees it: a stand-in kubelet drives the agent's servers
over real unix sockets."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry
from waiting import eventually

from agent._proto import deviceplugin_v1beta1_pb2 as pb
from agent._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from agent.config import Config, TimeSlicingResource
from agent.deviceplugin.manager import DevicePluginManager
from agent.health import HealthState
from agent.kubelet.unix_server import UnixGrpcServer
from agent.metrics.self_metrics import AgentMetrics
from tests.testbed.allocation_support import best_set
from tests.testbed.kubelet_stub import KubeletStub, PluginClient, hgx8_topology, pcie4_topology


def allocation_engine():
    from agent.topology.allocator import AllocationEngine

    return AllocationEngine


@pytest.fixture
def kubelet_dir():
    # unix socket paths are limited to 108 bytes: keep the directory short
    path = tempfile.mkdtemp(prefix="dp", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Node:
    """A running manager + stand-in kubelet, stopped by the fixture."""

    def __init__(self, kubelet_dir):
        self.kubelet_dir = kubelet_dir
        self.kubelet: KubeletStub | None = None
        self.manager: DevicePluginManager | None = None
        self.clients: list[PluginClient] = []

    def start(self, topology, config=None, *, kubelet=True, **kwargs):
        config = config or Config()
        from dataclasses import replace

        config = replace(config, kubelet_dir=self.kubelet_dir)
        if not config.nccl_host_dir:  # the default beside a /tmp kubelet dir is /tmp's, shared by every test
            config = replace(config, nccl_host_dir=os.path.join(self.kubelet_dir, "nccl"))
        if kubelet:
            self.kubelet = KubeletStub(self.kubelet_dir).start()
        self.health = HealthState(topology.gpu_count)
        # the agent's own metrics, built first and passed in (as the daemon does)
        self.metrics = AgentMetrics(CollectorRegistry())
        self.manager = DevicePluginManager(topology, config, self.health, events=self.metrics, poll_s=0.05, **kwargs)
        self.manager.start()
        return self

    def metric(self, name, labels=None):
        return self.metrics.registry.get_sample_value(name, labels or {})

    def client(self, resource="nvidia.com/gpu"):
        res = next(r for r in self.manager.resources if r.name == resource)
        c = PluginClient(os.path.join(self.kubelet_dir, res.socket_name))
        self.clients.append(c)
        return c

    def stop(self):
        for c in self.clients:
            c.close()
        if self.manager is not None:
            self.manager.stop(0.5)
        if self.kubelet is not None:
            self.kubelet.stop()


@pytest.fixture
def node(kubelet_dir):
    n = Node(kubelet_dir)
    yield n
    n.stop()


# ---------------------------------------------------------------------- registration
def test_plugin_registers_with_version_endpoint_resource_and_preferred_option(node):
    node.start(hgx8_topology())
    assert node.kubelet.wait_for(lambda: node.kubelet.registered("nvidia.com/gpu"))
    reg = node.kubelet.registered("nvidia.com/gpu")[0]
    assert reg.request.version == "v1beta1"
    assert reg.request.endpoint == "nvidia-gpu.sock"
    assert reg.request.options.get_preferred_allocation_available is True
    assert eventually(node.manager.ready, 2.0)


def test_kubelet_gets_options_from_the_plugin_during_register(node):
    node.start(hgx8_topology())
    assert node.kubelet.wait_for(lambda: node.kubelet.registrations)
    options = node.kubelet.registrations[0].options
    # PreStartContainer holds a container back until its NCCL topology file is written
    assert options.get_preferred_allocation_available is True and options.pre_start_required is True
    node.stop()
    node.start(hgx8_topology(), Config(nccl_pod_files="off"))
    assert node.kubelet.wait_for(lambda: node.kubelet.registrations)
    assert node.kubelet.registrations[0].options.pre_start_required is False


def test_one_registration_per_resource(node):
    config = Config(mig_strategy="mixed")
    node.start(hgx8_topology(mig=True), config)
    expected = {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"}
    assert node.kubelet.wait_for(lambda: {r.request.resource_name for r in node.kubelet.registrations} == expected)
    assert sorted(os.listdir(node.kubelet_dir)) == sorted(
        ["kubelet.sock", "nvidia-gpu.sock", "nvidia-mig-1g.10gb.sock", "nvidia-mig-3g.40gb.sock"]
    )


def test_refused_registration_is_retried_until_the_kubelet_accepts(node):
    node.kubelet = KubeletStub(node.kubelet_dir, refuse_reason="resource already registered").start()
    node.start(hgx8_topology(), kubelet=False, max_backoff_s=0.2)
    assert not eventually(node.manager.ready, 0.5)
    node.kubelet.refuse_reason = None
    assert eventually(node.manager.ready, 3.0)


def test_stale_socket_file_is_replaced(node):
    open(os.path.join(node.kubelet_dir, "nvidia-gpu.sock"), "w").close()
    node.start(hgx8_topology())
    assert eventually(node.manager.ready, 2.0)
    assert node.client().options().get_preferred_allocation_available


def test_a_socket_another_live_plugin_took_is_left_alone_said_once_and_served_once_free(node, caplog):
    node.start(hgx8_topology())
    assert eventually(node.manager.ready, 2.0)
    ours = os.path.join(node.kubelet_dir, "nvidia-gpu.sock")
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # NVIDIA's plugin on the same directory
    other.bind(ours + ".new")
    other.listen()
    theirs = os.stat(ours + ".new").st_ino
    try:
        with caplog.at_level(logging.INFO, logger="agent"):
            caplog.clear()
            os.rename(ours + ".new", ours)  # it takes the name over ours
            time.sleep(1.0)  # 20 watch rounds
            said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
            assert os.stat(ours).st_ino == theirs, "another live server's socket is never removed"
            assert not node.manager.ready()
            other.close()
            os.unlink(ours)  # it is gone
            assert eventually(node.manager.ready, 5.0), "served and registered again"
    finally:
        other.close()
    assert len(said) <= 2 and any("another device plugin is serving on this socket" in m for m in said), said
    assert node.client().options().get_preferred_allocation_available


class _SlowRegistration(pb_grpc.RegistrationServicer):
    """A kubelet whose Register takes ``delay_s`` to answer (a busy kubelet)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.in_flight = threading.Event()

    def Register(self, request, context):
        self.in_flight.set()
        time.sleep(self.delay_s)
        return pb.Empty()


def test_readiness_answers_at_once_while_a_slow_register_is_in_flight(node):
    slow = _SlowRegistration(delay_s=1.5)
    server = UnixGrpcServer(os.path.join(node.kubelet_dir, "kubelet.sock"),
                            lambda s: pb_grpc.add_RegistrationServicer_to_server(slow, s), name="slow-kubelet",
                            max_workers=2)
    server.start()
    try:
        node.start(hgx8_topology(), kubelet=False, register_timeout_s=3.0)
        assert slow.in_flight.wait(3.0)
        started = time.monotonic()
        assert node.manager.ready() is False
        assert time.monotonic() - started < 0.2, "the readiness probe waited for the kubelet's Register"
        assert eventually(node.manager.ready, 3.0)
    finally:
        node.manager.stop(0.5)
        server.stop(0)


# ---------------------------------------------------------------------- ListAndWatch
def test_device_list_has_every_gpu_healthy_with_its_numa_node(node):
    topo = hgx8_topology()
    node.start(topo)
    assert node.kubelet.wait_for(lambda: node.kubelet.latest("nvidia.com/gpu") is not None)
    devices = node.kubelet.latest("nvidia.com/gpu").devices
    assert [d.ID for d in devices] == [g.uuid for g in topo.gpus]
    assert {d.health for d in devices} == {"Healthy"}
    assert [[n.ID for n in d.topology.nodes] for d in devices] == [[0]] * 4 + [[1]] * 4


def test_device_list_has_no_topology_when_numa_is_unknown(node):
    node.start(hgx8_topology(numa=False))
    assert node.kubelet.wait_for(lambda: node.kubelet.latest("nvidia.com/gpu") is not None)
    assert all(not d.HasField("topology") for d in node.kubelet.latest("nvidia.com/gpu").devices)


def test_unhealthy_gpu_is_sent_at_once_with_all_its_replicas(node):
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=2),))
    node.start(pcie4_topology(), config)
    assert node.kubelet.wait_for(lambda: node.kubelet.latest("nvidia.com/gpu") is not None)
    node.health.mark_unhealthy(2, "XID 79")
    assert node.kubelet.wait_for(
        lambda: any(d.health == "Unhealthy" for d in node.kubelet.latest("nvidia.com/gpu").devices), 2.0
    )
    devices = node.kubelet.latest("nvidia.com/gpu").devices
    assert [d.ID.split("::")[0] for d in devices if d.health == "Unhealthy"] == [pcie4_topology().gpus[2].uuid] * 2
    node.health.mark_healthy(2)
    assert node.kubelet.wait_for(
        lambda: all(d.health == "Healthy" for d in node.kubelet.latest("nvidia.com/gpu").devices), 2.0
    )


def test_stop_closes_streams_and_removes_sockets(node):
    node.start(hgx8_topology())
    assert node.kubelet.wait_for(lambda: node.kubelet.latest("nvidia.com/gpu") is not None)
    node.manager.stop(0.5)
    assert os.listdir(node.kubelet_dir) == ["kubelet.sock"]
    stream_threads = [t for _, _, t in node.kubelet._streams]
    for t in stream_threads:
        t.join(2.0)
    assert not any(t.is_alive() for t in stream_threads)


# ---------------------------------------------------------------------- kubelet lifecycle
def test_kubelet_restart_triggers_reregistration_within_two_seconds(node):
    node.start(hgx8_topology())
    assert eventually(node.manager.ready, 2.0)
    node.kubelet.restart()
    assert node.kubelet.wait_for(lambda: len(node.kubelet.registrations) == 2, 2.0)
    assert node.metric("gpu_agent_kubelet_restarts_total") == 1
    assert eventually(node.manager.ready, 1.0)
    assert node.kubelet.wait_for(lambda: node.kubelet.latest("nvidia.com/gpu") is not None)
    assert node.client().options().get_preferred_allocation_available


def test_kubelet_that_starts_after_the_agent_gets_a_registration(node):
    node.start(hgx8_topology(), kubelet=False)
    assert not node.manager.ready()
    node.kubelet = KubeletStub(node.kubelet_dir).start()
    assert node.kubelet.wait_for(lambda: node.kubelet.registrations, 2.0)
    assert node.metric("gpu_agent_kubelet_restarts_total") == 0 and eventually(node.manager.ready, 1.0)


def test_removed_plugin_socket_is_served_again_and_reregistered(node, caplog):
    node.start(hgx8_topology())
    assert eventually(node.manager.ready, 2.0)
    with caplog.at_level(logging.WARNING, logger="agent.deviceplugin"):
        os.unlink(os.path.join(node.kubelet_dir, "nvidia-gpu.sock"))
        assert node.kubelet.wait_for(lambda: len(node.kubelet.registrations) == 2, 2.0)
    assert [r.getMessage() for r in caplog.records if "vanished" in r.getMessage()] == [
        f"socket {os.path.join(node.kubelet_dir, 'nvidia-gpu.sock')} vanished: serving it again"
    ]
    assert node.metric("gpu_agent_kubelet_restarts_total") == 0  # the kubelet stayed
    assert node.client().options().get_preferred_allocation_available


def test_reload_serves_the_new_configuration(node):
    topo = pcie4_topology()
    node.start(topo)
    assert eventually(node.manager.ready, 2.0)
    from dataclasses import replace

    new = replace(node.manager.config, time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=2),))
    node.manager.set_topology(topo, new)
    assert node.kubelet.wait_for(
        lambda: (lst := node.kubelet.latest("nvidia.com/gpu")) is not None and len(lst.devices) == 8, 3.0
    )


# ---------------------------------------------------------------------- preferred allocation
@pytest.mark.parametrize("make_topology", [hgx8_topology, pcie4_topology])
def test_preferred_allocation_is_the_engines_best_set(node, make_topology):
    AllocationEngine = allocation_engine()
    topo = make_topology()
    node.start(topo)
    client = node.client()
    engine = AllocationEngine(topo)
    uuids = [g.uuid for g in topo.gpus]
    for available, must, size in [(range(topo.gpu_count), [], 2), (range(1, topo.gpu_count), [3], 2), ([0, 2, 3], [], 2)]:
        got = client.preferred([uuids[i] for i in available], [uuids[i] for i in must], size)
        want = [uuids[i] for i in best_set(engine, list(available), list(must), size)]
        assert got == want and len(got) == size and all(uuids[m] in got for m in must)


def test_preferred_allocation_on_pcie_pairs_keeps_the_nvlink_pair(node):
    allocation_engine()
    topo = pcie4_topology()
    node.start(topo)
    got = node.client().preferred([g.uuid for g in topo.gpus], [topo.gpus[3].uuid], 2)
    assert sorted(got) == sorted([topo.gpus[2].uuid, topo.gpus[3].uuid])


def test_preferred_allocation_of_replicas_returns_replica_ids(node):
    allocation_engine()
    topo = pcie4_topology()
    node.start(topo, Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=2),)))
    ids = [d.id for d in node.manager.resources[0].devices]
    got = node.client().preferred(ids, [], 3)
    assert len(got) == 3 and set(got) <= set(ids)


# ---------------------------------------------------------------------- Allocate
def envs_of(response, i=0):
    return dict(response.container_responses[i].envs)


def test_allocate_envvar_uuid_strategy_lists_gpu_uuids(node):
    topo = hgx8_topology()
    node.start(topo)
    resp = node.client().allocate([topo.gpus[5].uuid, topo.gpus[4].uuid], [topo.gpus[0].uuid])
    assert envs_of(resp)["NVIDIA_VISIBLE_DEVICES"] == f"{topo.gpus[5].uuid},{topo.gpus[4].uuid}"
    assert envs_of(resp, 1)["NVIDIA_VISIBLE_DEVICES"] == topo.gpus[0].uuid
    assert envs_of(resp)["GPU_TOPOLOGY_NUMA_NODES"] == "1"
    assert envs_of(resp)["GPU_TOPOLOGY_CPULIST"] == "56-111,168-223"
    assert envs_of(resp)["GPU_TOPOLOGY_NVLINK_CONNECTED"] == "true"
    # the one mount is the container's NCCL topology file (tests/test_nccl_pods.py)
    assert [m.container_path for m in resp.container_responses[0].mounts] == ["/etc/nccl/topology.xml"]
    assert not resp.container_responses[0].devices


def test_allocate_index_strategy_lists_indices_and_mig_pairs(node):
    topo = hgx8_topology(mig=True)
    node.start(topo, Config(mig_strategy="mixed", device_id_strategy="index"))
    resp = node.client().allocate([topo.gpus[1].uuid])
    assert envs_of(resp)["NVIDIA_VISIBLE_DEVICES"] == "1"
    mig = node.client("nvidia.com/mig-3g.40gb").allocate([topo.gpus[6].mig_devices[1].uuid])
    assert envs_of(mig)["NVIDIA_VISIBLE_DEVICES"] == "6:1"


def test_allocate_volume_mounts_strategy_mounts_dev_null_per_device(node):
    topo = pcie4_topology()
    node.start(topo, Config(device_list_strategy=("volume-mounts",)))
    resp = node.client().allocate([topo.gpus[0].uuid, topo.gpus[1].uuid])
    c = resp.container_responses[0]
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert [(m.container_path, m.host_path) for m in c.mounts if m.container_path != "/etc/nccl/topology.xml"] == [
        (f"/var/run/nvidia-container-devices/{topo.gpus[i].uuid}", "/dev/null") for i in (0, 1)
    ]


def test_allocate_cdi_annotations_strategy_sets_one_annotation_and_no_env(node):
    topo = pcie4_topology()
    node.start(topo, Config(device_list_strategy=("cdi-annotations",), cdi_annotation_prefix="cdi.k8s.io/"))
    c = node.client().allocate([topo.gpus[2].uuid, topo.gpus[3].uuid]).container_responses[0]
    ((key, value),) = c.annotations.items()
    assert key.startswith("cdi.k8s.io/nvidia-device-plugin_")
    assert value == f"nvidia.com/gpu={topo.gpus[2].uuid},nvidia.com/gpu={topo.gpus[3].uuid}"
    assert "NVIDIA_VISIBLE_DEVICES" not in c.envs and not c.cdi_devices


def test_allocate_cdi_cri_strategy_returns_cdi_devices(node):
    topo = pcie4_topology()
    node.start(topo, Config(device_list_strategy=("cdi-cri", "envvar")))
    c = node.client().allocate([topo.gpus[1].uuid]).container_responses[0]
    assert [d.name for d in c.cdi_devices] == [f"nvidia.com/gpu={topo.gpus[1].uuid}"]
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == topo.gpus[1].uuid


def test_pass_device_specs_adds_present_control_nodes_and_one_node_per_gpu(node, tmp_path):
    root = tmp_path / "driver"
    (root / "dev").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm"):
        (root / "dev" / name).touch()
    topo = hgx8_topology()
    node.start(topo, Config(pass_device_specs=True, nvidia_driver_root=str(root)))
    c = node.client().allocate([topo.gpus[3].uuid, topo.gpus[1].uuid]).container_responses[0]
    assert [(d.container_path, d.host_path, d.permissions) for d in c.devices] == [
        ("/dev/nvidiactl", f"{root}/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", f"{root}/dev/nvidia-uvm", "rw"),
        ("/dev/nvidia3", f"{root}/dev/nvidia3", "rw"),
        ("/dev/nvidia1", f"{root}/dev/nvidia1", "rw"),
    ]


def test_mig_device_specs_add_the_parent_and_its_caps_nodes(node, tmp_path):
    root = tmp_path / "driver"
    gi = root / "proc/driver/nvidia/capabilities/gpu6/mig/gi2"
    (gi / "ci0").mkdir(parents=True)
    (gi / "access").write_text("DeviceFileMinor: 21\nDeviceFileMode: 292\n")
    (gi / "ci0" / "access").write_text("DeviceFileMinor: 22\nDeviceFileMode: 292\n")
    topo = hgx8_topology(mig=True)
    node.start(topo, Config(mig_strategy="mixed", pass_device_specs=True, nvidia_driver_root=str(root)))
    c = node.client("nvidia.com/mig-3g.40gb").allocate([topo.gpus[6].mig_devices[1].uuid]).container_responses[0]
    assert [d.container_path for d in c.devices] == ["/dev/nvidia6", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"]


def test_allocate_reduces_replicas_to_their_gpu_once(node):
    topo = pcie4_topology()
    node.start(topo, Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=4),)))
    u = [g.uuid for g in topo.gpus]
    resp = node.client().allocate([f"{u[1]}::3", f"{u[1]}::0", f"{u[0]}::2"])
    assert envs_of(resp)["NVIDIA_VISIBLE_DEVICES"] == f"{u[1]},{u[0]}"


def test_pre_start_container_succeeds_and_does_nothing_without_nccl_files(node):
    from agent._proto import deviceplugin_v1beta1_pb2 as pb

    node.start(pcie4_topology(), Config(nccl_pod_files="off"))
    resp = node.client().stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["x"]), timeout=5)
    assert resp == pb.PreStartContainerResponse()


# ---------------------------------------------------------------------- bad input
def invalid(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details()


def test_every_bad_input_is_invalid_argument_and_the_server_keeps_serving(node):
    topo = pcie4_topology()
    u = [g.uuid for g in topo.gpus]
    node.start(topo)
    c = node.client()
    resource = "for resource nvidia.com/gpu"
    assert invalid(lambda: c.allocate(["GPU-ffffffff-0000"])) == (
        f"devices: unknown device ID 'GPU-ffffffff-0000' {resource}"
    )
    assert invalid(lambda: c.allocate(["not a device"])) == (
        "devices: malformed device ID 'not a device': expected a GPU or MIG UUID, optionally"
        " with ::<replica>"
    )
    assert invalid(lambda: c.allocate([])) == "devices: empty device list"
    assert "no container requests" in invalid(lambda: c.allocate())
    assert invalid(lambda: c.allocate([u[0], u[0]])) == f"devices: device ID '{u[0]}' given twice"
    assert "replica" not in invalid(lambda: c.allocate([f"{u[0]}::1"]))
    assert invalid(lambda: c.preferred(u, [], 0)) == "size must be at least 1, got 0"
    assert invalid(lambda: c.preferred(u[:2], [], 3)) == "size 3 is more than the 2 available devices"
    assert invalid(lambda: c.preferred(u[:2], [u[3]], 2)) == (
        f"must-include: device ID '{u[3]}' is not in the available list"
    )
    assert invalid(lambda: c.preferred(u, u[:2], 1)) == "2 must-include devices do not fit in size 1"
    assert invalid(lambda: c.preferred(u + ["GPU-0000-dead"], [], 1)) == (
        f"available: unknown device ID 'GPU-0000-dead' {resource}"
    )
    assert envs_of(c.allocate([u[0]]))["NVIDIA_VISIBLE_DEVICES"] == u[0]


def test_each_kind_of_mistake_has_one_message_in_both_calls_and_the_cli(node, capsys):
    from agent import cli
    from agent.discovery import load_topology

    topo = load_topology("dgx-h100")
    u = [g.uuid for g in topo.gpus]
    node.start(topo)
    c = node.client()

    def cli_error(*argv: str) -> str:
        assert cli.main(["allocate", "--simulate", "dgx-h100", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        return err.strip().removeprefix("gpu-topology-agent allocate: error: ")

    # (available, must-include, size) over gRPC and as the command's flags; the message
    cases = [
        ((u[:2] + ["not a device"], [], 1), ("0,1,not a device", "", "1"),
         "available: malformed device ID 'not a device': expected a GPU or MIG UUID,"
         " optionally with ::<replica>"),
        ((u[:2] + ["GPU-0000-dead"], [], 1), ("0,1,GPU-0000-dead", "", "1"),
         "available: unknown device ID 'GPU-0000-dead' for resource nvidia.com/gpu"),
        (([u[0], u[1], u[0]], [], 1), ("0,1,0", "", "1"), f"available: device ID '{u[0]}' given twice"),
        ((u, [u[2], "GPU-0000-dead"], 2), ("", "2,GPU-0000-dead", "2"),
         "must-include: unknown device ID 'GPU-0000-dead' for resource nvidia.com/gpu"),
        ((u, [u[2], u[2]], 2), ("", "2,2", "2"), f"must-include: device ID '{u[2]}' given twice"),
        ((u[:2], [u[3]], 2), ("0,1", "3", "2"),
         f"must-include: device ID '{u[3]}' is not in the available list"),
        ((u, [], 0), ("", "", "0"), "size must be at least 1, got 0"),
        ((u[:2], [], 3), ("0,1", "", "3"), "size 3 is more than the 2 available devices"),
        ((u, u[:2], 1), ("", "0,1", "1"), "2 must-include devices do not fit in size 1"),
    ]
    for (available, must, size), (flag_available, flag_must, flag_size), message in cases:
        assert invalid(lambda a=available, m=must, k=size: c.preferred(a, m, k)) == message
        argv = ["--size", flag_size, "--must-include", flag_must]
        assert cli_error(*argv, *(["--available", flag_available] if flag_available else [])) == message
        if message.startswith("available: "):  # the same list given to Allocate
            devices = message.replace("available: ", "devices: ")
            assert invalid(lambda a=available: c.allocate(a)) == devices


def test_fail_requests_greater_than_one_refuses_multi_replica_requests(node, capsys, tmp_path):
    from agent import cli

    topo = pcie4_topology()
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=2),), fail_requests_greater_than_one=True)
    node.start(topo, config)
    ids = [d.id for d in node.manager.resources[0].devices]
    c = node.client()
    message = (
        "request for 2 devices is too large: the maximum request size for shared resources is 1"
        " (failRequestsGreaterThanOne)"
    )
    assert invalid(lambda: c.allocate(ids[:2])) == message
    assert invalid(lambda: c.preferred(ids, [], 2)) == message
    assert envs_of(c.allocate(ids[:1]))["NVIDIA_VISIBLE_DEVICES"] == topo.gpus[0].uuid
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    failRequestsGreaterThanOne: true\n"
        "    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
    )
    argv = ["allocate", "--simulate", "dgx-h100", "--config", str(config_file), "--size", "2"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")


# ---------------------------------------------------------------------- load
def test_32_threads_of_mixed_calls_all_succeed(node):
    allocation_engine()
    topo = hgx8_topology()
    node.start(topo)
    socket = os.path.join(node.kubelet_dir, "nvidia-gpu.sock")
    uuids = [g.uuid for g in topo.gpus]
    errors: list[BaseException] = []
    calls_per_thread = 500

    def worker(seed: int) -> None:
        client = PluginClient(socket)
        try:
            for i in range(calls_per_thread):
                k = (seed + i) % 4
                if k == 0:
                    client.options()
                elif k == 1:
                    got = client.preferred(uuids, [uuids[seed % 8]], 1 + i % 8)
                    assert uuids[seed % 8] in got
                elif k == 2:
                    client.allocate(uuids[: 1 + i % 8])
                else:
                    try:
                        client.allocate(["GPU-bad"])
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and not any(t.is_alive() for t in threads)


def test_preferred_allocation_of_mig_devices_keeps_them_on_one_parent(node):
    allocation_engine()
    topo = hgx8_topology(mig=True)
    node.start(topo, Config(mig_strategy="mixed"))
    ids = [m.uuid for m in topo.gpus[7].mig_devices]
    got = node.client("nvidia.com/mig-1g.10gb").preferred(ids, [ids[1]], 2)
    assert sorted(got) == sorted(ids)


def test_packed_replica_policy_fills_the_loaded_gpu_first(node):
    allocation_engine()
    topo = pcie4_topology()
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=4),),
                    shared_devices_allocation_policy="packed")
    node.start(topo, config)
    u = [g.uuid for g in topo.gpus]
    # GPU 1 already runs two replicas (only ::2 and ::3 free); the others are idle
    available = [f"{u[0]}::{n}" for n in range(4)] + [f"{u[1]}::2", f"{u[1]}::3"] + [f"{u[2]}::{n}" for n in range(4)]
    got = node.client().preferred(available, [], 2)
    assert got == [f"{u[1]}::2", f"{u[1]}::3"]


def test_distributed_replica_policy_spreads_over_idle_gpus(node):
    allocation_engine()
    topo = pcie4_topology()
    node.start(topo, Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=4),)))
    u = [g.uuid for g in topo.gpus]
    available = [f"{u[0]}::{n}" for n in range(4)] + [f"{u[1]}::3"] + [f"{u[2]}::{n}" for n in range(4)]
    got = node.client().preferred(available, [], 2)
    assert len({g.split("::")[0] for g in got}) == 2 and not any(g.startswith(u[1]) for g in got)


# ---------------------------------------------------------------------- self-metrics
def test_every_device_plugin_event_reaches_the_agent_metrics_it_was_built_with(node):
    topo = pcie4_topology()
    node.start(topo)
    healthy = {"resource": "nvidia.com/gpu", "device": topo.gpus[1].uuid}
    assert eventually(node.manager.ready, 2.0)
    assert node.metric("gpu_agent_registrations_total", {"resource": "nvidia.com/gpu"}) == 1
    assert node.metric("gpu_agent_device_healthy", healthy) == 1
    node.client().preferred([g.uuid for g in topo.gpus], [], 2)
    assert node.metric("gpu_agent_preferred_allocation_seconds_count") == 1
    node.health.mark_unhealthy(1, "XID 79")
    assert node.metric("gpu_agent_device_healthy", healthy) == 0  # reported as it changed, not later
    node.kubelet.restart()
    assert node.kubelet.wait_for(lambda: node.metric("gpu_agent_kubelet_restarts_total") == 1, 2.0)



# ---------------------------------------------------------------------- IMEX channels
def imex_root(tmp_path, channel: bool = True):
    """A driver root whose /dev holds IMEX channel 0 (a character device: /dev/null's, linked)."""
    root = tmp_path / "driver"
    (root / "dev" / "nvidia-caps-imex-channels").mkdir(parents=True)
    if channel:
        os.symlink("/dev/null", root / "dev" / "nvidia-caps-imex-channels" / "channel0")
    return root


def test_imex_channel_goes_with_the_gpus_in_every_strategy_as_nvidia_hands_it(node, tmp_path):
    root = imex_root(tmp_path)
    topo = hgx8_topology()
    node.start(topo, Config(imex_channel_ids=(0,), nvidia_driver_root=str(root), pass_device_specs=True,
                            device_list_strategy=("envvar", "volume-mounts", "cdi-cri")))
    c = node.client().allocate([topo.gpus[2].uuid]).container_responses[0]
    assert c.envs["NVIDIA_IMEX_CHANNELS"] == "0"
    assert ("/var/run/nvidia-container-devices/imex/0", "/dev/null") in [(m.container_path, m.host_path) for m in c.mounts]
    assert [d.name for d in c.cdi_devices] == [f"nvidia.com/gpu={topo.gpus[2].uuid}", "nvidia.com/imex-channel=0"]
    assert (("/dev/nvidia-caps-imex-channels/channel0", f"{root}/dev/nvidia-caps-imex-channels/channel0", "rw")
            in [(d.container_path, d.host_path, d.permissions) for d in c.devices])


def test_an_absent_optional_imex_channel_is_left_out_until_its_node_exists(node, tmp_path):
    root = imex_root(tmp_path, channel=False)
    (root / "dev" / "nvidia-caps-imex-channels" / "channel0").write_text("")  # a file is no channel
    topo = hgx8_topology()
    node.start(topo, Config(imex_channel_ids=(0,), nvidia_driver_root=str(root), pass_device_specs=True))
    c = node.client().allocate([topo.gpus[0].uuid]).container_responses[0]
    assert "NVIDIA_IMEX_CHANNELS" not in c.envs
    assert not [d for d in c.devices if "imex" in d.container_path]
    os.unlink(root / "dev" / "nvidia-caps-imex-channels" / "channel0")
    os.symlink("/dev/null", root / "dev" / "nvidia-caps-imex-channels" / "channel0")  # the IMEX daemon made it
    c = node.client().allocate([topo.gpus[0].uuid]).container_responses[0]
    assert c.envs["NVIDIA_IMEX_CHANNELS"] == "0"


def test_no_imex_channel_without_channel_ids(node, tmp_path):
    root = imex_root(tmp_path)
    topo = hgx8_topology()
    node.start(topo, Config(nvidia_driver_root=str(root), pass_device_specs=True, device_list_strategy=("cdi-cri",)))
    c = node.client().allocate([topo.gpus[0].uuid]).container_responses[0]
    assert "NVIDIA_IMEX_CHANNELS" not in c.envs and [d.name for d in c.cdi_devices] == [f"nvidia.com/gpu={topo.gpus[0].uuid}"]
