"""The ResourceSlice publisher against the stand-in API server, through the official client."""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import datetime, timezone

import pytest
from prometheus_client import CollectorRegistry
from waiting import eventually

from agent.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from agent.dra.devices import parse_set_name
from agent.dra.publish_settings import PublishSettings
from agent.dra.publisher import SlicePublisher
from agent.dra.slices import render_slices
from agent.dra.view import DraView
from agent.health import HealthState
from agent.kube import pick_version
from agent.metrics.self_metrics import AgentMetrics
from tests.testbed.apiserver_stub import ApiServerStub
from tests.testbed.dra_allocator_model import gather_pools
from tests.testbed.kubelet_stub import hgx8_topology

DRIVER = "gpu.gpu-agent.io"


def device_names(slices):
    """Every device name of the pool's slices (counter slice, single GPUs, GPU sets)."""
    return [d["name"] for obj in slices for d in obj["spec"].get("devices", [])]


def taints(slices, name):
    """The taints of device ``name`` (None when it is not published)."""
    for obj in slices:
        for d in obj["spec"].get("devices", []):
            if d["name"] == name:
                return (d.get("basic") or d).get("taints", [])
    return None


def tainted(slices, name):
    return bool(taints(slices, name))


@pytest.fixture
def server():
    with ApiServerStub() as s:
        yield s


def expected_slices(unhealthy=frozenset()) -> int:
    """How many slices the agent's rendering of the test node holds (what `slices` prints)."""
    return len(render_slices(hgx8_topology(), node_name="node-1", driver=DRIVER, unhealthy=unhealthy))


def make(server, topology=None, *, health=None, prepared=None, events=None, **settings):
    settings.setdefault("backoff_initial_s", 0.05)
    settings.setdefault("backoff_max_s", 0.2)
    return SlicePublisher(server.api_client, DraView(topology or hgx8_topology()), PublishSettings("node-1", DRIVER, **settings),
                          health=health, prepared=prepared, events=events)


@contextlib.contextmanager
def running(server, **kwargs):
    """A publisher (:func:`make`'s arguments) started, ready, and stopped on the way out."""
    pub = make(server, **kwargs)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        yield pub
    finally:
        pub.stop()


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
            pub.update(unhealthy={3: "XID 79"})
            assert server.wait_for(lambda s: s and tainted(s, "gpu-3"))
        finally:
            pub.stop()
        objs = server.slices()
        # v1: a counter slice, then the single GPUs and the GPU sets (15 devices); older
        # versions: the single GPUs only. The taint changed one slice: the same generation
        assert len(objs) == (2 if expected == "v1" else 1)
        for obj in objs:
            assert obj["apiVersion"] == f"resource.k8s.io/{expected}"
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
            assert obj["spec"]["pool"] == {"name": "node-1", "generation": 1, "resourceSliceCount": len(objs)}
        obj = next(o for o in objs if o["spec"].get("devices"))
        discovery = [r for r in server.requests if r.path == "/apis/resource.k8s.io"]
        assert len(discovery) == 1  # discovery once at start
        assert server.count("POST", f"/apis/resource.k8s.io/{expected}/resourceslices") == (2 if expected == "v1" else 1)
        if expected == "v1beta1":
            assert "basic" in obj["spec"]["devices"][0]
        else:
            assert "attributes" in obj["spec"]["devices"][0]


