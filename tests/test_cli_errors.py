"""Nothing a user types ends in a traceback, and nothing fails silently (issue 11, section 3).

Each bad input gives one line on stderr naming the flag or file, the value and what was
expected, and exit 2 (1 for a runtime failure such as a directory that cannot be written).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent import cli

TOPO = Path(__file__).parent / "fixtures" / "topo"
ENV = {**os.environ, "PYTHONWARNINGS": "error"}


def main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_cli(*argv: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "agent", *argv],
        input=stdin, capture_output=True, timeout=timeout, env=ENV, check=False,
    )
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")
    )


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def big_matrix(n: int) -> str:
    head = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\tCPU Affinity\tNUMA Affinity"
    rows = [
        f"GPU{i}\t" + "\t".join(" X " if i == j else "NV2" for j in range(n)) + "\t0-7\t0"
        for i in range(n)
    ]
    return "\n".join([head, *rows]) + "\n"


# ------------------------------------------------------------------ files that are not UTF-8
LATIN1_SPEC = b"name: caf\xe9\ngpus: []\n"
UTF16_SPEC = "name: x\n".encode("utf-16")
UTF16_MATRIX = (TOPO / "dgx1-v100-8gpu-4nic.txt").read_text(encoding="utf-8").encode("utf-16")
LATIN1_MATRIX = (TOPO / "dgx1-v100-8gpu-4nic.txt").read_bytes() + b"# caf\xe9\n"


@pytest.mark.parametrize(
    "content", [LATIN1_SPEC, UTF16_SPEC, UTF16_MATRIX, LATIN1_MATRIX],
    ids=["latin1-spec", "utf16-spec", "utf16-matrix", "latin1-matrix"],
)
@pytest.mark.parametrize("command", ["discover", "labels", "allocate", "demo"])
def test_a_simulate_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys, content, command):
    path = tmp_path / "machine.txt"
    path.write_bytes(content)
    extra = ["--size", "1"] if command == "allocate" else []
    rc, _, err = main(capsys, command, "--simulate", str(path), *extra)
    line = one_error_line(err)
    assert rc == 2
    assert str(path) in line and "UTF-8" in line


@pytest.mark.parametrize("content", [b"version: v1\nflags:\n  migStrategy: \"n\xe9\"\n", "version: v1\n".encode("utf-16")])
def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys, content):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    rc, _, err = main(capsys, "labels", "--simulate", "single-gpu", "--config", str(path))
    line = one_error_line(err)
    assert rc == 2 and str(path) in line and "not UTF-8" in line
    proc = run_cli("run", "--simulate", "single-gpu", "--config", str(path),
                   "--kubelet-dir", str(tmp_path / "k"), "--features-dir", str(tmp_path / "f"))
    assert proc.returncode == 2 and str(path) in one_error_line(proc.stderr)


def test_stdin_that_is_not_utf8_names_standard_input():
    proc = run_cli("discover", "--simulate", "-", stdin=UTF16_MATRIX)
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2
    assert "standard input is not UTF-8" in line and "UTF-16" in line


# ------------------------------------------------------------------ more GPUs than the engine
def test_a_pasted_matrix_with_65_gpus_says_the_limit(tmp_path, capsys):
    path = tmp_path / "big.txt"
    path.write_text(big_matrix(65))
    rc, _, err = main(capsys, "discover", "--simulate", str(path))
    line = one_error_line(err)
    assert rc == 2 and str(path) in line and "65 GPUs" in line and "at most 64" in line


# ------------------------------------------------------------------ --simulate "" and -
@pytest.mark.parametrize("command", ["discover", "labels", "allocate", "demo", "run"])
def test_an_empty_simulate_is_rejected_not_taken_for_nvml(capsys, command):
    extra = ["--size", "1"] if command == "allocate" else []
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--simulate", "", *extra])
    line = one_error_line(capsys.readouterr().err)
    assert exc.value.code == 2
    assert "--simulate" in line and "empty" in line and "NVML" not in line


def test_simulate_dash_reads_a_pasted_matrix_from_standard_input():
    text = (TOPO / "h200-8gpu-8nic-epyc9534.txt").read_bytes()
    piped = run_cli("discover", "--simulate", "-", "--format", "json", stdin=text)
    from_file = run_cli("discover", "--simulate", str(TOPO / "h200-8gpu-8nic-epyc9534.txt"), "--format", "json")
    assert piped.returncode == 0, piped.stderr
    import json

    a, b = json.loads(piped.stdout), json.loads(from_file.stdout)
    text = piped.stdout
    for ga, gb in zip(a["gpus"], b["gpus"]):  # synthetic UUIDs derive from the source's name
        text = text.replace(ga["uuid"], gb["uuid"])
    a = json.loads(text)
    assert a.pop("source") == "simulated:stdin"
    b.pop("source")
    assert a == b


@pytest.mark.parametrize("command", ["labels", "allocate"])
def test_simulate_dash_reads_a_spec_for_every_one_shot_subcommand(command):
    from agent.hw.sim import machines

    spec = Path(machines._SPECS, "pcie-4gpu.yaml").read_bytes()
    extra = ["--size", "2", "--format", "json"] if command == "allocate" else []
    piped = run_cli(command, "--simulate", "-", *extra, stdin=spec)
    named = run_cli(command, "--simulate", "pcie-4gpu", *extra)
    assert piped.returncode == 0, piped.stderr
    strip = [line for line in piped.stdout.splitlines() if "gfd.timestamp" not in line]
    assert strip == [line for line in named.stdout.splitlines() if "gfd.timestamp" not in line]


def test_empty_standard_input_is_one_line():
    proc = run_cli("discover", "--simulate", "-", stdin=b"")
    assert proc.returncode == 2 and "standard input is empty" in one_error_line(proc.stderr)


def test_a_bad_matrix_on_standard_input_is_named_stdin_not_a_temp_file():
    proc = run_cli("discover", "--simulate", "-", stdin=b"\tGPU0\tGPU1\nGPU0\t X \tQQ\n")
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2 and "<stdin>: line 2" in line and tempfile.gettempdir() not in line


def test_run_reads_standard_input_once_at_start(tmp_path):
    spec = (TOPO / "dgx1-v100-8gpu-4nic.txt").read_bytes()
    (tmp_path / "matrix").write_bytes(spec)
    with open(tmp_path / "matrix", "rb") as stdin:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--simulate", "-", "--kubelet-dir", str(tmp_path / "k"),
             "--features-dir", str(tmp_path / "f"), "--metrics-address", "127.0.0.1:0",
             "--pod-resources-socket", str(tmp_path / "pr.sock")],
            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
        )
    (tmp_path / "matrix").unlink()  # read once at start: the agent no longer needs it
    label_file = tmp_path / "f" / "gpu-topology-agent"
    try:
        for _ in range(300):
            if label_file.exists() and "gpu-count=8" in label_file.read_text():
                break
            if proc.poll() is not None:
                break
            import time

            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1]
        assert "topology.gpu-agent.io/gpu-count=8" in label_file.read_text()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


# ------------------------------------------------------------------ run: directories
def _run_agent(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    base = ["run", "--simulate", "single-gpu", "--metrics-address", "127.0.0.1:0", "--log-level", "ERROR",
            "--pod-resources-socket", str(tmp_path / "pr.sock")]
    if "--kubelet-dir" not in argv:
        base += ["--kubelet-dir", str(tmp_path / "k")]
    if "--features-dir" not in argv:
        base += ["--features-dir", str(tmp_path / "f")]
    return run_cli(*base, *argv, timeout=30)


@pytest.mark.parametrize("flag", ["--kubelet-dir", "--features-dir"])
def test_a_directory_flag_naming_a_file_fails_at_start(tmp_path, flag):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for value in (a_file, a_file / "below"):
        proc = _run_agent(tmp_path, flag, str(value))
        line = one_error_line(proc.stderr)
        assert proc.returncode == 2
        assert flag in line and str(value) in line and "is not a directory" in line


def _unwritable_dir() -> str:
    """A directory nobody can create files in, even root (procfs)."""
    try:
        fd, probe = tempfile.mkstemp(dir="/proc")
    except OSError:
        return "/proc"
    os.close(fd)
    os.unlink(probe)
    pytest.skip("/proc is writable here")


@pytest.mark.parametrize("flag", ["--kubelet-dir", "--features-dir"])
def test_a_directory_that_cannot_be_written_fails_at_start(tmp_path, flag):
    path = _unwritable_dir()
    proc = _run_agent(tmp_path, flag, path)
    line = one_error_line(proc.stderr)
    assert proc.returncode == 1
    assert flag in line and path in line and "cannot be written" in line


def test_a_features_dir_that_cannot_be_created_fails_at_start(tmp_path):
    path = os.path.join(_unwritable_dir(), "features.d")
    proc = _run_agent(tmp_path, "--features-dir", path)
    line = one_error_line(proc.stderr)
    assert proc.returncode == 1 and "--features-dir" in line and path in line


def test_a_missing_kubelet_dir_is_not_an_error(tmp_path):
    from agent.commands.run import check_directories
    from agent.config import load_config

    args = cli.build_parser().parse_args(["run", "--kubelet-dir", str(tmp_path / "not-yet" / "dp"),
                                          "--features-dir", str(tmp_path / "f")])
    config = load_config(None, {}, {"kubelet_dir": args.kubelet_dir, "features_dir": args.features_dir})
    check_directories(config, args)
    assert not (tmp_path / "not-yet").exists()  # the kubelet creates it; we wait
    assert (tmp_path / "f").is_dir()


# ------------------------------------------------------------------ config devices
@pytest.mark.parametrize("device", ["99", "GPU-00000000-0000-0000-0000-000000000000"])
def test_time_slicing_devices_naming_no_device_of_the_node_fail_at_start(tmp_path, device):
    config = tmp_path / "config.yaml"
    config.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
        f"      replicas: 2\n      devices: [0, \"{device}\"]\n"
    )
    proc = _run_agent(tmp_path, "--config", str(config))
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2
    assert str(config) in line and repr(device) in line and "resources[0].devices" in line


# ------------------------------------------------------------------ allocate lists
@pytest.mark.parametrize("flag", ["--available", "--must-include"])
def test_a_negative_index_in_a_list_says_it_is_no_gpu(capsys, flag):
    rc, _, err = main(capsys, "allocate", "--simulate", "dgx-a100", "--size", "1", flag, "-1,0")
    line = one_error_line(err)
    assert rc == 2
    assert line.endswith(f"{flag}: -1 is not a GPU of this machine: expected GPU indices 0-7 or GPU UUIDs")


def test_a_list_flag_without_a_value_still_says_so(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["allocate", "--simulate", "dgx-a100", "--available", "--size", "1"])
    assert exc.value.code == 2
    assert "--available: expected one argument" in one_error_line(capsys.readouterr().err)


def test_stdin_reader_accepts_a_text_stream(monkeypatch):
    from agent.commands import _common

    monkeypatch.setattr(sys, "stdin", io.StringIO((TOPO / "dgx1-v100-8gpu-4nic.txt").read_text()))
    path = _common.simulate_value("-")
    assert Path(path).read_text() == (TOPO / "dgx1-v100-8gpu-4nic.txt").read_text()
