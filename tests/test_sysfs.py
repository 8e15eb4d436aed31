"""agent.hw.sysfs: the reader on a hand-written tree, and the
fake-tree writer meeting the reader only through the files it writes."""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.formats import (
    format_cpulist,
    nvml_to_sysfs_bus_id,
    parse_cpulist,
    sysfs_to_nvml_bus_id,
)
from agent.hw.sim.sysfs_tree import PciDeviceSpec, SysfsTreeSpec, write_tree
from agent.hw.sysfs import NumaNode, RdmaNic, SysfsReader
from agent.topology.model import PcieLevel

FIXTURE = str(Path(__file__).parent / "fixtures" / "sysfs" / "two-socket")

GPU_SW0 = "0000:1a:00.0"  # socket 0, below a switch with NIC mlx5_0
NIC_SW0 = "0000:1b:00.0"
GPU_NO_NUMA = "0000:39:00.0"  # numa_node -1
GPU_HB4A = "0000:4b:00.0"
NVME_HB4A = "0000:4c:00.0"
GPU_SW1 = "0000:9c:00.0"  # socket 1, below two switches
NIC_SW1 = "0000:9d:00.0"  # socket 1, below the outer switch only


@pytest.fixture
def reader() -> SysfsReader:
    return SysfsReader(FIXTURE)


# --------------------------------------------------------------------------- reader on the fixture
def test_pci_numa_node_accepts_both_bus_id_spellings(reader: SysfsReader) -> None:
    assert reader.pci_numa_node(GPU_SW0) == 0
    assert reader.pci_numa_node("00000000:1A:00.0") == 0
    assert reader.pci_numa_node("00000000:9C:00.0") == 1


def test_numa_node_minus_one_reads_as_none(reader: SysfsReader) -> None:
    assert reader.pci_numa_node(GPU_NO_NUMA) is None


def test_pci_local_cpulist_is_the_file_without_newline(reader: SysfsReader) -> None:
    assert reader.pci_local_cpulist("00000000:1A:00.0") == "0-31,64-95"
    assert reader.pci_local_cpulist(GPU_SW1) == "32-63,96-127"
    assert reader.pci_local_cpulist(GPU_NO_NUMA) == "0-127"


def test_numa_nodes_read_cpulists_and_distances(reader: SysfsReader) -> None:
    assert reader.numa_nodes() == {
        0: NumaNode(0, "0-31,64-95", (10, 21)),
        1: NumaNode(1, "32-63,96-127", (21, 10)),
    }


def test_rdma_nics_come_with_their_pci_device_and_numa_node(reader: SysfsReader) -> None:
    assert reader.rdma_nics() == [
        RdmaNic("mlx5_0", NIC_SW0, 0),
        RdmaNic("mlx5_1", NIC_SW1, 1),
    ]


def test_product_name_comes_from_dmi(reader: SysfsReader) -> None:
    assert reader.product_name() == "PowerEdge R760xa"


FIXTURE_LEVELS = [
    (GPU_SW0, NIC_SW0, PcieLevel.PIX),
    (GPU_SW1, NIC_SW1, PcieLevel.PXB),
    (GPU_HB4A, NVME_HB4A, PcieLevel.PHB),
    (GPU_SW0, GPU_HB4A, PcieLevel.NODE),
    (NIC_SW0, NVME_HB4A, PcieLevel.NODE),
    (GPU_SW0, GPU_SW1, PcieLevel.SYS),
    (NIC_SW0, NIC_SW1, PcieLevel.SYS),
    (GPU_SW0, GPU_NO_NUMA, None),  # another host bridge, no NUMA node, two sockets
]


@pytest.mark.parametrize("a,b,level", FIXTURE_LEVELS)
def test_pcie_level_follows_the_real_device_paths(
    reader: SysfsReader, a: str, b: str, level: PcieLevel | None
) -> None:
    assert reader.pcie_level(a, b) == level
    assert reader.pcie_level(b, a) == level
    assert reader.pcie_level(sysfs_to_nvml_bus_id(a), sysfs_to_nvml_bus_id(b)) == level


