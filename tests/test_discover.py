"""``gpu-topology-agent discover``: the table and the DESIGN.md JSON contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import cli
from agent.discovery import load_topology
from agent.hw.sim.machines import BUILTIN_MACHINES
from agent.render import render_table

TOPO = Path(__file__).parent / "fixtures" / "topo"
LEVELS = {"BOARD", "PIX", "PXB", "PHB", "NODE", "SYS", None}


def discover(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["discover", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("machine", BUILTIN_MACHINES)
def test_json_follows_the_design_contract_on_every_built_in_machine(machine, capsys):
    rc, out, err = discover(capsys, "--simulate", machine, "--format", "json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    topo = load_topology(machine)
    assert [g["index"] for g in doc["gpus"]] == list(range(topo.gpu_count))
    for g, gpu in zip(doc["gpus"], topo.gpus):
        assert {"index", "uuid", "name", "pci_bus_id", "numa_node"} <= set(g)
        assert g["uuid"] == gpu.uuid and g["numa_node"] == gpu.numa_node
        assert g["numa_node"] is None or isinstance(g["numa_node"], int)
    n = topo.gpu_count
    assert len(doc["links"]) == n * (n - 1) // 2
    for link in doc["links"]:
        assert link["a"] < link["b"] and link["pcie"] in LEVELS
        assert link["nvlinks"] == topo.link(link["a"], link["b"]).nvlinks
    assert doc["nvlink_islands"] == [list(i) for i in topo.nvlink_islands]
    assert doc["nvlink_cliques"] == [list(c) for c in topo.nvlink_cliques]
    assert [nic["name"] for nic in doc["nics"]] == [nic.name for nic in topo.nics]


def test_table_shows_matrix_islands_cliques_numa_groups_and_nics(capsys):
    rc, out, _ = discover(capsys, "--simulate", "dgx1-v100")
    assert rc == 0
    lines = out.splitlines()
    gpu0 = next(line for line in lines if line.startswith("GPU0 "))
    assert gpu0.split()[1:5] == ["X", "NV1", "NV1", "NV2"]
    assert "NVLink islands: {0,1,2,3,4,5,6,7}" in out
    assert "NVLink cliques:" in out and "{0,1,2,3}" in out
    assert "NUMA groups:" in out and "NICs:" in out


def test_a_pasted_matrix_is_discovered_and_says_what_was_inferred(capsys):
    rc, out, _ = discover(capsys, "--simulate", str(TOPO / "dgx1-v100-8gpu-4nic.txt"))
    assert rc == 0
    assert "inferred NODE" in out


@pytest.mark.parametrize("machine", BUILTIN_MACHINES)
def test_narrow_table_fits_100_columns(machine):
    table = render_table(load_topology(machine), max_columns=100)
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "NVLink islands:" in table


def test_simulate_list_names_every_built_in_machine(capsys):
    rc, out, _ = discover(capsys, "--simulate", "list")
    assert rc == 0 and out.split() == list(BUILTIN_MACHINES)


def test_unknown_machine_and_bad_format_are_usage_errors(capsys):
    rc, out, err = discover(capsys, "--simulate", "nope")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exc:
        cli.main(["discover", "--format", "xml"])
    assert exc.value.code == 2


def test_without_simulate_and_without_a_driver_the_error_is_one_clear_line(capsys):
    rc, out, err = discover(capsys)
    assert rc == 1 and out == ""
    assert "NVML is not available" in err and "Traceback" not in err


# ------------------------------------------------------------------ one path from any input
MATRIX_FILES = sorted(str(p) for p in TOPO.glob("*.txt"))


def daemon_topology(machine: str):
    """The topology ``run --simulate MACHINE`` serves: the daemon's own backend and reader."""
    from agent.config import Config
    from agent.daemon import Daemon

    daemon = Daemon.from_config(Config(), simulate=machine)
    daemon.backend.init()
    try:
        return daemon._read_topology()
    finally:
        daemon.backend.shutdown()
        daemon._on_close()


@pytest.mark.parametrize("machine", [*BUILTIN_MACHINES, *MATRIX_FILES], ids=lambda m: Path(m).name)
def test_discover_shows_the_topology_run_serves_for_every_input(machine, capsys):
    from agent.render import topology_to_json

    rc, out, _ = discover(capsys, "--simulate", machine, "--format", "json")
    assert rc == 0
    assert json.loads(out) == json.loads(json.dumps(topology_to_json(daemon_topology(machine))))


@pytest.mark.parametrize("machine", [*BUILTIN_MACHINES, *MATRIX_FILES], ids=lambda m: Path(m).name)
def test_labels_prints_what_the_running_agent_writes_for_every_input(machine, capsys):
    from agent.config import Config
    from agent.labels import compute_labels, format_labels

    assert cli.main(["labels", "--simulate", machine, "--no-timestamp"]) == 0
    out, _ = capsys.readouterr()
    assert out == format_labels(compute_labels(daemon_topology(machine), Config()))


@pytest.mark.parametrize("machine", MATRIX_FILES, ids=lambda m: Path(m).name)
def test_a_matrix_states_no_model_driver_or_mig_capability_and_labels_leave_them_out(machine):
    from agent.config import Config
    from agent.labels import compute_labels

    topo = load_topology(machine)
    labels = compute_labels(topo, Config())
    for key in ("nvidia.com/mig.capable", "nvidia.com/cuda.driver-version.full",
                "nvidia.com/gpu.family", "nvidia.com/gpu.compute.major", "nvidia.com/gpu.memory",
                "topology.gpu-agent.io/gpu-models"):
        assert key not in labels, key
    if any(g.numa_node is None for g in topo.gpus):
        assert "topology.gpu-agent.io/numa-nodes" not in labels
        assert None in topo.numa_groups
