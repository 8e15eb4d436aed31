"""Node labels: GFD-compatible names and formats, our topology labels, validity, the sink."""

from __future__ import annotations

import logging
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from label_rules import is_valid_label_key

from agent.config import Config, TimeSlicingResource
from agent.labels import compute_labels, format_labels
from agent.labels.gfd import arch_family, is_valid_label_value, sanitize_value
from agent.labels.publishing import LabelPublisher
from agent.labels.sinks import FeatureFileSink
from agent.labels.topology_labels import nvlink_fabric_kind
from agent.topology.model import Gpu, Link, MigDevice, Nic, PcieLevel, Topology

H100 = "NVIDIA H100 80GB HBM3"


def dgx_h100_like() -> Topology:
    """8 H100 on NVSwitch, 2 NUMA nodes, one NIC per GPU on its PCIe switch."""
    gpus = [
        Gpu(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", H100, memory_mib=81559,
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", minor_number=i,
            compute_capability=(9, 0), numa_node=0 if i < 4 else 1)
        for i in range(8)
    ]
    links = [
        Link(a, b, nvlinks=18, pcie=PcieLevel.NODE if (a < 4) == (b < 4) else PcieLevel.SYS,
             nvswitch=True)
        for a in range(8) for b in range(a + 1, 8)
    ]
    nics = [
        Nic(f"mlx5_{n}", numa_node=0 if n < 4 else 1,
            levels=tuple(PcieLevel.PIX if g == n else PcieLevel.SYS for g in range(8)))
        for n in range(8)
    ]
    return Topology.build(gpus, links, nics=tuple(nics), driver_version="550.54.15",
                          cuda_driver_version="12.4", machine="DGX H100")


def pcie_pairs(names: list[str], cc=(8, 0), mig: dict[int, tuple[MigDevice, ...]] | None = None,
               nvlink_pairs: bool = True) -> Topology:
    mig = mig or {}
    gpus = [
        Gpu(i, f"GPU-{i}", n, memory_mib=40960 if "A100" in n else 46068,
            compute_capability=cc, numa_node=i // 2, mig_enabled=i in mig,
            mig_devices=mig.get(i, ()))
        for i, n in enumerate(names)
    ]
    links = []
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            paired = nvlink_pairs and a // 2 == b // 2
            links.append(Link(a, b, nvlinks=4 if paired else 0,
                              pcie=PcieLevel.PHB if a // 2 == b // 2 else PcieLevel.SYS))
    return Topology.build(gpus, links, driver_version="535.104.05", cuda_driver_version="12.2")


def mig_devices(parent: int, profile: str, count: int, memory_mib: int) -> tuple[MigDevice, ...]:
    return tuple(MigDevice(f"MIG-{parent}-{k}", parent, k, profile, memory_mib) for k in range(count))


# ------------------------------------------------------------------ expected dictionaries
def test_dgx_h100_like_node_gets_the_expected_labels():
    assert compute_labels(dgx_h100_like(), Config()) == {
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "54",
        "nvidia.com/cuda.driver.rev": "15",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.machine": "DGX-H100",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.mode": "compute",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mps.capable": "false",
        "topology.gpu-agent.io/gpu-count": "8",
        "topology.gpu-agent.io/gpu-models": "1",
        "topology.gpu-agent.io/gpu-nic-same-switch": "true",
        "topology.gpu-agent.io/max-gpus-per-numa-node": "4",
        "topology.gpu-agent.io/numa-nodes": "2",
        "topology.gpu-agent.io/nvlink-fabric": "nvswitch",
        "topology.gpu-agent.io/nvlink-islands": "1",
        "topology.gpu-agent.io/nvlink-largest-clique": "8",
        "topology.gpu-agent.io/nvlink-largest-island": "8",
        "topology.gpu-agent.io/nvlink-max-links-per-pair": "18",
        "topology.gpu-agent.io/rdma-nics": "8",
    }


def test_bridged_pairs_node_reports_bridge_fabric_and_no_nics():
    labels = compute_labels(pcie_pairs(["NVIDIA A100 80GB PCIe"] * 4), Config())
    assert labels["topology.gpu-agent.io/nvlink-fabric"] == "bridge"
    assert labels["topology.gpu-agent.io/nvlink-islands"] == "2"
    assert labels["topology.gpu-agent.io/nvlink-largest-island"] == "2"
    assert labels["topology.gpu-agent.io/nvlink-largest-clique"] == "2"
    assert labels["topology.gpu-agent.io/rdma-nics"] == "0"
    assert labels["topology.gpu-agent.io/gpu-nic-same-switch"] == "false"
    assert labels["nvidia.com/gpu.family"] == "ampere"


def test_pcie_only_node_reports_no_nvlink_fabric():
    labels = compute_labels(pcie_pairs(["NVIDIA L40S"] * 4, cc=(8, 9), nvlink_pairs=False),
                            Config())
    assert labels["topology.gpu-agent.io/nvlink-fabric"] == "none"
    assert labels["topology.gpu-agent.io/nvlink-islands"] == "0"
    assert labels["topology.gpu-agent.io/nvlink-largest-clique"] == "0"
    assert labels["nvidia.com/gpu.family"] == "ada-lovelace"
    assert labels["nvidia.com/mig.capable"] == "false"


def test_direct_nvlinks_among_four_gpus_are_a_mesh():
    gpus = [Gpu(i, f"GPU-{i}", "Tesla V100-SXM2-16GB", compute_capability=(7, 0)) for i in range(4)]
    links = [Link(a, b, nvlinks=2) for a in range(4) for b in range(a + 1, 4)]
    assert nvlink_fabric_kind(Topology.build(gpus, links)) == "mesh"


def test_a_node_without_gpus_gets_no_labels():
    assert compute_labels(Topology.build([], []), Config()) == {}


def test_unknown_driver_version_leaves_version_labels_out():
    gpus = [Gpu(0, "GPU-0", "NVIDIA A10", compute_capability=(8, 6))]
    labels = compute_labels(Topology.build(gpus, []), Config())
    assert not any(k.startswith("nvidia.com/cuda.") for k in labels)
    assert labels["nvidia.com/gpu.machine"] == "unknown"


def test_two_part_driver_version_has_no_revision_label():
    gpus = [Gpu(0, "GPU-0", "NVIDIA A10", compute_capability=(8, 6))]
    labels = compute_labels(Topology.build(gpus, [], driver_version="470.82"), Config())
    assert labels["nvidia.com/cuda.driver-version.full"] == "470.82"
    assert "nvidia.com/cuda.driver-version.revision" not in labels
    assert "nvidia.com/cuda.driver.rev" not in labels


# ------------------------------------------------------------------ sharing and MIG
def test_time_slicing_sets_replicas_strategy_and_shared_product_suffix():
    config = Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=4),))
    labels = compute_labels(dgx_h100_like(), config)
    assert labels["nvidia.com/gpu.replicas"] == "4"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"


