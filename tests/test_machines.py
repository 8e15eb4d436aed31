"""Built-in machines, spec files and pasted matrices, discovered through NvmlBackend on the
fake pynvml and the fake sysfs tree."""

from __future__ import annotations

import glob
import os
from itertools import combinations

import pytest

from agent.discovery import load_topology
from agent.errors import InputFormatError
from agent.hw.sim.machines import BUILTIN_MACHINES, load_spec, open_simulated
from agent.hw.sysfs import SysfsReader
from agent.hw.topo_matrix import read_topo_matrix
from agent.topology.model import PcieLevel, Topology

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "machines")
MATRICES = sorted(glob.glob(os.path.join(FIXTURES, "*.txt")))


def matrix_topology(path: str) -> Topology:
    """What the topo-matrix reader states, as a topology (to compare the simulation with)."""
    return Topology.from_facts(read_topo_matrix(path))


MACHINES_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "agent", "hw", "sim", "specs")


@pytest.fixture(scope="module")
def machines():
    """Every built-in machine opened once for the module: (SimulatedMachine, Topology)."""
    opened = {}
    for name in BUILTIN_MACHINES:
        sim = open_simulated(name)
        backend = sim.backend()
        backend.init()
        opened[name] = (sim, Topology.from_facts(backend.read_facts(source=f"simulated:{name}")))
        backend.shutdown()
    yield opened
    for sim, _ in opened.values():
        sim.close()


@pytest.fixture(scope="module")
def topologies(machines) -> dict[str, Topology]:
    return {name: topo for name, (_, topo) in machines.items()}


def nvlink_pairs(topo: Topology) -> dict[tuple[int, int], int]:
    return {(link.a, link.b): link.nvlinks for link in topo.links if link.nvlinks}


def nic_levels(topo: Topology) -> dict[str, tuple[str | None, ...]]:
    return {
        nic.name: tuple(lv.name if lv is not None else None for lv in nic.levels)
        for nic in topo.nics
    }


def all_pairs(n: int, count: int) -> dict[tuple[int, int], int]:
    return {pair: count for pair in combinations(range(n), 2)}


# ---------------------------------------------------------------- the built-in list
def test_every_builtin_machine_ships_a_spec_file_and_every_spec_file_is_builtin():
    files = {
        os.path.splitext(os.path.basename(p))[0]
        for p in glob.glob(os.path.join(MACHINES_DIR, "*.yaml"))
    }
    assert files == set(BUILTIN_MACHINES)


@pytest.mark.parametrize("name", BUILTIN_MACHINES)
def test_every_builtin_machine_is_discovered_with_its_source_and_versions(topologies, name):
    topo = topologies[name]
    assert topo.source == f"simulated:{name}"
    assert topo.driver_version and topo.cuda_driver_version and topo.machine
    assert len({g.uuid for g in topo.gpus}) == topo.gpu_count
    assert all(g.uuid.startswith("GPU-") and not g.lost for g in topo.gpus)
    assert all(g.memory_mib and g.compute_capability and g.pci_bus_id for g in topo.gpus)
    assert [g.minor_number for g in topo.gpus] == list(range(topo.gpu_count))


@pytest.mark.parametrize("name", BUILTIN_MACHINES)
def test_nvml_common_ancestor_agrees_with_the_sysfs_tree(machines, name):
    sim, topo = machines[name]
    sysfs = SysfsReader(sim.sysfs_root)
    assert len(topo.links) == topo.gpu_count * (topo.gpu_count - 1) // 2, "every pair is a link"
    for link in topo.links:
        a, b = topo.gpus[link.a].pci_bus_id, topo.gpus[link.b].pci_bus_id
        assert link.pcie == sysfs.pcie_level(a, b), (link.a, link.b)


@pytest.mark.parametrize("name", [n for n in BUILTIN_MACHINES if load_spec(n).nvswitch])
def test_nvswitch_machines_link_every_pair_at_the_smaller_link_count(topologies, name):
    topo = topologies[name]
    per_gpu = load_spec(name).nvswitch.links_per_gpu
    assert nvlink_pairs(topo) == all_pairs(topo.gpu_count, per_gpu)
    assert all(link.nvswitch for link in topo.links)
    assert topo.nvlink_islands == (tuple(range(topo.gpu_count)),)
    assert topo.nvlink_cliques == (tuple(range(topo.gpu_count)),)


