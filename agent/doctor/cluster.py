"""Cluster checks, through the agent's one API client (:func:`agent.kube.api_client`, from
``--kubeconfig`` or the in-cluster service account) and its one call idiom
(:func:`agent.kube.call`; ``resource.k8s.io`` discovered once per run, as the agent
discovers it: :meth:`DoctorContext.resource_versions`): the API server reachable, the agent's
identity allowed each verb it needs (``SelfSubjectAccessReview``; the GPUHealthy condition's
``nodes/status`` and Events where ``health.nodeCondition`` writes them), NFD's NodeFeature API
where the label sink needs it, the ``resource.k8s.io`` versions served and whether the API
server keeps partitionable devices (DRA mode).

**Partitionable devices, read back as the agent does.** The agent learns whether the API
server keeps the ``DRAPartitionableDevices`` fields from the slice it wrote (a gate that is
off drops them without an error: :mod:`agent.dra.readback`). Doctor asks the same question
without changing anything: it sends the agent's counter slice as a *dry-run* create
(``dryRun=All``, ``generateName``), which the API server validates, admits and answers as it
would store it, and stores nothing; the answer is compared with what was sent by the
agent's own :func:`~agent.dra.readback.dropped_features`.

Each request waits at most :data:`agent.doctor.context.API_TIMEOUT_S`.
"""

from __future__ import annotations

import json
from typing import Any

from agent.doctor.context import API_TIMEOUT_S, DoctorContext, Unavailable
from agent.doctor.report import Check, Result, failed, passed, warned
from agent.dra.readback import PARTITIONABLE_DEVICES, dropped_features
from agent.dra.slices import API_VERSIONS, SETS_API_VERSIONS, render_slices
from agent.errors import AgentError, shorten
from agent.health.node_events import EVENTS_NAMESPACE
from agent.kube import ApiCallError, call, own_namespace, pick_version

__all__ = ["CHECKS", "required_access"]

NFD_GROUP, NFD_VERSION = "nfd.k8s-sigs.io", "v1alpha1"

#: What the agent does with the API server, per need: (verb, API group, resource). The rules
#: of the project's RBAC (daemonset/dra/rbac.yaml, daemonset/nodefeature/rbac.yaml and the
#: chart's templates/rbac.yaml grant exactly these; a test holds them together).
DRA_ACCESS = tuple(("resourceslices", v) for v in ("create", "update", "delete", "list", "watch", "get")) + (
    ("resourceclaims", "get"),)
NODE_ACCESS = (("nodes", "get"),)
PER_NODE_CONFIG_ACCESS = (("nodes", "get"), ("nodes", "list"), ("nodes", "watch"))
NODEFEATURE_ACCESS = tuple(("nodefeatures", v) for v in ("get", "create", "update", "delete"))
#: the GPUHealthy condition (health.nodeCondition on, or auto with a node name): its Node's
#: status, then Events on the Node in the namespace the agent writes them to
NODE_CONDITION_ACCESS = (("nodes/status", "get"), ("nodes/status", "patch"))
NODE_EVENTS_ACCESS = tuple(("events", v) for v in ("create", "patch", "get"))
_GROUPS = {"resourceslices": "resource.k8s.io", "resourceclaims": "resource.k8s.io", "nodes": "",
           "nodefeatures": NFD_GROUP, "nodes/status": "", "events": ""}


def required_access(context: DoctorContext) -> list[tuple[str, str, str, str]]:
    """(verb, group, resource, namespace) the agent needs with these settings; namespace ""
    is every namespace (cluster-scoped resources, claims of any pod)."""
    config = context.config
    wanted: list[tuple[str, str]] = []
    if config.mode == "dra":
        wanted += [*DRA_ACCESS, *NODE_ACCESS]
    if config.config_file_srcdir:
        wanted += list(PER_NODE_CONFIG_ACCESS)
    out = [(verb, _GROUPS[resource], resource, "") for resource, verb in dict.fromkeys(wanted)]
    if config.node_condition == "on" or (config.node_condition == "auto" and config.node_name):
        out += [(verb, "", resource, "") for resource, verb in NODE_CONDITION_ACCESS]
        out += [(verb, "", resource, EVENTS_NAMESPACE) for resource, verb in NODE_EVENTS_ACCESS]
    if config.labels_sink == "nodefeature":
        namespace = own_namespace(config)
        out += [(verb, NFD_GROUP, resource, namespace) for resource, verb in NODEFEATURE_ACCESS]
    return out


