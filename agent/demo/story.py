"""``gpu-topology-agent demo``: the real agent on a simulated machine, told as a story.

The agent runs exactly as ``run --simulate`` would (daemon, device-plugin servers on unix
sockets, labels file, metrics server, health watcher), in a temporary directory, against an
in-process stand-in kubelet (:mod:`agent.demo.kubelet`). The stand-in registers the plugin,
watches its device list, asks it for preferred allocations over gRPC and allocates, then
reports the running pods through a pod-resources server so the metrics carry pod labels.
Last, the agent runs again with one GPU time-sliced between two pods
(:mod:`agent.demo.shared_gpu`), to show each pod's own use of it, and once more with one GPU
shared through MPS (:mod:`agent.demo.mps_gpu`), to show what an MPS replica's pod gets.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys
import tempfile
import textwrap
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

from prometheus_client.parser import text_string_to_metric_families

from agent.config import Config
from agent.demo.busy_node import BusyNode, busy_node_trace, n_gpus
from agent.demo.mps_gpu import show_mps
from agent.demo.nccl_pod import show_nccl
from agent.demo.node import demo_node
from agent.demo.shared_gpu import show_shared_gpu
from agent.errors import AgentError
from agent.formats import GPU_RESOURCE
from agent.render import render_table, topology_to_json
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent._proto.deviceplugin_v1beta1_pb2 import Device
    from agent.daemon import Daemon
    from agent.demo.kubelet import KubeletStub, PluginClient, PodResourcesStub

NAMESPACE = "demo"
WIDTH = 100
#: Metrics shown in the excerpt, in this order.
EXCERPT_METRICS = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "gpu_topology_placement_quality_ratio",
    "gpu_topology_info",
    "gpu_agent_registrations_total",
    "gpu_agent_preferred_allocation_seconds_count",
)


def demo_config(workdir: str) -> Config:
    """The agent's settings for a demo in ``workdir`` (sockets, labels, metrics on a free
    port, fast sampling so the excerpt fills quickly)."""
    features_dir = os.path.join(workdir, "features.d")
    os.makedirs(features_dir)
    return replace(
        Config(),
        kubelet_dir=os.path.join(workdir, "device-plugins"),
        features_dir=features_dir,
        pod_resources_socket=os.path.join(workdir, "pod-resources.sock"),
        metrics_address="127.0.0.1:0",
        node_name="demo-node",
        sample_interval_s=0.5,
        pod_resources_refresh_s=0.5,
    )


def read_labels(features_dir: str) -> dict[str, str]:
    """The ``key=value`` labels of every file in ``features_dir``."""
    labels: dict[str, str] = {}
    for name in sorted(os.listdir(features_dir)):
        with open(os.path.join(features_dir, name), encoding="utf-8") as fh:
            for line in fh:
                key, sep, value = line.strip().partition("=")
                if sep:
                    labels[key] = value
    return labels


class Story:
    """Runs the demo and collects its facts (for the table or for ``--format json``)."""

    def __init__(
        self, machine: str, out: TextIO, progress: Callable[[str], None], label: str | None = None
    ) -> None:
        self.machine = machine
        self.label = label or machine  # how the user named it: "-" for standard input
        self.out = out
        self.progress = progress
        self.facts: dict[str, Any] = {"machine": self.label}

    # ------------------------------------------------------------------ output helpers
    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def explain(self, text: str) -> None:
        """Prose, wrapped to the output width."""
        self.say(textwrap.fill(text, WIDTH, break_on_hyphens=False))

    def heading(self, text: str) -> None:
        self.say()
        self.say(f"== {text} " + "=" * max(0, WIDTH - len(text) - 4))

    # ------------------------------------------------------------------ the run
    def run(self, table: bool) -> dict[str, Any]:
        workdir = tempfile.mkdtemp(prefix="gta-demo-")
        config = demo_config(workdir)
        try:
            with demo_node(config, self.machine, self.progress) as node:
                topology = node.daemon.topology
                assert topology is not None  # start() read it
                self.show_node(topology, config.features_dir, table)
                endpoint, devices = self.show_registration(node.kubelet, table)
                running = self.replay(topology, devices, node.client(endpoint), table)
                self.report_pods(node.pod_resources, running)
                if (nccl := show_nccl(self, topology, config, running, table)) is not None:
                    self.facts["nccl"] = nccl
                self.progress("waiting for the metrics to attribute GPUs to pods")
                self.show_metrics(node.daemon, running, table)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        self.show_shared_gpu(table)
        return self.facts

    def show_shared_gpu(self, table: bool) -> None:
        """Two pods sharing one GPU of the machine's model, time-slicing
        (:mod:`agent.demo.shared_gpu`) then MPS (:mod:`agent.demo.mps_gpu`), the agent run
        again for each in a directory of its own."""
        gpus = self.facts["topology"]["gpus"]
        model = gpus[0]["name"] if gpus else None
        for key, section in (("shared_gpu", show_shared_gpu), ("mps", show_mps)):
            workdir = tempfile.mkdtemp(prefix="gta-demo-shared-")
            try:
                config = replace(demo_config(workdir), nccl_pod_files="off")  # NCCL: shown above
                self.facts[key] = section(self, config, workdir, model, table)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)

    # ------------------------------------------------------------------ sections
    def show_node(self, topology: Topology, features_dir: str, table: bool) -> None:
        """The topology the agent read and the labels it wrote."""
        self.facts["topology"] = topology_to_json(topology)
        if not table:
            self.facts["labels"] = read_labels(features_dir)
            return
        self.explain(
            "The real agent runs on a simulated machine against a stand-in kubelet (an "
            "in-process fake of the node agent that registers device plugins and asks them for "
            "GPUs); everything lives in a temporary directory."
        )
        self.heading(f"Topology of {'standard input' if self.label == '-' else self.label}")
        self.explain(
            "What the agent read, as `nvidia-smi topo -m` shows it. NVLink island = GPUs that "
            "reach each other over NVLink, directly or through other GPUs; NVLink clique = GPUs "
            "of which every two are linked directly; NUMA group = GPUs attached to one CPU "
            "socket's memory node."
        )
        self.say()
        self.out.write(render_table(topology, max_columns=WIDTH))
        labels = self.facts["labels"] = read_labels(features_dir)
        self.heading(f"Node labels ({len(labels)})")
        self.explain(
            "Written to a features.d file of NFD (Node Feature Discovery), which puts them on the "
            "Node object for node selectors: nvidia.com/ ones as NVIDIA's GPU Feature Discovery "
            "(GFD) names them, topology.gpu-agent.io/ ones ours."
        )
        for key, value in labels.items():
            self.say(f"  {key}={value}")

    def show_registration(self, kubelet: KubeletStub, table: bool) -> tuple[str, list[Device]]:
        """Wait for the agent to register and send its device list; returns the plugin's
        socket name and the devices it advertised."""
        self.progress("waiting for the agent to register with the kubelet")
        if not kubelet.wait_for(lambda: bool(kubelet.registered(GPU_RESOURCE)), 10.0):
            raise AgentError("the agent did not register with the stand-in kubelet in 10 s")
        if not kubelet.wait_for(lambda: kubelet.latest(GPU_RESOURCE) is not None, 5.0):
            raise AgentError("the agent sent no device list in 5 s")
        registration = kubelet.registered(GPU_RESOURCE)[0]
        latest = kubelet.latest(GPU_RESOURCE)
        assert latest is not None  # wait_for saw one; the stub's lists only grow
        devices = list(latest.devices)
        r = self.facts["registration"] = {
            "resource": registration.request.resource_name,
            "version": registration.request.version,
            "endpoint": registration.request.endpoint,
            "preferred_allocation": registration.options.get_preferred_allocation_available,
            "devices": len(devices),
            "healthy": sum(d.health == "Healthy" for d in devices),
            "numa_nodes": sorted({n.ID for d in devices for n in d.topology.nodes}),
        }
        if table:
            self.heading("The kubelet's view")
            self.explain(
                "The agent registered as a device plugin. ListAndWatch is its stream of devices "
                "and their health to the kubelet; with preferred allocation on, the kubelet asks "
                "it (GetPreferredAllocation) which of the free GPUs to give each pod."
            )
            self.say(
                f"registered {r['resource']} (API {r['version']}, socket {r['endpoint']}, "
                f"preferred allocation {'on' if r['preferred_allocation'] else 'off'})"
            )
            self.say(
                f"ListAndWatch: {r['devices']} devices, {r['healthy']} healthy, "
                f"NUMA nodes {r['numa_nodes'] or 'not reported'}"
            )
        return registration.request.endpoint, devices

    def replay(
        self, topology: Topology, devices: list[Device], client: PluginClient, table: bool
    ) -> dict[str, list[str]]:
        """The busy node: each arriving pod asks the agent over gRPC (GetPreferredAllocation
        then Allocate); go-gpuallocator's and a naive choice on the same free GPUs are scored
        beside it. Returns the running pods' device IDs."""
        if table:
            self.heading("A busy node: pods arrive and leave")
            self.explain(
                "Pods arrive (+) and leave (-); one that does not fit waits, and is placed (*) "
                "once GPUs free up, oldest first, as the kubelet would. For each pod: ours = the "
                "agent's answer to GetPreferredAllocation; gpuallocator = NVIDIA's go-gpuallocator, "
                "the allocator of NVIDIA's device plugin, which we compare against, on the same "
                "free GPUs; naive = the lowest free indices. score = the sum over every two GPUs "
                "of the set of 100 per NVLink plus 10 (PCIe SYS: across sockets) .. 60 (BOARD); "
                "higher is better. NUMA = the NUMA nodes the set spans (1: single-NUMA)."
            )
            self.say()
            self.say(
                f"{'event':<20}{'ours: GPUs':<18}{'score':>7}{'NUMA':>5}"
                f"{'gpuallocator: GPUs':>20}{'score':>7}{'naive: GPUs':>16}{'score':>7}"
            )
        node = BusyNode(topology, devices, client, self.say if table else None, self.progress)
        for step in busy_node_trace(len(node.free)):  # the sizes fit the GPUs advertised
            node.play(step)
        waiting = self.facts["still_waiting"] = node.still_waiting()
        arrived = [r for r in node.rows if r["event"] == "arrive" and r["size"] > 1]
        score_totals: dict[str, int] = {
            k: sum((r[k]["score"] if k != "ours" else r["score"]) for r in arrived)
            for k in ("ours", "gpuallocator", "naive")
        }
        one_numa_node: dict[str, int] = {
            k: sum((r[k]["numa_nodes"] if k != "ours" else r["numa_nodes"]) == 1 for r in arrived)
            for k in ("ours", "gpuallocator", "naive")
        }
        self.facts["allocations"] = node.rows
        self.facts["allocation_summary"] = {
            "multi_gpu_pods": len(arrived),
            "score": score_totals,
            "one_numa_node": one_numa_node,
        }
        if table:
            for w in waiting:
                self.say(
                    f"  {w['pod']} still waiting at the end: {n_gpus(w['size'])} asked, "
                    f"{w['free']} free"
                )
            self.say()
            if arrived:
                s, n = score_totals, one_numa_node
                self.say(
                    f"{len(arrived)} multi-GPU pods: total score ours {s['ours']}, go-gpuallocator "
                    f"{s['gpuallocator']}, naive {s['naive']};"
                )
                self.say(f"on one NUMA node: ours {n['ours']}, go-gpuallocator {n['gpuallocator']}, naive {n['naive']}")
        return node.running

    def report_pods(self, pod_resources: PodResourcesStub, running: dict[str, list[str]]) -> None:
        """What the kubelet's pod-resources API would now list for the running pods."""
        from agent._proto import podresources_v1_pb2 as pr

        response = pr.ListPodResourcesResponse()
        for pod, ids in sorted(running.items()):
            p = response.pod_resources.add(name=pod, namespace=NAMESPACE)
            c = p.containers.add(name="main")
            c.devices.add(resource_name=GPU_RESOURCE, device_ids=ids)
        pod_resources.list_response = response

    def show_metrics(self, daemon: Daemon, running: dict[str, list[str]], table: bool) -> None:
        metrics = daemon.metrics
        if metrics is None:
            raise AgentError("the metrics service did not start")
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        text = ""
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=5) as reply:
                text = reply.read().decode()
            attributed = {line.split('pod="', 1)[1].split('"', 1)[0] for line in text.splitlines() if 'pod="' in line}
            if not running or set(running) <= attributed:
                break
            time.sleep(0.25)
        samples = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in EXCERPT_METRICS:
                    samples.append(sample)
        excerpt = []
        for name in EXCERPT_METRICS:
            picked = [s for s in samples if s.name == name]
            # GPUs held by pods first: the excerpt is about attribution
            picked.sort(key=lambda s: ("pod" not in s.labels, s.labels.get("gpu", "")))
            excerpt.extend(picked[:3])
        self.facts["metrics_url"] = url
        self.facts["metrics"] = [{"name": s.name, "labels": dict(s.labels), "value": s.value} for s in excerpt]
        self.facts["metrics_series"] = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        if not table:
            return
        self.heading(f"/metrics excerpt ({self.facts['metrics_series']} series in all)")
        keep = ("gpu", "pod", "namespace", "resource", "numa_node", "nvlink_island", "nearest_nic")
        for s in excerpt:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items() if k in keep)
            value = f"{s.value:g}"
            line = f"{s.name}{{{labels}}} {value}" if labels else f"{s.name} {value}"
            if len(line) > WIDTH:
                line = line[: WIDTH - len(value) - 5] + "...} " + value
            self.say(line)
        self.say()
        self.explain(
            "dcgm-exporter's (NVIDIA's GPU metrics exporter) names and labels (gpu, UUID, device, "
            "modelName, Hostname, pod, ...); placement quality 1.0 = the best GPU set of that "
            "size this node offers."
        )


