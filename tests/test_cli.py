"""The CLI a platform engineer expects (issue 11, section 4): help lines with defaults,
output that fits 100 columns, ``labels --format json`` and GFD's timestamp label,
``gpu-nic-same-switch`` on the DGX machines, and ``allocate`` giving what the running
plugin's GetPreferredAllocation gives for the same node and configuration."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import cli
from agent.config import Config, TimeSlicingResource, load_config
from agent.deviceplugin.allocation import RequestHandler
from agent.deviceplugin.resources import build_resources
from agent.discovery import load_topology
from agent.hw.sim.machines import BUILTIN_MACHINES
from agent.labels import compute_labels
from agent.labels.gfd import TIMESTAMP_LABEL

#: Each command module's subcommand is named like the module.
SUBCOMMANDS = tuple(m.__name__.rpartition(".")[2] for m in cli.COMMAND_MODULES)

TOPO = Path(__file__).parent / "fixtures" / "topo"


def main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------ help
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_has_a_help_line():
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helped = {a.dest: a.help for a in action._choices_actions}
    assert set(helped) == set(SUBCOMMANDS)
    assert all(helped.values())


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_flag_has_a_help_line_with_its_default(command):
    parser = _subparsers()[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, action.option_strings
        assert "default" in action.help or (action.required and "required" in action.help), (
            command, action.option_strings, action.help,
        )


# ------------------------------------------------------------------ width
def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


@pytest.mark.parametrize("machine", BUILTIN_MACHINES)
def test_discover_fits_100_columns_and_wide_keeps_the_full_matrix(machine, capsys):
    rc, out, _ = main(capsys, "discover", "--simulate", machine)
    assert rc == 0 and _widest(out) <= 100, out
    rc, wide, _ = main(capsys, "discover", "--simulate", machine, "--wide")
    header = wide.splitlines()[2]  # the matrix's column heads
    assert ("--wide shows them" in out) == (len(header) > 100)
    if len(header) > 100:
        assert header not in out


@pytest.mark.parametrize("machine", BUILTIN_MACHINES)
def test_allocate_explain_fits_100_columns_on_every_built_in_machine(machine, capsys):
    topology = load_topology(machine)
    gpus = len(next(r for r in build_resources(topology, Config()) if r.name == "nvidia.com/gpu").devices)
    for size in sorted({1, min(2, gpus), gpus // 2 or 1, gpus}):
        rc, out, err = main(capsys, "allocate", "--simulate", machine, "--size", str(size), "--explain")
        assert rc == 0, err
        assert _widest(out) <= 100, out


# ------------------------------------------------------------------ labels
def test_labels_json_is_the_same_labels_as_the_text(capsys):
    rc, text, _ = main(capsys, "labels", "--simulate", "dgx-h100", "--no-timestamp")
    rc2, doc, _ = main(capsys, "labels", "--simulate", "dgx-h100", "--no-timestamp", "--format", "json")
    assert rc == rc2 == 0
    assert json.loads(doc) == dict(line.split("=", 1) for line in text.splitlines())


def test_labels_carry_gfds_timestamp_in_seconds_unless_turned_off(capsys, monkeypatch):
    before = int(time.time())
    _, out, _ = main(capsys, "labels", "--simulate", "single-gpu", "--format", "json")
    stamp = int(json.loads(out)[TIMESTAMP_LABEL])
    assert before <= stamp <= time.time()
    _, out, _ = main(capsys, "labels", "--simulate", "single-gpu", "--no-timestamp")
    assert "gfd.timestamp" not in out
    monkeypatch.setenv("GFD_NO_TIMESTAMP", "true")
    _, out, _ = main(capsys, "labels", "--simulate", "single-gpu")
    assert "gfd.timestamp" not in out


def test_the_config_files_gfd_no_timestamp_is_honoured(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nflags:\n  gfd:\n    noTimestamp: true\n    oneshot: false\n")
    config = load_config(str(path), {}, {})
    assert config.no_timestamp
    assert TIMESTAMP_LABEL not in compute_labels(load_topology("single-gpu"), config, 1.0)
    assert compute_labels(load_topology("single-gpu"), Config(), 1700000000.9)[TIMESTAMP_LABEL] == "1700000000"
    assert TIMESTAMP_LABEL not in compute_labels(load_topology("single-gpu"), Config())


@pytest.mark.parametrize("machine", ["dgx-a100", "dgx-h100"])
def test_dgx_gpus_see_their_rdma_nic_at_pxb_and_the_label_says_same_switch(machine):
    from agent.records import PcieLevel

    topology = load_topology(machine)
    for gpu in topology.gpus:
        levels = [nic.levels[gpu.index] for nic in topology.nics]
        assert PcieLevel.PXB in levels and PcieLevel.PIX not in levels, (gpu.index, levels)
    labels = compute_labels(topology, Config())
    assert labels["topology.gpu-agent.io/gpu-nic-same-switch"] == "true"


def test_a_nic_across_the_host_bridge_is_not_same_switch():
    # an H200 box where each GPU has a NIC at PIX, and a PCIe-only box with NICs at NODE/SYS
    assert compute_labels(load_topology(str(TOPO / "h200-8gpu-8nic-epyc9534.txt")), Config())[
        "topology.gpu-agent.io/gpu-nic-same-switch"] == "true"
    assert compute_labels(load_topology(str(TOPO / "l40s-4gpu-2socket-2nic.txt")), Config())[
        "topology.gpu-agent.io/gpu-nic-same-switch"] == "false"


@pytest.mark.parametrize("matrix", ["dgx1-v100-8gpu-4nic.txt", "gb200-4gpu-8nic.txt"])
def test_the_feature_file_of_a_running_agent_equals_labels_for_a_pasted_matrix(tmp_path, matrix):
    path = str(TOPO / matrix)
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--simulate", path, "--kubelet-dir", str(tmp_path / "k"),
         "--features-dir", str(tmp_path / "f"), "--metrics-address", "127.0.0.1:0",
         "--pod-resources-socket", str(tmp_path / "pr.sock"), "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    feature_file = tmp_path / "f" / "gpu-topology-agent"
    try:
        deadline = time.monotonic() + 60
        while not feature_file.exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        written = feature_file.read_text()
    finally:
        agent.terminate()
        agent.communicate(timeout=30)
    printed = subprocess.run(
        [sys.executable, "-m", "agent", "labels", "--simulate", path],
        capture_output=True, text=True, check=True,
    ).stdout

    def without_stamp(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(TIMESTAMP_LABEL + "=")]

    assert TIMESTAMP_LABEL + "=" in written and TIMESTAMP_LABEL + "=" in printed
    assert without_stamp(written) == without_stamp(printed)


# ------------------------------------------------------------------ allocate == the plugin
CASES = [
    # machine, config file text, allocate flags, resource
    ("a100-mig", "version: v1\nflags:\n  migStrategy: mixed\n", [], "nvidia.com/mig-1g.5gb"),
    ("a100-mig", "version: v1\nflags:\n  migStrategy: mixed\n", [], "nvidia.com/gpu"),
    ("dgx-a100", "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                 "      replicas: 4\n", [], "nvidia.com/gpu"),
    ("dgx-h100", "version: v1\nflags:\n  sharedDevicesAllocationPolicy: packed\nsharing:\n  timeSlicing:\n"
                 "    resources:\n    - name: nvidia.com/gpu\n      replicas: 3\n", [], "nvidia.com/gpu"),
    ("dgx-a100", "version: v1\n", ["--replicas", "2", "--shared-devices-allocation-policy", "packed"],
     "nvidia.com/gpu"),
    ("dgx1-v100", "version: v1\n", [], "nvidia.com/gpu"),
]


@pytest.mark.parametrize("machine,config_text,flags,resource_name", CASES)
def test_allocate_gives_what_the_plugins_get_preferred_allocation_gives(
    tmp_path, capsys, machine, config_text, flags, resource_name
):
    config_file = tmp_path / "config.yaml"
    config_file.write_text(config_text)
    topology = load_topology(machine)
    config = load_config(str(config_file), {}, {})
    if "--replicas" in flags:
        config = Config(time_slicing=(TimeSlicingResource(replicas=2),),
                        shared_devices_allocation_policy="packed")
    resource = next(r for r in build_resources(topology, config) if r.name == resource_name)
    handler = RequestHandler(resource, topology, config)
    ids = [d.id for d in resource.devices]
    rng = random.Random(f"{machine}{resource_name}{flags}")
    for _ in range(6):
        available = sorted(rng.sample(ids, rng.randint(1, len(ids))), key=ids.index)
        size = rng.randint(1, min(len(available), 4))
        must = rng.sample(available, rng.randint(0, min(size, 1)))
        expected = handler.preferred(available, must, size)
        argv = ["allocate", "--simulate", machine, "--config", str(config_file), *flags,
                "--resource", resource_name, "--size", str(size), "--format", "json",
                "--available", ",".join(available)]
        if must:
            argv += ["--must-include", ",".join(must)]
        rc, out, err = main(capsys, *argv)
        assert rc == 0, err
        assert json.loads(out)["devices"] == expected


def test_allocate_on_a_served_resource_rejects_gpus_the_resource_lacks(capsys):
    rc, _, err = main(capsys, "allocate", "--simulate", "a100-mig", "--mig-strategy", "mixed",
                      "--size", "1", "--available", "0")
    assert rc == 2 and "GPU 0 has no nvidia.com/gpu device" in err


def test_allocate_names_the_resources_when_the_name_is_unknown(capsys):
    rc, _, err = main(capsys, "allocate", "--simulate", "a100-mig", "--mig-strategy", "mixed",
                      "--size", "1", "--resource", "nvidia.com/mig-7g.80gb")
    assert rc == 2 and "nvidia.com/mig-1g.5gb" in err


def test_every_subcommand_runs_with_its_own_help(capsys):
    for command in itertools.chain(SUBCOMMANDS):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert _widest(out) <= 100 or os.environ.get("COLUMNS")
