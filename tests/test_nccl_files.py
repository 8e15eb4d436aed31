"""The NCCL topology file a container gets (``agent.nccl.container_file``): for every built-in
machine with NICs and every size, NCCL's reader (the stand-in ``nccl_standin``) takes it, it
holds exactly the GPUs and their nearest NICs with the node's hierarchy, and read back as a
topology it gives the same facts for those GPUs; on a node whose topology came from an NCCL
file it is the matching part of that file."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import nccl_standin
import pytest

from agent.discovery import load_topology
from agent.formats import nvml_to_sysfs_bus_id as nccl_bus_id
from agent.hw.sim.machines import BUILTIN_MACHINES
from agent.nccl.container_file import nccl_topology_xml, nearest_nics
from agent.nccl.node_file import parse_nccl_topology, read_nccl_topology
from agent.records import PcieLevel

NCCL = Path(__file__).parent / "fixtures" / "nccl"
WITH_NICS = [m for m in BUILTIN_MACHINES if load_topology(m).nics]
# what a file can say (module docstring of agent.nccl.node_file): a board is one switch, and a
# host bridge is not told from the NUMA node
FOLD = {PcieLevel.BOARD: PcieLevel.PIX, PcieLevel.PHB: PcieLevel.NODE}


def fold(level: PcieLevel | None) -> PcieLevel | None:
    return FOLD.get(level, level) if level is not None else None


def gpu_sets(n: int):
    for k in range(1, n + 1):
        yield list(range(k))
        if k < n:
            yield list(range(n - k, n))


def test_there_are_machines_with_nics():
    assert len(WITH_NICS) >= 5


@pytest.mark.parametrize("machine", WITH_NICS)
def test_every_size_passes_ncclss_reader_with_exactly_the_gpus_and_nearest_nics(machine):
    topo = load_topology(machine)
    checked = 0
    for gpus in gpu_sets(topo.gpu_count):
        system = nccl_standin.load(nccl_topology_xml(topo, gpus))
        assert set(system.gpus) == {nccl_bus_id(topo.gpus[i].pci_bus_id) for i in gpus}
        nics = nearest_nics(topo, gpus)
        assert set(system.nics) == {nccl_bus_id(n.pci_bus_id) for n in nics if n.pci_bus_id}
        by_bus = {nccl_bus_id(topo.gpus[i].pci_bus_id): i for i in gpus}
        for a, (numa_a, path_a) in system.gpus.items():
            assert numa_a == str(topo.gpus[by_bus[a]].numa_node)
            for b, (numa_b, path_b) in system.gpus.items():
                if a < b:
                    level = topo.link(by_bus[a], by_bus[b]).pcie
                    assert (path_a == path_b and path_a != ()) == (fold(level) == PcieLevel.PIX)
                    assert (numa_a != numa_b) == (level == PcieLevel.SYS)
        checked += 1
    assert checked == 2 * topo.gpu_count - 1


@pytest.mark.parametrize("machine", WITH_NICS)
def test_a_written_file_read_back_gives_the_same_facts_for_those_gpus(machine):
    topo = load_topology(machine)
    for gpus in gpu_sets(topo.gpu_count):
        back = parse_nccl_topology(nccl_topology_xml(topo, gpus), "pod.xml").facts
        assert [nccl_bus_id(g.pci_bus_id) for g in back.gpus] == sorted(
            nccl_bus_id(topo.gpus[i].pci_bus_id) for i in gpus)
        order = sorted(gpus, key=lambda i: nccl_bus_id(topo.gpus[i].pci_bus_id))  # NVML's order
        assert [g.numa_node for g in back.gpus] == [topo.gpus[i].numa_node for i in order]
        assert len(back.links) == len(gpus) * (len(gpus) - 1) // 2, (machine, gpus)  # every pair
        for link in back.links:
            mine = topo.link(order[link.a], order[link.b])
            assert (link.nvlinks, link.pcie) == (mine.nvlinks, fold(mine.pcie)), (machine, gpus, link)
        written = {nccl_bus_id(n.pci_bus_id or ""): n for n in nearest_nics(topo, gpus)}
        assert {nccl_bus_id(n.pci_bus_id or "") for n in back.nics} == set(written)
        for nic in back.nics:
            mine = written[nccl_bus_id(nic.pci_bus_id or "")]
            assert list(nic.levels) == [fold(mine.levels[i]) for i in order]


def test_nearest_nics_are_the_switch_then_root_complex_then_numa_node():
    topo = load_topology("dgx-h100")  # one NIC on each GPU's switch
    assert [n.name for n in nearest_nics(topo, [0])] == ["mlx5_0"]
    assert len(nearest_nics(topo, range(8))) == 8
    pcie = load_topology("pcie-4gpu")  # NICs on NUMA 1's root complex only
    assert {n.name for n in nearest_nics(pcie, [2])} == {"mlx5_0", "mlx5_1"}
    assert nearest_nics(pcie, [0]) == ()  # nothing near GPU 0: no NIC is named


def test_on_a_node_read_from_an_nccl_file_the_pods_file_is_its_matching_part():
    topo = load_topology(str(NCCL / "azure-ndv5-h100.xml"))
    text = nccl_topology_xml(topo, [1, 5], node_file=read_nccl_topology(NCCL / "azure-ndv5-h100.xml"))
    system = nccl_standin.load(text)
    assert system.gpus == {"0002:00:00.0": ("0", ("ffff:ff:02.0",)), "000a:00:00.0": ("1", ("ffff:ff:06.0",))}
    assert system.nics == {"0102:00:00.0": ("0", ("ffff:ff:02.0",)), "0106:00:00.0": ("1", ("ffff:ff:06.0",))}
    source = (NCCL / "azure-ndv5-h100.xml").read_text()
    for line in text.splitlines():  # every element as the node's file has it
        assert line.strip().removesuffix("/>").removesuffix(">") in source


def test_a_full_dump_loses_dev_and_rank_and_keeps_the_rest():
    topo = load_topology(str(NCCL / "azure-ncv4-a100.xml"))
    node_file = read_nccl_topology(NCCL / "azure-ncv4-a100.xml")
    text = nccl_topology_xml(topo, [2], node_file=node_file)
    system = nccl_standin.load(text)  # refuses dev/rank
    assert list(system.gpus) == ["0003:00:00.0"] and system.nics == {}
    assert '<gpu sm="80" gdr="1">' in text and 'affinity="000000ff,ffff0000,00000000"' in text
    with_nic = nccl_standin.load(nccl_topology_xml(topo, [0], node_file=node_file))
    assert with_nic.nics == {"eth0": ("0", ())}


def test_the_written_file_is_a_pure_function_of_its_inputs():
    topo = load_topology("dgx-a100")
    assert nccl_topology_xml(topo, [3, 1]) == nccl_topology_xml(load_topology("dgx-a100"), [3, 1])


def test_allocate_explain_names_the_nics_and_the_file_it_would_mount(capsys):
    import json

    from agent import cli

    assert cli.main(["allocate", "--simulate", "dgx-h100", "--size", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "nics      mlx5_0, mlx5_1" in out
    assert "/var/lib/kubelet/gpu-topology-agent/nccl/dp-" in out and "/etc/nccl/topology.xml (NCCL_TOPO_FILE)" in out
    assert cli.main(["allocate", "--simulate", str(NCCL / "azure-ndv5-h100.xml"), "--size", "2",
                     "--explain", "--format", "json"]) == 0
    nccl = json.loads(capsys.readouterr().out)["nccl"]
    assert nccl["nics"] == ["nic-0101-00-00.0", "nic-0102-00-00.0"]
    assert set(nccl_standin.load(nccl["topology"]).gpus) == {"0001:00:00.0", "0002:00:00.0"}


def test_the_example_claim_pairs_a_gpu_with_a_nic_by_the_pcie_root_our_slices_publish(capsys):
    import yaml
    from dra_api_validation import default_claim, validate_claim

    from agent import cli

    path = Path(__file__).parent.parent / "daemonset" / "dra" / "examples" / "gpu-and-nic-claim.yaml"
    (template,) = yaml.safe_load_all(path.read_text())
    claim = {"metadata": {"name": "c"}, "spec": template["spec"]["spec"]}
    assert validate_claim(default_claim(claim)) == []
    (constraint,) = claim["spec"]["devices"]["constraints"]
    assert constraint == {"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}
    assert cli.main(["slices", "--simulate", "dgx-h100", "--node-name", "n1"]) == 0
    slices = [s for s in yaml.safe_load_all(capsys.readouterr().out) if s]
    roots = [d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
             for s in slices for d in s["spec"].get("devices", []) if "resource.kubernetes.io/pcieRoot" in d.get("attributes", {})]
    assert len(roots) == 8 and all(r.startswith("pci") for r in roots)


# ----------------------------------------------------------------------------- cloud VM files
SHARED_NCCL = Path(__file__).parent.parent.parent / "shared" / "data" / "nccl"
NODE_FILES = sorted(NCCL.glob("*.xml")) + sorted(SHARED_NCCL.glob("*.xml") if SHARED_NCCL.is_dir() else [])


def node_view(path: Path) -> nccl_standin.System:
    """What NCCL builds from the node's own file (``dev`` and ``rank``, which a container's
    file must not carry, taken out first)."""
    return nccl_standin.load(re.sub(r' (dev|rank)="[^"]*"', "", path.read_text()))


def test_there_are_node_files_with_gpus_of_several_domains_under_one_switch():
    view = node_view(NCCL / "azure-ndv4-a100.xml")
    assert view.gpus["0003:00:00.0"] == view.gpus["0004:00:00.0"] == ("0", ("ffff:ff:01.0",))
    assert len(NODE_FILES) >= 4


def test_discover_keeps_the_files_bus_ids_of_gpus_and_nics(capsys):
    from agent import cli

    assert cli.main(["discover", "--simulate", str(NCCL / "azure-ndv4-a100.xml"), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [g["pci_bus_id"] for g in doc["gpus"]] == [
        f"0000000{d}:00:00.0" for d in "1234BCDE"]  # NVML's spelling and order of the file's IDs
    nics = {n["pci_bus_id"]: n for n in doc["nics"]}
    assert sorted(nics) == [f"010{k}:00:00.0" for k in range(1, 9)]
    gpu = {g["pci_bus_id"]: g["index"] for g in doc["gpus"]}
    # GPUs 0003 and 0004 share the switch ffff:ff:01.0 with NICs 0103 and 0104
    assert {(k["a"], k["b"]): k["pcie"] for k in doc["links"]}[(gpu["00000003:00:00.0"], gpu["00000004:00:00.0"])] == "PIX"
    for nic in ("0103:00:00.0", "0104:00:00.0"):
        pix = [i for i, lv in enumerate(nics[nic]["levels"]) if lv == "PIX"]
        assert pix == sorted([gpu["00000003:00:00.0"], gpu["00000004:00:00.0"]])
    cli.main(["discover", "--simulate", str(NCCL / "azure-ndv4-a100.xml")])
    table = capsys.readouterr().out
    assert "00000003:00:00.0" in table and "0103:00:00.0" in table and "00000000:01:00.0" not in table


def gpu_subsets(n: int):
    for k in range(1, n + 1):
        yield from itertools.combinations(range(n), k)


@pytest.mark.parametrize("path", NODE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_gpu_subsets_file_holds_exactly_its_gpus_and_their_nics_on_the_files_paths(path):
    """On a node with this NCCL file (``topology.ncclTopologyFile``) the container's file is
    the matching part of it; simulated (``--simulate FILE``), it is built from the facts:
    either way NCCL finds exactly the container's GPUs and their nearest NICs, a GPU under
    the file's switch with its NICs."""
    topo = load_topology(str(path))
    node_file = read_nccl_topology(path)
    view = node_view(path)
    bus = {g.index: nccl_bus_id(g.pci_bus_id) for g in topo.gpus}
    for gpus in gpu_subsets(topo.gpu_count):
        nics = nearest_nics(topo, gpus)
        nic_keys = {nccl_bus_id(n.pci_bus_id) if n.pci_bus_id else n.name for n in nics}
        echoed = nccl_standin.load(nccl_topology_xml(topo, gpus, node_file=node_file))
        assert echoed.gpus == {bus[i]: view.gpus[bus[i]] for i in gpus}, (path.name, gpus)
        assert echoed.nics == {k: view.nics[k] for k in nic_keys}, (path.name, gpus)
        built = nccl_standin.load(nccl_topology_xml(topo, gpus))
        assert set(built.gpus) == {bus[i] for i in gpus}, (path.name, gpus)
        assert set(built.nics) == {k for k in nic_keys if ":" in k}  # a NIC without a bus ID: NCCL finds it
        for g, (numa, switches) in built.gpus.items():
            assert numa == view.gpus[g][0]
            for n, (_, nic_switches) in built.nics.items():  # on the file's switch <=> on one here
                assert (switches == nic_switches != ()) == (view.gpus[g][1] == view.nics[n][1] != ())


def test_a_node_file_without_the_containers_gpus_is_not_echoed():
    topo = load_topology(str(NCCL / "azure-ndv4-a100.xml"))
    other = read_nccl_topology(NCCL / "azure-ndv5-h100.xml")  # no GPU 000d/000e
    system = nccl_standin.load(nccl_topology_xml(topo, [6, 7], node_file=other))
    assert set(system.gpus) == {"000d:00:00.0", "000e:00:00.0"}
