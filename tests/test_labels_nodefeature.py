"""``--labels-sink nodefeature``: the agent publishes its labels as one NFD NodeFeature object,
through the stand-in API server reached with ``--kubeconfig`` (or ``KUBECONFIG``), under the
RBAC and admission policy of ``daemonset/nodefeature`` (the identity of a pod-bound service
account token of the agent on ``node-1``).

The agent runs as a real process (``python -m agent run --simulate dgx-h100``); what is
observed is the API server's objects, the exit code and the log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from agent_run import AgentRun, reap

from tests.testbed.apiserver_auth import Access, service_account
from tests.testbed.apiserver_stub import ApiServerStub
from tests.testbed.kubelet_stub import KubeletStub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = "gpu-topology-agent"
NODE = "node-1"
OBJECT = f"gpu-topology-agent-{NODE}"
NODE_LABEL = "nfd.node.kubernetes.io/node-name"
POD_UID = "8f2b6c1e-0000-4000-8000-00000000a001"


def write_kubeconfig(path: str, server: str, token: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("apiVersion: v1\nkind: Config\ncurrent-context: stub\n"
                f"clusters:\n- name: stub\n  cluster:\n    server: {server}\n"
                f"users:\n- name: stub\n  user:\n    token: {token}\n"
                "contexts:\n- name: stub\n  context:\n    cluster: stub\n    user: stub\n")
    return path


class Cluster:
    """The stand-in API server with the access of ``variant`` (a daemonset/ directory) and a
    kubeconfig for the agent's service account on ``node-1``."""

    def __init__(self, variant: str = "nodefeature") -> None:
        self.root = tempfile.mkdtemp(prefix="nft", dir="/tmp")
        self.access = Access.from_deploy(variant)
        self.access.add_token("agent-on-node-1", service_account(NAMESPACE, "gpu-topology-agent", NODE))
        self.api = ApiServerStub(access=self.access).start()
        self.kubeconfig = write_kubeconfig(os.path.join(self.root, "kubeconfig"), self.api.url, "agent-on-node-1")
        self.kubelet_dir = os.path.join(self.root, "k")
        os.makedirs(self.kubelet_dir)

    def objects(self) -> list[dict]:
        return self.api.nodefeatures(NAMESPACE)

    def labels(self) -> dict[str, str] | None:
        objs = [o for o in self.objects() if o["metadata"]["name"] == OBJECT]
        return objs[0]["spec"]["labels"] if objs else None

    def args(self, *extra: str) -> list[str]:
        return ["run", "--simulate", "dgx-h100", "--kubelet-dir", self.kubelet_dir,
                "--metrics-address", "127.0.0.1:0",
                "--pod-resources-socket", os.path.join(self.kubelet_dir, "podres.sock"), *extra]

    def close(self) -> None:
        self.api.stop()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def agent(args: list[str], **env: str) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CONFIG_FILE", "KUBECONFIG", "NODE_NAME", "LABELS_SINK", "POD_NAMESPACE",
                          "POD_NAME", "POD_UID")}
    return subprocess.Popen([sys.executable, "-m", "agent", *args], cwd=ROOT,
                            env={**clean, "PYTHONPATH": ROOT, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, then the exit code must be 0; returns stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        reap(proc)
    assert proc.returncode == 0, stderr
    return stderr


def expected_labels() -> dict[str, str]:
    """What ``labels`` prints: exactly the feature file's content (see its docstring)."""
    out = subprocess.run([sys.executable, "-m", "agent", "labels", "--simulate", "dgx-h100", "--format", "json",
                          "--no-timestamp"], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(out.stdout))


def sink_flags(cluster: Cluster, *extra: str) -> list[str]:
    return cluster.args("--labels-sink", "nodefeature", "--kubeconfig", cluster.kubeconfig, "--node-name", NODE,
                        "--pod-namespace", NAMESPACE, "--pod-name", "gta-x1", "--pod-uid", POD_UID, *extra)


# ---------------------------------------------------------------------- the object's life
def test_the_nodefeature_holds_the_feature_file_labels_comes_back_and_goes_away_on_a_clean_stop(cluster):
    proc = agent(sink_flags(cluster, "--no-timestamp", "--label-interval-s", "0.2"))
    try:
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 30), proc.stderr
        (obj,) = cluster.objects()
        assert obj["metadata"]["name"] == OBJECT
        assert obj["metadata"]["labels"] == {NODE_LABEL: NODE}  # what nfd-master selects by
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Pod", "name": "gta-x1", "uid": POD_UID, "blockOwnerDeletion": False}]
        assert obj["spec"] == {"labels": expected_labels()}

        cluster.api.delete_nodefeature(NAMESPACE, OBJECT)  # deleted behind the agent's back
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 10)
        assert cluster.labels() == expected_labels()

        def vandalise(o: dict) -> None:
            o["spec"]["labels"]["nvidia.com/gpu.count"] = "1"
            o["spec"]["labels"]["evil.example.com/x"] = "y"
            o["metadata"]["labels"] = {NODE_LABEL: "node-9", "team": "gpu"}
            o["metadata"]["ownerReferences"] = []

        cluster.api.modify_nodefeature(NAMESPACE, OBJECT, vandalise)
        assert cluster.api.wait_for_nodefeatures(
            lambda objs: objs[0]["spec"]["labels"] == expected_labels()
            and objs[0]["metadata"]["labels"][NODE_LABEL] == NODE, 10)
        (obj,) = cluster.objects()
        assert obj["metadata"]["labels"]["team"] == "gpu", "a label someone else added is kept"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == POD_UID
    finally:
        stderr = stop(proc)
    assert cluster.objects() == [], "a clean stop deletes the object"
    assert f"deleted NodeFeature {NAMESPACE}/{OBJECT}" in stderr
    # unchanged labels are not written again: at most the three repairs and the first write
    assert cluster.api.count("POST", "/nodefeatures") == 2
    assert cluster.api.count("PUT", "/nodefeatures") == 1


