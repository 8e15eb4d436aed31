"""Logs grow with the state, not with the attack (issue 20, defect 7).

Under each condition that repeats (a client retrying ListAndWatch in a loop, a kubelet
that refuses registration, a regular file where ``kubelet.sock`` belongs, the API server
down while the kubelet prepares 100 claims, the label file re-asserted with a moving
timestamp) the log says it once, and a ``gpu_agent_*`` counter counts the repeats. Each
test counts log lines; each failed before the fix (one line per refusal, per retry, per
claim plus three urllib3 retry warnings per claim, per label write).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest
from agent_run import AgentRun
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_dra_daemon import Node
from waiting import eventually

from agent._proto import deviceplugin_v1beta1_pb2 as pb
from agent._proto import dra_v1_pb2, dra_v1_pb2_grpc
from agent.config import Config
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.server import MAX_STREAMS
from agent.health import HealthState
from agent.metrics.self_metrics import AgentMetrics
from tests.testbed.kubelet_stub import KubeletStub, PluginClient, hgx8_topology

RESOURCE = "nvidia.com/gpu"


@pytest.fixture
def kubelet_dir():
    path = tempfile.mkdtemp(prefix="lv", dir="/tmp")  # unix socket paths: keep it short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugins(kubelet_dir):
    """A started manager (hgx8) reporting to its own self-metrics, and the stand-in kubelet
    (``kubelet=False``: none); both stopped after."""
    made: list[tuple[DevicePluginManager, KubeletStub | None]] = []

    def start(*, kubelet: bool = True, refuse_reason: str | None = None):
        stub = KubeletStub(kubelet_dir, refuse_reason=refuse_reason).start() if kubelet else None
        topology = hgx8_topology()
        metrics = AgentMetrics(CollectorRegistry())
        manager = DevicePluginManager(topology, replace(Config(), kubelet_dir=kubelet_dir,
                                                          nccl_host_dir=os.path.join(kubelet_dir, "nccl")),
                                      HealthState(topology.gpu_count), events=metrics, poll_s=0.02,
                                      max_backoff_s=0.05)
        made.append((manager, stub))
        manager.start()
        return manager, stub, metrics.registry

    yield start
    for manager, stub in made:
        manager.stop(0.2)
        if stub is not None:
            stub.stop()


def _said(caplog, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


# ---------------------------------------------------------------------- device plugin
def test_a_client_retrying_list_and_watch_in_a_loop_is_said_once_and_counted(plugins, kubelet_dir, caplog):
    manager, kubelet, registry = plugins()
    assert eventually(manager.ready, 5.0) and kubelet.wait_for(lambda: kubelet.latest(RESOURCE) is not None)
    client = PluginClient(os.path.join(kubelet_dir, manager.resources[0].socket_name))
    held = [client.stub.ListAndWatch(pb.Empty()) for _ in range(MAX_STREAMS - 1)]  # the kubelet holds one
    try:
        for call in held:
            assert next(call).devices, "served"
        with caplog.at_level(logging.WARNING, logger="agent.deviceplugin"):
            for _ in range(200):
                with pytest.raises(grpc.RpcError) as refused:
                    next(client.stub.ListAndWatch(pb.Empty(), timeout=5))
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            said = _said(caplog)
            assert len(said) == 1 and "refusing ListAndWatch streams" in said[0], said[:3]
            assert registry.get_sample_value("gpu_agent_list_and_watch_refused_total", {"resource": RESOURCE}) == 200
            # a stream closes and the next is served: the refusals after that are news again
            held.pop().cancel()
            assert eventually(lambda: _served(client, held), 5.0)
            caplog.clear()
            for _ in range(3):
                with pytest.raises(grpc.RpcError):
                    next(client.stub.ListAndWatch(pb.Empty(), timeout=5))
            assert len(_said(caplog)) == 1
    finally:
        for call in held:
            call.cancel()
        client.close()


def _served(client: PluginClient, held: list) -> bool:
    """Open one more stream; True if it was served (then it is kept open in ``held``)."""
    call = client.stub.ListAndWatch(pb.Empty())
    try:
        next(call)
    except grpc.RpcError:
        return False
    held.append(call)
    return True


def test_a_kubelet_refusing_registration_is_said_once_and_each_retry_counted(plugins, caplog):
    with caplog.at_level(logging.DEBUG, logger="agent.deviceplugin"):
        manager, kubelet, registry = plugins(refuse_reason="resource name not allowed here")
        assert eventually(lambda: (registry.get_sample_value(
            "gpu_agent_registration_failures_total", {"resource": RESOURCE}) or 0) >= 20, 10.0)
        said = _said(caplog)
        assert len(said) == 1, said[:3]
        assert "registering nvidia.com/gpu with the kubelet failed" in said[0]
        assert "resource name not allowed here" in said[0]
        kubelet.refuse_reason = None
        assert eventually(manager.ready, 5.0)
        assert eventually(lambda: any("registered nvidia.com/gpu" in r.getMessage() for r in caplog.records))


def test_a_regular_file_at_kubelet_sock_is_said_once_for_what_it_is(plugins, kubelet_dir, caplog):
    with caplog.at_level(logging.INFO, logger="agent.deviceplugin"):
        path = os.path.join(kubelet_dir, "kubelet.sock")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("not a socket\n")
        manager, _, registry = plugins(kubelet=False)
        time.sleep(1.0)  # 50 watch rounds at poll_s 0.02, backoff capped at 0.05 s
        said = _said(caplog)
        assert len(said) == 1 and f"{path} is a regular file, not the kubelet's socket" in said[0], said[:3]
        assert not any("kubelet socket" in m and "found" in m for m in _said(caplog, logging.INFO))
        assert registry.get_sample_value("gpu_agent_registration_failures_total", {"resource": RESOURCE}) is None
        assert registry.get_sample_value("gpu_agent_kubelet_restarts_total") == 0
        os.unlink(path)
        kubelet = KubeletStub(kubelet_dir).start()  # the kubelet comes: registered at once
        try:
            assert eventually(manager.ready, 5.0)
        finally:
            kubelet.stop()


# ---------------------------------------------------------------------- DRA, a real process
def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def test_a_100_claim_prepare_with_the_api_server_down_logs_one_line_and_counts_100():
    node = Node()
    agent = AgentRun(["--simulate", "dgx-h100", "--metrics-address", "127.0.0.1:0", *node.args()],
                     os.path.join(node.root, "agent.log"))
    try:
        port, _ = agent.ports()
        node.kubelet_registers()
        assert node.api.wait_for(lambda s: len(s) > 0, 20.0), agent.log()[-3000:]
        node.api.go_down()
        before = len(agent.log().splitlines())
        request = dra_v1_pb2.NodePrepareResourcesRequest(claims=[
            dra_v1_pb2.Claim(namespace="default", uid=f"00000000-0000-0000-0000-{i:012d}", name=f"claim-{i}")
            for i in range(100)])
        stub = dra_v1_pb2_grpc.DRAPluginStub(node.channel(node.dra_socket))
        response = stub.NodePrepareResources(request, timeout=60, wait_for_ready=True)
        assert all("cannot be read" in c.error for c in response.claims.values()), "each claim told the kubelet"
        assert len(response.claims) == 100
        new = agent.log().splitlines()[before:]
        about_claims = [line for line in new if "ResourceClaim" in line or "urllib3" in line or "Retrying" in line]
        assert len(about_claims) == 1 and "reading ResourceClaims failed: " in about_claims[0] \
            and "API server unreachable" in about_claims[0], (
            len(about_claims), about_claims[:4])
        assert _metric(port, "gpu_agent_claim_read_errors_total") == 100
        node.api.come_up()
        claim = node.put_claim("after", ["gpu-1"])
        assert node.prepare(claim).claims[claim["metadata"]["uid"]].error == ""
        assert len(agent.lines("reading ResourceClaims works again")) == 1
        assert agent.stop() == 0, agent.log()[-3000:]
    finally:
        agent.kill()
        node.close()


# ---------------------------------------------------------------------- labels, a real process
def test_labels_re_asserted_with_a_new_timestamp_are_said_once(kubelet_dir):
    features = os.path.join(kubelet_dir, "features")
    kubelet = KubeletStub(kubelet_dir).start()
    agent = AgentRun(["--simulate", "dgx-h100", "--kubelet-dir", kubelet_dir, "--features-dir", features,
                      "--metrics-address", "127.0.0.1:0", "--label-interval-s", "0.1",
                      "--pod-resources-socket", os.path.join(kubelet_dir, "podres.sock")],
                     os.path.join(kubelet_dir, "agent.log"))
    path = os.path.join(features, "gpu-topology-agent")
    try:
        assert kubelet.wait_for(lambda: kubelet.registered(RESOURCE), 20.0), agent.log()[-3000:]

        def timestamp() -> str:
            try:
                with open(path, encoding="utf-8") as fh:
                    return next(line for line in fh if line.startswith("nvidia.com/gfd.timestamp="))
            except (FileNotFoundError, StopIteration):
                return ""

        first = timestamp()
        assert eventually(lambda: timestamp() not in ("", first), 5.0), "rewritten with a new timestamp"
        assert agent.stop() == 0, agent.log()[-3000:]
    finally:
        agent.kill()
        kubelet.stop()
    said = agent.lines(" agent.labels.")
    assert len(said) == 2 and "labels written to" in said[0] and "removed" in said[1], said[:4]
