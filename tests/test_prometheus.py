"""Real Prometheus against the agent: scrape, the dashboards' PromQL, and the alert rules.

Needs Debian's ``prometheus`` package (``prometheus`` and ``promtool``); CI installs it. The
tests skip, saying so, where the binaries are absent.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from agent.config import Config
from agent.metrics.self_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from tests.testbed.metrics_support import PodResourcesStub, listing, open_node, pod

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "daemonset" / "base"
#: the chart's own files: the dashboard, the plain rule file and its promtool unit tests
CHART_FILES = ROOT / "daemonset" / "helm" / "gpu-topology-agent" / "files"
DASHBOARD_PROMQL = Path(__file__).parent / "fixtures" / "dcgm" / "dcgm-dashboard-metrics.txt"

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus binary not installed (Debian package 'prometheus')")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool binary not installed (Debian package 'prometheus')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_expressions() -> list[str]:
    """The panel PromQL of NVIDIA's dcgm-exporter dashboard, "All" selected for $instance
    and $gpu (Grafana substitutes ``.*``)."""
    text = DASHBOARD_PROMQL.read_text()
    section = text.split("# === Panel PromQL expressions ===")[1].split("# === Template")[0]
    return [line.replace("$instance", ".*").replace("$gpu", ".*")
            for line in section.splitlines() if line.strip() and not line.startswith("#")]


class PrometheusServer:
    """Prometheus scraping ``target`` every second as job ``gpu-topology-agent``, or running
    the scrape ``jobs`` given (Prometheus's ``scrape_configs`` entries)."""

    def __init__(self, workdir: Path, target: str, jobs: list[dict] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": jobs or [{"job_name": "gpu-topology-agent", "honor_labels": True,
                                        "static_configs": [{"targets": [target]}]}],
        }))
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())

    def query(self, expr: str) -> list[dict]:
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def wait_for(self, expr: str, count: int, timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        result: list[dict] = []
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            try:
                result = self.query(expr)
                if len(result) >= count:
                    return result
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.25)
        raise AssertionError(f"{expr}: {len(result)} series after {timeout_s} s, wanted {count}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """The agent's metrics service on loopback, with one attributed 2-GPU pod, scraped by
    a real Prometheus until every GPU's series is in."""
    if PROMETHEUS is None:
        pytest.skip("prometheus binary not installed (Debian package 'prometheus')")
    workdir = tmp_path_factory.mktemp("prometheus")
    node = open_node("dgx-h100")  # the real NvmlBackend on the simulated machine's NVML
    backend, topology = node.backend, node.topology
    g = topology.gpus
    kubelet = PodResourcesStub(str(workdir / "kubelet.sock"), listing(
        pod("ml", "trainer", {"main": [("nvidia.com/gpu", [g[0].uuid, g[1].uuid])]}))).start()
    try:
        config = Config(metrics_address="127.0.0.1:0", pod_resources_socket=kubelet.socket_path,
                        sample_interval_s=3600, pod_resources_refresh_s=3600)
        service = MetricsService(backend, topology, config, hostname="node-a", ready=lambda: True,
                                 agent_metrics=AgentMetrics(CollectorRegistry(), backend))
        # GPM ratios need two samples: this one, then the thread's first
        service.sampler.sample_once()
        service.pod_resources.refresh_once()
        service.start()
        prom = PrometheusServer(workdir, f"127.0.0.1:{service.port}")
        try:
            prom.wait_for("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", topology.gpu_count)
            yield prom, topology
        finally:
            prom.stop()
            service.stop()
    finally:
        kubelet.stop()
        node.close()


@needs_prometheus
def test_prometheus_scrapes_the_agent_successfully(scraped):
    prom, _ = scraped
    up = prom.query('up{job="gpu-topology-agent"}')
    assert [float(s["value"][1]) for s in up] == [1.0]


@needs_prometheus
@pytest.mark.parametrize("expr", dashboard_expressions())
def test_every_dcgm_dashboard_expression_gives_one_series_per_gpu(scraped, expr):
    prom, topology = scraped
    result = prom.query(expr)
    if expr.startswith(("avg(", "sum(")):
        assert len(result) == 1  # the gauges aggregate all GPUs into one value
        return
    gpus = sorted(int(s["metric"]["gpu"]) for s in result)
    # attributed GPUs carry one series per container; this node has one container per GPU
    assert gpus == list(range(topology.gpu_count)), expr


@needs_prometheus
def test_dashboard_template_variables_find_the_instance_and_every_gpu(scraped):
    prom, topology = scraped
    gpus = prom.get("/api/v1/label/gpu/values", **{"match[]": "DCGM_FI_DEV_GPU_TEMP"})["data"]
    assert sorted(map(int, gpus)) == list(range(topology.gpu_count))
    instances = prom.get("/api/v1/label/instance/values",
                         **{"match[]": "DCGM_FI_DEV_GPU_TEMP"})["data"]
    assert len(instances) == 1


@needs_prometheus
def test_attributed_series_and_placement_ratio_reach_prometheus(scraped):
    prom, _ = scraped
    util = prom.query('DCGM_FI_DEV_GPU_UTIL{pod="trainer"}')
    assert sorted(s["metric"]["gpu"] for s in util) == ["0", "1"]
    ratio = prom.query('gpu_topology_placement_quality_ratio{pod="trainer"}')
    assert len(ratio) == 1 and 0.0 < float(ratio[0]["value"][1]) <= 1.0


@needs_prometheus
def test_every_expression_of_our_dashboard_is_valid_promql(scraped):
    prom, _ = scraped
    dashboard = json.loads((CHART_FILES / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        prom.query(expr.replace("$instance", ".*").replace("$gpu", ".*"))  # asserts success
    temp = prom.query('DCGM_FI_DEV_GPU_TEMP{instance=~".*", gpu=~".*"}')
    assert temp


# ------------------------------------------------------------------ alert rules
@needs_promtool
def test_alert_rules_pass_promtool_check():
    done = subprocess.run([PROMTOOL, "check", "rules", str(CHART_FILES / "prometheusrule-rules.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_each_alert_fires_on_crafted_series_in_promtool_unit_tests():
    done = subprocess.run([PROMTOOL, "test", "rules", str(CHART_FILES / "rules-test.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_promtool_unit_test():
    rules = yaml.safe_load((CHART_FILES / "prometheusrule-rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((CHART_FILES / "rules-test.yaml").read_text())
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
             if t["exp_alerts"]}
    assert alerts == fired == {"GpuAllocatedIdle", "GpuTemperatureHigh", "GpuDoubleBitEccError",
                               "GpuCriticalXid", "GpuDeviceUnhealthy", "GpuPodMisplaced",
                               "GpuDraFeatureDropped", "GpuNodeConditionFalse"}


def test_prometheus_rule_object_wraps_exactly_the_plain_rule_file():
    plain = yaml.safe_load((CHART_FILES / "prometheusrule-rules.yaml").read_text())
    wrapped = yaml.safe_load((DEPLOY / "prometheusrule.yaml").read_text())
    assert wrapped["kind"] == "PrometheusRule"
    assert wrapped["spec"]["groups"] == plain["groups"]
