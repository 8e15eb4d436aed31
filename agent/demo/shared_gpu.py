"""The demo's shared-GPU section: two pods time-slicing one GPU, each told its own use.

The real agent runs a second time, with ``sharing.timeSlicing`` replicas 2, on a one-GPU
simulated machine (a machine spec written to the demo's directory) whose GPU runs one process
of each of two pods: its ``processes:`` carry the cgroup lines of the pods' containers
(systemd driver, cgroup v2, containerd). The stand-in kubelet gives each pod one replica of
the GPU (GetPreferredAllocation, then Allocate) and lists them through pod-resources; the
stand-in containerd (:mod:`agent.demo.containerd`) answers ``ListContainers`` with the
kubelet's labels. ``/metrics`` then tells each pod's own SM utilisation and framebuffer
(``gpu_agent_pod_*``) beside the DCGM series, which give both pods the whole GPU's figure.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol

from prometheus_client.parser import text_string_to_metric_families

from agent.config import Config
from agent.config_file import TimeSlicingResource
from agent.demo.containerd import ContainerdStub, PodContainer
from agent.demo.node import demo_node
from agent.errors import AgentError
from agent.formats import GPU_RESOURCE
from agent.hw.sim.catalogue import GPU_MODELS

if TYPE_CHECKING:
    from agent.daemon import Daemon
    from agent.demo.kubelet import KubeletStub, PluginClient, PodResourcesStub

__all__ = ["SHARED_MACHINE", "show_shared_gpu"]

REPLICAS = 2
SHARED_MACHINE = "shared-gpu"
#: The GPU model when the demo's machine names none the simulator knows.
DEFAULT_MODEL = "NVIDIA A10"
#: (per-pod series, the DCGM series of the same quantity), as the section shows them.
SERIES = (
    ("gpu_agent_pod_sm_utilization_percent", "DCGM_FI_DEV_GPU_UTIL"),
    ("gpu_agent_pod_framebuffer_used_mib", "DCGM_FI_DEV_FB_USED"),
)
MEM_BW = "gpu_agent_pod_memory_bandwidth_utilization_percent"
SHOWN_LABELS = ("gpu", "pod", "container")


class Teller(Protocol):
    """What the section needs of the story that tells it."""

    progress: Callable[[str], None]

    def say(self, text: str = "") -> None: ...
    def explain(self, text: str) -> None: ...
    def heading(self, text: str) -> None: ...


@dataclass(frozen=True)
class DemoPod:
    """A pod of the section with its one process on the shared GPU."""

    n: int
    pod: str
    container: str
    sm_util: int
    mem_util: int
    fb_mib: int
    namespace: str = "demo"

    @property
    def container_id(self) -> str:
        return f"{0xC0DE0000 + self.n:064x}"

    @property
    def pod_uid(self) -> str:
        return f"5eed{self.n:04x}-0000-4000-8000-{self.n:012x}"

    def cgroup(self) -> str:
        """``/proc/<pid>/cgroup`` of its process: cgroup v2, systemd driver, containerd."""
        uid = self.pod_uid.replace("-", "_")
        return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
                f"cri-containerd-{self.container_id}.scope")


PODS = (
    DemoPod(1, "trainer", "main", sm_util=55, mem_util=30, fb_mib=9216),
    DemoPod(2, "notebook", "jupyter", sm_util=12, mem_util=4, fb_mib=3072),
)


def shared_machine(model: str | None) -> dict[str, Any]:
    """The machine spec: one GPU of ``model`` (when the simulator knows it) running one
    process of each pod."""
    return {
        "name": SHARED_MACHINE,
        "description": "one GPU time-sliced between two pods",
        "driver_version": "550.54.15",
        "gpus": [{
            "model": model if model in GPU_MODELS else DEFAULT_MODEL,
            "bus_id": "0000:00:1e.0",
            "processes": [
                {"pid": 4100 + p.n, "used_memory_mib": p.fb_mib, "sm_util": p.sm_util,
                 "mem_util": p.mem_util, "cgroup": p.cgroup()}
                for p in PODS
            ],
        }],
    }


def show_shared_gpu(
    teller: Teller, base: Config, workdir: str, model: str | None, table: bool
) -> dict[str, Any]:
    """Run the section in ``workdir`` with the demo's settings ``base``; returns its facts."""
    spec = shared_machine(model)
    spec_path = os.path.join(workdir, f"{SHARED_MACHINE}.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    config = replace(
        base,
        time_slicing=(TimeSlicingResource(replicas=REPLICAS),),
        cri_socket=os.path.join(workdir, "containerd.sock"),
    )
    teller.progress(f"starting the agent again, time-slicing one GPU {REPLICAS} ways")
    held, text = _serve_two_pods(config, spec_path)
    facts = _facts(text, held, spec["gpus"][0]["model"])
    if table:
        _show(teller, facts)
    return facts


def _serve_two_pods(config: Config, spec_path: str) -> tuple[dict[str, str], str]:
    """Run the agent on the machine of ``spec_path`` with the stand-ins; returns each pod's
    replica and the ``/metrics`` text once both pods' own figures are in it."""
    containerd = ContainerdStub(config.cri_socket, [
        PodContainer(p.container_id, p.pod, p.namespace, p.container, p.pod_uid) for p in PODS
    ]).start()
    try:
        with demo_node(config, spec_path) as node:
            client = node.client(_registered(node.kubelet))
            held = _allocate(client, node.kubelet)
            _report(node.pod_resources, held)
            return held, _scrape(node.daemon)
    finally:
        containerd.stop()