def test_an_unhealthy_gpu_and_its_sets_are_tainted_with_the_reason_and_untainted_on_recovery(server):
    server.add_node("node-1")
    health = HealthState(8)
    pub = make(server, health=health)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        first = server.slices()[0]["spec"]["pool"]["generation"]
        sets_of_5 = [d["name"] for o in server.slices() for d in o["spec"].get("devices", [])
                     if "gpu-5" in (d.get("consumesCounters") or [{}])[0].get("counters", {}) and d["name"] != "gpu-5"]
        health.mark_unhealthy(5, "XID 79")
        assert server.wait_for(lambda s: all(tainted(s, n) for n in ["gpu-5", *sets_of_5]))
        slices = server.slices()
        want = [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
        assert [{k: v for k, v in t.items() if k != "timeAdded"} for t in taints(slices, "gpu-5")] == want
        # the sets published with GPU 5 stay (a claim may hold one), tainted; new sets leave it out
        assert len(sets_of_5) == 3 and all(tainted(slices, n) for n in sets_of_5)
        assert sum(tainted(slices, n) for n in device_names(slices)) == 1 + len(sets_of_5)
        second = slices[0]["spec"]["pool"]["generation"]
        health.mark_healthy(5)
        assert server.wait_for(lambda s: not any(tainted(s, n) for n in device_names(s)))
        third = server.slices()[0]["spec"]["pool"]["generation"]
    finally:
        pub.stop()
    assert first == second == third  # one slice changed each time: rewritten in place


def test_the_taint_effect_is_the_configured_one_and_a_kept_taint_keeps_the_time_it_was_added(server):
    server.add_node("node-1")
    pub = make(server, taint_effect="NoExecute")
    pub.update(unhealthy={2: "double-bit ECC error"})
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        (taint,) = taints(server.slices(), "gpu-2")
        assert (taint["key"], taint["value"], taint["effect"]) == (f"{DRIVER}/ecc", "double-bit", "NoExecute")
        assert taint["timeAdded"]  # set by the server
        name = next(o["metadata"]["name"] for o in server.slices() if taints([o], "gpu-2"))

        def backdate(obj):
            for d in obj["spec"]["devices"]:
                for t in d.get("taints", []):
                    t["timeAdded"] = "2020-01-01T00:00:00Z"
        server.modify_slice(name, backdate)
        pub.update(unhealthy={2: "double-bit ECC error", 6: "GPU lost"})
        assert server.wait_for(lambda s: tainted(s, "gpu-6"))
        kept = taints(server.slices(), "gpu-2")[0]["timeAdded"]  # the client writes RFC 3339 its own way
        assert datetime.fromisoformat(kept.replace("Z", "+00:00")) == datetime(2020, 1, 1, tzinfo=timezone.utc)
        assert taints(server.slices(), "gpu-6")[0]["key"] == f"{DRIVER}/lost"
    finally:
        pub.stop()
    writes = server.count("POST") + server.count("PUT")
    pub = make(server, taint_effect="NoExecute")
    pub.update(unhealthy={2: "double-bit ECC error", 6: "GPU lost"})
    pub.start()  # a restart with the same health: the server's taint times are no change
    assert eventually(pub.ready, 30)
    pub.stop()
    assert server.count("POST") + server.count("PUT") == writes


def test_stale_resource_version_conflict_is_reread_and_retried(server):
    server.add_node("node-1")
    pub = make(server)
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        name = next(o["metadata"]["name"] for o in server.slices() if "gpu-0" in device_names([o]))
        # another writer changes the slice behind the publisher's back, between its list and
        # its update: the first PUT carries a stale resourceVersion
        server.fail(409, method="PUT", times=1)
        server.modify_slice(name, lambda o: o["metadata"].setdefault("labels", {}).update(x="y"))
        pub.update(unhealthy={0})
        assert server.wait_for(lambda s: tainted(s, "gpu-0"))
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
    name = next(o["metadata"]["name"] for o in server.slices() if "gpu-1" in device_names([o]))
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
        assert server.wait_for(lambda s: tainted(s, "gpu-1"))
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
        assert server.wait_for(lambda s: len(s) == expected_slices(unhealthy={2}) and tainted(s, "gpu-2"))
    finally:
        pub.stop()


def test_unreachable_server_is_not_ready_then_publishes_on_recovery(server, caplog):
    server.add_node("node-1")
    server.go_down()
    pub = make(server)
    with caplog.at_level(logging.INFO, logger="agent.dra.publisher"):
        pub.start()
        try:
            time.sleep(0.6)  # several retries
            assert not pub.ready()
            server.come_up()
            assert eventually(pub.ready, 30)
        finally:
            pub.stop()
    failures = [r for r in caplog.records if "the ResourceSlices of node" in r.getMessage() and " failed: " in r.getMessage()]
    assert len(failures) == 1, "one log line per reason, not per retry"
    assert "unreachable" in failures[0].getMessage()
    assert [r.getMessage() for r in caplog.records if "works again" in r.getMessage()] == [
        "publishing the ResourceSlices of node node-1 works again"]
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
    failures = [r.getMessage() for r in caplog.records if "the ResourceSlices of node" in r.getMessage() and " failed: " in r.getMessage()]
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


# ---------------------------------------------------------------------- read-back fallback
def feature(registry, name):
    return registry.get_sample_value("gpu_agent_dra_api_feature", {"feature": name})


def test_without_partitionable_devices_only_single_gpus_are_published_said_once_and_in_the_metric(caplog):
    registry = CollectorRegistry()
    with ApiServerStub(disabled_features={"DRAPartitionableDevices"}) as server:
        server.add_node("node-1")
        stored = []  # every device name the server ever stored
        create, update = server._create_slice, server._update_slice

        def recording(write):
            def call(*args):
                code, obj = write(*args)
                stored.extend(d["name"] for d in obj["spec"].get("devices", []))
                return code, obj
            return call
        server._create_slice, server._update_slice = recording(create), recording(update)
        health = HealthState(8)
        pub = make(server, health=health, events=AgentMetrics(registry))
        with caplog.at_level(logging.WARNING, logger="agent.dra.publisher"):
            pub.start()
            try:
                assert eventually(pub.ready, 30)
                health.mark_unhealthy(4, "XID 79")
                assert server.wait_for(lambda s: tainted(s, "gpu-4"))
                health.mark_healthy(4)
                assert server.wait_for(lambda s: not tainted(s, "gpu-4"))
            finally:
                pub.stop()
        slices = server.slices()
    assert sorted(device_names(slices)) == [f"gpu-{i}" for i in range(8)]
    assert not any("sharedCounters" in o["spec"] or any("consumesCounters" in d for d in o["spec"]["devices"])
                   for o in slices)
    # the counter slice is written first: no GPU set was ever stored without its counters
    assert not any(n.startswith("gpuset-") for n in stored)
    said = [r.getMessage() for r in caplog.records if "stored without" in r.getMessage()]
    assert len(said) == 1 and "DRAPartitionableDevices" in said[0] and "single GPUs only" in said[0]
    assert feature(registry, "DRAPartitionableDevices") == 0.0
    assert feature(registry, "DRADeviceTaints") == 1.0


def test_without_device_taints_unhealthy_devices_leave_but_those_of_prepared_claims_stay_until_unprepared(
        tmp_path, caplog):
    registry = CollectorRegistry()
    checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
    with ApiServerStub(disabled_features={"DRADeviceTaints"}) as server:
        server.add_node("node-1")
        health = HealthState(8)
        pub = make(server, health=health, prepared=checkpoint, events=AgentMetrics(registry))
        with caplog.at_level(logging.WARNING, logger="agent.dra.publisher"):
            pub.start()
            try:
                assert eventually(pub.ready, 30)
                pair = next(d for o in server.slices() for d in o["spec"].get("devices", [])
                            if d["name"].startswith("gpuset-2-"))  # the first pair
                (bad, other) = parse_set_name(pair["name"])
                checkpoint.add(PreparedClaim("uid-1", "default", "train",
                                             (PreparedDevice("gpus", "node-1", pair["name"], ("x",)),),
                                             str(tmp_path / "spec.json")))
                health.mark_unhealthy(bad, "XID 79")
                assert server.wait_for(lambda s: f"gpu-{bad}" not in device_names(s))
                names = device_names(server.slices())
                assert pair["name"] in names and f"gpu-{other}" in names  # the prepared set stays
                assert not any(tainted(server.slices(), n) for n in names)
                checkpoint.remove("uid-1")  # unprepared: now it leaves too
                assert server.wait_for(lambda s: pair["name"] not in device_names(s))
                health.mark_healthy(bad)
                assert server.wait_for(lambda s: f"gpu-{bad}" in device_names(s) and pair["name"] in device_names(s))
            finally:
                pub.stop()
    said = [r.getMessage() for r in caplog.records if "stored without" in r.getMessage()]
    assert len(said) == 1 and "DRADeviceTaints" in said[0] and "left out" in said[0]
    assert feature(registry, "DRADeviceTaints") == 0.0
    assert feature(registry, "DRAPartitionableDevices") == 1.0


@pytest.mark.parametrize("version,setting,sets", [
    ("1.36", "auto", False), ("1.37", "auto", True), ("1.38", "auto", True),
    ("1.36", "on", True), ("1.37", "off", False),
])
def test_gpu_sets_follow_the_api_servers_version_said_in_one_line_and_the_metric(version, setting, sets, caplog):
    registry = CollectorRegistry()
    with ApiServerStub(server_version=version) as server:
        server.add_node("node-1")
        pub = make(server, gpu_sets=setting, events=AgentMetrics(registry))
        with caplog.at_level(logging.INFO, logger="agent.dra.publisher"):
            pub.start()
            try:
                assert eventually(pub.ready, 30)
            finally:
                pub.stop()
        names = device_names(server.slices())
        assert any(n.startswith("gpuset-") for n in names) == sets
        assert any("sharedCounters" in o["spec"] for o in server.slices()) == sets
        assert server.count("GET", "/version") == (1 if setting == "auto" else 0)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU sets ")]
    assert len(said) == 1 and said[0].startswith("GPU sets published" if sets else "GPU sets not published")
    assert f"dra.gpuSets is {setting}" in said[0]
    if setting == "auto":
        assert f"Kubernetes {version}" in said[0] and ("before 1.37" in said[0]) == (not sets)
    mode = "on" if sets else "off"
    assert registry.get_sample_value("gpu_agent_dra_gpu_sets_mode", {"mode": mode, "setting": setting}) == 1.0


# ----------------------------------------------------------------------- withdrawing a set
WITHDRAWN = (f"{DRIVER}/withdrawn", "member-in-use", "NoSchedule")


def sets_holding(slices, gpu):
    """The set devices published with GPU ``gpu`` among their members (by their names)."""
    return sorted(d["name"] for o in slices for d in o["spec"].get("devices", [])
                  if gpu in (parse_set_name(d["name"]) or ()))


def declared(slices):
    """The counters the pool's counter slice declares."""
    return {c for o in slices for cs in o["spec"].get("sharedCounters", []) for c in cs["counters"]}


def consumed(slices):
    """The counters the pool's devices consume."""
    return {c for o in slices for d in o["spec"].get("devices", []) for u in d.get("consumesCounters") or ()
            for c in u["counters"]}


def withdrawal(slices, name):
    """The withdrawal taint of device ``name``: ((key, value, effect), timeAdded as a datetime), or None."""
    for t in taints(slices, name) or ():
        if t["key"] == WITHDRAWN[0]:
            return (t["key"], t["value"], t["effect"]), datetime.fromisoformat(t["timeAdded"].replace("Z", "+00:00"))
    return None


def backdate_withdrawals(server, names):
    """Move the withdrawal taints of the slices holding ``names`` to 2020: their grace ran out."""
    def backdate(obj):
        for d in obj["spec"]["devices"]:
            for t in d.get("taints", []):
                t["timeAdded"] = "2020-01-01T00:00:00Z"
    for name in {o["metadata"]["name"] for o in server.slices() if any(withdrawal([o], n) for n in names)}:
        server.modify_slice(name, backdate)


def hold(checkpoint, tmp_path, uid, device):
    checkpoint.add(PreparedClaim(uid, "default", uid, (PreparedDevice("gpus", "node-1", device, ("x",)),),
                                 str(tmp_path / f"{uid}.json")))


def test_a_set_whose_gpu_is_held_through_another_device_is_tainted_then_withdrawn_after_the_grace(
        server, tmp_path, caplog):
    server.add_node("node-1")
    checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
    pub = make(server, prepared=checkpoint, withdrawal_grace_s=3.0)
    with caplog.at_level(logging.INFO, logger="agent.dra.publisher"):
        pub.start()
        try:
            assert eventually(pub.ready, 30)
            due = sets_holding(server.slices(), 0)
            assert due and not any(tainted(server.slices(), n) for n in due)
            hold(checkpoint, tmp_path, "uid-1", "gpu-0")  # GPU 0 held as a single: every set holding it is due
            assert server.wait_for(lambda s: all(withdrawal(s, n) for n in due), 2.0)
            marks = {n: withdrawal(server.slices(), n) for n in due}
            assert {m[0] for m in marks.values()} == {WITHDRAWN}
            added = min(m[1] for m in marks.values())
            time.sleep(max(0.0, (added - datetime.now(timezone.utc)).total_seconds() + 1.5))
            # not before the grace ran out (1.5 s left: room for a slow machine)
            assert set(due) <= set(device_names(server.slices()))
            assert server.wait_for(lambda s: not set(due) & set(device_names(s)), 10.0)
            assert "gpu-0" in device_names(server.slices())
        finally:
            pub.stop()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("withdrawing a GPU set")]
    assert len(said) == 1 and f"tainted {DRIVER}/withdrawn, withdrawn after 3 s" in said[0]