# ---------------------------------------------------------------- each machine
def test_dgx1_v100_is_the_hybrid_cube_mesh_of_the_real_matrix(topologies):
    topo = topologies["dgx1-v100"]
    real = matrix_topology(os.path.join(FIXTURES, "dgx1-v100-8gpu-4nic.txt"))
    assert {g.name for g in topo.gpus} == {"Tesla V100-SXM2-16GB"}
    assert nvlink_pairs(topo) == nvlink_pairs(real)
    assert sorted(set(nvlink_pairs(topo).values())) == [1, 2]
    assert not any(link.nvswitch for link in topo.links)
    assert nic_levels(topo) == nic_levels(real)
    assert {k: list(v) for k, v in topo.numa_groups.items()} == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert topo.nvlink_islands == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert set(topo.nvlink_cliques) == {(0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (1, 5), (2, 6), (3, 7)}
    assert topo.gpus[0].cpu_affinity == "0-19,40-59"


def test_dgx2_is_sixteen_v100_at_nv6_over_two_sockets(topologies):
    topo = topologies["dgx2"]
    assert topo.gpu_count == 16 and {g.name for g in topo.gpus} == {"Tesla V100-SXM3-32GB"}
    assert {k: list(v) for k, v in topo.numa_groups.items()} == {
        0: list(range(8)),
        1: list(range(8, 16)),
    }
    assert [topo.link(0, b).pcie for b in (1, 2, 4, 8)] == [
        PcieLevel.PIX,
        PcieLevel.PXB,
        PcieLevel.NODE,
        PcieLevel.SYS,
    ]
    assert len(topo.nics) == 8
    assert nic_levels(topo)["mlx5_0"] == ("PIX",) * 2 + ("PXB",) * 2 + ("NODE",) * 4 + ("SYS",) * 8


def test_dgx_a100_has_eight_numa_nodes_as_on_the_real_box(topologies):
    topo = topologies["dgx-a100"]
    assert {g.name for g in topo.gpus} == {"NVIDIA A100-SXM4-40GB"}
    assert nvlink_pairs(topo) == all_pairs(8, 12)
    assert sorted(topo.numa_distances) == list(range(8))
    assert topo.numa_distances[3] == (12, 12, 12, 10, 32, 32, 32, 32)
    assert [g.numa_node for g in topo.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert topo.link(0, 1).pcie == PcieLevel.PXB and topo.link(0, 2).pcie == PcieLevel.SYS
    # as `nvidia-smi topo -m` on a DGX A100: each GPU sees its pair's two NICs at PXB
    assert nic_levels(topo)["mlx5_0"][:3] == ("PXB", "PXB", "SYS")
    assert len(topo.nics) == 8


def test_dgx_h100_has_nv18_two_numa_nodes_and_a_nic_beside_each_gpu(topologies):
    topo = topologies["dgx-h100"]
    assert {g.name for g in topo.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_mib for g in topo.gpus} == {81559}
    assert nvlink_pairs(topo) == all_pairs(8, 18)
    assert {k: list(v) for k, v in topo.numa_groups.items()} == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert [nic.name for nic in topo.nics] == [f"mlx5_{i}" for i in range(8)]
    for i, nic in enumerate(topo.nics):
        # as `nvidia-smi topo -m` on a DGX H100: each GPU and its NIC are PXB
        assert [g for g, lv in enumerate(nic.levels) if lv == PcieLevel.PXB] == [i]
        assert PcieLevel.PIX not in nic.levels
        assert nic.numa_node == (0 if i < 4 else 1)
    assert topo.link(0, 1).pcie == PcieLevel.NODE and topo.link(0, 4).pcie == PcieLevel.SYS


def test_pcie_pairs_has_four_bridged_pairs(topologies):
    topo = topologies["pcie-pairs"]
    assert nvlink_pairs(topo) == {(0, 1): 12, (2, 3): 12, (4, 5): 12, (6, 7): 12}
    assert topo.nvlink_islands == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert not any(link.nvswitch for link in topo.links)
    assert topo.link(0, 1).pcie == PcieLevel.PIX and topo.link(1, 2).pcie == PcieLevel.NODE


def test_pcie_4gpu_has_no_nvlink_and_a_dual_port_nic_on_socket_one(topologies):
    topo = topologies["pcie-4gpu"]
    assert nvlink_pairs(topo) == {} and topo.nvlink_islands == () and topo.nvlink_cliques == ()
    assert {g.name for g in topo.gpus} == {"NVIDIA L40S"}
    assert nic_levels(topo) == {
        "mlx5_0": ("SYS", "SYS", "NODE", "NODE"),
        "mlx5_1": ("SYS", "SYS", "NODE", "NODE"),
    }
    assert [nic.pci_bus_id for nic in topo.nics] == ["0000:c1:00.0", "0000:c1:00.1"]


def test_gb200_tray_is_one_fabric_clique(topologies):
    topo = topologies["gb200-tray"]
    assert {g.name for g in topo.gpus} == {"NVIDIA GB200"}
    assert {g.compute_capability for g in topo.gpus} == {(10, 0)}
    assert {(g.fabric_cluster_uuid, g.fabric_clique_id) for g in topo.gpus} == {
        ("3c7b5f0e-9a3d-4c8e-b1f2-6d2a9e4f7c10", 1)
    }
    assert nvlink_pairs(topo) == all_pairs(4, 18)
    assert [g.pci_bus_id for g in topo.gpus][0] == "00000008:01:00.0"


def test_a100_mig_has_mig_devices_in_mixed_profiles(topologies):
    topo = topologies["a100-mig"]
    profiles = [[m.profile for m in g.mig_devices] for g in topo.gpus]
    assert profiles == [
        ["1g.5gb"] * 7,
        ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"],
        [],
        ["4g.20gb", "3g.20gb"],
    ]
    assert [g.mig_enabled for g in topo.gpus] == [True, True, False, True]
    mig = topo.gpus[1].mig_devices[0]
    assert (
        mig.uuid.startswith("MIG-") and mig.parent_index == 1 and mig.gi_id == 1 and mig.ci_id == 0
    )
    assert len({m.uuid for g in topo.gpus for m in g.mig_devices}) == 13
    assert nvlink_pairs(topo) == all_pairs(4, 4)


def test_single_gpu_is_one_a10_in_a_vm(topologies):
    topo = topologies["single-gpu"]
    assert topo.gpu_count == 1 and topo.links == () and topo.nics == ()
    assert topo.gpus[0].name == "NVIDIA A10" and topo.gpus[0].numa_node == 0
    assert topo.machine == "g5.8xlarge"


# ---------------------------------------------------------------- files
@pytest.mark.parametrize("path", MATRICES, ids=os.path.basename)
def test_a_pasted_matrix_states_nothing_beyond_the_matrix(path):
    topo = load_topology(path)
    assert topo.driver_version is None and topo.cuda_driver_version is None
    for g in topo.gpus:
        assert (g.name, g.memory_mib, g.compute_capability, g.mig_capable) == (
            "unknown",
            None,
            None,
            None,
        )
    assert any("synthetic" in note for note in topo.notes)


@pytest.mark.parametrize("machine", [*BUILTIN_MACHINES, *MATRICES], ids=os.path.basename)
def test_the_fake_nvml_and_the_fake_sysfs_place_every_gpu_pair_alike(machine):
    with open_simulated(machine) as sim:
        lib, reader = sim.lib, SysfsReader(sim.sysfs_root)
        lib.nvmlInit()
        compared = 0
        for a, b in combinations(sim.spec.gpus, 2):
            if (a.index, b.index) in sim.spec.pcie_levels or (a.board and a.board == b.board):
                continue  # stated levels and boards are NVML's alone
            compared += 1
            try:
                nvml: PcieLevel | None = PcieLevel(
                    lib.nvmlDeviceGetTopologyCommonAncestor(
                        lib.nvmlDeviceGetHandleByIndex(a.index),
                        lib.nvmlDeviceGetHandleByIndex(b.index),
                    )
                )
            except lib.NVMLError_NotSupported:
                nvml = None
            assert nvml == reader.pcie_level(a.bus_id, b.bus_id), (a.index, b.index)
        if len(sim.spec.gpus) > 1 and not sim.spec.pcie_levels:
            assert compared, "no GPU pair placed by the sysfs tree"  # (pasted matrices state them all)


@pytest.mark.parametrize("path", MATRICES, ids=os.path.basename)
def test_a_pasted_matrix_runs_as_a_simulated_machine_that_reproduces_it(path):
    real = matrix_topology(path)
    with open_simulated(path) as sim:
        backend = sim.backend()
        backend.init()
        topo = Topology.from_facts(backend.read_facts())
    assert topo.gpu_count == real.gpu_count
    assert [g.uuid for g in topo.gpus] == [g.uuid for g in real.gpus]
    assert nvlink_pairs(topo) == nvlink_pairs(real)
    assert [(link.a, link.b, link.pcie) for link in topo.links] == [
        (link.a, link.b, link.pcie) for link in real.links
    ]
    assert nic_levels(topo) == nic_levels(real)
    known = [(g.index, g.numa_node) for g in real.gpus if g.numa_node is not None]
    assert known == [
        (g.index, g.numa_node)
        for g in topo.gpus
        if g.numa_node is not None and g.index in dict(known)
    ]


def test_a_matrix_too_dense_for_nvlink_ports_is_wired_through_nvswitches():
    spec = load_spec(os.path.join(FIXTURES, "h200-8gpu-8nic-epyc9534.txt"))
    assert (
        spec.nvswitch is not None and spec.nvswitch.links_per_gpu == 18 and spec.nvlink_pairs == ()
    )
    bridged = load_spec(
        os.path.join(FIXTURES, "a100-80gb-pcie-4gpu-nv12-bridge-pairs-4numa-vm.txt")
    )
    assert bridged.nvswitch is None and bridged.nvlink_pairs == ((0, 1, 12), (2, 3, 12))


def test_yaml_and_json_spec_files_run_as_machines():
    topo = load_topology(os.path.join(FIXTURES, "custom-spec.yaml"))
    assert topo.source == "simulated:workstation" and topo.machine == "Precision 7960 Tower"
    assert topo.cuda_driver_version == "12.4"
    assert [g.name for g in topo.gpus] == ["NVIDIA RTX A6000"] * 2 and topo.gpus[
        0
    ].memory_mib == 49140
    assert topo.link(0, 1).nvlinks == 4 and topo.link(0, 1).pcie == PcieLevel.PIX
    assert nic_levels(topo) == {"mlx5_0": ("NODE", "NODE")}
    box = load_topology(os.path.join(FIXTURES, "custom-spec.json"))
    assert box.gpu_count == 1 and box.gpus[0].pci_bus_id == "00000000:3B:00.0"


def test_an_unknown_machine_name_lists_the_builtin_machines():
    with pytest.raises(InputFormatError) as info:
        open_simulated("dgx-h300")
    message = str(info.value)
    assert "dgx-h300" in message and all(name in message for name in BUILTIN_MACHINES)


def test_unreadable_or_malformed_machine_files_are_input_format_errors(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- 1\n- 2\n")
    bad_key = tmp_path / "key.yaml"
    bad_key.write_text("name: x\ngpus: [{bus_id: '0000:01:00.0', colour: red}]\n")
    for path, message in (
        (bad_yaml, "bad.yaml: not valid YAML"),
        (a_list, "a machine spec is a mapping"),
        (bad_key, r"key.yaml: gpus\[0\]: unknown keys \['colour'\]"),
        (tmp_path, "unknown machine"),  # a directory is not a machine file
    ):
        with pytest.raises(InputFormatError, match=message):
            load_topology(str(path))


def test_closing_a_simulated_machine_removes_its_sysfs_tree():
    sim = open_simulated("single-gpu")
    root = sim.sysfs_root
    assert os.path.isdir(os.path.join(root, "bus", "pci", "devices"))
    sim.close()
    assert not os.path.exists(root)


def test_nvlinks_no_gpu_has_ports_for_are_an_input_format_error():
    from agent.hw.sim.from_facts import spec_from_facts
    from agent.records import Gpu, Link, NodeFacts

    gpus = tuple(Gpu(i, f"GPU-{i}", "unknown") for i in range(3))
    links = (Link(0, 1, 20), Link(0, 2, 20), Link(1, 2, 19))  # not uniform: no NVSwitch either
    facts = NodeFacts(gpus, links, source="odd.txt")
    with pytest.raises(InputFormatError, match="odd.txt: GPU0 would need 40 NVLink ports"):
        spec_from_facts(facts)


def test_a_nics_local_cpus_place_it_on_a_socket_without_numa_ids():
    from agent.hw.sim.machines import SimulatedMachine
    from agent.hw.sim.spec import machine_spec_from_dict

    spec = machine_spec_from_dict(
        {
            "name": "two-sockets-no-numa",
            "gpus": [
                {"bus_id": "0000:1a:00.0", "cpus": "0-7", "host_bridge": "pci0000:17"},
                {"bus_id": "0000:9a:00.0", "cpus": "8-15", "host_bridge": "pci0000:97"},
            ],
            "nics": [
                {"name": "mlx5_0", "bus_id": "0000:1b:00.0", "cpus": "0-7", "host_bridge": "pci0000:17"},
                {"name": "mlx5_1", "bus_id": "0000:3b:00.0", "host_bridge": "pci0000:37"},
            ],
        }
    )
    with SimulatedMachine(spec) as sim:
        backend = sim.backend()
        backend.init()
        topo = Topology.from_facts(backend.read_facts())
    assert [g.numa_node for g in topo.gpus] == [None, None]
    assert [n.numa_node for n in topo.nics] == [None, None]
    # same host bridge as GPU 0: PHB; another socket's CPUs: SYS; no CPUs stated: NODE
    # (a machine without NUMA nodes has no SMP link to cross)
    assert nic_levels(topo) == {"mlx5_0": ("PHB", "SYS"), "mlx5_1": ("NODE", "NODE")}
