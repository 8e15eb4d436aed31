"""Each container's NCCL topology file, through the public surfaces: the device plugin's
Allocate over the stand-in kubelet (mount, env, the file), MIG devices and replicas, clean-up
when the stand-in pod-resources API no longer lists the container, an agent restart, and a
prepared DRA claim's CDI spec."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import nccl_standin
import pytest
from test_deviceplugin import Node, kubelet_dir  # noqa: F401  (the fixture)
from waiting import eventually

from agent._proto import podresources_v1_pb2 as pr
from agent.config import Config, TimeSlicingResource
from agent.demo.kubelet import PodResourcesStub
from agent.discovery import load_topology
from agent.formats import nvml_to_sysfs_bus_id as nccl_bus_id
from tests.testbed.kubelet_stub import hgx8_topology

MOUNT = "/etc/nccl/topology.xml"


@pytest.fixture
def node(kubelet_dir):  # noqa: F811
    n = Node(kubelet_dir)
    yield n
    n.stop()


def config(tmp_path, **kw) -> Config:
    return Config(nccl_host_dir=str(tmp_path / "nccl"), **kw)


def nccl_mount(response, i: int = 0):
    (mount,) = [m for m in response.container_responses[i].mounts if m.container_path == MOUNT]
    return mount


def pre_start(node, ids, resource: str = "nvidia.com/gpu") -> None:
    """What the kubelet calls before it starts the container (the plugin asks for it)."""
    from agent._proto import deviceplugin_v1beta1_pb2 as pb

    node.client(resource).stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=list(ids)), timeout=10)


def allocate(node, ids, resource: str = "nvidia.com/gpu"):
    """Allocate, then PreStartContainer, as the kubelet does for one container."""
    response = node.client(resource).allocate(ids)
    pre_start(node, ids, resource)
    return response


def test_allocate_mounts_the_containers_own_file_read_only_and_names_it(node, tmp_path):
    topo = load_topology("dgx-h100")
    node.start(topo, config(tmp_path, nccl_ib_hca=True))
    resp = allocate(node, [topo.gpus[1].uuid, topo.gpus[0].uuid])
    mount = nccl_mount(resp)
    assert mount.read_only and mount.host_path.startswith(str(tmp_path / "nccl" / "dp-"))
    envs = resp.container_responses[0].envs
    assert envs["NCCL_TOPO_FILE"] == MOUNT
    assert envs["GPU_TOPOLOGY_NICS"] == "mlx5_0,mlx5_1" and envs["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    system = nccl_standin.load(Path(mount.host_path).read_text())
    assert set(system.gpus) == {nccl_bus_id(topo.gpus[i].pci_bus_id) for i in (0, 1)}
    assert set(system.nics) == {nccl_bus_id(topo.nics[i].pci_bus_id) for i in (0, 1)}
    # the same devices again: the same file (named by allocation), written again
    again = allocate(node, [topo.gpus[0].uuid, topo.gpus[1].uuid])
    assert nccl_mount(again).host_path == mount.host_path
    assert len(os.listdir(tmp_path / "nccl")) == 1


def test_pre_start_puts_back_a_file_a_restarted_agent_never_wrote(node, tmp_path):
    topo = load_topology("pcie-pairs")
    node.start(topo, config(tmp_path))
    ids = [topo.gpus[2].uuid, topo.gpus[3].uuid]
    path = Path(nccl_mount(allocate(node, ids)).host_path)
    text = path.read_text()
    node.stop()
    path.unlink()  # lost (a node reboot before the container started again)
    node.start(topo, config(tmp_path))
    pre_start(node, ids)
    assert path.read_text() == text


def test_off_gives_no_file_and_no_ib_hca_by_default(node, tmp_path):
    topo = load_topology("dgx-h100")
    node.start(topo, config(tmp_path, nccl_pod_files="off"))
    resp = node.client().allocate([topo.gpus[0].uuid])
    assert not resp.container_responses[0].mounts
    envs = resp.container_responses[0].envs
    assert "NCCL_TOPO_FILE" not in envs and "NCCL_IB_HCA" not in envs
    assert envs["GPU_TOPOLOGY_NICS"] == "mlx5_0"
    assert not os.path.exists(tmp_path / "nccl")


def test_replicas_get_the_file_of_their_physical_gpu_and_mig_devices_none(node, tmp_path):
    topo = load_topology("dgx-h100")
    shared = config(tmp_path, time_slicing=(TimeSlicingResource("nvidia.com/gpu", 4),))
    node.start(topo, shared)
    ids = [f"{topo.gpus[3].uuid}::0", f"{topo.gpus[3].uuid}::1"]
    system = nccl_standin.load(Path(nccl_mount(allocate(node, ids)).host_path).read_text())
    assert list(system.gpus) == [nccl_bus_id(topo.gpus[3].pci_bus_id)]
    node.stop()
    mig = hgx8_topology(mig=True)
    node.start(mig, config(tmp_path, mig_strategy="mixed"))
    resp = node.client("nvidia.com/mig-3g.40gb").allocate([mig.gpus[6].mig_devices[1].uuid])
    assert not [m for m in resp.container_responses[0].mounts if m.container_path == MOUNT]
    assert "NCCL_TOPO_FILE" not in resp.container_responses[0].envs


def listing(*containers: tuple[str, list[str]]) -> pr.ListPodResourcesResponse:
    return pr.ListPodResourcesResponse(pod_resources=[
        pr.PodResources(name=f"pod-{name}", namespace="default", containers=[
            pr.ContainerResources(name=name, devices=[
                pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids)])])
        for name, ids in containers
    ])


def test_files_go_when_the_kubelet_no_longer_lists_the_container_and_survive_a_restart(node, tmp_path):
    topo = load_topology("dgx-a100")
    a, b = [topo.gpus[0].uuid, topo.gpus[1].uuid], [topo.gpus[4].uuid]
    stub = PodResourcesStub(str(tmp_path / "podres.sock"), listing(("a", a), ("b", b))).start()
    try:
        cfg = config(tmp_path, pod_resources_socket=stub.socket_path, pod_resources_refresh_s=0.1)
        node.start(topo, cfg)
        file_a = nccl_mount(allocate(node, a)).host_path
        file_b = nccl_mount(allocate(node, b)).host_path
        old = time.time() - 3600  # past the age grace an Allocate gets before the kubelet lists it
        for f in (file_a, file_b):
            os.utime(f, (old, old))
        time.sleep(0.5)
        assert os.path.exists(file_a) and os.path.exists(file_b)  # both listed
        node.stop()  # the agent goes; pod b goes while it is away
        stub.list_response = listing(("a", a))
        assert os.path.exists(file_b)
        node.start(topo, cfg)  # a new agent over the same directory
        assert eventually(lambda: not os.path.exists(file_b), timeout_s=10)
        time.sleep(0.3)
        assert os.path.exists(file_a)  # still listed: kept over the restart
        fresh = nccl_mount(allocate(node, [topo.gpus[7].uuid])).host_path
        time.sleep(0.3)
        assert os.path.exists(fresh)  # not listed yet, but too young to go
    finally:
        stub.stop()


def test_a_prepared_claims_cdi_spec_mounts_its_file_and_unprepare_removes_it(tmp_path):
    from test_dra_plugin import Node as DraNode

    dra = DraNode()
    try:
        dra.start(load_topology("dgx-h100"), replace(dra.config, nccl_host_dir=str(tmp_path / "nccl")))
        claim = dra.put_claim("two", ["gpu-0", "gpu-1"])
        resp = dra.prepare(claim)
        assert not any(r.error for r in resp.claims.values()), resp
        (spec_file,) = [f for f in os.listdir(os.path.join(dra.root, "cdi")) if f.endswith(".json")]
        spec = json.loads(Path(dra.root, "cdi", spec_file).read_text())
        edits = spec["containerEdits"]
        (mount,) = edits["mounts"]
        assert mount["containerPath"] == MOUNT and "ro" in mount["options"]
        assert mount["hostPath"] == str(tmp_path / "nccl" / f"claim-{claim['metadata']['uid']}.xml")
        assert f"NCCL_TOPO_FILE={MOUNT}" in edits["env"]
        assert "GPU_TOPOLOGY_NICS=mlx5_0,mlx5_1" in edits["env"]
        assert len(nccl_standin.load(Path(mount["hostPath"]).read_text()).gpus) == 2
        dra.unprepare(claim)
        assert not os.path.exists(mount["hostPath"])
    finally:
        dra.close()


def test_a_claims_nic_from_a_network_driver_goes_into_its_file(tmp_path):
    from test_dra_plugin import Node as DraNode
    from test_dra_plugin import claim_object

    dra = DraNode()
    try:
        topo = load_topology("dgx-h100")
        dra.start(topo, replace(dra.config, nccl_host_dir=str(tmp_path / "nccl")))
        claim = claim_object("gpu-and-nic", ["gpu-0"])
        far = topo.nics[7]  # not near GPU 0: only the claim puts it there
        claim["status"]["allocation"]["devices"]["results"].append(
            {"request": "nic", "driver": "rdma.example.com", "pool": "node-1", "device": far.name})
        claim = dra.api.put_claim(claim)
        resp = dra.prepare(claim)
        assert not any(r.error for r in resp.claims.values()), resp
        text = (tmp_path / "nccl" / f"claim-{claim['metadata']['uid']}.xml").read_text()
        assert set(nccl_standin.load(text).nics) == {nccl_bus_id(topo.nics[0].pci_bus_id), nccl_bus_id(far.pci_bus_id)}
    finally:
        dra.close()


def test_the_file_writer_leaves_no_thread_behind_once_its_files_are_written(node, tmp_path):
    """The files' writer thread ends when its queue is empty: nothing has to stop it when
    the files' owner goes (a reload to another host directory, the agent stopping)."""
    import threading

    topo = load_topology("dgx-h100")
    node.start(topo, config(tmp_path))
    for i in range(4):
        allocate(node, [topo.gpus[i].uuid])
    assert len(os.listdir(tmp_path / "nccl")) == 4
    assert eventually(lambda: not [t for t in threading.enumerate() if t.name == "nccl-files"], 5.0), \
        [t.name for t in threading.enumerate()]