def _registered(kubelet: KubeletStub) -> str:
    """The plugin's socket name, once it has advertised the GPU's replicas."""
    def advertised() -> bool:
        latest = kubelet.latest(GPU_RESOURCE)
        return latest is not None and len(latest.devices) == REPLICAS

    if not kubelet.wait_for(advertised, 10.0):
        raise AgentError(f"the agent advertised no {REPLICAS} replicas in 10 s")
    return kubelet.registered(GPU_RESOURCE)[0].request.endpoint


def _allocate(client: PluginClient, kubelet: KubeletStub) -> dict[str, str]:
    """Each pod in turn asks for one device, as the kubelet does: GetPreferredAllocation
    among the free replicas, then Allocate. Returns pod -> replica ID."""
    latest = kubelet.latest(GPU_RESOURCE)
    assert latest is not None  # _registered saw it
    free = [d.ID for d in latest.devices]
    held: dict[str, str] = {}
    for p in PODS:
        chosen = client.preferred(free, [], 1)
        client.start_containers(chosen)
        held[p.pod] = chosen[0]
        free.remove(chosen[0])
    return held


def _report(pod_resources: PodResourcesStub, held: dict[str, str]) -> None:
    """What the kubelet's pod-resources API now lists: each pod's container and replica."""
    from agent._proto import podresources_v1_pb2 as pr

    response = pr.ListPodResourcesResponse()
    for p in PODS:
        c = response.pod_resources.add(name=p.pod, namespace=p.namespace).containers.add(
            name=p.container
        )
        c.devices.add(resource_name=GPU_RESOURCE, device_ids=[held[p.pod]])
    pod_resources.list_response = response


def _scrape(daemon: Daemon) -> str:
    """``/metrics`` once every series the section shows has both pods (15 s at most)."""
    if daemon.metrics is None:
        raise AgentError("the metrics service did not start")
    url = f"http://127.0.0.1:{daemon.metrics.port}/metrics"
    wanted = [name for pair in SERIES for name in pair]
    deadline = time.monotonic() + 15.0
    while True:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text: str = reply.read().decode()
        found = _pod_samples(text, wanted)
        if all({p.pod for p in PODS} <= {s["labels"]["pod"] for s in found[n]} for n in wanted):
            return text
        if time.monotonic() > deadline:
            raise AgentError("the metrics gave the two pods' figures of the shared GPU in 15 s")
        time.sleep(0.25)


def _pod_samples(text: str, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """name -> its samples of the demo's pods, in the order of PODS."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    order = {p.pod: i for i, p in enumerate(PODS)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out and s.labels.get("pod") in order:
                out[s.name].append({"name": s.name, "labels": dict(s.labels), "value": s.value})
    for samples in out.values():
        samples.sort(key=lambda s: order[s["labels"]["pod"]])
    return out


def _facts(text: str, held: dict[str, str], model: str) -> dict[str, Any]:
    names = [name for pair in SERIES for name in pair]
    found = _pod_samples(text, [*names, MEM_BW])

    def value(name: str, pod: str) -> float | None:
        return next((s["value"] for s in found[name] if s["labels"]["pod"] == pod), None)

    pods = []
    for p in PODS:
        labels = next(s["labels"] for s in found[SERIES[0][0]] if s["labels"]["pod"] == p.pod)
        pods.append({
            "namespace": p.namespace, "pod": p.pod, "container": p.container,
            "device": held[p.pod], "gpu": labels.get("gpu"), "uuid": labels.get("UUID"),
            "sm_util_pct": value(SERIES[0][0], p.pod),
            "mem_bw_util_pct": value(MEM_BW, p.pod),
            "fb_used_mib": value(SERIES[1][0], p.pod),
            "dcgm_gpu_util_pct": value(SERIES[0][1], p.pod),
            "dcgm_fb_used_mib": value(SERIES[1][1], p.pod),
        })
    return {
        "machine": SHARED_MACHINE, "model": model, "resource": GPU_RESOURCE,
        "replicas": REPLICAS, "pods": pods,
        "metrics": [s for name in names for s in found[name]],
    }


def _show(teller: Teller, facts: dict[str, Any]) -> None:
    teller.heading("One GPU, two pods: time-slicing and per-pod use")
    teller.explain(
        f"The agent runs again, with sharing.timeSlicing replicas {REPLICAS} (NVIDIA's config "
        f"v1), on a one-GPU machine ({facts['model']}), which it advertises as {REPLICAS} "
        f"{GPU_RESOURCE} devices. The stand-in kubelet gives two pods one each and lists them "
        "through pod-resources; each pod runs a process on the GPU, and a stand-in containerd "
        "answers ListContainers (the CRI call naming the container each process's cgroup "
        "points to)."
    )
    teller.say()
    for p in facts["pods"]:
        teller.say(f"  {p['namespace']}/{p['pod']:<10} container {p['container']:<8} "
                   f"got {p['device']}")
    teller.say()
    for s in facts["metrics"]:
        labels = ",".join(f'{k}="{s["labels"][k]}"' for k in SHOWN_LABELS if k in s["labels"])
        teller.say(f"{s['name']}{{{labels}}} {s['value']:g}")
    teller.say()
    first = facts["pods"][0]
    teller.explain(
        "The DCGM series keep dcgm-exporter's behaviour and give every pod holding a shared GPU "
        f"the whole GPU's figure (here {first['dcgm_gpu_util_pct']:g} % and "
        f"{first['dcgm_fb_used_mib']:g} MiB for both), while gpu_agent_pod_* add up only the "
        "pod's own processes, found through their cgroups and the runtime, so each pod shows "
        "its own share."
    )