def test_pcie_level_is_unknown_for_one_device_with_itself_or_a_bridge_above_it(
    reader: SysfsReader,
) -> None:
    assert reader.pcie_level(GPU_SW0, "00000000:1A:00.0") is None
    assert reader.pcie_level("0000:19:00.0", GPU_SW0) is None  # its switch port


def test_pcie_level_is_unknown_for_a_device_that_is_not_there(reader: SysfsReader) -> None:
    assert reader.pcie_level(GPU_SW0, "0000:ee:00.0") is None


def test_host_bridges_below_other_devices_are_found_as_in_hyper_v_guests(
    tmp_path: Path,
) -> None:
    vmbus = "devices/LNXSYSTM:00/LNXSYBUS:00/ACPI0004:00/VMBUS:00"
    gpus = {
        "0001:00:00.0": f"{vmbus}/47505500-0001-0000-3130-444531303244/pci0001:00/0001:00:00.0",
        "0002:00:00.0": f"{vmbus}/47505500-0002-0000-3130-444531303244/pci0002:00/0002:00:00.0",
    }
    for bdf, path in gpus.items():
        (tmp_path / path).mkdir(parents=True)
        (tmp_path / path / "numa_node").write_text("0\n")
        link = tmp_path / "bus" / "pci" / "devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("../../../" + path, link)
    r = SysfsReader(str(tmp_path))
    assert r.pcie_level("00000001:00:00.0", "00000002:00:00.0") == PcieLevel.NODE


# --------------------------------------------------------------------------- missing / broken files
def _assert_knows_nothing(r: SysfsReader) -> None:
    assert r.pci_numa_node(GPU_SW0) is None
    assert r.pci_local_cpulist(GPU_SW0) is None
    assert r.numa_nodes() == {}
    assert r.rdma_nics() == []
    assert r.pcie_level(GPU_SW0, GPU_SW1) is None
    assert r.product_name() is None


def test_a_root_that_does_not_exist_gives_no_facts_and_no_exception(tmp_path: Path) -> None:
    _assert_knows_nothing(SysfsReader(str(tmp_path / "nope")))


def test_an_empty_tree_gives_no_facts_and_no_exception(tmp_path: Path) -> None:
    _assert_knows_nothing(SysfsReader(str(tmp_path)))


def test_malformed_bus_ids_read_as_missing_devices(reader: SysfsReader) -> None:
    assert reader.pci_numa_node("gpu0") is None
    assert reader.pci_local_cpulist("") is None
    assert reader.pcie_level("gpu0", GPU_SW0) is None


def test_garbled_and_partial_files_read_as_missing(tmp_path: Path) -> None:
    dev = tmp_path / "bus" / "pci" / "devices" / GPU_SW0
    dev.mkdir(parents=True)  # a plain directory, not a link into devices/
    (dev / "numa_node").write_text("banana\n")
    (dev / "local_cpulist").write_text("\n")
    node = tmp_path / "devices" / "system" / "node" / "node0"
    node.mkdir(parents=True)
    (node / "distance").write_text("10 x\n")
    (tmp_path / "devices" / "system" / "node" / "node1").mkdir()
    ib = tmp_path / "class" / "infiniband" / "rxe0"
    ib.mkdir(parents=True)  # a software RDMA device: no PCI parent
    dmi = tmp_path / "class" / "dmi" / "id"
    dmi.mkdir(parents=True)
    (dmi / "product_name").write_text("  \n")
    r = SysfsReader(str(tmp_path))
    assert r.pci_numa_node(GPU_SW0) is None
    assert r.pci_local_cpulist(GPU_SW0) is None
    assert r.numa_nodes() == {0: NumaNode(0, "", ()), 1: NumaNode(1, "", ())}
    assert r.rdma_nics() == [RdmaNic("rxe0", None, None)]
    assert r.pcie_level(GPU_SW0, GPU_SW0.replace("1a", "1b")) is None
    assert r.product_name() is None


