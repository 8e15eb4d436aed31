"""The agent's lifecycle: start order, readiness, health in the kubelet's stream, fencing,
SIGHUP reload, and a real ``python -m agent run`` process stopped by SIGTERM."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace

import pytest
from agent_run import AgentRun, reap
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from waiting import eventually

from agent.config import Config, TimeSlicingResource
from agent.daemon import Daemon
from agent.errors import ConfigError
from agent.labels.publishing import LabelPublisher
from agent.labels.sinks import FeatureFileSink
from agent.metrics.self_metrics import AgentMetrics
from agent.modes import servers_for
from tests.testbed.kubelet_stub import KubeletStub, hgx8_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Event:
    gpu_index: int
    kind: str
    xid: int | None = None


class StubBackend:
    """The NvmlBackend methods the daemon and the health watcher use, a topology to read
    and a queue of events (for in-process tests that do not need a simulated NVML)."""

    def __init__(self, topology) -> None:
        self.topology = topology
        self.cond = threading.Condition()
        self.events: list[Event] = []
        self.fail_with: Exception | None = None
        self.shut_down = False
        self.lost_gpus: set[int] = set()

    def init(self) -> None:
        pass

    def shutdown(self) -> None:
        self.shut_down = True

    def inject(self, event: Event) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def wait_events(self, timeout_ms: int):
        with self.cond:
            if self.fail_with is not None:
                raise self.fail_with
            if not self.events:
                self.cond.wait(timeout_ms / 1000)
            out, self.events = self.events, []
            return out

    def probe(self, index: int) -> bool:
        return True


def in_process_daemon(config, backend, **kwargs) -> Daemon:
    """The real Daemon with the stub backend, the real device plugins, the feature file and
    no metrics server (the agent's own metrics are built first, as ``from_config`` does)."""
    agent_metrics = AgentMetrics(CollectorRegistry())
    kwargs.setdefault("labels", LabelPublisher(FeatureFileSink(config.features_dir),
                                               count_error=agent_metrics.label_write_error))
    return Daemon(config, backend, servers=servers_for(config.mode, agent_metrics),
                  read_topology=lambda: backend.topology, **kwargs)


def http_get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


@pytest.fixture
def dirs():
    base = tempfile.mkdtemp(prefix="dd", dir="/tmp")
    paths = {name: os.path.join(base, name) for name in ("k", "features")}
    for p in paths.values():
        os.makedirs(p)
    yield paths
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def running(dirs):
    """Start an in-process daemon against a stand-in kubelet; stopped afterwards."""
    made = []

    def start(config=None, loader=None, topology=None):
        config = replace(config or Config(), kubelet_dir=dirs["k"], features_dir=dirs["features"])
        kubelet = KubeletStub(dirs["k"]).start()
        backend = StubBackend(topology or hgx8_topology())
        daemon = in_process_daemon(config, backend, config_loader=loader)
        made.append((daemon, kubelet))
        assert daemon.start()
        return daemon, kubelet, backend

    yield start
    for daemon, kubelet in made:
        daemon.shutdown()
        kubelet.stop()


def health_of(kubelet, resource="nvidia.com/gpu"):
    latest = kubelet.latest(resource)
    return [d.health for d in latest.devices] if latest is not None else None


def test_daemon_becomes_ready_once_registered_and_writes_labels(running, dirs):
    daemon, kubelet, _ = running(Config(health_recovery_s=60))
    deadline = time.monotonic() + 2.0
    while not daemon.ready() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert daemon.ready()
    assert kubelet.registered("nvidia.com/gpu")
    assert os.listdir(dirs["features"]), "the labels feature file is written at start"


def test_injected_xid_turns_the_gpu_unhealthy_in_the_stream_then_it_recovers(running):
    daemon, kubelet, backend = running(Config(health_recovery_s=0.3))
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8)
    daemon.watcher.poll_ms = 20
    backend.inject(Event(5, "xid", 79))
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 5 + ["Unhealthy"] + ["Healthy"] * 2, 3.0)
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8, 5.0)


def test_ignored_xid_leaves_every_gpu_healthy(running):
    daemon, kubelet, backend = running(Config(health_recovery_s=60))
    daemon.watcher.poll_ms = 20
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8)
    backend.inject(Event(1, "xid", 13))
    backend.inject(Event(2, "xid", 48))  # critical: proves events were processed in order
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy", "Healthy", "Unhealthy"] + ["Healthy"] * 5, 3.0)