def _needed_api(context: DoctorContext) -> tuple[Any, Result | None]:
    """(client, None), or (None, the result to report when the API server cannot be used)."""
    needs = context.cluster_needed
    try:
        return context.api(), None
    except Unavailable as exc:
        if needs:
            return None, warned(f"not run: no API client ({exc})", "see cluster.api_server")
        return None, passed("not needed (device-plugin mode, file label sink, no per-node configs)")


def api_server(context: DoctorContext) -> Result:
    """The API server answers, when the agent needs it (or one is configured)."""
    needs = context.cluster_needed
    try:
        api = context.api()
    except Unavailable as exc:
        if needs:
            return failed(f"the agent needs the API server for {', '.join(needs)}: {exc}",
                          "run in the DaemonSet's pod (its service account) or pass --kubeconfig")
        return passed("not needed (device-plugin mode, file label sink, no per-node configs) and not configured")
    from kubernetes import client

    try:
        version = call("read /version", client.VersionApi(api).get_code, timeout_s=API_TIMEOUT_S) or {}
    except ApiCallError as exc:
        said = f"{exc.reason}: {exc.detail}" if exc.status is None else f"HTTP {exc.status} {exc.reason}: {exc.detail}"
        found = f"API server not reachable: {shorten(said, 200)}"
        action = "check the network path to the API server and the kubeconfig's server address"
        return failed(found, action) if needs else warned(found, action)
    return passed(f"API server {version.get('gitVersion', '?')} reachable"
                  + (f"; needed for {', '.join(needs)}" if needs else ""))


def access(context: DoctorContext) -> Result:
    """``SelfSubjectAccessReview`` of every verb the agent needs (:func:`required_access`)."""
    api, skipped = _needed_api(context)
    if api is None:
        return skipped  # type: ignore[return-value]
    from kubernetes import client

    try:
        wanted = required_access(context)
    except AgentError as exc:
        return failed(f"the agent's namespace is unknown: {exc}", "set --pod-namespace or POD_NAMESPACE")
    if not wanted:
        return passed("the agent needs no API permission with these settings")
    denied = []
    review = client.AuthorizationV1Api(api).create_self_subject_access_review
    for verb, group, resource, namespace in wanted:
        name, _, sub = resource.partition("/")
        attributes = {"verb": verb, "group": group, "resource": name, **({"subresource": sub} if sub else {})}
        if namespace:
            attributes["namespace"] = namespace
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes}}
        answer = call(f"review {verb} {resource}", review, body, missing_ok=False, timeout_s=API_TIMEOUT_S) or {}
        if not (answer.get("status") or {}).get("allowed"):
            where = f" in {namespace}" if namespace else ""
            denied.append(f"{verb} {resource}{'.' + group if group else ''}{where}")
    if denied:
        return failed(f"the agent's identity may not: {', '.join(denied)}",
                      "apply the chart's RBAC (helm upgrade) or bind the agent's service account to a role"
                      " granting them")
    return passed(f"all {len(wanted)} verbs the agent needs are allowed")