def test_a_kubelet_that_cannot_be_asked_is_said_once_and_files_stay(node, tmp_path, caplog):
    """The sweeper asks pod-resources every refresh: an unreachable socket is one line, and
    nothing is removed meanwhile."""
    import logging

    caplog.set_level(logging.DEBUG, logger="agent")
    topo = load_topology("dgx-h100")
    node.start(topo, config(tmp_path, pod_resources_socket=str(tmp_path / "absent.sock"),
                            pod_resources_refresh_s=0.05))
    allocate(node, [topo.gpus[0].uuid])
    assert eventually(lambda: sum("pod-resources List" in r.getMessage() for r in caplog.records) >= 4, 5.0)
    said = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "pod-resources List" in r.getMessage()]
    assert len(said) == 1 and "none removed until it answers" in said[0], said
    assert len(os.listdir(tmp_path / "nccl")) == 1


def test_a_sweep_leaves_alone_a_file_an_allocate_is_still_writing(node, tmp_path, monkeypatch):
    """One owner of the host directory: the sweeper sees the writes the resources' request
    handlers have pending. The same GPUs go to a new container while the old one's file is
    still there, and the disk is slow: the kubelet no longer lists the old container and not
    yet the new one, yet the file being written is not swept from under it."""
    import threading

    from agent.nccl import host_dir

    topo = load_topology("dgx-a100")
    ids = [topo.gpus[0].uuid, topo.gpus[1].uuid]
    stub = PodResourcesStub(str(tmp_path / "podres.sock"), listing(("old", ids))).start()
    disk = threading.Event()
    write = host_dir.write_text_atomic

    def slow_disk(path: str, text: str, **kw) -> None:
        disk.wait(10.0)
        write(path, text, **kw)

    monkeypatch.setattr(host_dir, "write_text_atomic", slow_disk)
    path = tmp_path / "nccl" / f"{host_dir.allocation_key('nvidia.com/gpu', ids)}.xml"
    path.parent.mkdir()
    path.write_text("<system version=\"1\"/>\n")  # the old container's
    old = time.time() - 3600
    os.utime(path, (old, old))
    try:
        node.start(topo, config(tmp_path, pod_resources_socket=stub.socket_path, pod_resources_refresh_s=0.05))
        node.client().allocate(ids)  # the new container's: queued behind the slow disk
        stub.list_response = listing()  # the old container gone, the new one not listed yet
        time.sleep(0.6)  # a dozen sweeps
        assert path.exists()
    finally:
        disk.set()
        stub.stop()
    pre_start(node, ids)
    assert set(nccl_standin.load(path.read_text()).gpus) == {nccl_bus_id(topo.gpus[i].pci_bus_id) for i in (0, 1)}