def test_failing_health_watcher_fences_every_device(running, caplog):
    daemon, kubelet, backend = running(Config(health_recovery_s=60))
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8)
    with caplog.at_level(logging.ERROR, logger="agent.health"):
        backend.fail_with = RuntimeError("NVML event set lost")
        backend.inject(Event(0, "xid", 13))  # wake the watcher
        assert kubelet.wait_for(lambda: health_of(kubelet) == ["Unhealthy"] * 8, 3.0)
    assert any("HEALTH WATCHER FAILED" in r.message for r in caplog.records)


def test_health_checks_disabled_starts_no_watcher(running):
    daemon, kubelet, _ = running(Config(health_checks_enabled=False))
    assert daemon.watcher is None
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8)


def test_reload_serves_the_new_config_and_reregisters(running):
    holder: dict[str, Config] = {}
    daemon, kubelet, _ = running(Config(), loader=lambda: holder["config"])
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 1)
    holder["config"] = replace(daemon.config, time_slicing=(TimeSlicingResource("nvidia.com/gpu", replicas=2),))
    daemon.reread(reload_config=True)
    assert kubelet.wait_for(lambda: len(kubelet.registrations) == 2, 3.0)
    # the first stream may not have sent anything before the reload: None until it does
    assert kubelet.wait_for(lambda: len(getattr(kubelet.latest("nvidia.com/gpu"), "devices", ())) == 16, 3.0)
    assert daemon.config.time_slicing[0].replicas == 2


def test_reload_with_a_bad_config_keeps_the_running_one(running, caplog):
    def broken():
        raise ConfigError("/etc/config.yaml: flags.migStrategy: expected one of none, single, mixed")

    daemon, kubelet, _ = running(Config(), loader=broken)
    before = daemon.config
    with caplog.at_level(logging.ERROR, logger="agent.daemon"):
        assert daemon.reread(reload_config=True) is False
    assert daemon.config is before
    assert any("keeping the running configuration" in r.message for r in caplog.records)


def test_shutdown_removes_sockets_and_shuts_nvml_down(running, dirs):
    daemon, kubelet, backend = running(Config())
    assert kubelet.wait_for(lambda: kubelet.registrations)
    watchers = [t for t in threading.enumerate() if t.name == "health-watcher"]
    assert watchers
    daemon.shutdown()
    assert os.listdir(dirs["k"]) == ["kubelet.sock"] and backend.shut_down
    assert not any(t.is_alive() for t in watchers)


