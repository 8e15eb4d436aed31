"""The plain deployment in ``daemonset/`` renders and agrees with the agent it deploys.

``daemonset/base/`` (the device plugin; ``kubectl apply -k daemonset/``) and
``daemonset/dra/`` (the DRA driver) are rendered from the Helm chart by
``daemonset/render.py``; tests/test_helm.py checks they are the chart's current rendering
and tests the chart's values. Here every check runs against two readings of the plain
files: ``kubectl kustomize`` (skipped where no kubectl is installed; it works offline) and
the files the kustomizations list, read as YAML (so the suite still checks the manifests
without kubectl). Facts about the agent (default paths, the metrics port, the config loader,
the CLI, the probe endpoints) come from the agent's own code, not from copies of them here.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

import agent
from agent.config import Config, load_config, probe_address_of
from agent.topology.model import Topology

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_DIR = ROOT / "daemonset"
BASE_DIR = DEPLOY_DIR / "base"
DRA_DIR = DEPLOY_DIR / "dra"
CHART_FILES = DEPLOY_DIR / "helm" / "gpu-topology-agent" / "files"
#: kubectl on PATH, else the one .ci/run puts beside Helm in .tools/bin
KUBECTL = shutil.which("kubectl") or next(
    (str(p) for p in [ROOT / ".tools" / "bin" / "kubectl"] if p.exists()), None)

CLUSTER_SCOPED_KINDS = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PriorityClass", "RuntimeClass", "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding", "DeviceClass",
}
RBAC_KINDS = {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}


@dataclasses.dataclass
class Rendered:
    objects: list[dict[str, Any]]
    how: str

    def all_of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") == kind]

    def one(self, kind: str, name_prefix: str = "") -> dict[str, Any]:
        found = [o for o in self.all_of(kind) if o["metadata"]["name"].startswith(name_prefix)]
        assert len(found) == 1, f"expected one {kind} named {name_prefix}*, got {len(found)}"
        return found[0]

    @property
    def daemonset(self) -> dict[str, Any]:
        return self.one("DaemonSet")

    @property
    def pod(self) -> dict[str, Any]:
        return self.daemonset["spec"]["template"]["spec"]

    @property
    def container(self) -> dict[str, Any]:
        containers = self.pod["containers"]
        assert len(containers) == 1
        return containers[0]


# ----------------------------------------------------------------------------- rendering


def _render_with_kubectl(directory: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize failed: {result.stderr.strip()}"
    assert not result.stderr.strip(), f"kubectl kustomize warned: {result.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _render_with_yaml(directory: Path) -> list[dict[str, Any]]:
    """The objects of the files a kustomization lists (it uses nothing but ``resources``)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - {"apiVersion", "kind", "resources"}
    assert not unsupported, f"teach the YAML reader in this test about {sorted(unsupported)}"
    objects: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        if (directory / resource).is_dir():
            objects += _render_with_yaml(directory / resource)
        else:
            objects += [d for d in yaml.safe_load_all((directory / resource).read_text()) if d]
    return objects


def _rendered(request: pytest.FixtureRequest, directory: Path) -> Rendered:
    if request.param == "kubectl" and KUBECTL is None:
        pytest.skip("kubectl is not installed; the YAML reader covers the manifests")
    render = _render_with_kubectl if request.param == "kubectl" else _render_with_yaml
    return Rendered(render(directory), request.param)


@pytest.fixture(scope="module", params=["kubectl", "yaml"])
def rendered(request: pytest.FixtureRequest) -> Rendered:
    """``daemonset/``: the device-plugin deployment."""
    return _rendered(request, DEPLOY_DIR)


@pytest.fixture(scope="module", params=["kubectl", "yaml"])
def rendered_dra(request: pytest.FixtureRequest) -> Rendered:
    """``daemonset/dra``: the DRA deployment."""
    return _rendered(request, DRA_DIR)


@pytest.fixture(scope="module", params=["kubectl", "yaml"])
def rendered_both(request: pytest.FixtureRequest) -> tuple[Rendered, Rendered]:
    """``daemonset/`` and ``daemonset/dra``, read the same way."""
    return (_rendered(request, DEPLOY_DIR), _rendered(request, DRA_DIR))


# ----------------------------------------------------------------------------- helpers