def nodefeature_crd(context: DoctorContext) -> Result:
    """NFD's ``nodefeatures.nfd.k8s-sigs.io/v1alpha1`` is served, when the label sink is
    ``nodefeature``."""
    if context.config.labels_sink != "nodefeature":
        return passed("not needed (labels go to the feature file)")
    api, skipped = _needed_api(context)
    if api is None:
        return skipped  # type: ignore[return-value]
    from kubernetes import client

    listed = call(f"discovery of {NFD_GROUP}/{NFD_VERSION}", client.CustomObjectsApi(api).get_api_resources,
                  NFD_GROUP, NFD_VERSION, timeout_s=API_TIMEOUT_S)
    names = {r.get("name") for r in (listed or {}).get("resources", [])}
    if "nodefeatures" not in names:
        return failed(f"{NFD_GROUP}/{NFD_VERSION} nodefeatures is not served (NFD's CRD is not installed)",
                      "install Node Feature Discovery (its CRDs) or use --labels-sink file")
    return passed(f"{NFD_GROUP}/{NFD_VERSION} nodefeatures served")


def resource_api(context: DoctorContext) -> Result:
    """DRA mode: the ``resource.k8s.io`` versions served, and the one the agent publishes."""
    if context.config.mode != "dra":
        return passed("not needed (device-plugin mode)")
    api, skipped = _needed_api(context)
    if api is None:
        return skipped  # type: ignore[return-value]
    served = context.resource_versions()
    version = pick_version(served)
    if version is None:
        return failed(f"resource.k8s.io served: {served or 'none'}; the agent publishes {', '.join(API_VERSIONS)}",
                      "enable DRA on the API server (Kubernetes >= 1.32; resource.k8s.io/v1 from 1.34)")
    if version not in SETS_API_VERSIONS:
        return warned(f"resource.k8s.io served: {served}; publishing {version}, which has no partitionable"
                      " devices", f"GPU sets need resource.k8s.io/{' or '.join(SETS_API_VERSIONS)}")
    return passed(f"resource.k8s.io served: {served}; the agent publishes {version}")


def partitionable_devices(context: DoctorContext) -> Result:
    """DRA mode: whether the API server keeps the counters of GPU sets (module docstring)."""
    config = context.config
    if config.mode != "dra":  # before the client is imported: a node without it needs none
        return passed("not needed (device-plugin mode)")
    from kubernetes import client

    api, skipped = _needed_api(context)
    if api is None:
        return skipped  # type: ignore[return-value]
    version = pick_version(context.resource_versions())
    if version not in SETS_API_VERSIONS:
        return warned(f"not asked: resource.k8s.io/{version or 'none'} has no partitionable devices",
                      "see cluster.resource_api")
    try:
        topology = context.node().topology
    except Unavailable:
        return warned("not run: NVML did not load (see nvml.library)", "fix nvml.library first")
    slices = render_slices(topology, node_name=config.node_name or "doctor", driver=config.driver_name,
                           api_version=version)
    sent = next((s for s in slices if (s.get("spec") or {}).get("sharedCounters")), None)
    if sent is None:
        return passed("no GPU sets on this node: nothing depends on partitionable devices")
    body = json.loads(json.dumps(sent))
    body["metadata"] = {"generateName": f"{config.node_name or 'doctor'}-doctor-"}
    cls: Any = {"v1": client.ResourceV1Api, "v1beta2": client.ResourceV1beta2Api}[version]
    stored = call("dry-run create of a ResourceSlice", cls(api).create_resource_slice, body, dry_run="All",
                  missing_ok=False, timeout_s=API_TIMEOUT_S) or {}
    if PARTITIONABLE_DEVICES in dropped_features(sent, stored):
        return failed("the API server drops sharedCounters and consumesCounters (a dry-run create, read back):"
                      " feature gate DRAPartitionableDevices is off",
                      "enable the gate on the API server and the scheduler; until then the agent publishes"
                      " single GPUs only, no GPU sets")
    return passed(f"the API server keeps partitionable devices (resource.k8s.io/{version}, dry-run create read back)")


CHECKS = (
    Check("cluster.api_server", api_server),
    Check("cluster.access", access, timeout_s=8.0),
    Check("cluster.nodefeature_crd", nodefeature_crd),
    Check("cluster.resource_api", resource_api),
    Check("cluster.partitionable_devices", partitionable_devices, timeout_s=8.0),
)