# ---------------------------------------------------------------------- a real process
def agent_process(args, env=None, **kwargs):
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    env.pop("CONFIG_FILE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "agent", *args], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


def test_sighup_reregisters_and_sigterm_stops_a_real_agent_process_cleanly(dirs):
    kubelet = KubeletStub(dirs["k"]).start()
    proc = agent_process([
        "run", "--simulate", "dgx-h100", "--kubelet-dir", dirs["k"], "--features-dir", dirs["features"],
        "--metrics-address", "127.0.0.1:0", "--pod-resources-socket", os.path.join(dirs["k"], "podres.sock"),
    ])
    try:
        assert kubelet.wait_for(lambda: kubelet.registered("nvidia.com/gpu"), 20.0), proc.stderr and "no registration"
        assert kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") is not None, 5.0)
        assert len(kubelet.latest("nvidia.com/gpu").devices) == 8
        proc.send_signal(signal.SIGHUP)  # reload: serve again and re-register
        assert kubelet.wait_for(lambda: len(kubelet.registered("nvidia.com/gpu")) == 2, 10.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
    finally:
        reap(proc)
        kubelet.stop()
    assert proc.returncode == 0, stderr
    assert os.listdir(dirs["k"]) == []
    assert os.listdir(dirs["features"]) == [], "a clean stop removes the labels feature file"
    assert "effective configuration" in stderr


TIME_SLICED_4 = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def offered(kubelet, resource="nvidia.com/gpu") -> set[str]:
    latest = kubelet.latest(resource)
    return {d.ID for d in latest.devices} if latest is not None else set()


def device_health_series(port: int) -> set[str]:
    status, body = http_get(port, "/metrics")
    if status != 200:
        return set()
    return {s.labels["device"] for f in text_string_to_metric_families(body)
            if f.name == "gpu_agent_device_healthy" for s in f.samples}


def test_after_a_reload_that_changes_the_devices_every_health_series_names_an_offered_device(dirs, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(TIME_SLICED_4, encoding="utf-8")
    kubelet = KubeletStub(dirs["k"]).start()
    agent = AgentRun([
        "--config", str(config), "--simulate", "dgx-h100", "--kubelet-dir", dirs["k"],
        "--features-dir", dirs["features"], "--metrics-address", "127.0.0.1:0",
        "--pod-resources-socket", os.path.join(dirs["k"], "podres.sock"),
    ], str(tmp_path / "agent.log"))
    try:
        port, _ = agent.ports()
        assert kubelet.wait_for(lambda: len(offered(kubelet)) == 32, 20.0), "4 replicas of 8 GPUs"
        assert eventually(lambda: device_health_series(port) == offered(kubelet), 10.0)
        config.write_text("version: v1\n", encoding="utf-8")  # time-slicing off
        agent.signal(signal.SIGHUP)
        assert kubelet.wait_for(lambda: len(offered(kubelet)) == 8, 10.0)
        # the replicas' series are gone: the series are the devices offered, nothing else
        assert eventually(lambda: device_health_series(port) == offered(kubelet), 5.0), (
            sorted(device_health_series(port) - offered(kubelet))[:4])
        assert agent.stop() == 0, agent.log()[-3000:]
    finally:
        agent.kill()
        kubelet.stop()


def test_bad_config_file_exits_2_with_one_line(dirs, tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("version: v1\nflags:\n  migStrategy: sometimes\n")
    proc = agent_process(["run", "--config", str(bad), "--kubelet-dir", dirs["k"]])
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "flags.migStrategy" in lines[0]


def test_a_required_imex_channel_missing_on_the_node_exits_2_with_one_line(dirs, tmp_path):
    root = tmp_path / "driver"
    (root / "dev").mkdir(parents=True)
    proc = agent_process(["run", "--simulate", "dgx-h100", "--kubelet-dir", dirs["k"], "--imex-channel-ids", "0",
                          "--imex-required"], env={"NVIDIA_DRIVER_ROOT": str(root)})
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "imex.required: IMEX channel channel0 does not exist on this node" in lines[0]
    assert f"{root}/dev/nvidia-caps-imex-channels/channel0" in lines[0]


# ---------------------------------------------------------------------- on the simulated NVML
@pytest.fixture
def simulated(dirs):
    """The real Daemon (NvmlBackend over FakeNvml, metrics included) on dgx-h100."""
    made = []

    def start(config=None):
        config = replace(
            config or Config(), kubelet_dir=dirs["k"], features_dir=dirs["features"],
            metrics_address="127.0.0.1:0", pod_resources_socket=os.path.join(dirs["k"], "podres.sock"),
        )
        kubelet = KubeletStub(dirs["k"]).start()
        daemon = Daemon.from_config(config, simulate="dgx-h100")
        made.append((daemon, kubelet))
        assert daemon.start()
        daemon.watcher.poll_ms = 20 if daemon.watcher else 0
        return daemon, kubelet

    yield start
    for daemon, kubelet in made:
        daemon.shutdown()
        kubelet.stop()



def test_fake_nvml_xid_makes_the_gpu_unhealthy_then_it_recovers(simulated):
    daemon, kubelet = simulated(Config(health_recovery_s=0.3))
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8, 5.0)
    assert eventually(daemon.ready, 2.0)
    daemon.backend.lib.inject_xid(3, 79)
    assert kubelet.wait_for(lambda: (health_of(kubelet) or [])[3:4] == ["Unhealthy"], 5.0)
    assert health_of(kubelet).count("Unhealthy") == 1
    reg = daemon.metrics.registry
    uuid3 = daemon.topology.gpus[3].uuid
    labels = {"resource": "nvidia.com/gpu", "device": uuid3}
    # the metrics listener runs right after the stream is woken: poll, do not race it
    assert eventually(lambda: reg.get_sample_value("gpu_agent_device_healthy", labels) == 0.0)
    assert reg.get_sample_value("gpu_agent_registrations_total", {"resource": "nvidia.com/gpu"}) == 1.0
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8, 5.0)
    assert eventually(lambda: reg.get_sample_value("gpu_agent_device_healthy", labels) == 1.0)


def test_fake_nvml_lost_gpu_stays_unhealthy_until_it_answers_again(simulated):
    daemon, kubelet = simulated(Config(health_recovery_s=0.2))
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8, 5.0)
    daemon.backend.lib.lose_gpu(6)
    assert kubelet.wait_for(lambda: (health_of(kubelet) or [])[6:7] == ["Unhealthy"], 5.0)
    time.sleep(0.5)  # longer than the recovery period: a GPU that does not answer stays out
    assert health_of(kubelet)[6] == "Unhealthy"
    daemon.backend.lib.recover_gpu(6)
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8, 5.0)