def test_renamed_shared_resource_keeps_the_plain_product_name():
    for config in (
        Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", 4, rename="gpu.shared"),)),
        Config(time_slicing=(TimeSlicingResource("nvidia.com/gpu", 4),), rename_by_default=True),
    ):
        labels = compute_labels(dgx_h100_like(), config)
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["nvidia.com/gpu.replicas"] == "4"


def test_mig_single_strategy_describes_the_mig_devices_as_nvidia_gpu():
    a100 = "NVIDIA A100-SXM4-40GB"
    mig = {i: mig_devices(i, "1g.5gb", 7, 4864) for i in range(2)}
    labels = compute_labels(pcie_pairs([a100] * 2, mig=mig), Config(mig_strategy="single"))
    assert labels["nvidia.com/mig.strategy"] == "single"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert labels["nvidia.com/gpu.count"] == "14"
    assert labels["nvidia.com/gpu.memory"] == "4864"
    assert labels["nvidia.com/gpu.slices.gi"] == "1"
    assert labels["nvidia.com/gpu.slices.ci"] == "1"


def test_mig_single_strategy_with_mixed_profiles_is_labelled_invalid():
    a100 = "NVIDIA A100-SXM4-40GB"
    mig = {0: mig_devices(0, "1g.5gb", 7, 4864), 1: mig_devices(1, "3g.20gb", 2, 19968)}
    labels = compute_labels(pcie_pairs([a100] * 2, mig=mig), Config(mig_strategy="single"))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-INVALID"
    assert labels["nvidia.com/gpu.count"] == "0"
    assert labels["nvidia.com/gpu.replicas"] == "0"


