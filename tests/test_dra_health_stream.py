"""The kubelet's device-health stream (DRAResourceHealth/NodeWatchResources, v1alpha1 and
v1beta1) over the DRA plugin's real unix socket: listed in the registration, the full device
list at once, a GPU going unhealthy and recovering reaching a subscribed client within a
second, the list sent again without a change, the stream ended when the plugin stops."""

from __future__ import annotations

import os
import queue
import tempfile
import threading

import grpc
import pytest
from test_dra_plugin import NODE, Node

from agent._proto import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_health_v1beta1_pb2,
    dra_health_v1beta1_pb2_grpc,
)
from agent._proto import pluginregistration_v1_pb2 as reg_pb
from agent.dra.devices import DeviceRefs
from agent.dra.health_stream import HealthStreams
from agent.health import HealthState
from agent.kubelet.unix_server import UnixGrpcServer

VERSIONS = [(dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc), (dra_health_v1beta1_pb2, dra_health_v1beta1_pb2_grpc)]
IDS = ["v1alpha1", "v1beta1"]


@pytest.fixture
def node():
    n = Node()
    yield n
    n.close()


class Subscriber:
    """A client of the stream, reading in the background."""

    def __init__(self, channel: grpc.Channel, pb, pb_grpc) -> None:
        self.pb = pb
        self.call = pb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
        self.messages: queue.Queue = queue.Queue()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.messages.put(msg)
        except grpc.RpcError as exc:
            self.messages.put(exc)
        finally:
            self.ended.set()

    def next(self, timeout_s: float):
        msg = self.messages.get(timeout=timeout_s)
        assert not isinstance(msg, grpc.RpcError), msg
        return msg

    def health(self, msg) -> dict[str, str]:
        assert {d.device.pool_name for d in msg.devices} == {NODE}
        return {d.device.device_name: self.pb.HealthStatus.Name(d.health) for d in msg.devices}


def test_the_registration_lists_both_health_services_after_the_dra_services(node):
    node.start()
    info = node.registration().GetInfo(reg_pb.InfoRequest(), timeout=5)
    assert list(info.supported_versions) == [
        "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]


@pytest.mark.parametrize("pb,pb_grpc", VERSIONS, ids=IDS)
def test_a_gpu_going_unhealthy_and_recovering_reaches_a_subscriber_within_a_second(node, pb, pb_grpc):
    plugin = node.start()
    sub = Subscriber(node.channel(plugin.endpoint), pb, pb_grpc)
    first = sub.health(sub.next(5.0))
    names = list(DeviceRefs(node.topology))
    assert list(first) == names and set(first.values()) == {"HEALTHY"}
    assert names == [f"gpu-{i}" for i in range(8)]  # no claim holds a set: the single GPUs
    c = node.put_claim("c", ["gpuset-4-mf"])  # GPUs 0-3, prepared: the kubelet asks about it
    assert node.prepare(c).claims[c["metadata"]["uid"]].error == ""
    node.health.mark_unhealthy(3, "XID 79")
    msg = sub.next(1.0)
    sick = {n for n, h in sub.health(msg).items() if h == "UNHEALTHY"}
    assert sick == {"gpu-3", "gpuset-4-mf"}
    if pb is dra_health_v1beta1_pb2:
        assert {d.message for d in msg.devices if d.device.device_name in sick} == {"GPU 3: XID 79"}
        assert {d.message for d in msg.devices if d.device.device_name not in sick} == {""}
    assert all(d.last_updated_time > 0 for d in msg.devices)
    node.health.mark_healthy(3)
    assert set(sub.health(sub.next(1.0)).values()) == {"HEALTHY"}
    plugin.stop()
    assert sub.ended.wait(5.0), "the stream ends when the plugin stops"


def test_a_mig_device_has_its_parent_gpus_health(node):
    from tests.testbed.kubelet_stub import hgx8_topology

    plugin = node.start(hgx8_topology(mig=True))
    sub = Subscriber(node.channel(plugin.endpoint), dra_health_v1beta1_pb2, dra_health_v1beta1_pb2_grpc)
    sub.next(5.0)
    node.health.mark_unhealthy(7, "double-bit ECC error")
    health = sub.health(sub.next(1.0))
    assert {n for n, h in health.items() if h == "UNHEALTHY"} == {"gpu-7-mig-0", "gpu-7-mig-1"}


def test_without_a_change_the_full_list_is_sent_again_before_the_kubelet_forgets_it():
    health = HealthState(8)
    from tests.testbed.kubelet_stub import hgx8_topology

    devices = DeviceRefs(hgx8_topology())
    streams = HealthStreams(health, lambda: devices, NODE, resend_s=0.2)
    path = os.path.join(tempfile.mkdtemp(prefix="hs", dir="/tmp"), "dra.sock")
    server = UnixGrpcServer(path, streams.add_to, name="health")
    server.start()
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        sub = Subscriber(channel, dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc)
        lists = [sub.health(sub.next(5.0)) for _ in range(3)]
        assert lists[0] == lists[1] == lists[2] and len(lists[0]) == len(devices)
        sub.call.cancel()  # the kubelet goes: the stream's worker is freed
        assert sub.ended.wait(5.0)
    finally:
        channel.close()
        streams.close()
        server.stop(0)
