"""Reliability under load and faults (issue 11, section 5): open streams, untrusted input,
oversized device lists, a vanished kubelet directory, a GPU lost mid-run, label files
deleted behind the agent's back, the metrics server under many clients, stale simulator
trees. Each test failed before its fix."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace

import grpc
import pytest
from prometheus_client import CollectorRegistry
from waiting import eventually

from agent._proto import deviceplugin_v1beta1_pb2 as pb
from agent.config import Config, TimeSlicingResource
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.server import MAX_STREAMS
from agent.errors import ConfigError, shorten
from agent.health import HealthState
from agent.metrics.self_metrics import AgentMetrics
from tests.testbed.kubelet_stub import KubeletStub, PluginClient, hgx8_topology


@pytest.fixture
def kubelet_dir():
    path = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # unix socket paths: keep it short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugins(kubelet_dir):
    """A started manager (hgx8, whole GPUs) and a stand-in kubelet; both stopped after."""
    made: list[tuple[DevicePluginManager, KubeletStub | None]] = []

    def start(config: Config | None = None, *, kubelet: bool = True, **kwargs):
        config = replace(config or Config(), kubelet_dir=kubelet_dir,
                         nccl_host_dir=os.path.join(kubelet_dir, "nccl"))  # not /tmp's default
        stub = KubeletStub(kubelet_dir).start() if kubelet else None
        topology = hgx8_topology()
        manager = DevicePluginManager(topology, config, HealthState(topology.gpu_count),
                                      events=AgentMetrics(CollectorRegistry()), poll_s=0.05, **kwargs)
        made.append((manager, stub))
        manager.start()
        return manager, stub

    yield start
    for manager, stub in made:
        manager.stop(0.2)
        if stub is not None:
            stub.stop()


def _socket(manager: DevicePluginManager, kubelet_dir: str) -> str:
    return os.path.join(kubelet_dir, manager.resources[0].socket_name)


# ---------------------------------------------------------------------- open streams
def test_open_list_and_watch_streams_never_starve_the_unary_calls(plugins, kubelet_dir):
    manager, kubelet = plugins()
    assert eventually(manager.ready, 3.0) and kubelet.wait_for(lambda: kubelet.latest("nvidia.com/gpu") is not None)
    client = PluginClient(_socket(manager, kubelet_dir))
    streams = [client.stub.ListAndWatch(pb.Empty()) for _ in range(20)]
    try:
        time.sleep(0.5)  # let every stream reach the server
        ids = [g.uuid for g in manager.topology.gpus]
        assert client.options(timeout_s=2.0).get_preferred_allocation_available
        assert len(client.preferred(ids, [], 2, timeout_s=2.0)) == 2
        assert client.allocate(ids[:1], timeout_s=2.0).container_responses
        refused = 0
        for call in streams:
            if call.done() and call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused += 1
                assert "ListAndWatch streams" in call.details()
        # the kubelet's stream and the first extra ones are served, the rest refused
        assert refused == 20 - (MAX_STREAMS - 1)
    finally:
        for call in streams:
            call.cancel()
        client.close()


def test_a_closed_stream_frees_its_place_for_a_new_one(plugins, kubelet_dir):
    manager, kubelet = plugins()
    assert eventually(manager.ready, 3.0)
    client = PluginClient(_socket(manager, kubelet_dir))
    limit = MAX_STREAMS
    try:
        streams = [client.stub.ListAndWatch(pb.Empty()) for _ in range(limit - 1)]  # + the kubelet's
        for call in streams:
            next(call)  # served: the first device list arrives
        extra = client.stub.ListAndWatch(pb.Empty())
        with pytest.raises(grpc.RpcError) as refused:
            next(extra)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        streams[0].cancel()
        deadline = time.monotonic() + 3.0
        while True:  # the server notices the cancel within its 1 s wait
            again = client.stub.ListAndWatch(pb.Empty())
            try:
                assert len(next(again).devices) == 8
                again.cancel()
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the cancelled stream's place was never freed"
                time.sleep(0.1)
        for call in streams:
            call.cancel()
    finally:
        client.close()


# ---------------------------------------------------------------------- untrusted input
def test_shorten_keeps_short_values_and_cuts_long_ones_saying_how_long():
    assert shorten("GPU-1") == "GPU-1"
    cut = shorten("x" * 1_000_000)
    assert cut.startswith("x" * 80) and cut.endswith("...(+999920 chars)") and len(cut) < 120


def test_a_megabyte_device_id_gets_invalid_argument_with_a_short_message(plugins, kubelet_dir, caplog):
    manager, _ = plugins()
    assert eventually(manager.ready, 3.0)
    client = PluginClient(_socket(manager, kubelet_dir))
    huge = "GPU-" + "a" * (1 << 20)
    try:
        with caplog.at_level(logging.WARNING, logger="agent.deviceplugin"):
            for call in (lambda: client.allocate([huge]), lambda: client.preferred([huge], [], 1)):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "unknown device ID" in err.value.details() and len(err.value.details()) < 400
    finally:
        client.close()
    logged = [r.getMessage() for r in caplog.records if "device ID" in r.getMessage()]
    assert len(logged) == 2 and all(len(m) < 400 for m in logged)


# ---------------------------------------------------------------------- oversized device lists
@pytest.mark.parametrize("numa", [True, False])
def test_the_refused_device_list_size_is_what_protobuf_would_serialize(numa):
    # the refusal names the size of the ListAndWatch message it would have sent (every device
    # Unhealthy, the longer health word): replica IDs of 1 to 4 digits, with and without NUMA
    from agent.deviceplugin.resources import build_resources

    topology, replicas = hgx8_topology(numa=numa), 10_000
    with pytest.raises(ConfigError) as err:
        build_resources(topology, Config(time_slicing=(TimeSlicingResource(replicas=replicas),)))
    message = pb.ListAndWatchResponse()
    for gpu in topology.gpus:
        for n in range(replicas):
            device = message.devices.add(ID=f"{gpu.uuid}::{n}", health="Unhealthy")
            if gpu.numa_node is not None:
                device.topology.nodes.add(ID=gpu.numa_node)
    assert f"a ListAndWatch message of {message.ByteSize()} bytes" in str(err.value)


def test_a_device_list_larger_than_the_grpc_limit_is_rejected_naming_the_limit(kubelet_dir):
    from agent.deviceplugin.resources import build_resources

    config = Config(time_slicing=(TimeSlicingResource(replicas=10_000),), kubelet_dir=kubelet_dir)
    with pytest.raises(ConfigError, match=r"80000 devices.*4194304 bytes \(4 MiB\).*replicas"):
        build_resources(hgx8_topology(), config)
    topology = hgx8_topology()
    manager = DevicePluginManager(topology, config, HealthState(8), events=AgentMetrics(CollectorRegistry()))
    with pytest.raises(ConfigError):
        manager.start()
    assert not manager.ready()
    assert build_resources(hgx8_topology(), replace(config, time_slicing=(TimeSlicingResource(replicas=1000),)))


# ---------------------------------------------------------------------- kubelet directory removed
def test_a_removed_kubelet_directory_is_logged_once_per_change_and_retried_with_backoff(
    plugins, kubelet_dir, caplog
):
    manager, kubelet = plugins(max_backoff_s=0.4)
    assert eventually(manager.ready, 3.0)
    with caplog.at_level(logging.DEBUG, logger="agent.deviceplugin"):
        kubelet.stop()
        shutil.rmtree(kubelet_dir)
        time.sleep(1.5)  # 30 watch rounds at poll_s 0.05
        failing = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not any(r.exc_info for r in failing), "no traceback for a missing directory"
        assert len(failing) <= 3, [r.getMessage() for r in failing]
        assert any("does not exist" in r.getMessage() for r in failing)
        caplog.clear()
        os.makedirs(kubelet_dir)
        kubelet.start()
        assert eventually(manager.ready, 3.0)
    assert any("is back" in r.getMessage() for r in caplog.records)


def test_a_socket_path_that_cannot_be_served_is_said_once_and_retried_with_backoff(plugins, kubelet_dir, caplog):
    manager, kubelet = plugins(max_backoff_s=0.4)
    assert eventually(manager.ready, 3.0)
    path = _socket(manager, kubelet_dir)
    with caplog.at_level(logging.DEBUG, logger="agent.deviceplugin"):
        os.unlink(path)
        os.mkdir(path)  # something in the way that is not ours to delete
        time.sleep(1.5)
        loud = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(loud) == 1, [r.getMessage() for r in loud]
        os.rmdir(path)
        assert eventually(manager.ready, 3.0)
        time.sleep(0.2)  # the round that registered says so once it returns
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_a_socket_that_cannot_be_served_for_the_limit_makes_the_plugins_not_alive_until_it_is(
    plugins, kubelet_dir
):
    manager, kubelet = plugins(max_backoff_s=0.2, unserved_limit_s=1.0)
    assert eventually(manager.ready, 3.0) and manager.live()
    path = _socket(manager, kubelet_dir)
    os.unlink(path)
    os.mkdir(path)  # in the way, not ours to delete: serving fails round after round
    time.sleep(0.5)
    assert manager.live(), "not before the limit"
    assert eventually(lambda: not manager.live(), 3.0), "still alive long after the limit"
    os.rmdir(path)
    assert eventually(manager.ready, 3.0) and manager.live()


def test_a_kubelet_away_leaves_the_plugins_alive_however_long(plugins, kubelet_dir):
    manager, kubelet = plugins(max_backoff_s=0.2, unserved_limit_s=0.5)
    assert eventually(manager.ready, 3.0)
    kubelet.stop()
    shutil.rmtree(kubelet_dir)  # the kubelet is away: waiting for it is no failure to serve
    time.sleep(1.5)
    assert manager.live()
    os.makedirs(kubelet_dir)
    kubelet.start()
    assert eventually(manager.ready, 3.0) and manager.live()


# ---------------------------------------------------------------------- a GPU lost mid-run
@pytest.fixture
def agent(kubelet_dir):
    """The real Daemon on a simulated machine (NvmlBackend over the fake NVML), a stand-in
    kubelet, metrics on a free port; stopped after."""
    from agent.daemon import Daemon

    made = []
    features = tempfile.mkdtemp(prefix="rlf", dir="/tmp")

    def start(machine: str = "dgx-h100", config: Config | None = None):
        config = replace(
            config or Config(), kubelet_dir=kubelet_dir, features_dir=features,
            metrics_address="127.0.0.1:0", pod_resources_socket=os.path.join(kubelet_dir, "podres.sock"),
        )
        kubelet = KubeletStub(kubelet_dir).start()
        daemon = Daemon.from_config(config, simulate=machine)
        made.append((daemon, kubelet))
        assert daemon.start()
        if daemon.watcher is not None:
            daemon.watcher.poll_ms = 20
        return daemon, kubelet

    yield start
    for daemon, kubelet in made:
        daemon.shutdown()
        kubelet.stop()
    shutil.rmtree(features, ignore_errors=True)


def _devices(kubelet):
    latest = kubelet.latest("nvidia.com/gpu")
    return [] if latest is None else [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in latest.devices]


def _labels(daemon) -> dict[str, str]:
    """The label file as written, less GFD's timestamp (it moves with every write)."""
    with open(daemon.labels.sink.path, encoding="utf-8") as f:
        labels = dict(line.split("=", 1) for line in f.read().splitlines() if line)
    labels.pop("nvidia.com/gfd.timestamp", None)
    return labels