def test_environment_settings_as_the_daemonset_sets_them_and_no_features_directory_needed(cluster, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    proc = agent(cluster.args("--features-dir", str(blocker / "features.d")),
                 KUBECONFIG=cluster.kubeconfig, LABELS_SINK="nodefeature", NODE_NAME=NODE,
                 POD_NAMESPACE=NAMESPACE, POD_NAME="gta-x2", POD_UID=POD_UID)
    try:
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 30), "no NodeFeature"
        (obj,) = cluster.objects()
        assert obj["metadata"]["ownerReferences"][0]["name"] == "gta-x2"
        labels = obj["spec"]["labels"]
        assert "nvidia.com/gfd.timestamp" in labels  # GFD's timestamp, as in the file
        assert {k: v for k, v in labels.items() if k != "nvidia.com/gfd.timestamp"} == expected_labels()
    finally:
        stop(proc)
    assert not (blocker / "features.d").exists()


def test_a_node_feature_another_pod_of_the_agent_took_over_is_left_on_a_clean_stop(cluster):
    proc = agent(sink_flags(cluster, "--label-interval-s", "60"))
    try:
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 30)

        def new_pod(o: dict) -> None:  # the next agent pod (a surge rollout) wrote it since
            o["metadata"]["ownerReferences"] = [dict(o["metadata"]["ownerReferences"][0], name="gta-y", uid="y")]

        cluster.api.modify_nodefeature(NAMESPACE, OBJECT, new_pod)
    finally:
        stderr = stop(proc)
    assert [o["metadata"]["name"] for o in cluster.objects()] == [OBJECT]
    assert "another pod owns it now" in stderr


# ---------------------------------------------------------------------- failures
def wait_requests(cluster: Cluster, method: str, at_least: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.api.count(method, "/nodefeatures") < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} {method} requests"
        time.sleep(0.05)


def test_api_server_errors_are_logged_once_per_change_of_state_and_the_agent_keeps_going(cluster):
    cluster.api.fail(403, path_contains="/nodefeatures", message="injected: RBAC says no")
    proc = agent(sink_flags(cluster, "--label-interval-s", "0.1"))
    try:
        wait_requests(cluster, "GET", 5)  # five re-assertions, all refused
        cluster.api.clear_failures()
        cluster.api.fail(500, path_contains="/nodefeatures", message="injected: etcd is sad")
        seen = cluster.api.count("GET", "/nodefeatures")
        wait_requests(cluster, "GET", seen + 5)
        cluster.api.clear_failures()
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 20), "never published"
        assert proc.poll() is None, "the agent kept running"
    finally:
        stderr = stop(proc)
    errors = [line for line in stderr.splitlines() if "publishing the labels as" in line and " failed: " in line]
    assert len(errors) == 2, stderr
    assert "HTTP 403 Forbidden: injected: RBAC says no" in errors[0] and "RBAC must allow it" in errors[0]
    assert "HTTP 500 InternalError: injected: etcd is sad" in errors[1]
    assert stderr.count(f"publishing the labels as NodeFeature {NAMESPACE}/{OBJECT} works again") == 1


