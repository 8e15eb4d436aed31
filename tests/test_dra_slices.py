"""ResourceSlice rendering (agent.dra.slices) and the ``slices`` subcommand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from agent.cli import main
from agent.discovery import load_topology
from agent.dra.slices import (
    MAX_DEVICES_PER_SLICE,
    clique_ids,
    device_order,
    island_ids,
    render_slices,
    semver,
)
from agent.dra.yaml_stream import dump_yaml
from agent.hw.sim.machines import BUILTIN_MACHINES
from agent.topology.model import Gpu, Link, MigDevice, Topology
from tests.testbed.kubelet_stub import hgx8_topology, pcie4_topology

D = "gpu.gpu-agent.io/"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def devices(topology, **kw):
    """Every device of every slice, in publication order."""
    kw.setdefault("node_name", "node-1")
    return [d for obj in render_slices(topology, **kw) for d in obj["spec"].get("devices", [])]


def by_name(devs):
    return {d["name"]: d for d in devs}


def test_full_gpu_attributes_and_capacity():
    dev = by_name(devices(hgx8_topology()))["gpu-5"]
    a = dev["attributes"]
    assert a[D + "type"] == {"string": "gpu"}
    assert a[D + "index"] == {"int": 5}
    assert a[D + "uuid"] == {"string": "GPU-50000000-1111-2222-3333-444444444445"}
    assert a[D + "productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert a[D + "pciBusID"] == {"string": "0000:68:00.0"}
    assert a[D + "numaNode"] == {"int": 1}
    assert a[D + "nvlinkIsland"] == {"int": 0}
    assert a[D + "nvlinkClique"] == {"int": 0}
    assert dev["capacity"] == {"memory": {"value": "81559Mi"}}


def test_unknown_facts_are_left_out():
    # the hand-built topology knows no compute capability, driver, NUMA node or PCIe root
    a = devices(hgx8_topology(numa=False))[0]["attributes"]
    for missing in ("numaNode", "cudaComputeCapability", "architecture", "driverVersion",
                    "cudaDriverVersion", "brand"):
        assert D + missing not in a
    assert "resource.kubernetes.io/pcieRoot" not in a


def test_versions_and_architecture_from_a_simulated_machine():
    a = by_name(devices(load_topology("dgx-h100")))["gpu-0"]["attributes"]
    assert a[D + "cudaComputeCapability"] == {"version": "9.0.0"}
    assert a[D + "cudaDriverVersion"] == {"version": "12.4.0"}
    assert a[D + "driverVersion"] == {"version": "550.54.15"}
    assert a[D + "architecture"] == {"string": "Hopper"}
    assert a["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:15"}
    assert a[D + "brand"] == {"string": "NVIDIA"}  # nvmlDeviceGetBrand, as nvidia-smi spells it


def test_brand_comes_from_nvml_and_is_left_out_where_the_input_does_not_say():
    assert by_name(devices(load_topology("dgx1-v100")))["gpu-0"]["attributes"][D + "brand"] == {"string": "Tesla"}
    pasted = load_topology(str(Path(__file__).parent / "fixtures" / "topo" / "dgx1-v100-8gpu-4nic.txt"))
    assert all(D + "brand" not in d["attributes"] for d in devices(pasted))


@pytest.mark.parametrize("text,expected", [
    ("12.4", "12.4.0"), ("9", "9.0.0"), ("535.104.05", "535.104.5"), ("550.54.15", "550.54.15"),
    ("1.2.3.4", None), ("r535", None), ("", None), (None, None),
])
def test_semver_normalises_driver_versions(text, expected):
    assert semver(text) == expected


def test_island_and_clique_ids_on_the_hybrid_cube_mesh():
    topo = load_topology("dgx1-v100")
    assert set(island_ids(topo).values()) == {0}
    cliques = clique_ids(topo)
    # GPU 0 is in (0,1,2,3) and (0,4): the larger wins; every GPU sharing an id is NVLinked
    assert cliques[0] == cliques[1] == cliques[2] == cliques[3] != cliques[4]
    for a in range(8):
        for b in range(a + 1, 8):
            if cliques[a] == cliques[b]:
                assert topo.link(a, b).nvlinks > 0


def test_islands_of_nvlink_pairs_and_lone_gpus():
    assert island_ids(load_topology("pcie-pairs")) == {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 4, 6: 6, 7: 6}
    lone = load_topology("pcie-4gpu")
    assert island_ids(lone) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert len(set(clique_ids(lone).values())) == 4


def test_device_order_groups_numa_nodes_then_islands_then_best_links():
    assert device_order(load_topology("dgx-a100")) == [2, 3, 0, 1, 6, 7, 4, 5]  # NUMA 1, 3, 5, 7
    order = device_order(load_topology("dgx1-v100"))
    assert sorted(order[:4]) == [0, 1, 2, 3] and sorted(order[4:]) == [4, 5, 6, 7]
    topo = load_topology("dgx1-v100")
    # inside a group each next GPU is the best linked to the one before
    for prev, nxt in zip(order[:3], order[1:4]):
        rest = [g for g in order[:4] if g not in order[: order.index(nxt)]]
        assert topo.pair_score(prev, nxt) == max(topo.pair_score(prev, g) for g in rest)


@pytest.mark.parametrize("machine,held", [("dgx-h100", {5}), ("pcie-pairs", {3, 6}), ("dgx1-v100", {0, 2, 4})])
def test_the_first_single_gpu_is_the_device_plugins_choice_on_the_free_gpus(machine, held):
    from agent.dra.gpusets import SetPolicy
    from agent.dra.slices import Occupancy

    topo = load_topology(machine)
    occupancy = Occupancy({f"gpu-{i}": (i,) for i in held})
    names = [d["name"] for d in devices(topo, node_name="n1", occupancy=occupancy) if d["name"].startswith("gpu-")]
    free = [i for i in range(topo.gpu_count) if i not in held]
    assert names[0] == f"gpu-{SetPolicy(topo).choose(free, 1)[0]}"
    assert {f"gpu-{i}" for i in held} == set(names[-len(held):])  # held GPUs last
    assert sorted(names) == sorted(f"gpu-{i}" for i in range(topo.gpu_count))


def test_unknown_numa_nodes_come_last():
    gpus = [Gpu(i, f"GPU-{i}", "X", numa_node=None if i == 0 else 0) for i in range(3)]
    topo = Topology.build(gpus, [Link(0, 1), Link(0, 2), Link(1, 2)])
    assert device_order(topo) == [1, 2, 0]


def test_mig_devices_replace_their_parent():
    devs = by_name(devices(hgx8_topology(mig=True)))
    assert "gpu-6" not in devs and "gpu-7" not in devs
    mig = devs["gpu-6-mig-1"]
    a = mig["attributes"]
    assert a[D + "type"] == {"string": "mig"}
    assert a[D + "profile"] == {"string": "3g.40gb"}
    assert a[D + "parentIndex"] == {"int": 6}
    assert a[D + "parentUUID"] == {"string": "GPU-60000000-1111-2222-3333-444444444446"}
    assert a[D + "uuid"]["string"].startswith("MIG-")
    assert a[D + "numaNode"] == {"int": 1} and D + "nvlinkIsland" in a
    assert mig["capacity"] == {"memory": {"value": "40192Mi"}}
    assert devs["gpu-0"]["attributes"][D + "type"] == {"string": "gpu"}


def test_unhealthy_gpus_and_their_mig_devices_are_tainted_with_the_reason():
    devs = by_name(devices(hgx8_topology(mig=True), unhealthy={1: "XID 79", 7: "double-bit ECC error"}))
    assert devs["gpu-1"]["taints"] == [{"key": D + "xid", "value": "79", "effect": "NoSchedule"}]
    migs = [d for n, d in devs.items() if n.startswith("gpu-7-")]
    assert migs and all(d["taints"] == [{"key": D + "ecc", "value": "double-bit", "effect": "NoSchedule"}]
                        for d in migs)
    assert "taints" not in devs["gpu-0"] and "taints" not in devs["gpu-6-mig-0"]
    lost = by_name(devices(hgx8_topology(mig=True), unhealthy={2: "GPU lost at discovery"},
                           taint_effect="NoExecute", api_version="v1beta1"))
    assert lost["gpu-2"]["basic"]["taints"] == [{"key": D + "lost", "value": "true", "effect": "NoExecute"}]


def test_without_taints_unhealthy_devices_are_left_out_but_those_kept_for_prepared_claims():
    names = [d["name"] for d in devices(hgx8_topology(mig=True), unhealthy={1: "XID 79", 7: "XID 48"},
                                        taint_effect=None, keep={"gpu-7-mig-1"})]
    assert "gpu-1" not in names and [n for n in names if n.startswith("gpu-7-")] == ["gpu-7-mig-1"]
    assert "gpu-0" in names and "gpu-6-mig-0" in names
    assert not any("taints" in d for d in devices(hgx8_topology(), unhealthy={1}, taint_effect=None))


@pytest.mark.parametrize("machine", BUILTIN_MACHINES)
def test_older_versions_render_single_gpus_within_the_api_limits(machine):
    # (v1 with counters and sets: tests/test_dra_gpusets.py checks it against the API rules)
    topology = load_topology(machine)
    for version in ("v1beta2", "v1beta1"):
        objs = render_slices(topology, node_name="node-1", api_version=version)
        assert [o["metadata"]["name"] for o in objs] == sorted(o["metadata"]["name"] for o in objs)
        # every GPU is rendered, whole or as its MIG devices (the checks below pass on no slices)
        names = [d["name"] for obj in objs for d in obj["spec"]["devices"]]
        assert {n.split("-mig-")[0] for n in names} == {f"gpu-{g.index}" for g in topology.gpus}, version
        for obj in objs:
            assert len(obj["metadata"]["name"]) <= 253
            assert "sharedCounters" not in obj["spec"]
            devs = obj["spec"]["devices"]
            assert len(devs) <= MAX_DEVICES_PER_SLICE
            assert len({d["name"] for d in devs}) == len(devs)
            for d in devs:
                assert DNS_LABEL.match(d["name"]) and not d["name"].startswith("gpuset-")
                body = d["basic"] if version == "v1beta1" else d
                assert len(body["attributes"]) + len(body.get("capacity", {})) <= 32
                for key, value in body["attributes"].items():
                    domain, _, ident = key.rpartition("/")
                    assert len(domain) <= 63 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,31}", ident)
                    assert len(value) == 1
                    if "string" in value:
                        assert len(value["string"]) <= 64


def test_more_than_128_devices_are_split_into_slices_of_one_pool():
    # 20 GPUs with 7 MIG devices each: 140 devices
    gpus = [Gpu(i, f"GPU-{i}", "X", mig_enabled=True, mig_devices=tuple(
        MigDevice(f"MIG-{i}-{j}", i, j, "1g.10gb", 1024) for j in range(7))) for i in range(20)]
    topo = Topology.build(gpus, [])
    objs = render_slices(topo, node_name="big", api_version="v1")
    assert [len(o["spec"]["devices"]) for o in objs] == [128, 12]
    assert {o["spec"]["pool"]["resourceSliceCount"] for o in objs} == {2}
    assert len({o["metadata"]["name"] for o in objs}) == 2
    assert objs[0]["spec"]["devices"][0]["capacity"] == {"memory": {"value": "1Gi"}}


def test_owner_reference_names_the_node_when_its_uid_is_known():
    objs = render_slices(pcie4_topology(), node_name="n1", node_uid="1234")
    assert objs  # the loop below checks something
    for obj in objs:
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "1234", "controller": True}]


def test_v1beta1_puts_attributes_and_capacity_under_basic():
    dev = devices(hgx8_topology(), api_version="v1beta1")[0]
    assert set(dev) == {"name", "basic"}
    assert set(dev["basic"]) == {"attributes", "capacity"}


@pytest.mark.parametrize("node", ["n", "no", "on", "y", "yes", "off", "true", "null", "1e3", "0x1f"])
def test_yaml_keeps_yaml11_lookalike_node_names_strings(node, capsys):
    assert main(["slices", "--simulate", "pcie-4gpu", "--node-name", node]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs[0]["spec"]["nodeName"] == node
    assert docs[0]["spec"]["pool"]["name"] == node


def test_dump_yaml_round_trips_bus_ids_and_versions():
    objs = render_slices(load_topology("dgx-h100"), node_name="node-1", api_version="v1beta1")
    assert list(yaml.safe_load_all(dump_yaml(objs))) == objs


def test_slices_command_prints_what_render_slices_returns(capsys):
    assert main(["slices", "--simulate", "dgx-h100", "--node-name", "node-1", "--api-version", "v1beta1"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == render_slices(load_topology("dgx-h100"), node_name="node-1", api_version="v1beta1")


def test_slices_command_uses_the_configured_driver_name(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DRA_DRIVER_NAME", "gpus.example.com")
    assert main(["slices", "--simulate", "single-gpu", "--node-name", "n1"]) == 0
    (doc,) = yaml.safe_load_all(capsys.readouterr().out)
    assert doc["spec"]["driver"] == "gpus.example.com"
    assert "gpus.example.com/index" in doc["spec"]["devices"][0]["attributes"]


@pytest.mark.parametrize("argv,needle", [
    (["--api-version", "v2"], "--api-version 'v2': expected one of v1, v1beta2, v1beta1"),
    (["--node-name", "Bad_Name"], "--node-name 'Bad_Name'"),
    (["--simulate", "no-such-machine"], "no-such-machine"),
])
def test_slices_command_bad_input_exits_2_with_one_line(argv, needle, capsys):
    args = ["slices", "--simulate", "pcie-4gpu", "--node-name", "n1", *argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