def test_a_gpu_lost_mid_run_keeps_its_id_numa_and_labels_across_a_kubelet_restart(agent):
    daemon, kubelet = agent(config=Config(health_recovery_s=600))
    assert eventually(daemon.ready, 3.0) and kubelet.wait_for(lambda: len(_devices(kubelet)) == 8)
    before, labels_before = _devices(kubelet), _labels(daemon)
    assert all(numa for _, _, numa in before)
    daemon.backend.lib.lose_gpu(3)
    assert kubelet.wait_for(lambda: _devices(kubelet)[3][1] == "Unhealthy", 5.0)
    kubelet.restart()
    assert daemon._wake.wait(3.0) and daemon._reread_requested  # the main loop's job, done here
    daemon.reread()
    assert eventually(daemon.ready, 3.0)
    assert kubelet.wait_for(lambda: len(_devices(kubelet)) == 8, 3.0)
    after = _devices(kubelet)
    assert [d[0] for d in after] == [d[0] for d in before]  # GPU 3 is not GPU-unknown-3
    assert [d[2] for d in after] == [d[2] for d in before]  # NUMA on every device
    assert [d[1] for d in after] == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4
    assert _labels(daemon) == labels_before  # gpu.count=8: health is not a label
    assert daemon.topology.gpus[3].uuid == before[3][0]


