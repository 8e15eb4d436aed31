"""MPS across the agent: what NVML says decides where MPS can run (the fake pynvml answers
``nvmlDeviceGetComputeMode`` from the machine spec), GFD's MPS labels, the ``allocate`` and
``labels`` commands, and the agent (``run``) with an MPS configuration: registered through
the stand-in kubelet with the stand-in control program, stopped cleanly, or refused with
one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
from agent_run import reap
from test_deviceplugin_mps import MpsNode, standin_program

from agent import cli
from agent.config import Config, TimeSlicingResource
from agent.hw.sim.machines import SimulatedMachine
from agent.hw.sim.spec import machine_spec_from_dict
from agent.labels import compute_labels
from agent.topology.model import Topology
from tests.testbed.kubelet_stub import KubeletStub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPS4 = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"


def spec_file(tmp_path, gpus: list[dict], name: str = "mps-test") -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"name": name, "gpus": gpus}))
    return str(path)


def config_file(tmp_path, text: str = MPS4) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def cli_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------- NVML's word
@pytest.mark.parametrize("mode", ["Default", "Exclusive_Process", "Prohibited", "Exclusive_Thread"])
def test_the_compute_mode_nvml_reports_reaches_the_topology(mode):
    spec = machine_spec_from_dict({"name": "one", "gpus": [{"model": "NVIDIA A10", "bus_id": "0000:17:00.0",
                                                            "compute_mode": mode.lower()}]})
    with SimulatedMachine(spec) as machine:
        backend = machine.backend()
        backend.init()
        try:
            (gpu,) = Topology.from_facts(backend.read_facts()).gpus
        finally:
            backend.shutdown()
    assert gpu.compute_mode == mode


def test_a_compute_mode_the_spec_does_not_know_is_one_line():
    from agent.errors import InputFormatError

    with pytest.raises(InputFormatError, match=r"gpus\[0\].compute_mode: expected one of Default"):
        machine_spec_from_dict({"name": "x", "gpus": [{"bus_id": "0000:17:00.0", "compute_mode": "shared"}]})


# ---------------------------------------------------------------------- refusals
def test_mps_on_a_gpu_nvml_reports_prohibited_is_one_line_naming_the_gpu(tmp_path, capsys):
    machine = spec_file(tmp_path, [{"model": "NVIDIA A10", "bus_id": "0000:17:00.0"},
                                   {"model": "NVIDIA A10", "bus_id": "0000:18:00.0", "compute_mode": "Prohibited"}])
    rc, _, err = cli_main(capsys, "allocate", "--simulate", machine, "--config", config_file(tmp_path), "--size", "1")
    line = one_line(err)
    assert rc == 2 and "sharing.mps.resources[0]: GPU 1 cannot run MPS" in line and "Prohibited" in line
    # leaving that GPU out of the shared devices is the way out the message names
    ok = MPS4 + "      devices: [0]\n"
    rc, out, _ = cli_main(capsys, "allocate", "--simulate", machine, "--config", config_file(tmp_path, ok),
                          "--size", "1", "--resource", "nvidia.com/gpu", "--format", "json")
    assert rc == 0 and json.loads(out)["sharing"] == "mps"


def test_mps_on_gpus_in_mig_mode_is_one_line(tmp_path, capsys):
    machine = spec_file(tmp_path, [
        {"model": "NVIDIA A100-SXM4-40GB", "bus_id": f"0000:{b}:00.0", "mig": ["3g.20gb", "3g.20gb"]}
        for b in ("17", "18")
    ])
    rc, _, err = cli_main(capsys, "allocate", "--simulate", machine, "--config", config_file(tmp_path),
                          "--mig-strategy", "single", "--size", "1")
    assert rc == 2 and "MPS cannot share MIG devices: GPU 0 is in MIG mode" in one_line(err)


@pytest.mark.parametrize("cc, replicas, expected", [
    ([3, 0], 2, "compute capability 3.0, MPS needs 3.5 or newer"),
    ([6, 0], 17, "17 is more MPS clients than GPU 0's MPS server accepts (16 per GPU at compute capability 6.0)"),
    ([9, 0], 49, "49 is more MPS clients than GPU 0's MPS server accepts (48 per GPU at compute capability 9.0)"),
])
def test_mps_beyond_what_the_gpus_mps_server_takes_is_one_line(tmp_path, capsys, cc, replicas, expected):
    machine = spec_file(tmp_path, [{"model": "Some GPU", "memory_mib": 16384, "compute_capability": cc,
                                    "bus_id": "0000:17:00.0"}])
    rc, _, err = cli_main(capsys, "allocate", "--simulate", machine, "--config",
                          config_file(tmp_path, MPS4.replace("replicas: 4", f"replicas: {replicas}")), "--size", "1")
    assert rc == 2 and expected in one_line(err)


def test_the_documented_client_limits_are_accepted(tmp_path, capsys):
    machine = spec_file(tmp_path, [{"model": "Some GPU", "memory_mib": 16384, "compute_capability": [7, 0],
                                    "bus_id": "0000:17:00.0"}])
    rc, out, _ = cli_main(capsys, "allocate", "--simulate", machine, "--config",
                          config_file(tmp_path, MPS4.replace("replicas: 4", "replicas: 48")), "--size", "1",
                          "--format", "json")
    assert rc == 0 and json.loads(out)["mps"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "2"


# ---------------------------------------------------------------------- allocate and labels
def test_allocate_shows_an_mps_replica_and_what_its_container_gets(capsys):
    rc, out, _ = cli_main(capsys, "allocate", "--simulate", "dgx-h100", "--replicas", "4", "--sharing", "mps",
                          "--size", "1", "--format", "json")
    doc = json.loads(out)
    assert rc == 0 and doc["sharing"] == "mps" and doc["devices"][0].endswith("::0")
    assert doc["mps"] == {
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={81559 // 4}M",
    }
    rc, out, _ = cli_main(capsys, "allocate", "--simulate", "dgx-h100", "--replicas", "4", "--sharing", "mps",
                          "--size", "1")
    assert "(32 replica devices, shared through MPS)" in out and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in out
    rc, out, _ = cli_main(capsys, "allocate", "--simulate", "dgx-h100", "--replicas", "4", "--size", "1")
    assert "(32 replica devices, time-sliced)" in out and "CUDA_MPS" not in out


def test_allocate_refuses_what_mps_refuses(capsys):
    rc, _, err = cli_main(capsys, "allocate", "--simulate", "dgx-h100", "--replicas", "1", "--sharing", "mps",
                          "--size", "1")
    assert rc == 2 and "at least 2 with --sharing mps" in one_line(err)
    rc, _, err = cli_main(capsys, "allocate", "--simulate", "dgx-h100", "--replicas", "4", "--sharing", "mps",
                          "--size", "2")
    assert rc == 2 and "maximum request size for shared resources is 1" in one_line(err)
    rc, _, err = cli_main(capsys, "allocate", "--simulate", "dgx-h100", "--sharing", "mps", "--size", "1")
    assert rc == 2 and "give --replicas N too" in one_line(err)


def test_labels_command_writes_gfds_mps_labels(tmp_path, capsys):
    rc, out, _ = cli_main(capsys, "labels", "--simulate", "dgx-h100", "--config", config_file(tmp_path),
                          "--no-timestamp")
    labels = dict(line.split("=", 1) for line in out.splitlines())
    assert rc == 0
    assert labels["nvidia.com/gpu.sharing-strategy"] == "mps"
    assert labels["nvidia.com/gpu.replicas"] == "4"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
    assert labels["nvidia.com/mps.capable"] == "true"


def test_mps_capable_follows_the_config_and_what_the_gpus_allow(tmp_path):
    from tests.testbed.kubelet_stub import hgx8_topology

    mps = Config(mps=(TimeSlicingResource("nvidia.com/gpu", 2),))
    assert compute_labels(hgx8_topology(), Config())["nvidia.com/mps.capable"] == "false"
    assert compute_labels(hgx8_topology(), mps)["nvidia.com/mps.capable"] == "true"
    assert compute_labels(hgx8_topology(mig=True), mps)["nvidia.com/mps.capable"] == "false"
    t = hgx8_topology()
    prohibited = Topology.build([replace(g, compute_mode="Prohibited") if g.index == 3 else g for g in t.gpus],
                                t.links, numa_cpulists=t.numa_cpulists)
    assert compute_labels(prohibited, mps)["nvidia.com/mps.capable"] == "false"
    renamed = replace(mps, mps=(TimeSlicingResource("nvidia.com/gpu", 2, rename="gpu-mps"),))
    assert compute_labels(t, renamed)["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert compute_labels(t, renamed)["nvidia.com/gpu.sharing-strategy"] == "mps"


# ---------------------------------------------------------------------- the agent
@pytest.fixture
def mps_node():
    n = MpsNode()
    yield n
    n.stop()


def agent_process(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.Popen([sys.executable, "-m", "agent", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_agent_with_an_mps_config_registers_the_replicas_and_quits_the_daemon_on_sigterm(mps_node, tmp_path):
    kubelet = KubeletStub(mps_node.kubelet_dir).start()
    features = tmp_path / "features"
    proc = agent_process(
        "run", "--simulate", "dgx-h100", "--config", config_file(tmp_path), "--kubelet-dir", mps_node.kubelet_dir,
        "--features-dir", str(features), "--metrics-address", "127.0.0.1:0",
        "--pod-resources-socket", os.path.join(mps_node.base, "podres.sock"),
        "--mps-root", mps_node.mps_root, "--mps-control-binary", mps_node.program,
    )
    try:
        assert kubelet.wait_for(lambda: kubelet.registered("nvidia.com/gpu"), 20.0), "no registration"
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") is not None, 5.0)
        devices = kubelet.latest("nvidia.com/gpu").devices
        assert len(devices) == 32 and {d.health for d in devices} == {"Healthy"}
        assert "nvidia.com/gpu.sharing-strategy=mps" in (features / "gpu-topology-agent").read_text()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        reap(proc)
        kubelet.stop()
    assert proc.returncode == 0, stderr
    assert mps_node.commands()[-1] == "quit" and mps_node.daemon_pid() is None
    assert "MPS control daemon for nvidia.com/gpu answers" in stderr


@pytest.mark.parametrize("text, expected", [
    (MPS4 + "  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
     "timeSlicing and mps are exclusive"),
    (MPS4.replace("replicas: 4", "replicas: 1"), "sharing.mps.resources[0].replicas: expected an integer >= 2"),
    (MPS4.replace("nvidia.com/gpu", "nvidia.com/mig-1g.10gb"), "MPS cannot share MIG devices"),
])
def test_agent_refuses_a_bad_mps_config_with_one_line_and_exit_2(tmp_path, text, expected):
    path = config_file(tmp_path, text)
    proc = agent_process("run", "--config", path, "--kubelet-dir", str(tmp_path))
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 2
    line = one_line(stderr)
    assert path in line and expected in line


def test_agent_refuses_mps_on_mig_gpus_with_exit_2_and_one_error_line(mps_node, tmp_path):
    machine = spec_file(tmp_path, [
        {"model": "NVIDIA A100-SXM4-40GB", "bus_id": f"0000:{b}:00.0", "mig": ["3g.20gb", "3g.20gb"]}
        for b in ("17", "18")
    ])
    proc = agent_process(
        "run", "--simulate", machine, "--mig-strategy", "single", "--config", config_file(tmp_path),
        "--kubelet-dir", mps_node.kubelet_dir, "--features-dir", str(tmp_path / "f"),
        "--metrics-address", "127.0.0.1:0", "--mps-root", mps_node.mps_root,
        "--mps-control-binary", standin_program(str(tmp_path)),
    )
    _, stderr = proc.communicate(timeout=30)
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert "MPS cannot share MIG devices: GPU 0 is in MIG mode" in errors[0]
    assert mps_node.starts() == []  # refused before any daemon started
