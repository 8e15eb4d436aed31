"""Per-node configs: a real ``python -m agent run`` process with a directory of named configs,
the stand-in kubelet (what the node is offered) and the stand-in API server (its Node and the
label ``nvidia.com/device-plugin.config``), as NVIDIA's config-manager chooses configs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from waiting import eventually

from agent.errors import ConfigError
from agent.nodeconfig import NamedConfigs
from tests.testbed.apiserver_stub import ApiServerStub
from tests.testbed.kubelet_stub import KubeletStub

ROOT = Path(__file__).resolve().parent.parent
LABEL = "nvidia.com/device-plugin.config"
NODE = "gpu-node-1"
SHARED_4 = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
CONFIGS = {"default": "version: v1\n", "shared": SHARED_4, "broken": "version: v1\nflags:\n  migStrategy: both\n"}


class Agent:
    """The agent process, its stand-ins and what can be seen of it from outside."""

    def __init__(self, tmp: Path, api: ApiServerStub, kubelet: KubeletStub, args: list[str]) -> None:
        self.tmp, self.api, self.kubelet = tmp, api, kubelet
        self.log = tmp / "agent.log"
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: stub\n"
            f"clusters: [{{name: stub, cluster: {{server: '{api.url}'}}}}]\n"
            "users: [{name: agent, user: {token: t}}]\n"
            "contexts: [{name: stub, context: {cluster: stub, user: agent}}]\n")
        env = dict(os.environ, PYTHONPATH=str(ROOT), NODE_NAME=NODE)
        env.pop("CONFIG_FILE", None)
        with open(self.log, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--simulate", "dgx-h100",
                 "--kubelet-dir", str(tmp / "k"), "--features-dir", str(tmp / "features"),
                 "--metrics-address", "127.0.0.1:0", "--kubeconfig", str(kubeconfig),
                 "--pod-resources-socket", str(tmp / "k" / "podres.sock"), *args],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)

    def offered(self) -> int:
        latest = self.kubelet.latest("nvidia.com/gpu")
        return len(latest.devices) if latest is not None else 0

    def labels(self) -> dict[str, str]:
        try:
            text = (self.tmp / "features" / "gpu-topology-agent").read_text()
        except FileNotFoundError:
            return {}
        return dict(line.split("=", 1) for line in text.splitlines() if line)

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The samples of ``name`` on /metrics (the port the agent picked, from its log)."""
        import re
        import urllib.request

        port = re.search(r"metrics on 127\.0\.0\.1:(\d+)", self.log_text())
        if port is None:
            return {}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5) as resp:
                body = resp.read().decode()
        except OSError:
            return {}
        return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(body)
                for s in f.samples if s.name == name}

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def node(tmp_path: Path) -> Iterator:
    """Start an agent with the configs of ``CONFIGS`` (and ``--default-config default``)
    against stand-ins; the node exists with ``labels``."""
    (tmp_path / "k").mkdir()
    configs = tmp_path / "configs"
    configs.mkdir()
    for name, text in CONFIGS.items():
        (configs / name).write_text(text)
    api = ApiServerStub().start()
    kubelet = KubeletStub(str(tmp_path / "k")).start()
    agents: list[Agent] = []

    def start(labels: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> Agent:
        api.add_node(NODE, labels=labels)
        agent = Agent(tmp_path, api, kubelet,
                      ["--config-file-srcdir", str(configs), "--default-config", "default", *extra])
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        assert agent.stop() == 0, agent.log_text()[-3000:]
    kubelet.stop()
    api.stop()


def test_the_node_label_picks_the_config_and_a_changed_label_applies_the_other(node) -> None:
    agent = node({LABEL: "shared"})
    assert eventually(lambda: agent.offered() == 32, 30.0), agent.log_text()[-2000:]  # 4 replicas x 8
    assert agent.log_text().count("per-node config shared applied (label nvidia.com/device-plugin.config=shared)") == 1
    assert eventually(lambda: agent.labels().get("topology.gpu-agent.io/active-config") == "shared")
    assert eventually(lambda: agent.series("gpu_agent_active_config") == {(("name", "shared"),): 1.0})

    agent.api.label_node(NODE, **{LABEL: "default"})
    assert eventually(lambda: agent.offered() == 8, 15.0), agent.log_text()[-2000:]
    assert eventually(lambda: agent.labels().get("topology.gpu-agent.io/active-config") == "default")
    assert agent.series("gpu_agent_active_config") == {(("name", "default"),): 1.0}
    assert "per-node config default applied (label nvidia.com/device-plugin.config=default)" in agent.log_text()

    agent.api.label_node(NODE, **{LABEL: None})  # no label: the default config, applied already
    agent.api.label_node(NODE, **{LABEL: "shared"})
    assert eventually(lambda: agent.offered() == 32, 15.0)


def test_a_label_naming_no_config_keeps_the_last_good_one_and_says_why_once(node) -> None:
    agent = node()
    assert eventually(lambda: agent.offered() == 8, 30.0), agent.log_text()[-2000:]
    assert "per-node config default applied (label nvidia.com/device-plugin.config=<none>)" in agent.log_text()
    agent.api.label_node(NODE, **{LABEL: "missing"})
    refused = {(("label", "missing"), ("reason", "unknown")): 1.0}
    assert eventually(lambda: agent.series("gpu_agent_config_refused") == refused, 15.0)
    agent.api.label_node(NODE, team="ml")  # another label: nothing new to say
    agent.api.label_node(NODE, **{LABEL: "broken"})  # exists, does not load
    assert eventually(lambda: agent.series("gpu_agent_config_refused")
                      == {(("label", "broken"), ("reason", "invalid")): 1.0}, 15.0)
    assert agent.proc.poll() is None and agent.offered() == 8
    assert agent.series("gpu_agent_active_config") == {(("name", "default"),): 1.0}
    log = agent.log_text()
    assert log.count("label nvidia.com/device-plugin.config=missing: no config of that name") == 1, log[-3000:]
    assert "keeping config default" in log and "flags.migStrategy" in log

    agent.api.label_node(NODE, **{LABEL: "shared"})  # a good label again
    assert eventually(lambda: agent.offered() == 32, 15.0)
    assert eventually(lambda: agent.series("gpu_agent_config_refused") == {})


def test_a_watch_that_ends_is_resumed_and_an_expired_one_lists_again(node) -> None:
    agent = node({LABEL: "default"})
    api = agent.api
    assert eventually(lambda: agent.offered() == 8, 30.0), agent.log_text()[-2000:]
    api.label_node(NODE, **{LABEL: "shared"})  # seen by the open watch
    assert eventually(lambda: agent.offered() == 32, 15.0), agent.log_text()[-2000:]
    seen_rv = api._nodes[NODE]["metadata"]["resourceVersion"]

    api.end_watches()  # a restarting API server: the agent resumes where it was
    assert eventually(lambda: any(f"resourceVersion={seen_rv}" in q for q in _watch_queries(api)), 15.0)
    api.label_node(NODE, **{LABEL: "default"})
    assert eventually(lambda: agent.offered() == 8, 15.0), agent.log_text()[-2000:]

    lists = _list_count(api)
    api.go_down()  # ... and while it was away the label changed and the history was compacted
    api.label_node(NODE, **{LABEL: "shared"})
    api.compact()
    api.come_up()  # the resumed watch gets 410 Expired: the agent lists the node again
    assert eventually(lambda: agent.offered() == 32, 20.0), agent.log_text()[-2000:]
    assert _list_count(api) > lists
    log = agent.log_text()
    assert "listing it again" in log and "following the label nvidia.com/device-plugin.config of node gpu-node-1 failed" in log
    assert "following the label nvidia.com/device-plugin.config of node gpu-node-1 works again" in log


def _watch_queries(api: ApiServerStub) -> list[str]:
    return [r.query for r in api.requests if r.path == "/api/v1/nodes" and "watch=true" in r.query]


def _list_count(api: ApiServerStub) -> int:
    return sum(1 for r in api.requests if r.path == "/api/v1/nodes" and "watch=true" not in r.query)


# ----------------------------------------------------------------------------- at start


def run_agent(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("CONFIG_FILE", None)
    return subprocess.run([sys.executable, "-m", "agent", "run", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("args, env, message", [
    (["--default-config", "nope"], {"NODE_NAME": "n"}, "--default-config nope: no config of that name"),
    (["--config", "CONFIGS/a"], {"NODE_NAME": "n"}, "--config-file-srcdir and --config (or CONFIG_FILE): set only one"),
    ([], {"NODE_NAME": ""}, "--config-file-srcdir needs the node's name"),
    (["--fallback-strategies", "empty"], {"NODE_NAME": "n"}, "expected one of named, single, got 'empty'"),
])
def test_per_node_settings_that_cannot_work_exit_2_with_one_line(tmp_path: Path, args, env, message) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "a").write_text("version: v1\n")
    (configs / "b").write_text("version: v1\n")
    args = [a.replace("CONFIGS", str(configs)) for a in args]
    result = run_agent(["--config-file-srcdir", str(configs), "--kubelet-dir", str(tmp_path), *args], env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_configs_are_chosen_by_label_default_then_named_then_single(tmp_path: Path) -> None:
    d = tmp_path / "configs"
    d.mkdir()
    (d / "a100").write_text("")
    (d / "..data").mkdir()  # a ConfigMap volume's own entries are not configs
    (d / "..2025_01_01").write_text("")
    (d / "subdir").mkdir()
    single = NamedConfigs(str(d), "", ("named", "single"), LABEL)
    assert single.names() == ["a100"]
    assert single.choose("") == "a100" and single.choose("a100") == "a100"
    (d / "default").write_text("")
    assert NamedConfigs(str(d), "", ("named", "single"), LABEL).choose("") == "default"
    assert NamedConfigs(str(d), "a100", ("named",), LABEL).choose("") == "a100"
    with pytest.raises(ConfigError, match=r"no label nvidia.com/device-plugin.config, no --default-config, "
                                          r"and the fallbacks \(single\) choose no config"):
        NamedConfigs(str(d), "", ("single",), LABEL).choose("")
    with pytest.raises(ConfigError, match="label nvidia.com/device-plugin.config=h100: no config of that name"
                                          r" \(.* has: a100, default\)"):
        single.choose("h100")



def test_a_watch_ended_at_its_timeout_resumes_from_the_bookmarks_resource_version() -> None:
    """The API server ends each watch at ``timeoutSeconds``, after a bookmark naming the
    newest resourceVersion: the next watch starts there, not from an older event's."""
    from agent.nodeconfig import NodeLabelWatch

    api = ApiServerStub().start()
    try:
        api.add_node(NODE, labels={LABEL: "a"})
        api.add_node("other-node")
        values: list[str] = []
        watch = NodeLabelWatch(api.api_client, NODE, LABEL, watch_timeout_s=1)
        watch.start(values.append)
        assert eventually(lambda: values == ["a"], 15.0)
        api.label_node("other-node", team="ml")  # not this node: no event, but a newer version
        newest = api._nodes["other-node"]["metadata"]["resourceVersion"]
        assert eventually(lambda: any(f"resourceVersion={newest}" in q for q in _watch_queries(api)), 10.0)
        api.label_node(NODE, **{LABEL: "b"})
        assert eventually(lambda: values == ["a", "b"], 10.0)
        watch.stop()
    finally:
        api.stop()


def test_a_node_not_yet_in_the_api_server_is_said_once_and_once_when_it_appears(caplog) -> None:
    import logging

    from agent.nodeconfig import NodeLabelWatch

    api = ApiServerStub().start()
    try:
        values: list[str] = []
        watch = NodeLabelWatch(api.api_client, NODE, LABEL, watch_timeout_s=1)
        with caplog.at_level(logging.INFO, logger="agent.nodeconfig"):
            watch.start(values.append)
            assert eventually(lambda: len(_watch_queries(api)) >= 2, 15.0), "a watch ended and was resumed"
            api.add_node(NODE, labels={LABEL: "a"})
            assert eventually(lambda: values == ["a"], 10.0)
            watch.stop()
        said = [r.getMessage() for r in caplog.records if f"node {NODE} in the API server" in r.getMessage()]
        assert said == [f"finding node {NODE} in the API server failed: not found (waiting for it)",
                        f"finding node {NODE} in the API server works again"], said
    finally:
        api.stop()