def test_a_sighup_while_a_gpu_is_lost_keeps_the_topology_read_before(agent):
    daemon, kubelet = agent()
    assert eventually(daemon.ready, 3.0)
    first = daemon.topology
    daemon.config_loader = lambda: daemon.config
    daemon.backend.lib.lose_gpu(5)
    daemon.reread(reload_config=True)
    assert daemon.topology.gpus == first.gpus and daemon.topology.links == first.links
    assert daemon.topology.nics == first.nics


def test_a_gpu_lost_at_discovery_keeps_one_placeholder_id_until_it_is_read(agent, tmp_path):
    from agent.hw.sim.machines import _SPECS

    with open(os.path.join(_SPECS, "pcie-4gpu.yaml"), encoding="utf-8") as f:
        spec = f.read() + "faults: {lost_gpus: [2]}\n"
    path = tmp_path / "lost.yaml"
    path.write_text(spec, encoding="utf-8")
    daemon, kubelet = agent(str(path))
    assert eventually(daemon.ready, 3.0) and kubelet.wait_for(lambda: len(_devices(kubelet)) == 4)
    first = _devices(kubelet)
    assert first[2][:2] == ("GPU-unknown-2", "Unhealthy")
    for _ in range(2):  # re-reads while it stays lost: the same ID, nothing served again
        assert daemon.reread() is False
    assert _devices(kubelet) == first