def test_json_log_format_writes_one_object_per_line():
    import io
    import json

    from agent.logs import setup_logging

    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging(Config(log_format="json", log_level="INFO"), stream)
        logging.getLogger("agent.test").info("registered %s", "nvidia.com/gpu")
        logging.getLogger("agent.test").debug("not at INFO")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["message"] == "registered nvidia.com/gpu" and record["level"] == "INFO"
    assert record["logger"] == "agent.test" and record["time"].endswith("Z")


def test_kubelet_restart_rereads_the_topology_and_serves_a_changed_one(running):
    daemon, kubelet, backend = running(Config())
    assert kubelet.wait_for(lambda: health_of(kubelet) == ["Healthy"] * 8)
    backend.topology = hgx8_topology(mig=True)  # GPUs 6 and 7 switched to MIG mode meanwhile
    kubelet.restart()
    # the main loop is not running in this test: do what it does when woken
    assert daemon._wake.wait(3.0) and daemon._reread_requested
    assert daemon.reread()
    assert kubelet.wait_for(lambda: (lst := kubelet.latest("nvidia.com/gpu")) is not None and len(lst.devices) == 6, 3.0)
    assert daemon.reread() is False  # unchanged the second time


def test_second_stop_signal_exits_at_once(monkeypatch):
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    daemon = in_process_daemon(Config(), StubBackend(hgx8_topology()))
    daemon._on_stop_signal(signal.SIGTERM, None)
    assert daemon._stop_requested and exits == []
    with pytest.raises(SystemExit):
        daemon._on_stop_signal(signal.SIGINT, None)
    assert exits == [1]


def test_agent_attributes_gpus_to_the_pods_the_kubelet_lists(simulated, dirs):
    from agent._proto import podresources_v1_pb2 as pr
    from tests.testbed.kubelet_stub import PodResourcesStub

    daemon_topology = __import__("agent.discovery", fromlist=["load_topology"]).load_topology("dgx-h100")
    uuid3 = daemon_topology.gpus[3].uuid
    listing = pr.ListPodResourcesResponse()
    pod = listing.pod_resources.add(name="train-0", namespace="ml")
    pod.containers.add(name="main").devices.add(resource_name="nvidia.com/gpu", device_ids=[uuid3])
    stub = PodResourcesStub(os.path.join(dirs["k"], "podres.sock"), listing).start()
    try:
        daemon, _ = simulated(Config(pod_resources_refresh_s=0.05, sample_interval_s=0.05))
        assert daemon.topology.gpus[3].uuid == uuid3
        assert eventually(lambda: b'pod="train-0"' in daemon.metrics.render(), 10.0)
        lines = [line for line in daemon.metrics.render().decode().splitlines() if 'pod="train-0"' in line]
        dcgm = [line for line in lines if line.startswith("DCGM_FI_DEV_")]
        assert dcgm and all('gpu="3"' in line and 'namespace="ml"' in line for line in dcgm)
    finally:
        stub.stop()


class NoDriverBackend(StubBackend):
    def init(self) -> None:
        from agent.hw.nvml.calls import NvmlUnavailable

        raise NvmlUnavailable("NVML library not found (libnvidia-ml.so.1)")


def test_missing_nvml_fails_start_when_fail_on_init_error(dirs):
    daemon = in_process_daemon(Config(kubelet_dir=dirs["k"]), NoDriverBackend(hgx8_topology()))
    with pytest.raises(Exception, match="NVML library not found") as info:
        daemon.start()
    assert info.value.exit_code == 1