def test_an_api_server_that_goes_away_is_logged_once_and_the_labels_come_back(cluster):
    proc = agent(sink_flags(cluster, "--label-interval-s", "0.1"))
    try:
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 30)
        cluster.api.go_down()
        cluster.api.delete_nodefeature(NAMESPACE, OBJECT)  # lost while the server was away
        time.sleep(1.0)  # ten re-assertions against a closed port
        cluster.api.come_up()
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 20), "not re-created"
    finally:
        stderr = stop(proc)
    errors = [line for line in stderr.splitlines() if "publishing the labels as" in line and " failed: " in line]
    assert len(errors) == 1 and "API server unreachable" in errors[0], stderr
    assert stderr.count(f"publishing the labels as NodeFeature {NAMESPACE}/{OBJECT} works again") == 1


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of ``GET path``; (0, "") while nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def label_write_errors(port: int) -> float:
    status, body = http_get(port, "/metrics")
    values = [float(line.split()[-1]) for line in body.splitlines()
              if line.startswith("gpu_agent_label_write_errors_total ")]
    return values[0] if status == 200 and values else -1.0


def test_api_server_failures_are_counted_and_keep_the_agent_unready_until_a_write_works(cluster):
    kubelet = KubeletStub(cluster.kubelet_dir).start()  # the device plugins get registered
    cluster.api.fail(500, path_contains="/nodefeatures", message="injected: etcd is sad")
    run = AgentRun(sink_flags(cluster, "--label-interval-s", "0.1")[1:], os.path.join(cluster.root, "agent.log"))
    proc = run.proc
    try:
        metrics_port, probe_port = run.ports()
        deadline = time.monotonic() + 30
        while label_write_errors(metrics_port) < 3:  # three failed re-assertions, each counted
            assert time.monotonic() < deadline and proc.poll() is None, "label write errors not counted"
            time.sleep(0.1)
        assert kubelet.wait_for(lambda: len(kubelet.registered("nvidia.com/gpu")) >= 1, 10.0)
        assert http_get(probe_port, "/ready")[0] == 503  # registered, but the labels are not published
        cluster.api.clear_failures()
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 20), "never published"
        deadline = time.monotonic() + 20
        while http_get(probe_port, "/ready")[0] != 200:
            assert time.monotonic() < deadline, "not ready once the labels were published"
            time.sleep(0.1)
        counted = label_write_errors(metrics_port)
        time.sleep(0.5)  # five re-assertions that work
        assert label_write_errors(metrics_port) == counted >= 3
    finally:
        stopped = run.stop(30)
        run.kill()
        kubelet.stop()
    stderr = run.log()
    assert stopped == 0, stderr
    errors = [line for line in stderr.splitlines() if "publishing the labels as" in line and " failed: " in line]
    assert len(errors) == 1 and "HTTP 500 InternalError: injected: etcd is sad" in errors[0], stderr


def test_a_failed_write_is_retried_with_backoff_so_the_node_is_ready_seconds_after_the_api_server_heals(cluster):
    kubelet = KubeletStub(cluster.kubelet_dir).start()
    cluster.api.fail(500, path_contains="/nodefeatures", message="injected: etcd is sad")
    run = AgentRun(sink_flags(cluster, "--label-interval-s", "60")[1:], os.path.join(cluster.root, "agent.log"))
    proc = run.proc
    try:
        metrics_port, probe_port = run.ports()
        deadline = time.monotonic() + 30
        while label_write_errors(metrics_port) < 2:  # the write at start and a retry, long before the interval
            assert time.monotonic() < deadline and proc.poll() is None, "a failed write was not tried again"
            time.sleep(0.1)
        assert kubelet.wait_for(lambda: len(kubelet.registered("nvidia.com/gpu")) >= 1, 10.0)
        assert http_get(probe_port, "/ready")[0] == 503
        cluster.api.clear_failures()  # the API server is healthy again
        healed = time.monotonic()
        assert cluster.api.wait_for_nodefeatures(lambda objs: len(objs) == 1, 10), "not published within seconds"
        while http_get(probe_port, "/ready")[0] != 200:
            assert time.monotonic() - healed < 10, "not ready within seconds of the API server healing"
            time.sleep(0.1)
        counted, reads = label_write_errors(metrics_port), cluster.api.count("GET", "/nodefeatures")
        time.sleep(2.5)  # the backoff is over: the next write is an interval away
        assert (label_write_errors(metrics_port), cluster.api.count("GET", "/nodefeatures")) == (counted, reads)
    finally:
        stopped = run.stop(30)
        run.kill()
        kubelet.stop()
    stderr = run.log()
    assert stopped == 0, stderr
    errors = [line for line in stderr.splitlines() if "publishing the labels as" in line and " failed: " in line]
    assert len(errors) == 1 and "retrying with backoff" in errors[0], stderr
    assert stderr.count(f"publishing the labels as NodeFeature {NAMESPACE}/{OBJECT} works again") == 1