def test_a_reread_fills_what_it_lacks_from_the_previous_read_and_takes_what_it_knows():
    from agent.topology.model import Topology
    from agent.topology.reread import merge_reread

    first = hgx8_topology()
    blind = hgx8_topology(numa=False)  # this read got no NUMA nodes
    swapped = [replace(g, uuid="GPU-replaced-0000") if g.index == 0 else g for g in blind.gpus]
    reread = Topology.build(swapped, blind.links)
    merged = merge_reread(first, reread)
    assert merged.gpus[0].uuid == "GPU-replaced-0000"  # a replaced GPU is served as it is now
    assert [g.numa_node for g in merged.gpus[1:]] == [g.numa_node for g in first.gpus[1:]]
    assert merge_reread(first, replace(first, notes=("re-read",))) is first


# ---------------------------------------------------------------------- the label file
def test_a_deleted_label_file_and_a_removed_features_dir_come_back_within_the_interval(agent):
    daemon, _ = agent(config=Config(label_interval_s=0.2))
    written = _labels(daemon)
    path = daemon.labels.sink.path
    os.unlink(path)
    daemon.labels.maintain()  # before the interval: nothing yet
    assert not os.path.exists(path)
    time.sleep(0.25)
    daemon.labels.maintain()
    assert _labels(daemon) == written
    shutil.rmtree(os.path.dirname(path))
    time.sleep(0.25)
    daemon.labels.maintain()
    assert _labels(daemon) == written