def test_the_single_gpus_of_a_held_set_are_tainted_then_withdrawn_after_the_grace_and_return_when_it_ends(
        server, tmp_path):
    server.add_node("node-1")
    checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
    registry = CollectorRegistry()
    pub = make(server, prepared=checkpoint, withdrawal_grace_s=3.0, events=AgentMetrics(registry))

    def published(kind, state):
        return registry.get_sample_value("gpu_agent_dra_published_devices", {"kind": kind, "state": state})
    pub.start()
    try:
        assert eventually(pub.ready, 30)
        assert published("gpu", "ordinary") == 8 and published("gpu", "withdrawing") == 0
        (pair, *_) = [n for n in device_names(server.slices()) if n.startswith("gpuset-2-")]
        members = [f"gpu-{g}" for g in parse_set_name(pair)]
        hold(checkpoint, tmp_path, "uid-1", pair)  # the pair's GPUs held through it
        assert server.wait_for(lambda s: all(withdrawal(s, n) for n in members), 2.0)
        assert eventually(lambda: published("gpu", "withdrawing") == 2 and published("gpu", "ordinary") == 6, 2.0)
        assert published("gpuset", "withdrawing") == sum(
            1 for o in server.slices() for d in o["spec"].get("devices", [])
            if d["name"].startswith("gpuset-") and withdrawal([o], d["name"]))
        devices = {d["name"]: d for o in server.slices() for d in o["spec"].get("devices", [])}
        assert all(devices[n]["attributes"][f"{DRIVER}/heldBySet"] == {"bool": True} for n in members)
        assert pair in devices and not withdrawal(server.slices(), pair)  # the held set stays, untainted
        added = min(withdrawal(server.slices(), n)[1] for n in members)
        time.sleep(max(0.0, (added - datetime.now(timezone.utc)).total_seconds() + 1.5))
        assert set(members) <= set(device_names(server.slices()))  # not before the grace ran out
        assert server.wait_for(lambda s: not set(members) & set(device_names(s)), 10.0)
        assert pair in device_names(server.slices())
        assert eventually(lambda: published("gpu", "withdrawing") == 0 and published("gpu", "ordinary") == 6, 2.0)
        checkpoint.remove("uid-1")  # the claim ended: the singles come back, ordinary devices
        assert server.wait_for(lambda s: set(members) <= set(device_names(s)), 2.0)
        devices = {d["name"]: d for o in server.slices() for d in o["spec"].get("devices", [])}
        assert all(devices[n]["attributes"][f"{DRIVER}/heldBySet"] == {"bool": False} and not devices[n].get("taints")
                   for n in members)
    finally:
        pub.stop()
    # every pool the stand-in held on the way, tainting, withdrawing, publishing again, was usable
    # (after the first complete one: the first publication creates its slices one by one)
    usable = [len(p) == 1 and not p[0].incomplete and not p[0].invalid
              for p in (gather_pools(state, "node-1") for state in server.slice_history())]
    assert len(usable) >= 4 and all(usable[usable.index(True):])