def _mounts_by_path(rendered: Rendered) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in rendered.pod["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in rendered.container["volumeMounts"]}


def _quantity(text: str | int) -> float:
    text = str(text)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _config_map_for_volume(rendered: Rendered, mount_path: str) -> dict[str, Any]:
    _, volume = _mounts_by_path(rendered)[mount_path]
    assert "configMap" in volume, f"{mount_path} is not a ConfigMap volume"
    name = volume["configMap"]["name"]
    return next(o for o in rendered.all_of("ConfigMap") if o["metadata"]["name"] == name)


def _run_args(rendered: Rendered) -> Any:
    """The container's args as the agent's own command line parses them."""
    from agent.cli import build_parser

    return build_parser().parse_args(rendered.container["args"])


def _config_path(rendered: Rendered) -> str:
    path = _run_args(rendered).config
    assert path, "the DaemonSet names no --config file"
    return str(path)


def _loaded_config(rendered: Rendered, tmp_path: Path) -> Config:
    """The configuration the agent starts with: the mounted config file and the flags and
    environment the DaemonSet gives it (the downward-API NODE_NAME aside)."""
    from agent.commands.run import FLAG_FIELDS

    args = _run_args(rendered)
    path = _config_path(rendered)
    text = _config_map_for_volume(rendered, posixpath.dirname(path))["data"][posixpath.basename(path)]
    (tmp_path / "config.yaml").write_text(text)
    env = {e["name"]: e["value"] for e in rendered.container["env"] if "value" in e}
    return load_config(str(tmp_path / "config.yaml"), env,
                       {name: getattr(args, name) for name in FLAG_FIELDS})


def _agent_metrics_port() -> int:
    return int(Config().metrics_address.rpartition(":")[2])


# ----------------------------------------------------------------------------- objects


def test_kustomization_renders_every_object_of_the_deployment(rendered: Rendered) -> None:
    kinds = {o["kind"] for o in rendered.objects}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service",
            "ServiceMonitor"} <= kinds
    namespace = rendered.one("Namespace")["metadata"]["name"]
    for obj in rendered.objects:
        if obj["kind"] not in CLUSTER_SCOPED_KINDS:
            assert obj["metadata"].get("namespace") == namespace, obj["metadata"]["name"]


def test_every_object_fits_kubectl_apply_last_applied_annotation(rendered: Rendered) -> None:
    # Client-side `kubectl apply -k` copies each object into an annotation, and annotations
    # are capped at 256 KiB in total: a bigger dashboard would need --server-side.
    assert rendered.objects
    for obj in rendered.objects:
        size = len(json.dumps(obj, separators=(",", ":")).encode())
        assert size < 256 * 1024 - 4096, f"{obj['kind']} {obj['metadata']['name']}: {size} bytes"


def test_prometheus_rule_is_part_of_the_deployment(rendered: Rendered) -> None:
    rule = rendered.one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert groups and all(g["rules"] for g in groups)


def test_grafana_dashboard_is_a_config_map_the_grafana_sidecar_picks_up(rendered: Rendered) -> None:
    dashboards = [
        o for o in rendered.all_of("ConfigMap")
        if "grafana-dashboard.json" in o.get("data", {})
    ]
    assert len(dashboards) == 1
    assert dashboards[0]["metadata"]["labels"].get("grafana_dashboard") == "1"
    shipped = json.loads((CHART_FILES / "grafana-dashboard.json").read_text())
    assert json.loads(dashboards[0]["data"]["grafana-dashboard.json"]) == shipped


