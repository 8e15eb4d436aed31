"""The container image: the project's Dockerfile, unchanged, built by a real Docker engine and
run.

Its own tier (pytest marker ``image``, left out of the default run by ``addopts``):
``.venv/bin/python -m pytest -q -n 0 -m image tests/test_image.py``, which ``.ci/run`` runs. It
needs a Docker engine (Debian's ``docker.io``; the tier starts ``dockerd`` itself where it
is installed and not running, and stops it after) and, where the Dockerfile's base image
is not present, ``debootstrap`` to build a stand-in for it (tests/image_standin.py: no
image registry is reachable here). Everything skips, saying why, where no engine can start.

What is checked: the image builds; ``discover``, ``labels`` and ``demo`` run in it with the
same answers as on the host; it runs as user and group 10001 with no pip, setuptools or
wheel; its OCI labels; the DaemonSet's command (root, every capability dropped, read-only
root filesystem) registers with a stand-in kubelet, answers ``/ready`` and exits 0 on
SIGTERM. The image size is reported.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import image_standin
import pytest

pytestmark = [pytest.mark.image, pytest.mark.timeout(4000)]  # a build may take BUILD_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "gpu-topology-agent:image-test"
BUILD_TIMEOUT_S = 1800


def _docker(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _engine_answers() -> bool:
    try:
        return _docker("info", "--format", "{{.ServerVersion}}", timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A Docker engine: the running one, or a dockerd this fixture starts (and stops)."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client (Debian package docker.io)")
    if _engine_answers():
        yield
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker engine answers and none can be started (dockerd as root)")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log_path, "wb") as log:
        started = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _engine_answers():
            if started.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"dockerd did not start (see {log_path})")
            time.sleep(1)
        yield
    finally:
        started.terminate()
        started.wait(timeout=60)


@pytest.fixture(scope="session")
def base_image(engine: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Dockerfile's base image: present already (the real one, or a stand-in an earlier
    run built), else a stand-in built now."""
    if _docker("image", "inspect", image_standin.TAG).returncode == 0:
        return image_standin.TAG
    try:
        image_standin.build(image_standin.TAG, log=tmp_path_factory.mktemp("standin") / "build.log")
    except image_standin.StandInError as exc:
        pytest.skip(f"no {image_standin.TAG} and no stand-in can be built: {exc}")
    return image_standin.TAG


@pytest.fixture(scope="session")
def image(base_image: str, pytestconfig: pytest.Config) -> str:
    """The project's Dockerfile, unchanged, built (the classic builder: no BuildKit frontend
    image to pull)."""
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        done = subprocess.run(["docker", "build", "-t", IMAGE, str(ROOT)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, timeout=BUILD_TIMEOUT_S, check=False)
        log.seek(0)
        output = log.read()
    assert done.returncode == 0, f"docker build failed:\n{output[-6000:]}"
    size = int(_docker("image", "inspect", IMAGE, "--format", "{{.Size}}", check=True).stdout)
    base = int(_docker("image", "inspect", base_image, "--format", "{{.Size}}", check=True).stdout)
    venv = _exec_in(IMAGE, "du", "-sm", "/opt/venv").stdout.split()[0]
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nimage {IMAGE}: {size / 1e6:.0f} MB, of which the base "
                                f"{base_image} {base / 1e6:.0f} MB and /opt/venv {venv} MiB")
    return IMAGE


def _run_in(image: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``docker run`` of the image's entrypoint (the agent) with ``args``, no network."""
    return _docker("run", "--rm", "--network", "none", image, *args, timeout=timeout)


def _exec_in(image: str, program: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``program`` run in the image instead of its entrypoint."""
    return _docker("run", "--rm", "--network", "none", "--entrypoint", program, image, *args,
                   timeout=300)


def _host(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)


@pytest.mark.parametrize("args", [
    ("discover", "--simulate", "dgx-h100", "--format", "json"),
    ("labels", "--simulate", "dgx-h100", "--no-timestamp"),
    ("allocate", "--simulate", "dgx-h100", "--size", "4", "--format", "json"),
])
def test_the_image_answers_as_the_agent_does_on_the_host(image: str, args: tuple[str, ...]) -> None:
    inside = _run_in(image, *args)
    assert inside.returncode == 0, inside.stderr
    host = _host(*args)
    assert host.returncode == 0, host.stderr
    assert inside.stdout == host.stdout


def test_the_demo_runs_in_the_image(image: str) -> None:
    done = _run_in(image, "demo")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped cleanly" in done.stdout


def test_the_image_runs_as_user_and_group_10001_without_pip(image: str) -> None:
    assert _exec_in(image, "id").stdout.strip() == (
        "uid=10001(agent) gid=10001(agent) groups=10001(agent)")
    for module in ("pip", "setuptools", "wheel"):
        done = _exec_in(image, "python", "-c", f"import {module}")
        assert done.returncode != 0 and f"No module named '{module}'" in done.stderr, module
    assert _exec_in(image, "sh", "-c", "command -v pip pip3 gcc cc").stdout == ""


def test_the_image_carries_oci_labels_with_the_version(image: str) -> None:
    labels = json.loads(_docker("image", "inspect", image, "--format", "{{json .Config.Labels}}",
                                check=True).stdout)
    with open(ROOT / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert labels["org.opencontainers.image.version"] == project["version"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]
    assert "org.opencontainers.image.source" in labels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except OSError:
        return None


def test_the_daemonsets_command_serves_a_stand_in_kubelet_and_stops_on_sigterm(
    image: str, tmp_path: Path
) -> None:
    from tests.testbed.kubelet_stub import KubeletStub

    kubelet_dir, features = tmp_path / "device-plugins", tmp_path / "features.d"
    kubelet_dir.mkdir()
    features.mkdir()
    port = _free_port()
    kubelet = KubeletStub(str(kubelet_dir)).start()
    name = f"gta-image-test-{os.getpid()}"
    try:
        # as the DaemonSet runs it: root, no capability, read-only root filesystem, /tmp only
        started = _docker(
            "run", "-d", "--name", name, "--network", "host", "--user", "0:0", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp",
            "-v", f"{kubelet_dir}:/var/lib/kubelet/device-plugins",
            "-v", f"{features}:/etc/kubernetes/node-feature-discovery/features.d",
            image, "run", "--simulate", "dgx-h100", "--node-name", "gpu-node-7",
            "--metrics-address", f"127.0.0.1:{port}", "--probe-address", "127.0.0.1:0", check=False)
        assert started.returncode == 0, started.stderr
        assert kubelet.wait_for(lambda: bool(kubelet.registered("nvidia.com/gpu")), timeout_s=120), (
            _docker("logs", name).stderr[-3000:])
        deadline = time.monotonic() + 60
        while _status(f"http://127.0.0.1:{port}/ready") != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _status(f"http://127.0.0.1:{port}/ready") == 200
        assert os.listdir(features), "the label file is written"
        _docker("stop", "--time", "30", name, timeout=60, check=True)
        state = json.loads(_docker("inspect", name, "--format", "{{json .State}}", check=True).stdout)
        assert state["ExitCode"] == 0, _docker("logs", name).stderr[-3000:]
    finally:
        _docker("rm", "-f", name)
        kubelet.stop()