def test_a_dangling_bus_link_reads_as_a_missing_device(tmp_path: Path) -> None:
    links = tmp_path / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    os.symlink("../../../devices/pci0000:17/0000:17:01.0/0000:18:00.0", links / "0000:18:00.0")
    r = SysfsReader(str(tmp_path))
    assert r.pci_numa_node("0000:18:00.0") is None
    assert r.pcie_level("0000:18:00.0", GPU_SW0) is None


# --------------------------------------------------------------------------- writer
def _dev(
    bus_id: str,
    hb: str,
    switches: tuple[str, ...] = (),
    numa: int | None = 0,
    rdma_name: str | None = None,
) -> PciDeviceSpec:
    """A device spec whose local CPUs are its NUMA node's (node 0: 0-3, else 4-7)."""
    cpulist = "0-3" if numa == 0 else "4-7"
    return PciDeviceSpec(bus_id, numa, cpulist, hb, switches, rdma_name)


TWO_NODES = {0: ("0-3", (10, 21)), 1: ("4-7", (21, 10))}

WRITER_LEVELS = [
    # a, b, level by contract (1)
    (
        _dev("00000000:1A:00.0", "pci0000:17", ("s0",)),
        _dev("0000:1b:00.0", "pci0000:17", ("s0",)),
        PcieLevel.PIX,
    ),
    (
        _dev("0000:1a:00.0", "pci0000:17", ("s0", "s1")),
        _dev("0000:1b:00.0", "pci0000:17", ("s0", "s1")),
        PcieLevel.PIX,
    ),
    (
        _dev("0000:1a:00.0", "pci0000:17", ("s0", "s1")),
        _dev("0000:1b:00.0", "pci0000:17", ("s0", "s2")),
        PcieLevel.PXB,
    ),
    (
        _dev("0000:1a:00.0", "pci0000:17", ("s0", "s1")),
        _dev("0000:1b:00.0", "pci0000:17", ("s0",)),
        PcieLevel.PXB,
    ),
    (
        _dev("0000:1a:00.0", "pci0000:17", ("s0",)),
        _dev("0000:1b:00.0", "pci0000:17", ("s1",)),
        PcieLevel.PHB,
    ),
    (_dev("0000:1a:00.0", "pci0000:17", ()), _dev("0000:1b:00.0", "pci0000:17", ()), PcieLevel.PHB),
    (
        _dev("0000:1a:00.0", "pci0000:17", ("s0",)),
        _dev("0000:3b:00.0", "pci0000:3a", ("s9",)),
        PcieLevel.NODE,
    ),
    (_dev("0000:1a:00.0", "pci0000:17"), _dev("0000:9b:00.0", "pci0000:9a", numa=1), PcieLevel.SYS),
    # no NUMA node (the kernel then gives the device every CPU): unknown on a 2-node machine
    (
        _dev("0000:1a:00.0", "pci0000:17"),
        PciDeviceSpec("0000:9b:00.0", None, "0-7", "pci0000:9a"),
        None,
    ),
    # no NUMA node but disjoint local CPUs: different nodes, whichever they are
    (
        PciDeviceSpec("0000:1a:00.0", None, "0-3", "pci0000:17"),
        PciDeviceSpec("0000:9b:00.0", None, "4-7", "pci0000:9a"),
        PcieLevel.SYS,
    ),
]


@pytest.mark.parametrize("a,b,level", WRITER_LEVELS)
def test_written_tree_reads_back_each_pcie_level(
    tmp_path: Path, a: PciDeviceSpec, b: PciDeviceSpec, level: PcieLevel | None
) -> None:
    write_tree(str(tmp_path), SysfsTreeSpec(None, TWO_NODES, [a, b]))
    r = SysfsReader(str(tmp_path))
    assert r.pcie_level(a.bus_id, b.bus_id) == level
    assert r.pcie_level(b.bus_id, a.bus_id) == level