def test_a_restart_keeps_the_singles_withdrawal_times_and_one_withdrawn_stays_out(server, tmp_path):
    server.add_node("node-1")
    checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
    with running(server, prepared=checkpoint):  # the default grace: 60 s
        (pair, *_) = [n for n in device_names(server.slices()) if n.startswith("gpuset-2-")]
        members = [f"gpu-{g}" for g in parse_set_name(pair)]
        hold(checkpoint, tmp_path, "uid-1", pair)
        assert server.wait_for(lambda s: all(withdrawal(s, n) for n in members), 2.0)
        added = {n: withdrawal(server.slices(), n)[1] for n in members}
    with running(server, prepared=checkpoint) as pub:  # neither withdrawn at once nor the grace started again
        assert {n: withdrawal(server.slices(), n)[1] for n in members} == added
        backdate_withdrawals(server, members)
        pub.update()
        assert server.wait_for(lambda s: not set(members) & set(device_names(s)), 2.0)
    with running(server, prepared=checkpoint) as pub:  # withdrawn before: not published again while the set is held
        pub.update()
        time.sleep(0.5)
        assert not set(members) & set(device_names(server.slices())) and pair in device_names(server.slices())


def test_a_withdrawal_is_called_off_when_the_gpu_is_free_again_and_its_time_survives_a_restart(server, tmp_path):
    server.add_node("node-1")
    checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
    with running(server, prepared=checkpoint):  # the default grace: 60 s
        due = sets_holding(server.slices(), 3)
        hold(checkpoint, tmp_path, "uid-1", "gpu-3")
        assert server.wait_for(lambda s: all(withdrawal(s, n) for n in due), 2.0)
        checkpoint.remove("uid-1")  # the claim ended before the grace ran out: the sets stay, untainted
        assert server.wait_for(lambda s: not any(tainted(s, n) for n in due), 2.0)
        assert set(due) <= set(device_names(server.slices()))
        hold(checkpoint, tmp_path, "uid-2", "gpu-3")
        assert server.wait_for(lambda s: all(withdrawal(s, n) for n in due), 2.0)
        added = {n: withdrawal(server.slices(), n)[1] for n in due}
    with running(server, prepared=checkpoint) as pub:  # a restart neither withdraws at once nor starts the grace again
        assert {n: withdrawal(server.slices(), n)[1] for n in due} == added
        backdate_withdrawals(server, due)
        pub.update()  # the grace is read from the stored taint: it ran out long ago
        assert server.wait_for(lambda s: not set(due) & set(device_names(s)), 2.0)


