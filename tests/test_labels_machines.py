"""Labels of whole machines: every built-in simulated machine against its expected
dictionary, real pasted ``nvidia-smi topo -m`` outputs, and the ``labels`` subcommand."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from label_rules import is_valid_label_key

from agent import discovery
from agent.cli import main
from agent.config import Config
from agent.discovery import load_topology as read_topo_matrix  # the one path
from agent.hw.sim import machines
from agent.labels import compute_labels, format_labels
from agent.labels.gfd import is_valid_label_value
from agent.labels.topology_labels import TOPOLOGY_PREFIX

FIXTURES = Path(__file__).parent / "fixtures" / "labels"
TOPO = FIXTURES / "topo"


def read_expected(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def ours(labels: dict[str, str]) -> dict[str, str]:
    return {k[len(TOPOLOGY_PREFIX):]: v for k, v in labels.items() if k.startswith(TOPOLOGY_PREFIX)}


# ------------------------------------------------------------------ pasted topology matrices
@pytest.mark.parametrize(
    "filename, fabric, largest_clique, largest_island, numa_nodes, nics, nic_on_switch",
    [
        ("h200-8gpu-8nic-epyc9534.txt", "nvswitch", "8", "8", "2", "8", "true"),
        ("dgx1-v100-8gpu-4nic.txt", "mesh", "4", "8", None, "4", "true"),  # no NUMA column
        ("a100-80gb-pcie-4gpu-nv12-bridge-pairs-4numa-vm.txt", "bridge", "2", "2", "4", "0",
         "false"),
        ("l40s-4gpu-2socket-2nic.txt", "none", "0", "0", "2", "2", "false"),
        ("gb200-4gpu-8nic.txt", "nvswitch", "4", "4", "2", "8", "false"),
    ],
)
def test_topology_labels_of_real_pasted_matrices(filename, fabric, largest_clique,
                                                 largest_island, numa_nodes, nics, nic_on_switch):
    labels = compute_labels(read_topo_matrix(str(TOPO / filename)), Config())
    got = ours(labels)
    assert got["nvlink-fabric"] == fabric
    assert got["nvlink-largest-clique"] == largest_clique
    assert got["nvlink-largest-island"] == largest_island
    assert got.get("numa-nodes") == numa_nodes  # left out where the matrix has no NUMA data
    assert got["rdma-nics"] == nics
    assert got["gpu-nic-same-switch"] == nic_on_switch
    # a matrix names no model: no product, GFD's "unknown" mode, nothing empty or invalid
    assert "nvidia.com/gpu.product" not in labels
    assert labels["nvidia.com/gpu.mode"] == "unknown"
    for key, value in labels.items():
        assert is_valid_label_key(key) and is_valid_label_value(value) and value, (key, value)


# ------------------------------------------------------------------ built-in machines
BUILTIN = machines.BUILTIN_MACHINES


@functools.cache
def topology(name: str):
    """Built-in machine topologies, read once per test session (they are immutable)."""
    return discovery.load_topology(name)


def test_every_built_in_machine_has_an_expected_label_file():
    missing = [m for m in BUILTIN if not (FIXTURES / f"{m}.txt").exists()]
    assert missing == []


@pytest.mark.parametrize("name", BUILTIN or ["none"])
def test_built_in_machine_labels_match_the_expected_dictionary(name):
    labels = compute_labels(topology(name), Config())
    assert labels == read_expected(FIXTURES / f"{name}.txt")
    for key, value in labels.items():
        assert is_valid_label_key(key) and is_valid_label_value(value) and value, (key, value)


def test_mig_mixed_strategy_on_the_mig_machine_labels_each_profile():
    labels = compute_labels(topology("a100-mig"), Config(mig_strategy="mixed"))
    counts = {k.split("/")[1][len("mig-"):-len(".count")]: v for k, v in labels.items()
              if k.startswith("nvidia.com/mig-") and k.endswith(".count")}
    assert counts == {"1g.5gb": "9", "2g.10gb": "1", "3g.20gb": "2", "4g.20gb": "1"}
    assert labels["nvidia.com/mig-3g.20gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb"
    assert labels["nvidia.com/mig-3g.20gb.slices.gi"] == "3"
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/gpu.count"] == "4"


def test_mig_single_strategy_on_mixed_profiles_is_labelled_invalid():
    labels = compute_labels(topology("a100-mig"), Config(mig_strategy="single"))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-INVALID"
    assert labels["nvidia.com/gpu.count"] == "0"


# ------------------------------------------------------------------ the subcommand
def test_labels_command_prints_sorted_key_value_lines_of_a_simulated_machine(capsys):
    assert main(["labels", "--simulate", "dgx-h100", "--no-timestamp"]) == 0
    out = capsys.readouterr().out
    expected = compute_labels(topology("dgx-h100"), Config())
    assert out == format_labels(expected)
    assert out.splitlines() == sorted(out.splitlines())


def test_labels_command_without_simulate_reads_nvml_and_says_clearly_when_it_is_missing(capsys):
    # these machines have no NVIDIA driver: the command must fail with one clear line
    assert main(["labels"]) == 1
    err = capsys.readouterr().err
    assert "NVML is not available" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_labels_command_reads_a_pasted_topology_matrix(capsys):
    assert main(["labels", "--simulate", str(TOPO / "h200-8gpu-8nic-epyc9534.txt")]) == 0
    out = capsys.readouterr().out
    assert "topology.gpu-agent.io/nvlink-fabric=nvswitch\n" in out


def test_labels_command_with_a_config_file_applies_time_slicing(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(
        "version: v1\n"
        "sharing:\n"
        "  timeSlicing:\n"
        "    resources:\n"
        "      - name: nvidia.com/gpu\n"
        "        replicas: 4\n"
    )
    matrix = str(TOPO / "l40s-4gpu-2socket-2nic.txt")
    assert main(["labels", "--simulate", matrix, "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "nvidia.com/gpu.replicas=4\n" in out
    assert "nvidia.com/gpu.sharing-strategy=time-slicing\n" in out


def test_labels_command_rejects_an_unknown_machine_with_one_line(capsys):
    assert main(["labels", "--simulate", "no-such-machine-xyz"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err


def test_labels_command_rejects_a_broken_config_file_with_one_line(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags: {migStrategy: sometimes}\n")
    matrix = str(TOPO / "l40s-4gpu-2socket-2nic.txt")
    assert main(["labels", "--simulate", matrix, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "migStrategy" in err