def test_devices_without_numa_node_on_a_one_node_machine_are_node_apart(tmp_path: Path) -> None:
    spec = SysfsTreeSpec(
        None,
        {0: ("0-7", (10,))},
        [
            _dev("0000:1a:00.0", "pci0000:17", numa=None),
            _dev("0000:3b:00.0", "pci0000:3a", numa=None),
        ],
    )
    write_tree(str(tmp_path), spec)
    assert SysfsReader(str(tmp_path)).pcie_level("0000:1a:00.0", "0000:3b:00.0") == PcieLevel.NODE


def test_device_on_the_root_bus_sits_directly_on_the_host_bridge_as_in_a_vm(tmp_path: Path) -> None:
    spec = SysfsTreeSpec(
        None,
        {},
        [
            PciDeviceSpec("0000:00:05.0", None, None, "pci0000:00"),
            PciDeviceSpec("0000:00:06.0", None, None, "pci0000:00"),
        ],
    )
    write_tree(str(tmp_path), spec)
    link = tmp_path / "bus" / "pci" / "devices" / "0000:00:05.0"
    assert os.readlink(link) == "../../../devices/pci0000:00/0000:00:05.0"
    assert SysfsReader(str(tmp_path)).pcie_level("0000:00:05.0", "0000:00:06.0") == PcieLevel.PHB


def test_functions_of_one_device_share_their_port_and_are_pix(tmp_path: Path) -> None:
    spec = SysfsTreeSpec(
        None,
        {},
        [
            _dev("0000:1b:00.0", "pci0000:17", rdma_name="mlx5_0"),
            _dev("0000:1b:00.1", "pci0000:17", rdma_name="mlx5_1"),
        ],
    )
    write_tree(str(tmp_path), spec)
    r = SysfsReader(str(tmp_path))
    assert r.pcie_level("0000:1b:00.0", "0000:1b:00.1") == PcieLevel.PIX
    assert [n.name for n in r.rdma_nics()] == ["mlx5_0", "mlx5_1"]


def test_written_tree_uses_the_kernels_links_and_file_contents(tmp_path: Path) -> None:
    spec = SysfsTreeSpec(
        "DGX H100",
        TWO_NODES,
        [
            _dev("00000000:1A:00.0", "pci0000:17", ("s0",)),
            PciDeviceSpec("0000:1b:00.0", None, None, "pci0000:17", ("s0",), "mlx5_0"),
        ],
    )
    write_tree(str(tmp_path), spec)
    gpu_link = tmp_path / "bus" / "pci" / "devices" / "0000:1a:00.0"
    target = os.readlink(gpu_link)
    # host bridge / root port / switch upstream port / switch downstream port / device
    parts = target.split("/")
    assert parts[:4] == ["..", "..", "..", "devices"]
    assert (
        parts[4] == "pci0000:17" and parts[5].startswith("0000:17:") and parts[-1] == "0000:1a:00.0"
    )
    assert len(parts) == 9
    for bridge in parts[5:8]:
        assert (tmp_path / "bus" / "pci" / "devices" / bridge / "class").read_text() == "0x060400\n"
    assert (gpu_link / "numa_node").read_text() == "0\n"
    assert (gpu_link / "local_cpulist").read_text() == "0-3\n"
    assert (gpu_link / "local_cpus").read_text() == "0000000f\n"
    assert (gpu_link / "vendor").read_text() == "0x10de\n"
    nic = tmp_path / "bus" / "pci" / "devices" / "0000:1b:00.0"
    assert (nic / "numa_node").read_text() == "-1\n"
    assert not (nic / "local_cpulist").exists()
    assert (
        os.readlink(tmp_path / "class" / "infiniband" / "mlx5_0" / "device")
        == "../../../0000:1b:00.0"
    )
    assert os.path.islink(tmp_path / "class" / "dmi" / "id")
    assert (tmp_path / "class" / "dmi" / "id" / "product_name").read_text() == "DGX H100\n"
    node = tmp_path / "devices" / "system" / "node"
    assert (node / "node1" / "distance").read_text() == "21 10\n"
    assert (node / "node1" / "cpumap").read_text() == "000000f0\n"
    assert (node / "online").read_text() == "0-1\n"