def test_mig_mixed_strategy_adds_per_profile_labels():
    a100 = "NVIDIA A100-SXM4-40GB"
    mig = {0: mig_devices(0, "1g.5gb", 7, 4864), 1: mig_devices(1, "3g.20gb", 2, 19968)}
    labels = compute_labels(pcie_pairs([a100] * 4, mig=mig), Config(mig_strategy="mixed"))
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/mig-1g.5gb.count"] == "7"
    assert labels["nvidia.com/mig-1g.5gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert labels["nvidia.com/mig-1g.5gb.memory"] == "4864"
    assert labels["nvidia.com/mig-3g.20gb.count"] == "2"
    assert labels["nvidia.com/mig-3g.20gb.slices.gi"] == "3"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert labels["nvidia.com/gpu.count"] == "4"


def test_mig_strategy_none_adds_no_mig_strategy_label():
    assert "nvidia.com/mig.strategy" not in compute_labels(dgx_h100_like(), Config())


# ------------------------------------------------------------------ determinism
def test_heterogeneous_node_describes_the_majority_model_whatever_the_gpu_order():
    names = ["NVIDIA L4", "NVIDIA A10", "NVIDIA L4", "NVIDIA A10", "NVIDIA L4"]
    first = compute_labels(pcie_pairs(names, nvlink_pairs=False), Config())
    second = compute_labels(pcie_pairs(list(reversed(names)), nvlink_pairs=False), Config())
    assert first == second
    assert first["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert first["nvidia.com/gpu.count"] == "3"
    assert first["topology.gpu-agent.io/gpu-models"] == "2"
    assert first["topology.gpu-agent.io/gpu-count"] == "5"


def test_heterogeneous_tie_is_broken_by_name():
    labels = compute_labels(pcie_pairs(["NVIDIA L4", "NVIDIA A10"], nvlink_pairs=False), Config())
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A10"


# ------------------------------------------------------------------ clique
def test_fabric_clique_label_joins_cluster_uuid_and_clique_id():
    cluster = "8ab3dc4b-1d6e-4b3e-9a4f-5f1e2d3c4b5a"
    gpus = [Gpu(i, f"GPU-{i}", "NVIDIA GB200", compute_capability=(10, 0),
                fabric_cluster_uuid=cluster, fabric_clique_id=32766) for i in range(4)]
    links = [Link(a, b, nvlinks=18, nvswitch=True) for a in range(4) for b in range(a + 1, 4)]
    labels = compute_labels(Topology.build(gpus, links), Config())
    assert labels["nvidia.com/gpu.clique"] == f"{cluster}.32766"
    assert labels["nvidia.com/gpu.family"] == "blackwell"


def test_disagreeing_fabric_cliques_give_no_clique_label():
    gpus = [Gpu(i, f"GPU-{i}", "NVIDIA GB200", fabric_cluster_uuid="c", fabric_clique_id=i)
            for i in range(2)]
    assert "nvidia.com/gpu.clique" not in compute_labels(Topology.build(gpus, []), Config())


def test_nvlink_domain_label_is_the_cliques_cluster_one_level_above_it():
    """Kueue TAS and Volcano group by label, coarsest first: every node of a clique carries
    the same domain, and a node has both labels or neither."""
    cluster = "8ab3dc4b-1d6e-4b3e-9a4f-5f1e2d3c4b5a"
    nodes = []
    for clique in (1, 1, 2):
        gpus = [Gpu(i, f"GPU-{clique}{i}", "NVIDIA GB200", fabric_cluster_uuid=cluster, fabric_clique_id=clique)
                for i in range(4)]
        nodes.append(compute_labels(Topology.build(gpus, []), Config()))
    assert {n["topology.gpu-agent.io/nvlink-domain"] for n in nodes} == {cluster}
    for labels in nodes:
        assert labels["nvidia.com/gpu.clique"].rsplit(".", 1)[0] == labels["topology.gpu-agent.io/nvlink-domain"]
    disagreeing = [Gpu(i, f"GPU-{i}", "NVIDIA GB200", fabric_cluster_uuid=cluster, fabric_clique_id=i) for i in range(2)]
    no_fabric = [Gpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3") for i in range(2)]
    for gpus in (disagreeing, no_fabric):
        labels = compute_labels(Topology.build(gpus, []), Config())
        assert "topology.gpu-agent.io/nvlink-domain" not in labels and "nvidia.com/gpu.clique" not in labels


def test_active_config_label_names_the_per_node_config_only_when_configs_are_per_node():
    topology = Topology.build([Gpu(0, "GPU-0", "NVIDIA H100 80GB HBM3")], [])
    per_node = Config(config_file_srcdir="/etc/configs", config_file="/etc/configs/mig-mixed")
    assert compute_labels(topology, per_node)["topology.gpu-agent.io/active-config"] == "mig-mixed"
    assert "topology.gpu-agent.io/active-config" not in compute_labels(topology, Config(config_file="/etc/c.yaml"))
    long_name = Config(config_file_srcdir="/c", config_file="/c/" + "x" * 64)  # not a label value
    assert "topology.gpu-agent.io/active-config" not in compute_labels(topology, long_name)


# ------------------------------------------------------------------ formats and validity
@pytest.mark.parametrize(
    "raw, expected",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB"),
        ("NVIDIA RTX A6000 (rev. 2)", "NVIDIA-RTX-A6000-rev.-2"),
        ("  GeForce   RTX 4090 ", "GeForce-RTX-4090"),
        ("x" * 80, "x" * 63),
        ("©™", ""),
    ],
)
def test_sanitize_follows_the_gfd_product_rule(raw, expected):
    assert sanitize_value(raw) == expected


@pytest.mark.parametrize(
    "cc, family",
    [((7, 0), "volta"), ((7, 5), "turing"), ((8, 0), "ampere"), ((8, 6), "ampere"),
     ((8, 9), "ada-lovelace"), ((9, 0), "hopper"), ((10, 0), "blackwell"), ((6, 0), "pascal"),
     ((42, 0), "undefined")],
)
def test_family_follows_compute_capability(cc, family):
    assert arch_family(*cc) == family


def test_label_validators_reject_what_kubernetes_rejects():
    assert is_valid_label_key("nvidia.com/gpu.product")
    assert not is_valid_label_key("nvidia.com/-bad")
    assert not is_valid_label_key("Bad_Prefix.com/x")
    assert not is_valid_label_key("a/" + "x" * 64)
    assert is_valid_label_value("NVIDIA-H100-80GB-HBM3")
    assert not is_valid_label_value("has space")
    assert not is_valid_label_value("-leading")
    assert not is_valid_label_value("x" * 64)


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(st.text(min_size=0, max_size=90), min_size=1, max_size=6),
    machine=st.one_of(st.none(), st.text(max_size=90)),
    driver=st.one_of(st.none(), st.text(max_size=20), st.just("550.54.15")),
)
def test_every_label_is_valid_whatever_the_names(names, machine, driver):
    gpus = [Gpu(i, f"GPU-{i}", n, memory_mib=1024, compute_capability=(8, 0))
            for i, n in enumerate(names)]
    topo = Topology.build(gpus, [], driver_version=driver, machine=machine,
                          cuda_driver_version=driver)
    labels = compute_labels(topo, Config())
    assert "nvidia.com/gpu.count" in labels, sorted(labels)
    for key, value in labels.items():
        assert is_valid_label_key(key), key
        assert is_valid_label_value(value) and value, (key, value)


def test_format_is_sorted_key_value_lines():
    assert format_labels({"b": "2", "a": "1"}) == "a=1\nb=2\n"


# ------------------------------------------------------------------ sink
def test_feature_file_is_written_once_and_rewritten_only_on_change(tmp_path):
    sink = FeatureFileSink(str(tmp_path / "features.d"))
    assert sink.write({"a": "1"}) is True
    assert sink.write({"a": "1"}) is False
    assert (tmp_path / "features.d" / "gpu-topology-agent").read_text() == "a=1\n"
    assert sink.write({"a": "2"}) is True
    assert (tmp_path / "features.d" / "gpu-topology-agent").read_text() == "a=2\n"


def test_feature_file_leaves_no_temporary_files_and_is_world_readable(tmp_path):
    sink = FeatureFileSink(str(tmp_path))
    sink.write({"a": "1"})
    assert os.listdir(tmp_path) == ["gpu-topology-agent"]
    mode = stat.S_IMODE(os.stat(tmp_path / "gpu-topology-agent").st_mode)
    assert mode == 0o644


def test_feature_file_deleted_by_someone_else_is_restored(tmp_path):
    sink = FeatureFileSink(str(tmp_path))
    sink.write({"a": "1"})
    os.unlink(tmp_path / "gpu-topology-agent")
    assert sink.write({"a": "1"}) is True
    assert (tmp_path / "gpu-topology-agent").exists()


def test_feature_file_is_removed_on_clean_shutdown_and_removal_is_idempotent(tmp_path):
    sink = FeatureFileSink(str(tmp_path), filename="gfd-topology")
    sink.write({"a": "1"})
    sink.remove()
    sink.remove()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ publisher
class Clocks:
    """The publisher's monotonic and wall clocks, moved by hand."""

    def __init__(self) -> None:
        self.mono, self.wall = 100.0, 1_700_000_000.0

    def tick(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def test_publisher_reasserts_a_deleted_file_after_the_interval_and_says_written_only_on_change(tmp_path, caplog):
    clocks, errors = Clocks(), []
    sink = FeatureFileSink(str(tmp_path))
    publisher = LabelPublisher(sink, count_error=lambda: errors.append(1),
                               clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall)
    config = Config(features_dir=str(tmp_path), label_interval_s=60)
    topology = pcie_pairs([H100] * 4)
    with caplog.at_level(logging.INFO, logger="agent.labels.publishing"):
        publisher.publish(topology, config)
        os.unlink(sink.path)
        clocks.tick(30)
        publisher.maintain()  # before the interval: nothing yet
        assert not os.path.exists(sink.path)
        clocks.tick(31)
        publisher.maintain()  # back, with a new timestamp only
    assert os.path.exists(sink.path) and publisher.ready() and errors == []
    said = [r.getMessage() for r in caplog.records if r.name == "agent.labels.publishing"]
    assert said == [f"labels written to {tmp_path}"]
    publisher.withdraw()
    assert os.listdir(tmp_path) == []


def test_publisher_counts_each_failed_write_and_is_not_ready_until_one_works(tmp_path, caplog):
    clocks, errors = Clocks(), []
    features = tmp_path / "features.d"
    features.write_text("a file where the directory should be\n")
    publisher = LabelPublisher(FeatureFileSink(str(features)), count_error=lambda: errors.append(1),
                               clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall)
    config = Config(features_dir=str(features), label_interval_s=5)
    with caplog.at_level(logging.ERROR, logger="agent.labels.publishing"):
        publisher.publish(pcie_pairs([H100] * 2), config)
        clocks.tick(5)
        publisher.maintain()
    assert errors == [1, 1] and not publisher.ready()
    said = [r.getMessage().split(":")[0] for r in caplog.records if r.name == "agent.labels.publishing"]
    assert said == [f"writing labels to {features} failed"], "said once, the retry counted"
    features.unlink()
    clocks.tick(5)
    publisher.maintain()
    assert publisher.ready() and errors == [1, 1] and (features / "gpu-topology-agent").exists()


def test_feature_file_name_must_be_a_plain_visible_name(tmp_path):
    for bad in ("", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            FeatureFileSink(str(tmp_path), filename=bad)


def test_nvlinks_beyond_a_gpus_port_count_are_recognised_as_nvswitch():
    # as read from a pasted `nvidia-smi topo -m` of an 8x H200 board: NV18 to every peer
    gpus = [Gpu(i, f"GPU-{i}", "NVIDIA H200") for i in range(8)]
    links = [Link(a, b, nvlinks=18) for a in range(8) for b in range(a + 1, 8)]
    assert nvlink_fabric_kind(Topology.build(gpus, links)) == "nvswitch"
    # a DGX-1 hybrid cube mesh: at most 6 links per V100
    v100 = [Gpu(i, f"GPU-{i}", "Tesla V100-SXM2-16GB") for i in range(4)]
    mesh = [Link(0, 1, 1), Link(0, 2, 1), Link(0, 3, 2), Link(1, 2, 2), Link(1, 3, 1),
            Link(2, 3, 1)]
    assert nvlink_fabric_kind(Topology.build(v100, mesh)) == "mesh"


def test_mig_capable_comes_from_nvml_when_the_topology_records_it():
    from dataclasses import replace as dc_replace

    from agent.discovery import load_topology

    h100 = load_topology("dgx-h100")  # the name alone says MIG-capable
    said_no = dc_replace(h100, gpus=tuple(dc_replace(g, mig_capable=False) for g in h100.gpus))
    assert compute_labels(h100, Config())["nvidia.com/mig.capable"] == "true"
    assert compute_labels(said_no, Config())["nvidia.com/mig.capable"] == "false"


def test_gpu_mode_follows_the_pci_class_when_sysfs_gave_it():
    from dataclasses import replace as dc_replace

    from agent.discovery import load_topology

    topo = load_topology("pcie-4gpu")
    vga = dc_replace(topo, gpus=tuple(dc_replace(g, pci_class=0x030000) for g in topo.gpus))
    mixed = dc_replace(vga, gpus=(dc_replace(vga.gpus[0], pci_class=0x030200),) + vga.gpus[1:])
    assert all(g.pci_class == 0x030200 for g in topo.gpus)  # read from the fake sysfs tree
    assert compute_labels(topo, Config())["nvidia.com/gpu.mode"] == "compute"
    assert compute_labels(vga, Config())["nvidia.com/gpu.mode"] == "graphics"
    assert compute_labels(mixed, Config())["nvidia.com/gpu.mode"] == "compute"
