"""``gpu-topology-agent demo``: the real agent on a simulated machine, told as a story.

The agent runs exactly as ``run --simulate`` would (daemon, device-plugin servers on unix
sockets, labels file, metrics server, health watcher), in a temporary directory, against an
in-process stand-in kubelet (:mod:`agent.demo.kubelet`). The stand-in registers the plugin,
watches its device list, asks it for preferred allocations over gRPC and allocates, then
reports the running pods through a pod-resources server so the metrics carry pod labels.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from typing import Any, Callable, TextIO

from prometheus_client.parser import text_string_to_metric_families

from agent.config import Config
from agent.errors import AgentError
from agent.topology.allocator import AllocationEngine
from agent.topology.model import Topology

RESOURCE = "nvidia.com/gpu"
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


@dataclass(frozen=True)
class Step:
    """One event of the busy node: a pod arriving (``size`` GPUs) or leaving."""

    kind: str  # "arrive" | "leave"
    pod: str
    size: int = 0


def busy_node_trace(gpu_count: int, seed: int = 5, arrivals: int = 12) -> list[Step]:
    """A seeded sequence of pods of mixed sizes arriving and leaving. Sizes are 1, 2, 4
    and 8 GPUs (those that fit the node), small ones more often."""
    rng = random.Random(seed)
    sizes = [s for s in (1, 2, 4, 8) if s <= gpu_count] or [1]
    weights = (3, 3, 2, 1)[: len(sizes)]
    kinds = {1: "infer", 2: "finetune", 4: "train", 8: "train"}
    steps: list[Step] = []
    running: list[str] = []
    count = 0
    while count < arrivals:
        if len(running) >= 2 and rng.random() < 0.4:
            pod = running.pop(rng.randrange(len(running)))
            steps.append(Step("leave", pod))
            continue
        size = rng.choices(sizes, weights)[0]
        count += 1
        pod = f"{kinds[size]}-{count}"
        running.append(pod)
        steps.append(Step("arrive", pod, size))
    return steps


class Story:
    """Runs the demo and collects its facts (for the table or for ``--format json``)."""

    def __init__(self, machine: str, out: TextIO, progress: Callable[[str], None]) -> None:
        self.machine = machine
        self.out = out
        self.progress = progress
        self.facts: dict[str, Any] = {"machine": machine}

    # ------------------------------------------------------------------ output helpers
    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def heading(self, text: str) -> None:
        self.say()
        self.say(f"== {text} " + "=" * max(0, WIDTH - len(text) - 4))

    # ------------------------------------------------------------------ the run
    def run(self, table: bool) -> dict[str, Any]:
        from agent.daemon import Daemon
        from agent.demo.kubelet import KubeletStub, PluginClient, PodResourcesStub

        workdir = tempfile.mkdtemp(prefix="gta-demo-")
        kubelet_dir = os.path.join(workdir, "device-plugins")
        features_dir = os.path.join(workdir, "features.d")
        os.makedirs(features_dir)
        config = replace(
            Config(),
            kubelet_dir=kubelet_dir,
            features_dir=features_dir,
            pod_resources_socket=os.path.join(workdir, "pod-resources.sock"),
            metrics_address="127.0.0.1:0",
            node_name="demo-node",
            sample_interval_s=0.5,
            pod_resources_refresh_s=0.5,
        )
        kubelet = pod_resources = daemon = client = None
        try:
            self.progress(f"starting the stand-in kubelet in {workdir}")
            kubelet = KubeletStub(kubelet_dir).start()
            pod_resources = PodResourcesStub(config.pod_resources_socket).start()
            self.progress(f"starting the agent on the simulated machine {self.machine!r}")
            daemon = Daemon.from_config(config, simulate=self.machine)
            if not daemon.start():
                raise AgentError("the agent stopped while starting")
            topology = daemon.topology
            assert topology is not None  # start() read it
            from agent.commands.discover import topology_to_json

            self.facts["topology"] = topology_to_json(topology)
            if table:
                self.show_topology(topology)
                self.show_labels(features_dir)
            else:
                self.facts["labels"] = self.read_labels(features_dir)
            self.progress("waiting for the agent to register with the kubelet")
            if not kubelet.wait_for(lambda: bool(kubelet.registered(RESOURCE)), 10.0):
                raise AgentError("the agent did not register with the stand-in kubelet in 10 s")
            if not kubelet.wait_for(lambda: kubelet.latest(RESOURCE) is not None, 5.0):
                raise AgentError("the agent sent no device list in 5 s")
            registration = kubelet.registered(RESOURCE)[0]
            latest = kubelet.latest(RESOURCE)
            assert latest is not None  # wait_for saw one; the stub's lists only grow
            devices = list(latest.devices)
            self.facts["registration"] = {
                "resource": registration.request.resource_name,
                "version": registration.request.version,
                "endpoint": registration.request.endpoint,
                "preferred_allocation": registration.options.get_preferred_allocation_available,
                "devices": len(devices),
                "healthy": sum(d.health == "Healthy" for d in devices),
                "numa_nodes": sorted({n.ID for d in devices for n in d.topology.nodes}),
            }
            if table:
                r = self.facts["registration"]
                self.heading("The kubelet's view")
                self.say(
                    f"registered {r['resource']} (API {r['version']}, socket {r['endpoint']}, "
                    f"preferred allocation {'on' if r['preferred_allocation'] else 'off'})"
                )
                self.say(
                    f"ListAndWatch: {r['devices']} devices, {r['healthy']} healthy, "
                    f"NUMA nodes {r['numa_nodes'] or 'not reported'}"
                )
            client = PluginClient(os.path.join(kubelet_dir, registration.request.endpoint))
            running = self.replay(topology, devices, client, table)
            self.report_pods(pod_resources, running)
            self.progress("waiting for the metrics to attribute GPUs to pods")
            self.show_metrics(daemon, running, table)
        finally:
            if client is not None:
                client.close()
            if daemon is not None:
                daemon.shutdown()
            if pod_resources is not None:
                pod_resources.stop()
            if kubelet is not None:
                kubelet.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        return self.facts

    # ------------------------------------------------------------------ sections
    def show_topology(self, topology: Topology) -> None:
        from agent.commands.discover import render_table

        self.heading(f"Topology of {self.machine}")
        self.out.write(render_table(topology, max_columns=WIDTH))

    def read_labels(self, features_dir: str) -> dict[str, str]:
        labels: dict[str, str] = {}
        for name in sorted(os.listdir(features_dir)):
            with open(os.path.join(features_dir, name), encoding="utf-8") as fh:
                for line in fh:
                    key, sep, value = line.strip().partition("=")
                    if sep:
                        labels[key] = value
        return labels

    def show_labels(self, features_dir: str) -> None:
        labels = self.facts["labels"] = self.read_labels(features_dir)
        self.heading(f"Node labels ({len(labels)}, written to the NFD features.d file)")
        for key, value in labels.items():
            self.say(f"  {key}={value}")

    def replay(self, topology: Topology, devices: list[Any], client: Any, table: bool) -> dict:
        """The busy node: each arriving pod asks the agent over gRPC (GetPreferredAllocation
        then Allocate); the anchor's and a naive choice on the same free GPUs are scored
        beside it."""
        index_of = {g.uuid: g.index for g in topology.gpus}
        id_of = {g.index: g.uuid for g in topology.gpus}
        engine = AllocationEngine(topology)
        free = [d.ID for d in devices if d.health == "Healthy"]
        running: dict[str, list[str]] = {}
        rows: list[dict[str, Any]] = []
        if table:
            self.heading("A busy node: pods arrive and leave")
            self.say(
                f"{'event':<20}{'ours: GPUs':<18}{'score':>7}{'NUMA':>5}"
                f"{'anchor: GPUs':>18}{'score':>7}{'naive: GPUs':>18}{'score':>7}"
            )

        def numa_count(indices: list[int]) -> int | None:
            nodes = {topology.gpus[i].numa_node for i in indices}
            return None if None in nodes else len(nodes)  # unknown: shown as "?"

        def gpus(indices: list[int]) -> str:
            from agent.formats import format_cpulist

            return format_cpulist(indices)  # "0-3,6": the cpulist notation fits 16 GPUs

        for step in busy_node_trace(topology.gpu_count):
            if step.kind == "leave" and step.pod not in running:  # it never got its GPUs
                rows.append({"event": "gives up", "pod": step.pod})
                if table:
                    self.say(f"- {step.pod:<18}gives up waiting")
                continue
            if step.kind == "leave":
                ids = running.pop(step.pod)
                free = sorted(free + ids, key=lambda d: index_of[d])
                rows.append({"event": "leave", "pod": step.pod, "freed": sorted(index_of[d] for d in ids)})
                if table:
                    self.say(f"- {step.pod:<18}frees GPUs {gpus(sorted(index_of[d] for d in ids))}")
                continue
            if step.size > len(free):
                rows.append({"event": "wait", "pod": step.pod, "size": step.size, "free": len(free)})
                if table:
                    self.say(f"+ {step.pod:<18}waits: {step.size} GPUs asked, {len(free)} free")
                continue
            self.progress(f"{step.pod} asks for {step.size} GPU(s)")
            chosen_ids = client.preferred(free, [], step.size)
            response = client.allocate(chosen_ids)
            ours = sorted(index_of[d] for d in chosen_ids)
            free_idx = [index_of[d] for d in free]
            anchor = engine.partition_only_set(free_idx, step.size)
            naive = engine.naive_set(free_idx, step.size)
            row = {
                "event": "arrive",
                "pod": step.pod,
                "size": step.size,
                "gpus": ours,
                "score": topology.set_score(ours),
                "numa_nodes": numa_count(ours),
                "anchor": {"gpus": anchor, "score": topology.set_score(anchor), "numa_nodes": numa_count(anchor)},
                "naive": {"gpus": naive, "score": topology.set_score(naive), "numa_nodes": numa_count(naive)},
                "visible_devices": response.container_responses[0].envs.get("NVIDIA_VISIBLE_DEVICES", ""),
            }
            rows.append(row)
            running[step.pod] = [id_of[i] for i in ours]
            taken = set(running[step.pod])
            free = [d for d in free if d not in taken]
            if table:
                self.say(
                    f"+ {step.pod + f' ({step.size})':<18}{gpus(ours):<18}{row['score']:>7}"
                    f"{_or_unknown(row['numa_nodes']):>5}"
                    f"{gpus(anchor):>18}{row['anchor']['score']:>7}{gpus(naive):>18}{row['naive']['score']:>7}"
                )
        arrived = [r for r in rows if r["event"] == "arrive" and r["size"] > 1]
        score_totals: dict[str, int] = {
            k: sum((r[k]["score"] if k != "ours" else r["score"]) for r in arrived)
            for k in ("ours", "anchor", "naive")
        }
        one_numa_node: dict[str, int] = {
            k: sum((r[k]["numa_nodes"] if k != "ours" else r["numa_nodes"]) == 1 for r in arrived)
            for k in ("ours", "anchor", "naive")
        }
        summary = {
            "multi_gpu_pods": len(arrived),
            "score": score_totals,
            "one_numa_node": one_numa_node,
        }
        self.facts["allocations"] = rows
        self.facts["allocation_summary"] = summary
        if table:
            self.say()
            self.say(
                "score = sum of pair scores (NVLink 100 each + PCIe SYS 10 .. BOARD 60); anchor = "
                "go-gpuallocator's"
            )
            self.say("choice on the same free GPUs; naive = the lowest free indices.")
            if arrived:
                s, n = score_totals, one_numa_node
                self.say(
                    f"{len(arrived)} multi-GPU pods: total score ours {s['ours']}, anchor "
                    f"{s['anchor']}, naive {s['naive']};"
                )
                self.say(f"on one NUMA node: ours {n['ours']}, anchor {n['anchor']}, naive {n['naive']}")
        return running

    def report_pods(self, pod_resources: Any, running: dict[str, list[str]]) -> None:
        """What the kubelet's pod-resources API would now list for the running pods."""
        from agent._proto import podresources_v1_pb2 as pr

        response = pr.ListPodResourcesResponse()
        for pod, ids in sorted(running.items()):
            p = response.pod_resources.add(name=pod, namespace=NAMESPACE)
            c = p.containers.add(name="main")
            c.devices.add(resource_name=RESOURCE, device_ids=ids)
        pod_resources.list_response = response

    def show_metrics(self, daemon: Any, running: dict[str, list[str]], table: bool) -> None:
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
        self.say("dcgm-exporter's names and labels (gpu, UUID, device, modelName, Hostname, pod, ...);")
        self.say("placement quality 1.0 = the best GPU set of that size this node offers.")


def run_demo(machine: str, fmt: str, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The ``demo`` subcommand's body (stdout/stderr by default): 0 on success."""
    out = out or sys.stdout
    err = err or sys.stderr
    logging.getLogger("agent").setLevel(logging.WARNING)

    def progress(text: str) -> None:
        assert err is not None
        err.write(f"demo: {text}\n")
        err.flush()

    story = Story(machine, out, progress)
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
        story.say("Next: `gpu-topology-agent allocate --simulate " + machine + " --size 4 --explain`,")
        story.say("or deploy it: `kubectl apply -k daemonset/` (see README).")
    return 0


def _or_unknown(value: object) -> str:
    """A fact the input did not give is shown as ``?``, never as a made-up default."""
    return "?" if value is None else str(value)