def test_writing_a_tree_twice_into_one_root_replaces_it_in_place(tmp_path: Path) -> None:
    spec = SysfsTreeSpec(
        "A", TWO_NODES, [_dev("0000:1a:00.0", "pci0000:17", ("s0",), rdma_name="mlx5_0")]
    )
    write_tree(str(tmp_path), spec)
    write_tree(str(tmp_path), SysfsTreeSpec("B", spec.numa_nodes, spec.devices))
    r = SysfsReader(str(tmp_path))
    assert r.product_name() == "B"
    assert r.rdma_nics() == [RdmaNic("mlx5_0", "0000:1a:00.0", 0)]


@pytest.mark.parametrize(
    "devices,message",
    [
        (
            [_dev("0000:1a:00.0", "pci0000:17"), _dev("00000000:1A:00.0", "pci0000:17")],
            "given twice",
        ),
        (
            [
                _dev("0000:1a:00.0", "pci0000:17", ("s0",)),
                _dev("0000:1b:00.0", "pci0000:3a", ("s0",)),
            ],
            "two parents",
        ),
        (
            [
                _dev("0000:1a:00.0", "pci0000:17", ("s0", "s1")),
                _dev("0000:1b:00.0", "pci0000:17", ("s1",)),
            ],
            "two parents",
        ),
        ([_dev("0000:1a:00.0", "pci0000:17", ("s0", "s0"))], "twice"),
        ([_dev("0001:1a:00.0", "pci0000:17")], "domain"),
        (
            [_dev("0000:1a:00.0", "pci0000:17"), _dev("0000:1a:00.1", "pci0000:17", ("s0",))],
            "shares bus",
        ),
        ([_dev("0000:1a:00.0", "17")], "host bridge"),
        ([_dev("0000:1a:00.0", "pci0000:17"), _dev("0000:1b", "pci0000:17")], "not a PCI bus id"),
        ([PciDeviceSpec("0000:1a:00.0", 0, "0-x", "pci0000:17")], "cpulist"),
        (
            [
                _dev("0000:1a:00.0", "pci0000:17", rdma_name="a"),
                _dev("0000:1b:00.0", "pci0000:17", rdma_name="a"),
            ],
            "RDMA",
        ),
    ],
)
def test_write_tree_rejects_specs_no_pcie_tree_can_have(
    tmp_path: Path, devices: list[PciDeviceSpec], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        write_tree(str(tmp_path / "sys"), SysfsTreeSpec("X", TWO_NODES, devices))
    assert not (tmp_path / "sys").exists()  # nothing half-written


# --------------------------------------------------------------------------- random round trip
HOST_BRIDGE_BUSES = [0x00, 0x17, 0x3A, 0x5D, 0x80, 0x97, 0xB0, 0xD7]
PRODUCTS = [None, "DGX H100", "PowerEdge XE9680", "ProLiant XL675d Gen10 Plus"]


@st.composite
def tree_specs(draw: st.DrawFn) -> SysfsTreeSpec:
    n_nodes = draw(st.integers(0, 3))
    numa_nodes = {
        i: (
            format_cpulist(draw(st.sets(st.integers(0, 63), max_size=12))),
            tuple(10 if j == i else draw(st.integers(11, 40)) for j in range(n_nodes)),
        )
        for i in range(n_nodes)
    }
    hb_buses = draw(
        st.lists(st.sampled_from(HOST_BRIDGE_BUSES), min_size=1, max_size=3, unique=True)
    )
    bridges = []  # (name, numa, switch chains)
    for hb_bus in hb_buses:
        name = f"pci0000:{hb_bus:02x}"
        numa = draw(st.sampled_from(range(n_nodes))) if n_nodes else None
        chains: list[tuple[str, ...]] = [()]
        for i in range(draw(st.integers(0, 4))):
            parent = draw(st.sampled_from(chains))  # () makes a top-level switch
            chains.append(parent + (f"{name}-sw{i}",))
        bridges.append((name, numa, chains))
    free_buses = sorted(set(range(1, 0x100)) - set(HOST_BRIDGE_BUSES))
    buses = draw(st.lists(st.sampled_from(free_buses), min_size=1, max_size=6, unique=True))
    devices = []
    for k, bus in enumerate(buses):
        name, numa, chains = draw(st.sampled_from(bridges))
        bdf = f"0000:{bus:02x}:00.0"
        devices.append(
            PciDeviceSpec(
                bus_id=draw(st.sampled_from([bdf, sysfs_to_nvml_bus_id(bdf)])),
                numa_node=numa if draw(st.booleans()) or numa is None else None,
                local_cpulist=draw(
                    st.none()
                    | st.sets(st.integers(0, 63), min_size=1, max_size=8).map(format_cpulist)
                ),
                host_bridge=name,
                switches=draw(st.sampled_from(chains)),
                rdma_name=draw(st.sampled_from([None, f"mlx5_{k}"])),
            )
        )
    return SysfsTreeSpec(draw(st.sampled_from(PRODUCTS)), numa_nodes, devices)


def _level_by_contract(a: PciDeviceSpec, b: PciDeviceSpec, n_nodes: int) -> PcieLevel | None:
    """Contract (1)'s rules, from the spec alone."""
    if a.host_bridge == b.host_bridge:
        if a.switches and b.switches and a.switches[-1] == b.switches[-1]:
            return PcieLevel.PIX
        if a.switches and b.switches and a.switches[0] == b.switches[0]:
            return PcieLevel.PXB
        return PcieLevel.PHB
    if a.numa_node is not None and b.numa_node is not None:
        return PcieLevel.NODE if a.numa_node == b.numa_node else PcieLevel.SYS
    if a.local_cpulist and b.local_cpulist:
        if not set(parse_cpulist(a.local_cpulist)) & set(parse_cpulist(b.local_cpulist)):
            return PcieLevel.SYS  # disjoint local CPUs: different NUMA nodes
    return PcieLevel.NODE if n_nodes <= 1 else None


@given(tree_specs())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_tree_specs_round_trip_through_the_files(spec: SysfsTreeSpec) -> None:
    with tempfile.TemporaryDirectory() as root:
        write_tree(root, spec)
        r = SysfsReader(root)
        assert r.product_name() == spec.product_name
        assert r.numa_nodes() == {
            i: NumaNode(i, cpulist, distances)
            for i, (cpulist, distances) in spec.numa_nodes.items()
        }
        for dev in spec.devices:
            assert r.pci_numa_node(dev.bus_id) == dev.numa_node
            assert r.pci_local_cpulist(dev.bus_id) == dev.local_cpulist
        assert r.rdma_nics() == sorted(
            (
                RdmaNic(d.rdma_name, nvml_to_sysfs_bus_id(d.bus_id), d.numa_node)
                for d in spec.devices
                if d.rdma_name is not None
            ),
            key=lambda n: n.name,
        )
        for a, b in itertools.combinations(spec.devices, 2):
            assert r.pcie_level(a.bus_id, b.bus_id) == _level_by_contract(
                a, b, len(spec.numa_nodes)
            ), (a, b)


def test_pci_class_reads_the_class_code_and_is_none_when_missing(tmp_path):
    reader = SysfsReader(str(FIXTURE))
    assert reader.pci_class(GPU_SW0) == 0x030200
    assert reader.pci_class(sysfs_to_nvml_bus_id(GPU_SW0)) == 0x030200
    assert reader.pci_class("0000:ff:1f.7") is None
    assert SysfsReader(str(tmp_path)).pci_class(GPU_SW0) is None
