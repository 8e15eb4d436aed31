"""``gpu-topology-agent allocate``: output contract, lists of indices/UUIDs, errors.

Machines come from the real ``nvidia-smi topo -m`` fixtures in ``tests/fixtures/topo/`` (read
by ``agent.hw.topo_matrix``), patched in where the command loads its topology, so these tests
exercise the command itself.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

from agent import cli
from agent.commands import allocate
from agent.discovery import load_topology as read_topo_matrix  # the one path

pytestmark = pytest.mark.usefixtures("impl")  # every test on both engines (conftest.py)

TOPO = Path(__file__).parent / "fixtures" / "topo"


@pytest.fixture
def machine(monkeypatch):
    """Make ``--simulate NAME`` read ``tests/fixtures/topo/NAME.txt``; records the names asked."""
    asked: list[object] = []

    def fake_load(simulate):
        asked.append(simulate)
        return read_topo_matrix(str(TOPO / f"{simulate}.txt"))

    monkeypatch.setattr(allocate, "load_topology", fake_load)
    return asked


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["allocate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_follows_the_design_contract(machine, capsys):
    rc, out, err = run(
        capsys, "--size", "2", "--simulate", "h200-8gpu-8nic-epyc9534", "--format", "json"
    )
    assert rc == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"devices", "indices", "score"}
    topo = read_topo_matrix(str(TOPO / "h200-8gpu-8nic-epyc9534.txt"))
    assert doc["indices"] == [0, 1]
    assert doc["devices"] == [topo.gpus[0].uuid, topo.gpus[1].uuid]
    assert doc["score"] == topo.set_score([0, 1])


def test_available_and_must_include_accept_indices_and_uuids(machine, capsys):
    topo = read_topo_matrix(str(TOPO / "dgx1-v100-8gpu-4nic.txt"))
    uuid5 = topo.gpus[5].uuid
    rc, out, _ = run(
        capsys,
        "--size",
        "2",
        "--simulate",
        "dgx1-v100-8gpu-4nic",
        "--format",
        "json",
        "--available",
        f"0,1,2,3,{uuid5}",
        "--must-include",
        uuid5,
    )
    assert rc == 0
    doc = json.loads(out)
    assert 5 in doc["indices"] and len(doc["indices"]) == 2
    assert set(doc["indices"]) <= {0, 1, 2, 3, 5}


def test_without_simulate_the_command_asks_this_node_through_nvml(machine, capsys, monkeypatch):
    monkeypatch.setattr(
        allocate,
        "load_topology",
        lambda simulate: (
            machine.append(simulate) or read_topo_matrix(str(TOPO / "h200-8gpu-8nic-epyc9534.txt"))
        ),
    )
    rc, _, _ = run(capsys, "--size", "1")
    assert rc == 0 and machine == [None]


def test_without_simulate_and_without_a_driver_the_error_is_one_clear_line(capsys):
    rc, out, err = run(capsys, "--size", "1")
    assert rc == 1 and out == ""
    assert "NVML is not available" in err and len(err.strip().splitlines()) == 1


def test_explain_table_shows_winner_runners_up_and_separating_criterion(machine, capsys):
    rc, out, _ = run(capsys, "--size", "4", "--simulate", "h200-8gpu-8nic-epyc9534", "--explain", "--wide")
    assert rc == 0
    assert "indices   [0, 1, 2, 3]" in out
    assert "chosen [0, 1, 2, 3]" in out
    assert "runner-up [4, 5, 6, 7]" in out and "lost on lowest indices" in out
    # a cross-socket quad is a runner-up that loses on NUMA nodes (same NVSwitch score)
    assert "lost on" in out and "best possible for 4 GPUs" in out


def test_explain_json_adds_the_explanation(machine, capsys):
    rc, out, _ = run(
        capsys,
        "--size",
        "2",
        "--simulate",
        "l40s-4gpu-2socket-2nic",
        "--format",
        "json",
        "--explain",
    )
    doc = json.loads(out)
    assert rc == 0 and doc["explanation"]["chosen"]["indices"] == doc["indices"]
    assert doc["explanation"]["exact"] is True
    assert all("lost_on" in r for r in doc["explanation"]["runners_up"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "9"], "size 9 is more than the 8 available devices"),
        (["--size", "0"], "size must be at least 1, got 0"),
        (
            ["--size", "2", "--available", "0,12"],
            "--available: 12 is not a GPU of this machine: expected GPU indices 0-7 or GPU UUIDs",
        ),
        (["--size", "2", "--available", "0,,1"], "--available: empty item in *"),
        # the device plugin's own messages (tests/test_deviceplugin.py: one per mistake)
        (["--size", "2", "--must-include", "GPU-nope"],
         "must-include: unknown device ID 'GPU-nope' for resource nvidia.com/gpu"),
        (
            ["--size", "1", "--available", "0,1", "--must-include", "3"],
            "must-include: device ID 'GPU-*' is not in the available list",
        ),
        # a list gives each device once, as slices --in-use does (tests/test_dra_gpusets.py)
        (["--size", "1", "--available", "1,1"], "available: device ID 'GPU-*' given twice"),
    ],
)
def test_bad_requests_exit_2_with_one_line(machine, capsys, argv, message):
    rc, out, err = run(capsys, *argv, "--simulate", "dgx1-v100-8gpu-4nic")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gpu-topology-agent allocate: error:")
    assert fnmatch.fnmatchcase(err.strip(), f"*: {message}"), err


def test_size_flag_is_required_without_a_mig_profile(capsys):
    assert cli.main(["allocate"]) == 2
    assert capsys.readouterr().err.strip().endswith("--size K is required (or --mig-profile PROFILE)")


def test_simulated_dgx_h100_end_to_end_gives_one_numa_node_for_four_gpus(capsys):
    from agent.discovery import load_topology

    rc, out, err = run(capsys, "--size", "4", "--simulate", "dgx-h100", "--format", "json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    topo = load_topology("dgx-h100")
    assert len(doc["indices"]) == 4
    assert len({topo.gpus[i].numa_node for i in doc["indices"]}) == 1
    assert doc["devices"] == [topo.gpus[i].uuid for i in doc["indices"]]


def test_unknown_machine_is_a_usage_error(capsys):
    rc, out, err = run(capsys, "--size", "1", "--simulate", "no-such-machine")
    assert rc == 2 and out == "" and "no-such-machine" in err