def test_without_the_nodefeature_rbac_the_agent_logs_the_forbidden_request_once():
    base = Cluster("base")  # the plain manifests' device-plugin variant: no RBAC at all
    try:
        proc = agent(sink_flags(base, "--label-interval-s", "0.1"))
        try:
            wait_requests(base, "GET", 5)
        finally:
            stderr = stop(proc)
        assert base.objects() == []
        errors = [line for line in stderr.splitlines() if "publishing the labels as" in line and " failed: " in line]
        assert len(errors) == 1, stderr
        assert ('User "system:serviceaccount:gpu-topology-agent:gpu-topology-agent" cannot get resource'
                ' "nodefeatures" in API group "nfd.k8s-sigs.io" in the namespace "gpu-topology-agent"') in errors[0]
    finally:
        base.close()


def test_nfd_not_installed_is_said_once(cluster):
    cluster.api.nfd_installed = False
    proc = agent(sink_flags(cluster, "--label-interval-s", "0.1"))
    try:
        deadline = time.monotonic() + 20
        while cluster.api.count("POST", "/nodefeatures") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stderr = stop(proc)
    errors = [line for line in stderr.splitlines() if "publishing the labels as" in line and " failed: " in line]
    assert len(errors) == 1 and "is NFD installed?" in errors[0], stderr


@pytest.mark.parametrize("args, env, says", [
    (["--labels-sink", "nodefeature", "--pod-namespace", NAMESPACE], {}, "needs the node name"),
    (["--labels-sink", "nodefeature", "--node-name", NODE, "--pod-namespace", NAMESPACE,
      "--kubeconfig", "/nonexistent/kubeconfig"], {}, "--kubeconfig /nonexistent/kubeconfig: cannot load"),
    (["--node-name", NODE, "--pod-namespace", NAMESPACE], {"LABELS_SINK": "nodefeature"},
     "no --kubeconfig given and no in-cluster configuration"),
    (["--labels-sink", "nodefile"], {}, "invalid choice: 'nodefile'"),
])
def test_a_nodefeature_sink_that_cannot_work_fails_at_start_with_one_line(cluster, args, env, says):
    proc = agent(cluster.args(*args), **env)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    assert says in stderr and stderr.count("\n") <= 3 and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("env, says", [
    ({}, "Service host/port is not set."),
    ({"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": "443"}, "Service host/port is set but empty."),
])
def test_without_an_api_server_the_client_library_is_not_even_imported(env, says):
    """Outside a pod and without --kubeconfig, the answer "no API server" comes before the
    kubernetes client's import, which takes a second or more on a busy node, at every start
    of an agent with a node name (the GPUHealthy condition asks) and before its SIGTERM is
    handled."""
    import subprocess
    import sys

    script = ("import sys\nfrom agent.config import Config\nfrom agent.errors import ConfigError\n"
              "from agent.kube import api_client\n"
              "try:\n    api_client(Config())\nexcept ConfigError as exc:\n    print(exc)\n"
              "print('imported' if 'kubernetes' in sys.modules else 'not imported')\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE_")}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**clean, "PYTHONPATH": ROOT, **env},
                         capture_output=True, text=True, timeout=60)
    said, imported = out.stdout.strip().splitlines()
    assert said.startswith("no --kubeconfig given and no in-cluster configuration") and says in said, out
    assert imported == "not imported"