def test_no_rbac_and_no_api_token_by_default(rendered: Rendered) -> None:
    assert not [o for o in rendered.objects if o["kind"] in RBAC_KINDS]
    account = rendered.one("ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    assert rendered.pod["serviceAccountName"] == account["metadata"]["name"]
    assert rendered.pod["automountServiceAccountToken"] is False


def test_namespace_admits_hostpath_pods_under_pod_security_admission(rendered: Rendered) -> None:
    labels = rendered.one("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


@pytest.mark.parametrize("directory", [BASE_DIR, DRA_DIR], ids=["base", "dra"])
def test_yaml_reader_sees_the_same_objects_as_kubectl(directory: Path) -> None:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: nothing to compare the YAML reader with")

    def key(o: dict[str, Any]) -> tuple[str, str]:
        return (o["kind"], o["metadata"]["name"])

    by_kubectl = _render_with_kubectl(directory)
    assert sorted(by_kubectl, key=key) == sorted(_render_with_yaml(directory), key=key)


def test_top_level_kustomization_is_the_base_as_it_is() -> None:
    assert yaml.safe_load((DEPLOY_DIR / "kustomization.yaml").read_text())["resources"] == ["base"]
    assert _render_with_yaml(DEPLOY_DIR) == _render_with_yaml(BASE_DIR)
    if KUBECTL is not None:
        assert _render_with_kubectl(DEPLOY_DIR) == _render_with_kubectl(BASE_DIR)


# ----------------------------------------------------------------------------- placement


def test_daemonset_runs_only_on_gpu_nodes(rendered: Rendered) -> None:
    terms = rendered.pod["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # nodeSelectorTerms are ORed, expressions inside one term ANDed: one label per term.
    keys = set()
    for term in terms:
        (expression,) = term["matchExpressions"]
        assert expression["operator"] == "In" and expression["values"] == ["true"]
        keys.add(expression["key"])
    assert keys == {"feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present"}
    assert "nodeSelector" not in rendered.pod  # would AND away one of the two ways in


def test_daemonset_tolerates_the_gpu_taint(rendered: Rendered) -> None:
    assert any(
        t["key"] == "nvidia.com/gpu" and t.get("effect") == "NoSchedule"
        and (t.get("operator") == "Exists" or "value" in t)
        for t in rendered.pod["tolerations"]
    )


def test_daemonset_is_node_critical_and_rolls_one_node_at_a_time(rendered: Rendered) -> None:
    assert rendered.pod["priorityClassName"] == "system-node-critical"
    strategy = rendered.daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 1


def test_termination_grace_period_exceeds_the_agent_shutdown_budget(rendered: Rendered) -> None:
    shutdown_budget_s = _agent_shutdown_budget_s()
    assert rendered.pod["terminationGracePeriodSeconds"] > shutdown_budget_s


def _agent_shutdown_budget_s() -> float:
    """The daemon's shutdown budget (what ``run`` uses)."""
    from agent import daemon

    return daemon.SHUTDOWN_BUDGET_S


# ----------------------------------------------------------------------------- host access


def test_every_hostpath_the_agent_needs_is_mounted_where_its_defaults_look(rendered: Rendered) -> None:
    from agent.nccl.host_dir import host_dir_of

    defaults = Config()
    needed = {
        defaults.kubelet_dir: "writable",  # our sockets are created here
        posixpath.dirname(defaults.pod_resources_socket): "read-only",  # connect only
        defaults.features_dir: "writable",  # the NFD feature file is written here
        defaults.sysfs_root: "read-only",
        posixpath.dirname(defaults.cri_socket): "read-only",  # connect only: ListContainers
        host_dir_of(defaults): "writable",  # the containers' NCCL topology files
    }
    mounts = _mounts_by_path(rendered)
    for path, access in needed.items():
        assert path in mounts, f"{path} (an agent default) is not mounted"
        mount, volume = mounts[path]
        assert volume.get("hostPath", {}).get("path") == path, f"{path} is not the host's {path}"
        assert bool(mount.get("readOnly", False)) == (access == "read-only"), (
            f"{path} should be {access}"
        )
    host_mounts = {p for p, (_, v) in mounts.items() if "hostPath" in v}
    assert host_mounts == set(needed), "a hostPath the agent does not use is mounted"


def test_container_is_unprivileged_with_every_capability_dropped(rendered: Rendered) -> None:
    security = rendered.container["securityContext"]
    assert security.get("privileged", False) is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert not security["capabilities"].get("add")
    assert security["readOnlyRootFilesystem"] is True
    pod = rendered.pod
    assert not (pod.get("hostNetwork") or pod.get("hostIPC"))
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def test_pod_shares_the_host_pid_namespace_where_the_default_proc_root_is_the_hosts(
        rendered: Rendered) -> None:
    # NVML reports GPU processes by host PID; their cgroups name their pods (per-pod metrics)
    assert rendered.pod.get("hostPID") is True
    assert Config().proc_root == "/proc"
    assert "/proc" not in _mounts_by_path(rendered)


def test_only_tmp_and_the_agents_output_directories_are_writable(rendered: Rendered) -> None:
    defaults = Config()
    writable = {
        path: volume for path, (mount, volume) in _mounts_by_path(rendered).items()
        if not mount.get("readOnly", False)
    }
    from agent.nccl.host_dir import host_dir_of

    assert set(writable) == {defaults.kubelet_dir, defaults.features_dir, "/tmp", host_dir_of(defaults)}
    assert "emptyDir" in writable["/tmp"] and writable["/tmp"]["emptyDir"].get("sizeLimit")


def test_resources_have_requests_within_limits(rendered: Rendered) -> None:
    resources = rendered.container["resources"]
    for name in ("cpu", "memory"):
        request, limit = resources["requests"][name], resources["limits"][name]
        assert 0 < _quantity(request) <= _quantity(limit), name


# ----------------------------------------------------------------------------- agent wiring


def test_node_name_comes_from_the_downward_api_under_the_name_the_agent_reads(
    rendered: Rendered,
) -> None:
    env = {e["name"]: e for e in rendered.container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert load_config(None, {"NODE_NAME": "gpu-node-7"}, {}).node_name == "gpu-node-7"


def test_metrics_port_is_named_metrics_and_is_the_agents_default_port(rendered: Rendered) -> None:
    (port,) = [p for p in rendered.container["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == _agent_metrics_port()


def test_probes_hit_health_and_ready_on_the_agents_probe_port_not_the_metrics_port(rendered: Rendered) -> None:
    liveness = rendered.container["livenessProbe"]["httpGet"]
    readiness = rendered.container["readinessProbe"]["httpGet"]
    assert (liveness["path"], liveness["port"]) == ("/health", "probes")
    if "startupProbe" in rendered.container:
        assert rendered.container["startupProbe"]["httpGet"] == liveness
    assert (readiness["path"], readiness["port"]) == ("/ready", "probes")
    (port,) = [p for p in rendered.container["ports"] if p["name"] == "probes"]
    assert port["containerPort"] == int(probe_address_of(Config()).rpartition(":")[2]) != _agent_metrics_port()


def test_headless_service_and_service_monitor_select_the_agent_metrics(rendered: Rendered) -> None:
    service = rendered.one("Service")
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = rendered.daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] == "metrics"
    monitor = rendered.one("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_service_monitor_keeps_the_workload_pod_labels_of_gpu_series(rendered: Rendered) -> None:
    from agent.attribution import ContainerRef

    # GPU series are attributed to a workload container by labels named like ContainerRef's
    # fields; the Prometheus Operator would otherwise add target labels of the same names
    # (the agent's own pod), renaming ours to exported_* or, for unattributed GPUs, making
    # them look attributed to the agent.
    attribution_labels = {f.name for f in dataclasses.fields(ContainerRef)}
    operator_target_labels = {"namespace", "pod", "container", "service", "endpoint", "job",
                              "instance"}
    colliding = attribution_labels & operator_target_labels
    assert colliding
    (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    drops = [re.compile(r["regex"]) for r in endpoint.get("relabelings", [])
             if r.get("action") == "labeldrop"]
    for label in colliding:
        assert any(d.fullmatch(label) for d in drops), f"target label {label} is not dropped"
    for kept in ("instance", "job"):  # the dashboard selects on instance
        assert not any(d.fullmatch(kept) for d in drops)


def test_daemonset_selector_matches_its_pod_template(rendered: Rendered) -> None:
    selector = rendered.daemonset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= rendered.daemonset["spec"]["template"]["metadata"]["labels"].items()


def test_container_args_name_the_mounted_config_map_file(rendered: Rendered) -> None:
    assert rendered.container["args"][0] == "run"
    path = _config_path(rendered)
    config_map = _config_map_for_volume(rendered, posixpath.dirname(path))
    assert posixpath.basename(path) in config_map["data"]


def test_container_args_parse_with_the_agent_cli(rendered: Rendered) -> None:
    args = _run_args(rendered)
    assert args.command == "run"
    assert args.mode is None  # device-plugin, the agent's default


def test_image_tag_is_the_package_version(rendered: Rendered) -> None:
    image = rendered.container["image"]
    assert image.rsplit(":", 1)[1] == agent.__version__


def test_config_map_file_loads_with_the_agent_config_loader(
    rendered: Rendered, tmp_path: Path
) -> None:
    loaded = _loaded_config(rendered, tmp_path)
    # The shipped file spells out the built-in defaults (it says so); keep them in step. The
    # plain manifests give no API access: no GPUHealthy condition (HEALTH_NODE_CONDITION).
    assert loaded.node_condition == "off"
    assert dataclasses.replace(loaded, config_file=None, node_condition=Config().node_condition) == Config()


def test_commented_time_slicing_example_loads_when_uncommented(tmp_path: Path) -> None:
    lines = (CHART_FILES / "config.yaml").read_text().splitlines()
    start = lines.index("# sharing:")
    example = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        example.append(line[2:])
    text = "\n".join(lines[:start] + example) + "\n"
    (tmp_path / "config.yaml").write_text(text)
    loaded = load_config(str(tmp_path / "config.yaml"), {}, {})
    assert [(t.name, t.replicas) for t in loaded.time_slicing] == [("nvidia.com/gpu", 4)]


def test_probe_paths_are_served_by_the_agent_metrics_service(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from agent.hw.sim import machines
    from agent.metrics import service as service_module
    from agent.metrics.self_metrics import AgentMetrics

    container = Rendered(_render_with_yaml(DEPLOY_DIR), "yaml").container
    backend = machines.open_simulated("dgx-h100").backend()
    backend.init()
    try:
        topology = Topology.from_facts(backend.read_facts())
        config = dataclasses.replace(Config(), metrics_address="127.0.0.1:0")
        ready = {"value": False}
        service = service_module.MetricsService(
            backend, topology, config, hostname="gpu-node-7", ready=lambda: ready["value"],
            agent_metrics=AgentMetrics(CollectorRegistry(), backend),
        )
        service.start()
        try:
            liveness = container["livenessProbe"]["httpGet"]["path"]
            readiness = container["readinessProbe"]["httpGet"]["path"]
            base = f"http://127.0.0.1:{service.probe_port}"
            assert _http_status(base + liveness) == 200
            assert _http_status(base + readiness) == 503
            ready["value"] = True
            assert _http_status(base + readiness) == 200
        finally:
            service.stop()
    finally:
        backend.shutdown()


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


def test_every_file_in_the_plain_directories_is_applied() -> None:
    # base/ and dra/ hold the rendered manifests (render.py) and nothing else; dra/examples/
    # is not applied (claim templates for workloads).
    for directory in (BASE_DIR, DRA_DIR):
        listed = set(yaml.safe_load((directory / "kustomization.yaml").read_text())["resources"])
        present = {p.name for p in directory.iterdir() if p.is_file()} - {"kustomization.yaml"}
        assert present == listed, f"{directory.relative_to(ROOT)}: {sorted(present ^ listed)}"
    assert {p.name for p in DEPLOY_DIR.iterdir() if p.is_file()} == {
        "kustomization.yaml", "render.py", "plain-values.yaml"}


# ----------------------------------------------------------------------------- DRA


def test_dra_deployment_renders_the_base_plus_the_driver_objects(
    rendered_both: tuple[Rendered, Rendered]
) -> None:
    rendered, rendered_dra = rendered_both

    def key(o: dict[str, Any]) -> tuple[str, str]:
        return (o["kind"], o["metadata"]["name"])

    added = {key(o) for o in rendered_dra.objects} - {key(o) for o in rendered.objects}
    assert {k for k, _ in added} == {
        "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding", "DeviceClass",
        "Role", "RoleBinding",  # Events on the Node, in default (health.nodeCondition on)
    }
    assert len(rendered_dra.all_of("ConfigMap")) == len(rendered.all_of("ConfigMap"))
    assert len(rendered_dra.all_of("DaemonSet")) == 1
    namespace = rendered_dra.one("Namespace")["metadata"]["name"]
    for obj in rendered_dra.objects:
        expected = None if obj["kind"] in CLUSTER_SCOPED_KINDS else namespace
        if key(obj)[1] == "gpu-topology-agent-node-events":
            expected = "default"  # Events about a Node live there
        assert obj["metadata"].get("namespace") == expected, key(obj)
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpu-topology-agent"


def test_dra_deployment_mounts_the_kubelet_plugin_directories_and_the_cdi_directory(
    rendered_both: tuple[Rendered, Rendered]
) -> None:
    rendered, rendered_dra = rendered_both
    defaults = Config()
    mounts = _mounts_by_path(rendered_dra)
    expected = {
        defaults.plugins_registry_dir: "Directory",  # the kubelet creates it; absent: no kubelet
        defaults.plugins_dir: "DirectoryOrCreate",
        defaults.cdi_dir: "DirectoryOrCreate",
    }
    for path, kind in expected.items():
        mount, volume = mounts[path]
        assert not mount.get("readOnly", False), path
        assert volume["hostPath"] == {"path": path, "type": kind}
    # the base's mounts are all still there, but the NCCL files' directory: in DRA mode the
    # containers' NCCL topology files go under plugins/<driver>/nccl
    from agent.nccl.host_dir import host_dir_of

    base = set(_mounts_by_path(rendered)) - {host_dir_of(defaults)}
    assert host_dir_of(dataclasses.replace(defaults, mode="dra")).startswith(defaults.plugins_dir + "/")
    assert base | set(expected) == set(mounts)


def test_dra_deployment_mounts_the_service_account_token(rendered_dra: Rendered) -> None:
    account = rendered_dra.one("ServiceAccount")
    assert account.get("automountServiceAccountToken") is True
    assert rendered_dra.pod["serviceAccountName"] == account["metadata"]["name"]
    assert rendered_dra.pod["automountServiceAccountToken"] is True


def test_dra_cluster_role_grants_exactly_what_the_driver_needs(rendered_dra: Rendered) -> None:
    role = rendered_dra.one("ClusterRole")
    grants = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
    }
    assert grants == {
        ("resource.k8s.io", "resourceslices"): sorted(["create", "update", "delete", "list", "watch", "get"]),
        ("resource.k8s.io", "resourceclaims"): ["get"],
        ("", "nodes"): ["get"],
        ("", "nodes/status"): ["get", "patch"],  # the GPUHealthy condition
    }
    roles = [o for o in rendered_dra.objects if o["kind"] in {"Role", "RoleBinding"}]
    assert {(o["kind"], o["metadata"]["namespace"]) for o in roles} == {("Role", "default"), ("RoleBinding", "default")}
    assert rendered_dra.one("Role")["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch", "get"]}]


def test_dra_cluster_role_is_bound_to_the_agents_service_account(rendered_dra: Rendered) -> None:
    binding = rendered_dra.one("ClusterRoleBinding")
    account = rendered_dra.one("ServiceAccount")["metadata"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": rendered_dra.one("ClusterRole")["metadata"]["name"]}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}]


def test_dra_admission_policy_lets_the_agent_write_only_its_own_nodes_slices(
    rendered_dra: Rendered
) -> None:
    policy = rendered_dra.one("ValidatingAdmissionPolicy", "gpu-topology-agent-own-node-slices")
    account = rendered_dra.one("ServiceAccount")["metadata"]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (condition,) = spec["matchConditions"]
    username = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    assert f'"{username}"' in condition["expression"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    assert "oldObject" in variables["objectNodeName"] and "nodeName" in variables["objectNodeName"]
    assert any(v["expression"] == "variables.objectNodeName == variables.userNodeName"
               for v in spec["validations"])
    binding = rendered_dra.one("ValidatingAdmissionPolicyBinding", "gpu-topology-agent-own-node-slices")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_dra_device_classes_select_the_agents_gpus_and_mig_devices(rendered_dra: Rendered) -> None:
    from agent.config import DEFAULT_DRIVER_NAME as DEFAULT_DRIVER

    classes = {c["metadata"]["name"]: c for c in rendered_dra.all_of("DeviceClass")}
    sized = {f"set-of-{k}.{DEFAULT_DRIVER}": k for k in (2, 4, 8)}
    assert set(classes) == {DEFAULT_DRIVER, f"mig.{DEFAULT_DRIVER}", f"gpuset.{DEFAULT_DRIVER}", *sized}
    kinds = {DEFAULT_DRIVER: "gpu", f"mig.{DEFAULT_DRIVER}": "mig", f"gpuset.{DEFAULT_DRIVER}": "gpuset",
             **{name: "gpuset" for name in sized}}
    for name, kind in kinds.items():
        (selector,) = classes[name]["spec"]["selectors"]
        expression = " ".join(selector["cel"]["expression"].split())
        assert f'device.driver == "{DEFAULT_DRIVER}"' in expression
        assert f'device.attributes["{DEFAULT_DRIVER}"].type == "{kind}"' in expression
        if kind == "gpuset":
            assert f'device.attributes["{DEFAULT_DRIVER}"].healthy' in expression
        if name in sized:
            assert expression.endswith(f'device.attributes["{DEFAULT_DRIVER}"].gpuCount == {sized[name]}')
            assert classes[name]["spec"]["extendedResourceName"] == f"{DEFAULT_DRIVER}/set-of-{sized[name]}"
        else:
            assert "extendedResourceName" not in classes[name]["spec"]


def test_dra_daemonset_runs_the_agent_in_dra_mode_with_the_shipped_config(
    rendered_dra: Rendered, tmp_path: Path
) -> None:
    loaded = _loaded_config(rendered_dra, tmp_path)
    assert loaded.mode == "dra"
    # every other value is the built-in default, as in the device-plugin deployment
    assert loaded.node_condition == "on"  # the dra variant writes the GPUHealthy condition
    assert dataclasses.replace(loaded, config_file=None, mode=Config().mode,
                               node_condition=Config().node_condition) == Config()