def test_missing_nvml_waits_without_fail_on_init_error_answering_only_health_until_stopped(dirs, tmp_path):
    from agent.hw.sim.machines import _SPECS

    with open(os.path.join(_SPECS, "pcie-4gpu.yaml"), encoding="utf-8") as f:
        spec = f.read() + "faults: {init_error: library_not_found}\n"  # a node without the driver
    path = tmp_path / "no-driver.yaml"
    path.write_text(spec, encoding="utf-8")
    agent = AgentRun(["--simulate", str(path), "--kubelet-dir", dirs["k"], "--features-dir",
                      dirs["features"], "--metrics-address", "127.0.0.1:0"], str(tmp_path / "agent.log"),
                     env={"FAIL_ON_INIT_ERROR": "false"})
    try:
        port, probe_port = agent.ports()  # the listeners it serves while it waits
        # while it waits, liveness answers and readiness does not
        assert eventually(lambda: http_get(port, "/health")[0] == 200, 20.0), "no /health while waiting"
        answers = {path: http_get(port, path)[0] for path in ("/health", "/ready", "/metrics")}
        probes = {path: http_get(probe_port, path)[0] for path in ("/health", "/ready")}
        assert agent.proc.poll() is None, "the agent waits for NVML, it does not exit"
        assert agent.stop() == 0, agent.log()[-3000:]
    finally:
        agent.kill()
    assert answers == {"/health": 200, "/ready": 503, "/metrics": 503}
    assert probes == {"/health": 200, "/ready": 503}
    assert "failOnInitError is false" in agent.log()
    assert os.listdir(dirs["k"]) == [] and os.listdir(dirs["features"]) == []


def test_metrics_port_in_use_is_a_one_line_error(dirs):
    import socket as socketlib

    holder = socketlib.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        proc = agent_process(["run", "--simulate", "single-gpu", "--kubelet-dir", dirs["k"], "--features-dir",
                              dirs["features"], "--metrics-address", f"127.0.0.1:{port}", "--log-level", "ERROR"])
        _, stderr = proc.communicate(timeout=30)
    finally:
        holder.close()
    assert proc.returncode == 1
    assert stderr.strip().splitlines()[-1].endswith(f"cannot serve metrics on 127.0.0.1:{port}: Address already in use")
    assert os.listdir(dirs["k"]) == []  # the device plugin it had started is gone again


def test_ready_endpoint_follows_registration_with_the_kubelet(simulated):
    import urllib.error
    import urllib.request

    def status(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics.port}{path}", timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            exc.close()
            return exc.code

    daemon, kubelet = simulated(Config())
    assert eventually(lambda: status("/ready") == 200)
    kubelet.stop()  # the kubelet goes away: not registered any more
    assert eventually(lambda: status("/ready") == 503)
    assert status("/health") == 200
    kubelet.start()
    assert eventually(lambda: status("/ready") == 200)


class RecordingSink:
    """A label sink that keeps what it was given."""

    where = "the test's recording sink"

    def __init__(self) -> None:
        self.written: list[dict[str, str]] = []
        self.removed = False

    def write(self, labels) -> bool:
        self.written.append(dict(labels))
        return True

    def remove(self) -> None:
        self.removed = True


def test_daemon_uses_the_collaborators_it_is_given(dirs):
    kubelet = KubeletStub(dirs["k"]).start()
    sink = RecordingSink()
    made: list[tuple] = []

    def watcher(backend, health, config, on_xid, topology):
        from agent.health import HealthWatcher

        w = HealthWatcher(backend, health, config, poll_ms=20, on_xid=on_xid)
        made.append((backend, w))
        return w

    backend = StubBackend(hgx8_topology())
    errors: list[int] = []
    labels = LabelPublisher(sink, count_error=lambda: errors.append(1))
    daemon = in_process_daemon(Config(kubelet_dir=dirs["k"]), backend, labels=labels, watcher=watcher)
    try:
        assert daemon.start()
        assert kubelet.wait_for(lambda: kubelet.registered("nvidia.com/gpu"))
        assert sink.written and sink.written[0]["nvidia.com/gpu.count"] == "8"
        assert made == [(backend, daemon.watcher)] and daemon.metrics is None and errors == []
    finally:
        daemon.shutdown()
        kubelet.stop()
    assert sink.removed and backend.shut_down


def test_dynamic_mig_outside_dra_mode_is_said_to_be_ignored(running, caplog):
    with caplog.at_level(logging.WARNING, logger="agent.daemon"):
        running(Config(dynamic_mig="on"))
    assert any("dynamic MIG needs --mode dra: ignored in device-plugin mode" in r.message for r in caplog.records)
