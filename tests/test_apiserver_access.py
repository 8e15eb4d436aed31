"""The stand-in API server as the agent meets it: the agent's identity (a pod-bound service
account token of the agent on ``node-1``) has exactly the permissions of the project's
manifests (``daemonset/dra``, ``daemonset/nodefeature``), and the server keeps the behaviours
the agent relies on: 409 on a stale resourceVersion, 404, 422 in the server's Status shape,
403 where RBAC forbids, a watch that ends and is resumed, fields of disabled features dropped.

Who stops an agent from writing another node's objects: not RBAC (its ClusterRole allows
every ResourceSlice, its Role every NodeFeature of its namespace) and not the Node authorizer
or NodeRestriction (they apply to kubelets, ``system:node:<name>``, and know no NodeFeature):
the two ValidatingAdmissionPolicies of the manifests, which compare the node the object names
with the node in the agent's token.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from waiting import eventually

from agent.dra.publish_settings import PublishSettings
from agent.dra.publisher import SlicePublisher
from agent.dra.view import DraView
from tests.testbed.apiserver_auth import Access, load_variant, own_node_policies, service_account
from tests.testbed.apiserver_stub import ApiServerStub
from tests.testbed.kubelet_stub import hgx8_topology

NS = "gpu-topology-agent"
NFD = ("nfd.k8s-sigs.io", "v1alpha1")
DRIVER = "gpu.gpu-agent.io"


def connect(api: ApiServerStub, token: str | None) -> client.ApiClient:
    cfg = api.configuration()
    if token:
        cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


def serve(variant: str, **kw) -> ApiServerStub:
    access = Access.from_deploy(variant)
    access.add_token("node-1-agent", service_account(NS, "gpu-topology-agent", "node-1"))
    access.add_token("unbound-agent", service_account(NS, "gpu-topology-agent"))  # a token without a node
    return ApiServerStub(access=access, **kw).start()


def nodefeature(name: str, node: str, labels: dict[str, str] | None = None) -> dict:
    return {"apiVersion": "nfd.k8s-sigs.io/v1alpha1", "kind": "NodeFeature",
            "metadata": {"name": name, "namespace": NS, "labels": {"nfd.node.kubernetes.io/node-name": node}},
            "spec": {"labels": labels or {"nvidia.com/gpu.count": "8"}}}


def status_of(exc: ApiException) -> dict:
    return dict(json.loads(exc.body))


@pytest.fixture
def nfd():
    api = serve("nodefeature")
    yield api
    api.stop()


# ---------------------------------------------------------------------- another node's objects
def test_an_agent_cannot_create_change_or_delete_another_nodes_nodefeature(nfd):
    objects = client.CustomObjectsApi(connect(nfd, "node-1-agent"))
    nfd.put_nodefeature(nodefeature("gpu-topology-agent-node-2", "node-2"))  # node-2's agent wrote it
    attempts = [
        lambda: objects.create_namespaced_custom_object(*NFD, NS, "nodefeatures",
                                                        nodefeature("gpu-topology-agent-node-3", "node-3")),
        # its own object's name, labelled for another node: NFD would label node-3
        lambda: objects.create_namespaced_custom_object(*NFD, NS, "nodefeatures",
                                                        nodefeature("gpu-topology-agent-node-1", "node-3")),
        lambda: objects.replace_namespaced_custom_object(*NFD, NS, "nodefeatures", "gpu-topology-agent-node-2",
                                                         nodefeature("gpu-topology-agent-node-2", "node-1")),
        lambda: objects.delete_namespaced_custom_object(*NFD, NS, "nodefeatures", "gpu-topology-agent-node-2"),
        # NFD's own worker object of node-1 is not the agent's either
        lambda: objects.create_namespaced_custom_object(*NFD, NS, "nodefeatures", nodefeature("node-1", "node-1")),
    ]
    for attempt in attempts:
        with pytest.raises(ApiException) as denied:
            attempt()
        body = status_of(denied.value)
        assert denied.value.status == 422 and body["reason"] == "Invalid"
        assert "ValidatingAdmissionPolicy 'gpu-topology-agent-own-node-nodefeatures'" in body["message"]
    assert [o["metadata"]["name"] for o in nfd.nodefeatures()] == ["gpu-topology-agent-node-2"]
    created = objects.create_namespaced_custom_object(*NFD, NS, "nodefeatures",
                                                      nodefeature("gpu-topology-agent-node-1", "node-1"))
    assert created["metadata"]["resourceVersion"]


def test_a_token_without_a_node_writes_no_nodefeature(nfd):
    objects = client.CustomObjectsApi(connect(nfd, "unbound-agent"))
    with pytest.raises(ApiException) as denied:
        objects.create_namespaced_custom_object(*NFD, NS, "nodefeatures",
                                                nodefeature("gpu-topology-agent-node-1", "node-1"))
    assert denied.value.status == 422 and "names no node" in status_of(denied.value)["message"]


def test_an_agent_cannot_publish_or_delete_another_nodes_resource_slices(caplog):
    api = serve("dra")
    try:
        api.add_node("node-1")
        api.add_node("node-2")
        mine = SlicePublisher(lambda: connect(api, "node-1-agent"), DraView(hgx8_topology()),
                              PublishSettings("node-1", DRIVER, backoff_initial_s=0.05, backoff_max_s=0.1))
        mine.start()
        assert eventually(lambda: len(api.slices()) > 0, 10), "the DRA overlay's RBAC lets the agent publish its own node's slices"
        mine.stop()
        # the same identity publishing as node-2 (a wrong --node-name, or a stolen token)
        with caplog.at_level(logging.WARNING, logger="agent.dra.publisher"):
            theirs = SlicePublisher(lambda: connect(api, "node-1-agent"), DraView(hgx8_topology()),
                                    PublishSettings("node-2", DRIVER, backoff_initial_s=0.05, backoff_max_s=0.1))
            theirs.start()
            assert eventually(lambda: any("gpu-topology-agent-own-node-slices" in r.getMessage()
                                          for r in caplog.records), 10)
            theirs.stop()
        assert {s["spec"]["nodeName"] for s in api.slices()} == {"node-1"}
        node1_slice = api.slices()[0]["metadata"]["name"]
        api.put_slice({**api.slices()[0], "metadata": {"name": "node-2-slice"},
                       "spec": {**api.slices()[0]["spec"], "nodeName": "node-2"}})
        resource = client.ResourceV1Api(connect(api, "node-1-agent"))
        with pytest.raises(ApiException) as denied:
            resource.delete_resource_slice("node-2-slice")
        assert denied.value.status == 422
        assert "gpu-topology-agent-own-node-slices" in status_of(denied.value)["message"]
        resource.delete_resource_slice(node1_slice)  # its own: allowed
    finally:
        api.stop()


# ---------------------------------------------------------------------- RBAC
def test_rbac_grants_the_nodefeature_sink_its_four_verbs_in_its_namespace_only(nfd):
    objects = client.CustomObjectsApi(connect(nfd, "node-1-agent"))
    for forbidden in (
        lambda: objects.list_namespaced_custom_object(*NFD, NS, "nodefeatures"),  # no list, no watch
        lambda: objects.get_namespaced_custom_object(*NFD, "default", "nodefeatures", "gpu-topology-agent-node-1"),
        lambda: client.CoreV1Api(connect(nfd, "node-1-agent")).read_node("node-1"),
    ):
        with pytest.raises(ApiException) as denied:
            forbidden()
        body = status_of(denied.value)
        assert denied.value.status == 403 and body["reason"] == "Forbidden"
        assert 'User "system:serviceaccount:gpu-topology-agent:gpu-topology-agent" cannot' in body["message"]
    with pytest.raises(ApiException) as missing:  # get is allowed: a 404, not a 403
        objects.get_namespaced_custom_object(*NFD, NS, "nodefeatures", "gpu-topology-agent-node-1")
    assert missing.value.status == 404


def test_the_base_manifests_grant_nothing_and_an_unknown_token_is_unauthorized():
    api = serve("base")
    try:
        with pytest.raises(ApiException) as denied:
            client.CustomObjectsApi(connect(api, "node-1-agent")).get_namespaced_custom_object(
                *NFD, NS, "nodefeatures", "x")
        assert denied.value.status == 403
        with pytest.raises(ApiException) as unknown:
            client.CustomObjectsApi(connect(api, "stolen")).get_namespaced_custom_object(*NFD, NS, "nodefeatures", "x")
        assert unknown.value.status == 401
    finally:
        api.stop()


def test_a_policy_the_stand_in_cannot_read_is_refused_not_ignored():
    objects = load_variant("nodefeature")
    policy = next(o for o in objects if o["kind"] == "ValidatingAdmissionPolicy")
    policy["spec"]["matchConditions"][0]["expression"] = "request.userInfo.username.startsWith('system:')"
    with pytest.raises(ValueError, match="not the own-node shape"):
        own_node_policies(objects)


# ---------------------------------------------------------------------- conflicts and validation
def test_a_stale_resource_version_is_a_409_and_a_precondition_too(nfd):
    objects = client.CustomObjectsApi(connect(nfd, "node-1-agent"))
    created = objects.create_namespaced_custom_object(*NFD, NS, "nodefeatures",
                                                      nodefeature("gpu-topology-agent-node-1", "node-1"))
    updated = objects.replace_namespaced_custom_object(*NFD, NS, "nodefeatures", "gpu-topology-agent-node-1",
                                                       created)
    assert updated["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
    for stale in (
        lambda: objects.replace_namespaced_custom_object(*NFD, NS, "nodefeatures", "gpu-topology-agent-node-1",
                                                         created),
        lambda: objects.delete_namespaced_custom_object(
            *NFD, NS, "nodefeatures", "gpu-topology-agent-node-1",
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(
                resource_version=created["metadata"]["resourceVersion"]))),
    ):
        with pytest.raises(ApiException) as conflict:
            stale()
        assert conflict.value.status == 409 and status_of(conflict.value)["reason"] == "Conflict"
    with pytest.raises(ApiException) as gone:
        objects.replace_namespaced_custom_object(*NFD, NS, "nodefeatures", "gpu-topology-agent-node-9",
                                                 nodefeature("gpu-topology-agent-node-9", "node-1"))
    assert gone.value.status in (404, 422)


def test_an_object_validation_refuses_is_a_422_in_the_servers_status_shape(nfd):
    objects = client.CustomObjectsApi(connect(nfd, "node-1-agent"))
    bad = nodefeature("gpu-topology-agent-node-1", "node-1")
    bad["spec"] = None
    with pytest.raises(ApiException) as refused:
        objects.create_namespaced_custom_object(*NFD, NS, "nodefeatures", bad)
    body = status_of(refused.value)
    assert refused.value.status == 422
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": 'NodeFeature.nfd.k8s-sigs.io "gpu-topology-agent-node-1" is invalid: spec: Required value',
                    "reason": "Invalid", "code": 422,
                    "details": {"name": "gpu-topology-agent-node-1", "group": "nfd.k8s-sigs.io", "kind": "NodeFeature",
                                "causes": [{"reason": "FieldValueRequired", "message": "Required value",
                                            "field": "spec"}]}}


def test_a_refused_resource_slice_names_the_field_in_the_invalid_shape():
    with ApiServerStub() as api:
        bad = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
               "spec": {"driver": DRIVER, "nodeName": "node-1",
                        "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
                        "devices": [{"name": "GPU_0"}]}}
        with pytest.raises(ApiException) as refused:
            client.ResourceV1Api(api.api_client()).create_resource_slice(bad)
        body = status_of(refused.value)
        assert refused.value.status == 422 and body["reason"] == "Invalid"
        assert body["message"].startswith('ResourceSlice.resource.k8s.io "s" is invalid: spec.devices[0].name:')
        assert body["details"]["causes"][0]["field"] == "spec.devices[0].name"


# ---------------------------------------------------------------------- disabled features
def test_fields_of_a_disabled_feature_are_dropped_on_write_unless_already_in_use():
    slice_ = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
              "spec": {"driver": DRIVER, "nodeName": "node-1",
                       "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
                       "devices": [{"name": "gpu-0", "taints": [{"key": "k", "effect": "NoSchedule"}]}]}}
    with ApiServerStub(disabled_features=("DRADeviceTaints",)) as api:
        resource = client.ResourceV1Api(api.api_client())
        created = json.loads(resource.create_resource_slice(slice_, _preload_content=False).data)
        assert "taints" not in created["spec"]["devices"][0]  # the answer shows what was stored
        assert "taints" not in api.slices()[0]["spec"]["devices"][0]
    with ApiServerStub() as api:  # the gate was on when the taint was written, then turned off
        api.put_slice(slice_)
        api.disabled_features = frozenset({"DRADeviceTaints"})
        update = api.slices()[0]
        update["spec"]["devices"][0]["taints"].append({"key": "k2", "effect": "NoExecute"})
        client.ResourceV1Api(api.api_client()).replace_resource_slice("s", update, _preload_content=False)
        assert len(api.slices()[0]["spec"]["devices"][0]["taints"]) == 2


# ---------------------------------------------------------------------- watch
def test_a_watch_ends_and_resumes_from_the_last_resource_version_and_a_compacted_one_is_gone(nfd):
    objects = client.CustomObjectsApi(connect(nfd, "node-1-agent"))
    nfd.put_nodefeature(nodefeature("gpu-topology-agent-node-1", "node-1"))
    nfd.access.rbac.roles[(NS, "gpu-topology-agent-nodefeatures")].append(
        {"apiGroups": ["nfd.k8s-sigs.io"], "resources": ["nodefeatures"], "verbs": ["list", "watch"]})
    seen: list[tuple[str, str]] = []
    last_rv = ""

    def consume(resource_version: str) -> None:
        nonlocal last_rv
        kwargs = {"resource_version": resource_version} if resource_version else {}
        for event in watch.Watch().stream(objects.list_namespaced_custom_object, *NFD, NS, "nodefeatures",
                                          timeout_seconds=30, **kwargs):
            seen.append((event["type"], event["object"]["metadata"]["name"]))
            last_rv = event["object"]["metadata"]["resourceVersion"]

    first = threading.Thread(target=consume, args=("",))
    first.start()
    assert eventually(lambda: seen == [("ADDED", "gpu-topology-agent-node-1")], 10)
    nfd.modify_nodefeature(NS, "gpu-topology-agent-node-1", lambda o: o["spec"]["labels"].update(x="1"))
    assert eventually(lambda: len(seen) == 2, 10)
    nfd.end_watches()  # the server ends the watch; the client must resume
    first.join(10)
    assert not first.is_alive()
    nfd.delete_nodefeature(NS, "gpu-topology-agent-node-1")  # while nobody watched
    resumed = threading.Thread(target=consume, args=(last_rv,))
    resumed.start()
    assert eventually(lambda: seen[-1] == ("DELETED", "gpu-topology-agent-node-1"), 10), seen
    nfd.end_watches()
    resumed.join(10)
    assert seen == [("ADDED", "gpu-topology-agent-node-1"), ("MODIFIED", "gpu-topology-agent-node-1"),
                    ("DELETED", "gpu-topology-agent-node-1")]
    nfd.put_nodefeature(nodefeature("gpu-topology-agent-node-1", "node-1"))
    nfd.compact()  # the history up to now is gone: last_rv is older than what is kept
    with pytest.raises(ApiException) as expired:  # the client raises the ERROR event's 410
        consume(last_rv)
    assert expired.value.status == 410