def test_without_device_taints_a_set_is_withdrawn_at_once(tmp_path):
    checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
    with ApiServerStub(disabled_features={"DRADeviceTaints"}) as server:
        server.add_node("node-1")
        pub = make(server, prepared=checkpoint)
        pub.start()
        try:
            assert eventually(pub.ready, 30)
            due = sets_holding(server.slices(), 5)
            hold(checkpoint, tmp_path, "uid-1", "gpu-5")
            assert server.wait_for(lambda s: not set(due) & set(device_names(s)), 2.0)
        finally:
            pub.stop()


def test_the_counter_slice_declares_what_two_devices_share_and_follows_them_through_valid_pools(server, tmp_path):
    """The scheduler compares every declared counter for each device it reserves, so the agent
    declares a GPU's counter only while two published devices stand for that GPU. A pair held
    through its set: once its singles and the other sets holding its GPUs are withdrawn (after
    the grace), the pair alone stands for them and their counters go; when its claim ends they
    come back. Every pool the stand-in stored on the way was valid: the counter slice is widened
    before the devices consume a counter it lacks and narrowed only after they stop."""
    server.add_node("node-1")
    checkpoint = Checkpoint(str(tmp_path / "claims"), fsync=False)
    everything = {f"gpu-{g}" for g in range(8)}
    with running(server, prepared=checkpoint, withdrawal_grace_s=1.0):
        assert declared(server.slices()) == consumed(server.slices()) == everything
        (pair, *_) = [n for n in device_names(server.slices()) if n.startswith("gpuset-2-")]
        gpus = {f"gpu-{g}" for g in parse_set_name(pair)}
        hold(checkpoint, tmp_path, "uid-1", pair)
        assert server.wait_for(lambda s: not gpus & declared(s), 10.0)
        assert declared(server.slices()) == consumed(server.slices()) == everything - gpus
        assert pair in device_names(server.slices()) and not set(device_names(server.slices())) & gpus
        checkpoint.remove("uid-1")
        assert server.wait_for(lambda s: declared(s) == consumed(s) == everything, 5.0)
    pools = [gather_pools(state, "node-1") for state in server.slice_history()]
    usable = [len(p) == 1 and not p[0].incomplete and not p[0].invalid for p in pools]
    assert all(usable[usable.index(True):]), [p[0].invalid for p in pools if p]
