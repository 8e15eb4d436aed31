"""The ResourceSlice publisher against the stand-in API server, through the official client."""

from __future__ import annotations

import logging
import time

import pytest
from apiserver_stub import ApiServerStub
from kubelet_stub import hgx8_topology
from waiting import eventually

from agent.dra.publisher import SlicePublisher, pick_version
from agent.dra.slices import render_slices
from agent.health import HealthState

DRIVER = "gpu.gpu-agent.io"


def device_names(slices):
    """Every device name of the pool's slices (counter slice, single GPUs, GPU sets)."""
    return [d["name"] for obj in slices for d in obj["spec"].get("devices", [])]


@pytest.fixture
def server():
    with ApiServerStub() as s:
        yield s


def expected_slices(unhealthy=frozenset()) -> int:
    """How many slices the agent's rendering of the test node holds (what `slices` prints)."""
    return len(render_slices(hgx8_topology(), node_name="node-1", driver=DRIVER, unhealthy=unhealthy))


def make(server, topology=None, **kw):
    kw.setdefault("backoff_initial_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    pub = SlicePublisher(server.api_client, "node-1", topology or hgx8_topology(), DRIVER, **kw)
    return pub


def test_pick_version_prefers_v1_then_v1beta2_then_v1beta1():
    assert pick_version(["v1beta1", "v1", "v1beta2"]) == "v1"
    assert pick_version(["v1beta1", "v1beta2"]) == "v1beta2"
    assert pick_version(["v1beta1"]) == "v1beta1"
    assert pick_version(["v1alpha3"]) is None


@pytest.mark.parametrize("served,expected", [
    (("v1", "v1beta2", "v1beta1"), "v1"),
    (("v1beta2", "v1beta1"), "v1beta2"),
    (("v1beta1",), "v1beta1"),
])
def test_publisher_discovers_the_served_version_once_and_publishes_in_it(served, expected):
    with ApiServerStub(served) as server:
        uid = server.add_node("node-1")
        pub = make(server)
        pub.start()
        try:
            assert eventually(pub.ready, 30)
            pub.update(unhealthy={3})
            assert server.wait_for(lambda s: s and "gpu-3" not in device_names(s))
        finally:
            pub.stop()
        objs = server.slices()
        # v1: a counter slice, then the single GPUs and the GPU sets (107 devices: two slices at
        # first, one after GPU 3 and its sets left); older versions: the single GPUs only
        assert len(objs) == (2 if expected == "v1" else 1)
        for obj in objs:
            assert obj["apiVersion"] == f"resource.k8s.io/{expected}"
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
            assert obj["spec"]["pool"] == {"name": "node-1", "generation": 2, "resourceSliceCount": len(objs)}
        obj = next(o for o in objs if o["spec"].get("devices"))
        discovery = [r for r in server.requests if r.path == "/apis/resource.k8s.io"]
        assert len(discovery) == 1  # discovery once at start
        assert server.count("POST", f"/apis/resource.k8s.io/{expected}/resourceslices") == (3 if expected == "v1" else 1)
        if expected == "v1beta1":
            assert "basic" in obj["spec"]["devices"][0]
        else:
            assert "attributes" in obj["spec"]["devices"][0]


def test_unhealthy_gpu_leaves_the_slice_within_a_second_and_comes_back_with_a_higher_generation(server):
    server.add_node("node-1")
    health = HealthState(8)
    pub = make(server, health=health)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        first = server.slices()[0]["spec"]["pool"]["generation"]
        t0 = time.monotonic()
        health.mark_unhealthy(5, "XID 79")
        assert server.wait_for(lambda s: "gpu-5" not in device_names(s), timeout_s=1.0)
        assert time.monotonic() - t0 < 1.0
        second = server.slices()[0]["spec"]["pool"]["generation"]
        health.mark_healthy(5)
        assert server.wait_for(lambda s: "gpu-5" in device_names(s), timeout_s=1.0)
        third = server.slices()[0]["spec"]["pool"]["generation"]
    finally:
        pub.stop()
    assert first < second < third


def test_stale_resource_version_conflict_is_reread_and_retried(server):
    server.add_node("node-1")
    pub = make(server)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        name = server.slices()[0]["metadata"]["name"]
        # another writer changes the slice behind the publisher's back, between its list and
        # its update: the first PUT carries a stale resourceVersion
        server.fail(409, method="PUT", times=1)
        server.modify_slice(name, lambda o: o["metadata"].setdefault("labels", {}).update(x="y"))
        pub.update(unhealthy={0})
        assert server.wait_for(lambda s: "gpu-0" not in device_names(s))
    finally:
        pub.stop()
    assert server.count("PUT") >= 2
    assert server.count("GET", f"/resourceslices/{name}") >= 1  # re-read after the conflict


def test_a_real_stale_resource_version_from_the_server_is_retried(server):
    server.add_node("node-1")
    pub = make(server)
    pub.start()
    assert eventually(pub.ready, 30)
    pub.stop()
    name = server.slices()[0]["metadata"]["name"]
    # the publisher lists, then someone else writes, then it updates with the stale version
    original = server._slices_route

    def racing(method, version, rest, query, body):
        if method == "PUT" and not getattr(racing, "done", False):
            racing.done = True
            server._slices[name]["metadata"]["resourceVersion"] = server._next_rv()
        return original(method, version, rest, query, body)

    server._slices_route = racing
    pub = make(server)
    pub.update(unhealthy={1})
    pub.start()
    try:
        assert server.wait_for(lambda s: "gpu-1" not in device_names(s))
    finally:
        pub.stop()
    puts = [r for r in server.requests if r.method == "PUT" and r.path.endswith(f"/{name}")]
    assert len(puts) == 2


def test_a_slice_deleted_by_someone_else_is_created_again_on_the_next_change(server):
    server.add_node("node-1")
    pub = make(server)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        name = server.slices()[0]["metadata"]["name"]
        server.delete_slice(name)
        pub.update(unhealthy={2})
        assert server.wait_for(lambda s: len(s) == expected_slices(unhealthy={2}) and "gpu-2" not in device_names(s))
    finally:
        pub.stop()


def test_unreachable_server_is_not_ready_then_publishes_on_recovery(server, caplog):
    server.add_node("node-1")
    server.go_down()
    pub = make(server)
    with caplog.at_level(logging.WARNING, logger="agent.dra.publisher"):
        pub.start()
        try:
            time.sleep(0.6)  # several retries
            assert not pub.ready()
            server.come_up()
            assert eventually(pub.ready, 30)
        finally:
            pub.stop()
    failures = [r for r in caplog.records if "cannot publish" in r.getMessage()]
    assert len(failures) == 1, "one log line per reason, not per retry"
    assert "unreachable" in failures[0].getMessage()
    assert len(server.slices()) == expected_slices()


def test_forbidden_then_server_error_logs_once_per_reason_and_recovers(server, caplog):
    server.add_node("node-1")
    server.fail(403, method="POST", times=4, message="resourceslices is forbidden")
    server.fail(500, method="POST", times=3)
    pub = make(server)
    with caplog.at_level(logging.WARNING, logger="agent.dra.publisher"):
        pub.start()
        try:
            assert eventually(pub.ready, 30)
        finally:
            pub.stop()
    failures = [r.getMessage() for r in caplog.records if "cannot publish" in r.getMessage()]
    assert len(failures) == 2
    assert "403 Forbidden" in failures[0] and "forbidden" in failures[0]
    assert "500 InternalError" in failures[1]


def test_node_not_found_publishes_without_owner(server):
    pub = make(server)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
    finally:
        pub.stop()
    assert "ownerReferences" not in server.slices()[0]["metadata"]


def test_group_not_served_is_not_ready():
    with ApiServerStub(()) as server:
        pub = make(server)
        pub.start()
        try:
            assert not eventually(pub.ready, 0.5)
        finally:
            pub.stop()


def test_slices_are_kept_on_stop_by_default_and_deleted_when_configured(server):
    server.add_node("node-1")
    pub = make(server)
    pub.start()
    assert eventually(pub.ready, 30)
    pub.stop()
    assert len(server.slices()) == expected_slices()
    pub = make(server, delete_on_stop=True)
    pub.start()
    assert eventually(pub.ready, 30)
    pub.stop()
    assert server.slices() == []


def test_restart_with_unchanged_content_writes_nothing(server):
    server.add_node("node-1")
    pub = make(server)
    pub.start()
    assert eventually(pub.ready, 30)
    pub.stop()
    writes = server.count("POST") + server.count("PUT")
    pub = make(server)
    pub.start()
    assert eventually(pub.ready, 30)
    pub.stop()
    assert server.count("POST") + server.count("PUT") == writes
    assert server.slices()[0]["spec"]["pool"]["generation"] == 1


def test_other_drivers_and_nodes_slices_are_left_alone_and_our_strays_removed(server):
    server.add_node("node-1")
    base = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "spec": {"pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}, "devices": []}}

    def put(name, driver, node):
        obj = {**base, "metadata": {"name": name},
               "spec": {**base["spec"], "driver": driver, "nodeName": node}}
        server.put_slice(obj)

    put("other-driver", "nic.example.com", "node-1")
    put("other-node", DRIVER, "node-2")
    put("stray", DRIVER, "node-1")
    pub = make(server)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
    finally:
        pub.stop()
    names = [o["metadata"]["name"] for o in server.slices()]
    assert "other-driver" in names and "other-node" in names and "stray" not in names