def run_demo(
    machine: str,
    fmt: str,
    out: TextIO | None = None,
    err: TextIO | None = None,
    label: str | None = None,
) -> int:
    """The ``demo`` subcommand's body (stdout/stderr by default): 0 on success. ``label`` is
    how the user named the machine where ``machine`` is a copy (``-``: standard input)."""
    out = out or sys.stdout
    err = err or sys.stderr
    with _agent_logs_quiet():
        return _tell(machine, fmt, out, err, label)


@contextmanager
def _agent_logs_quiet() -> Iterator[None]:
    """Only the agent's warnings and errors while the story is told (its INFO lines would
    drown the story on stderr); the ``agent`` logger's level as it was afterwards, so a
    process that goes on (a test run, an embedding program) logs as it did before."""
    agent_log = logging.getLogger("agent")
    level = agent_log.level
    agent_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        agent_log.setLevel(level)


def _tell(machine: str, fmt: str, out: TextIO, err: TextIO, label: str | None) -> int:
    def progress(text: str) -> None:
        err.write(f"demo: {text}\n")
        err.flush()

    story = Story(machine, out, progress, label)
    started = time.monotonic()
    facts = story.run(table=fmt == "table")
    facts["seconds"] = round(time.monotonic() - started, 2)
    if fmt == "json":
        import json

        json.dump(facts, out, indent=2, default=str)
        out.write("\n")
    else:
        story.heading("Done")
        story.say(
            f"The agent served the stand-in kubelet for {facts['seconds']:.1f} s and stopped cleanly."
        )
        story.say(f"Next: `{next_command(story.label, facts)}`" + ("" if story.label == "-" else ","))
        if story.label == "-":
            story.say("      (with the same input on standard input),")
        story.say("or deploy it: `kubectl apply -k daemonset/` (see docs/install.md).")
    return 0


def next_command(machine: str, facts: dict[str, Any]) -> str:
    """The command the demo suggests next: why the agent picks the GPUs it picks, on the same
    machine, for a size that machine's advertised GPUs allow."""
    devices = int(facts.get("registration", {}).get("healthy", 1))
    size = max([s for s in (4, 2, 1) if s <= devices] or [1])
    return f"gpu-topology-agent allocate --simulate {shlex.quote(machine)} --size {size} --explain"