def test_an_unwritable_features_dir_is_logged_once_counted_per_write_and_not_ready(agent, caplog):
    daemon, kubelet = agent(config=Config(label_interval_s=0.05))
    assert eventually(daemon.ready, 3.0) and daemon.ready()
    features = daemon.config.features_dir
    shutil.rmtree(features)
    with open(features, "w", encoding="utf-8") as f:  # a file where the directory was
        f.write("not a directory\n")
    registry = daemon.metrics.registry
    with caplog.at_level(logging.ERROR, logger="agent.labels"):
        for _ in range(2):
            time.sleep(0.06)
            daemon.labels.maintain()
    errors = [r.getMessage() for r in caplog.records if r.getMessage().startswith("writing labels to")]
    assert len(errors) == 1 and features in errors[0], "said once, each write counted"
    assert registry.get_sample_value("gpu_agent_label_write_errors_total") == 2.0
    assert not daemon.ready()
    os.unlink(features)
    time.sleep(0.06)
    daemon.labels.maintain()
    assert daemon.ready() and _labels(daemon)
    assert registry.get_sample_value("gpu_agent_label_write_errors_total") == 2.0


# ---------------------------------------------------------------------- the metrics server
def _http_get(port: int, path: str = "/health", timeout_s: float = 5.0) -> tuple[int, float]:
    import http.client

    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - started
    finally:
        conn.close()


def test_a_burst_of_100_concurrent_probes_is_answered_without_listen_overflow(agent):
    from concurrent.futures import ThreadPoolExecutor

    daemon, _ = agent()
    port = daemon.metrics.port
    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(lambda _: _http_get(port), range(100)))
    assert all(status == 200 for status, _ in results)
    # an overflowed backlog shows as a dropped SYN, retried by the client after 1 s
    assert max(latency for _, latency in results) < 0.9, sorted(latency for _, latency in results)[-5:]


def test_connections_past_the_cap_get_503_at_once_and_hold_no_thread(agent):
    import socket
    import threading

    from agent.http.endpoints import MAX_CONNECTIONS

    daemon, _ = agent()
    port = daemon.metrics.port
    threads_before = threading.active_count()
    held = [socket.create_connection(("127.0.0.1", port), timeout=5.0) for _ in range(MAX_CONNECTIONS)]
    try:
        for conn in held:
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # half-sent: each holds a handler
        deadline = time.monotonic() + 5.0
        while threading.active_count() < threads_before + MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.02)
        extra = [socket.create_connection(("127.0.0.1", port), timeout=5.0) for _ in range(20)]
        for conn in extra:
            started = time.monotonic()
            reply = conn.recv(1024)
            assert reply.startswith(b"HTTP/1.1 503") and time.monotonic() - started < 1.0
            conn.close()
        # the 20 refused connections hold no thread (a few of the agent's own come and go)
        assert threading.active_count() < threads_before + MAX_CONNECTIONS + len(extra) // 2
    finally:
        for conn in held:
            conn.close()
    # places free again once the held ones are gone: each handler sees its peer's close when it next reads
    assert eventually(lambda: _http_get(port)[0] == 200, 5.0)


def test_a_client_reset_leaves_no_traceback_in_the_log_or_on_stderr(agent, caplog, capfd):
    import socket
    import struct

    daemon, _ = agent()
    with caplog.at_level(logging.DEBUG):
        for _ in range(5):
            conn = socket.create_connection(("127.0.0.1", daemon.metrics.port), timeout=5.0)
            conn.sendall(b"GET /met")
            time.sleep(0.02)  # the handler is reading when the reset arrives
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST
        time.sleep(0.2)
        assert _http_get(daemon.metrics.port)[0] == 200
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING and "http" in r.getMessage()]


# ---------------------------------------------------------------------- simulator temp trees
def test_stale_simulator_trees_of_dead_processes_are_removed_at_start(tmp_path, monkeypatch):
    import subprocess
    import sys

    from agent.hw.sim.machines import open_simulated

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"gta-sysfs-{dead.stdout.strip()}-dgx2-abc"
    live = tmp_path / f"gta-sysfs-{os.getppid()}-dgx2-def"  # a live process's tree
    other = tmp_path / "gta-sysfs-notapid"
    for d in (stale, live, other):
        (d / "devices").mkdir(parents=True)
    with open_simulated("single-gpu") as sim:
        assert os.path.basename(sim.sysfs_root).startswith(f"gta-sysfs-{os.getpid()}-")
        assert not stale.exists() and live.exists() and other.exists()
