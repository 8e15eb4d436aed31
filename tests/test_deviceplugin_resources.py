"""Resources and device IDs: MIG strategies and time-slicing, as NVIDIA's device plugin defines them,
with per-GPU sharing and rename really applied."""

from __future__ import annotations

import pytest

from agent.config import Config, TimeSlicingResource
from agent.deviceplugin.resources import ResourceKind, build_resources, physical_devices
from agent.errors import ConfigError
from tests.testbed.kubelet_stub import hgx8_topology, pcie4_topology


def names(resources):
    return [r.name for r in resources]


def test_plain_node_advertises_every_gpu_uuid_under_nvidia_com_gpu():
    topo = hgx8_topology()
    (res,) = build_resources(topo, Config())
    assert res.name == "nvidia.com/gpu" and res.socket_name == "nvidia-gpu.sock"
    assert [d.id for d in res.devices] == [g.uuid for g in topo.gpus]
    assert [d.numa_node for d in res.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert res.kind is ResourceKind.GPU and not res.shared


def test_time_slicing_advertises_replicas_with_nvidia_ids():
    topo = pcie4_topology()
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=3),))
    (res,) = build_resources(topo, config)
    assert len(res.devices) == 12
    assert [d.id for d in res.devices[:3]] == [f"{topo.gpus[0].uuid}::{n}" for n in range(3)]
    assert res.kind is ResourceKind.REPLICA and res.shared


def test_time_slicing_of_selected_gpus_leaves_the_others_whole():
    topo = pcie4_topology()
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=2, devices=("1", topo.gpus[3].uuid)),))
    (res,) = build_resources(topo, config)
    ids = [d.id for d in res.devices]
    assert ids == [
        topo.gpus[0].uuid, f"{topo.gpus[1].uuid}::0", f"{topo.gpus[1].uuid}::1",
        topo.gpus[2].uuid, f"{topo.gpus[3].uuid}::0", f"{topo.gpus[3].uuid}::1",
    ]


def test_rename_moves_only_the_shared_gpus_to_the_new_resource():
    topo = pcie4_topology()
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=4, rename="gpu-shared", devices=("0",)),))
    by_name = {r.name: r for r in build_resources(topo, config)}
    assert sorted(by_name) == ["nvidia.com/gpu", "nvidia.com/gpu-shared"]
    assert [d.gpu_index for d in by_name["nvidia.com/gpu-shared"].devices] == [0, 0, 0, 0]
    assert [d.id for d in by_name["nvidia.com/gpu"].devices] == [g.uuid for g in topo.gpus[1:]]
    assert by_name["nvidia.com/gpu-shared"].socket_name == "nvidia-gpu-shared.sock"


def test_rename_by_default_appends_dot_shared():
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=2),), rename_by_default=True)
    assert names(build_resources(pcie4_topology(), config)) == ["nvidia.com/gpu.shared"]


def test_mig_strategy_none_skips_mig_mode_gpus():
    (res,) = build_resources(hgx8_topology(mig=True), Config(mig_strategy="none"))
    assert [d.gpu_index for d in res.devices] == [0, 1, 2, 3, 4, 5]


def test_mig_strategy_mixed_advertises_one_resource_per_profile():
    topo = hgx8_topology(mig=True)
    resources = build_resources(topo, Config(mig_strategy="mixed"))
    assert names(resources) == ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"]
    mig = resources[2]
    assert [d.id for d in mig.devices] == [m.uuid for m in topo.gpus[6].mig_devices]
    assert mig.kind is ResourceKind.MIG and all(d.gpu_index == 6 and d.numa_node == 1 for d in mig.devices)


def test_mig_strategy_single_refuses_a_node_mixing_mig_and_whole_gpus():
    with pytest.raises(ConfigError, match="migStrategy single: GPUs \\[0, 1, 2, 3, 4, 5\\] have MIG disabled"):
        build_resources(hgx8_topology(mig=True), Config(mig_strategy="single"))


def test_mig_strategy_single_without_mig_gpus_advertises_whole_gpus():
    (res,) = build_resources(pcie4_topology(), Config(mig_strategy="single"))
    assert res.name == "nvidia.com/gpu" and len(res.devices) == 4


def test_time_sliced_mig_profile_under_mixed_strategy():
    config = Config(mig_strategy="mixed", time_slicing=(TimeSlicingResource("nvidia.com/mig-1g.10gb", replicas=2),))
    res = {r.name: r for r in build_resources(hgx8_topology(mig=True), config)}["nvidia.com/mig-1g.10gb"]
    assert len(res.devices) == 4 and res.devices[0].id.startswith("MIG-70") and res.devices[0].id.endswith("::0")


def test_physical_devices_reduce_replicas_to_their_gpu_once():
    topo = pcie4_topology()
    (res,) = build_resources(topo, Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=3),)))
    phys = physical_devices([res.devices[4], res.devices[3], res.devices[0], res.devices[5]])
    assert [d.id for d in phys] == [topo.gpus[1].uuid, topo.gpus[0].uuid]


def test_time_slicing_selects_mig_devices_by_gpu_and_mig_index():
    topo = hgx8_topology(mig=True)
    config = Config(mig_strategy="mixed", time_slicing=(TimeSlicingResource("nvidia.com/mig-1g.10gb", replicas=3, devices=("7:1",)),))
    res = {r.name: r for r in build_resources(topo, config)}["nvidia.com/mig-1g.10gb"]
    assert [d.id for d in res.devices] == [topo.gpus[7].mig_devices[0].uuid] + [
        f"{topo.gpus[7].mig_devices[1].uuid}::{n}" for n in range(3)
    ]
