"""Per-pod truth on a shared GPU: the processes NVML lists on each GPU, mapped through their
cgroups (a fake ``/proc``) and the runtime's CRI (a stand-in containerd) to pods, exported per
pod and GPU; and the faults around it (a PID gone, an unreadable cgroup, an unknown runtime,
a runtime down, a driver without per-process utilisation, thousands of processes) never
stop the sampler or the other GPUs' metrics.

Every test runs the real NVML backend on the simulator's fake ``pynvml`` of a machine spec
with ``processes:``, the real sampler and collector, the real CRI client."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from prometheus_client import CollectorRegistry

from agent.attribution.cgroups import CgroupReader
from agent.attribution.holders import PodResourcesCache
from agent.attribution.pod_processes import ContainerDirectory, PodProcesses
from agent.config import Config
from agent.hw.sim.machines import SimulatedMachine
from agent.hw.sim.processes import ProcessSpec
from agent.hw.sim.spec import machine_spec_from_dict
from agent.kubelet.cri import CriClient
from agent.kubelet.podresources import PodResourcesClient
from agent.metrics.collector import GpuCollector, render_text
from agent.metrics.sampler import Sampler
from agent.metrics.self_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from tests.testbed.cri_stub import CriStub, pod_container
from tests.testbed.metrics_support import (
    Clock,
    PodResourcesStub,
    listing,
    node_of,
    pod,
    samples_of,
)

H100 = "NVIDIA H100 80GB HBM3"
SM, BW, FB, PROCS = ("gpu_agent_pod_sm_utilization_percent",
                     "gpu_agent_pod_memory_bandwidth_utilization_percent",
                     "gpu_agent_pod_framebuffer_used_mib", "gpu_agent_pod_processes")


def cid(n: int) -> str:
    return f"{n:064x}"


def uid(n: int) -> str:
    return f"{n:08x}-0000-4000-8000-{n:012x}"


def containerd_cgroup(pod_n: int, container_n: int) -> str:
    """A container's cgroup under the systemd driver, cgroup v2, containerd."""
    u = uid(pod_n).replace("-", "_")
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/"
            f"cri-containerd-{cid(container_n)}.scope")


# pods: number -> (namespace, name, container)
PODS = {1: ("ml", "trainer", "main"), 2: ("ml", "notebook", "jupyter"),
        3: ("ml", "solo", "main"), 5: ("ml", "mig-user", "main"), 6: ("ml", "idle", "main")}


def machine() -> SimulatedMachine:
    """GPU 0 shared (time-sliced): a busy trainer (two processes), an idle notebook, a host
    process and a process that exited; GPU 1: one pod alone; GPU 2: MIG mode (no per-process
    utilisation)."""
    spec = {
        "name": "shared-box",
        "driver_version": "550.54.15",
        "gpus": [
            {"bus_id": "0000:18:00.0", "model": H100, "processes": [
                {"pid": 1001, "used_memory_mib": 30000, "sm_util": 60, "mem_util": 20,
                 "cgroup": containerd_cgroup(1, 1)},
                {"pid": 1002, "used_memory_mib": 1000, "sm_util": 10, "mem_util": 2,
                 "cgroup": containerd_cgroup(1, 1)},
                {"pid": 2001, "used_memory_mib": 8000, "cgroup": containerd_cgroup(2, 2)},
                {"pid": 3001, "used_memory_mib": 500, "sm_util": 20,
                 "cgroup": "0::/system.slice/render-farm.service"},
                {"pid": 3002, "used_memory_mib": 100},  # no cgroup file: it has just exited
            ]},
            {"bus_id": "0000:19:00.0", "model": H100, "processes": [
                {"pid": 4001, "used_memory_mib": 70000, "sm_util": 90, "mem_util": 45,
                 "cgroup": containerd_cgroup(3, 3)},
            ]},
            {"bus_id": "0000:1a:00.0", "model": "NVIDIA A100-SXM4-80GB", "mig": ["3g.40gb"],
             "processes": [{"pid": 5001, "used_memory_mib": 2000, "sm_util": 30,
                            "cgroup": containerd_cgroup(5, 5)}]},
        ],
    }
    return SimulatedMachine(machine_spec_from_dict(spec, source="test_pod_metrics"))


@pytest.fixture
def node():
    with node_of(machine()) as n:
        yield n


@pytest.fixture
def containerd(tmp_path):
    stub = CriStub(str(tmp_path / "containerd.sock"), [
        pod_container(cid(n), name, ns, container, uid(n))
        for n, (ns, name, container) in PODS.items() if n != 6
    ]).start()
    yield stub
    stub.stop()


@pytest.fixture
def kubelet(tmp_path):
    stub = PodResourcesStub(str(tmp_path / "kubelet.sock")).start()
    yield stub
    stub.stop()


def pods_of(node, containerd, clock=None) -> PodProcesses:
    return PodProcesses(CgroupReader(node.machine.proc_root),
                        ContainerDirectory(CriClient(containerd.socket_path),
                                           clock=clock or Clock(0.0)))


def sampler_of(node, containerd, clock=None, **kwargs) -> Sampler:
    return Sampler(node.backend.sample_source(), node.topology, interval_s=1.0,
                   clock=clock or Clock(), pods=pods_of(node, containerd), **kwargs)


def attribution_of(node, kubelet):
    """Pod-resources: trainer, notebook and an idle pod share GPU 0; solo has GPU 1; the MIG
    user has GPU 2's MIG device."""
    g = node.topology.gpus
    kubelet.list_response = listing(
        pod("ml", "trainer", {"main": [("nvidia.com/gpu", [g[0].uuid + "::0"])]}),
        pod("ml", "notebook", {"jupyter": [("nvidia.com/gpu", [g[0].uuid + "::1"])]}),
        pod("ml", "idle", {"main": [("nvidia.com/gpu", [g[0].uuid + "::2"])]}),
        pod("ml", "solo", {"main": [("nvidia.com/gpu", [g[1].uuid])]}),
        pod("ml", "mig-user", {"main": [("nvidia.com/mig-3g.40gb", [g[2].mig_devices[0].uuid])]}),
    )
    cache = PodResourcesCache(PodResourcesClient(kubelet.socket_path, timeout_s=2),
                              node.topology, refresh_s=60, clock=Clock(500.0))
    assert cache.refresh_once()
    cache.client.close()
    return cache.current


def render(node, sampler, attribution=None, clock=None) -> str:
    registry = CollectorRegistry()
    kwargs = {"attribution": lambda: attribution} if attribution is not None else {}
    registry.register(GpuCollector(node.topology, hostname="node-a",
                                   snapshot=lambda: sampler.snapshot,
                                   clock=clock or Clock(), **kwargs))
    return render_text(registry).decode()


def per_pod(text: str, name: str) -> dict[tuple[str, str, str], float]:
    """Family ``name``'s values by (gpu, pod, container)."""
    return {(s.labels["gpu"], s.labels["pod"], s.labels["container"]): s.value
            for s in samples_of(text, name)}


# ---------------------------------------------------------------- the per-pod figures
def test_each_pod_on_a_shared_gpu_gets_its_own_sm_bandwidth_and_framebuffer(node, containerd):
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    text = render(node, sampler)
    assert per_pod(text, SM)[("0", "trainer", "main")] == 70.0  # 60 + 10: two processes
    assert per_pod(text, SM)[("0", "notebook", "jupyter")] == 0.0  # no sample: idle
    assert per_pod(text, BW)[("0", "trainer", "main")] == 22.0
    assert per_pod(text, FB)[("0", "trainer", "main")] == 31000.0
    assert per_pod(text, FB)[("0", "notebook", "jupyter")] == 8000.0
    assert per_pod(text, PROCS)[("0", "trainer", "main")] == 2.0
    assert per_pod(text, SM)[("1", "solo", "main")] == 90.0  # an exclusive GPU: the same view
    sample = next(s for s in samples_of(text, SM) if s.labels["pod"] == "trainer")
    assert sample.labels["namespace"] == "ml"
    assert sample.labels["UUID"] == node.topology.gpus[0].uuid
    assert sample.labels["modelName"] == H100 and sample.labels["Hostname"] == "node-a"


def test_processes_of_no_pod_are_reported_with_empty_pod_labels_not_dropped(node, containerd):
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    text = render(node, sampler)
    # the host service and the process that exited before its cgroup was read
    (no_pod,) = [s for s in samples_of(text, PROCS) if s.labels["gpu"] == "0" and not s.labels["pod"]]
    assert no_pod.value == 2.0 and no_pod.labels["namespace"] == "" and no_pod.labels["container"] == ""
    assert per_pod(text, FB)[("0", "", "")] == 600.0
    assert per_pod(text, SM)[("0", "", "")] == 20.0


def test_a_pod_holding_a_shared_gpu_without_processes_shows_zero(node, containerd, kubelet):
    attribution = attribution_of(node, kubelet)
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    text = render(node, sampler, attribution)
    assert per_pod(text, SM)[("0", "idle", "main")] == 0.0
    assert per_pod(text, FB)[("0", "idle", "main")] == 0.0
    assert per_pod(text, PROCS)[("0", "idle", "main")] == 0.0


def test_dcgm_series_keep_dcgm_exporters_whole_gpu_value_on_every_pod(node, containerd, kubelet):
    attribution = attribution_of(node, kubelet)
    node.lib.set_value(0, "gpu_util_pct", 77)
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    text = render(node, sampler, attribution)
    on_gpu0 = {s.labels["pod"]: s.value for s in samples_of(text, "DCGM_FI_DEV_GPU_UTIL")
               if s.labels["gpu"] == "0"}
    assert on_gpu0 == {"trainer": 77.0, "notebook": 77.0, "idle": 77.0}


def test_without_per_process_utilisation_the_utilisation_series_are_absent_and_logged_once(
        node, containerd, caplog):
    sampler = sampler_of(node, containerd)
    with caplog.at_level(logging.WARNING):
        sampler.sample_once()
        sampler.sample_once()
    text = render(node, sampler)
    assert per_pod(text, FB)[("2", "mig-user", "main")] == 2000.0  # memory is still known
    assert not [s for s in samples_of(text, SM) if s.labels["gpu"] == "2"]
    assert not [s for s in samples_of(text, BW) if s.labels["gpu"] == "2"]
    assert ("0", "trainer", "main") in per_pod(text, SM)  # the other GPUs keep theirs
    why = [r.getMessage() for r in caplog.records if "per-process utilisation" in r.getMessage()]
    assert len(why) == 1 and why[0].startswith("GPU 2:")


# ---------------------------------------------------------------- idle on a shared GPU
def test_idle_allocated_uses_the_pods_own_figure_on_a_shared_gpu(node, containerd, kubelet):
    attribution = attribution_of(node, kubelet)  # everyone first seen at t=500
    clock = Clock(1000.0)
    sampler = sampler_of(node, containerd, clock)
    sampler.sample_once()  # GPU 0 busy (the trainer); the notebook idle
    clock.t = 1600.0
    text = render(node, sampler, attribution, clock)
    idle = {(s.labels["gpu"], s.labels["pod"]): s.value
            for s in samples_of(text, "gpu_topology_allocated_idle_seconds")}
    assert idle[("0", "trainer")] == 600.0  # busy at t=1000
    # the busy host process could be a holder's whose cgroup was not read: everyone on
    # the GPU counts as busy while processes of no pod are
    assert idle[("0", "notebook")] == 600.0
    # once it is gone, the notebook's own figure shows: a busy neighbour does not hide it
    node.lib.set_value(0, "processes", [p for p in node.machine.spec.gpus[0].processes
                                        if p.pid != 3001])
    clock.t = 2000.0
    sampler.sample_once()
    clock.t = 2600.0
    text = render(node, sampler, attribution, clock)
    idle = {(s.labels["gpu"], s.labels["pod"]): s.value
            for s in samples_of(text, "gpu_topology_allocated_idle_seconds")}
    assert idle[("0", "trainer")] == 600.0
    assert idle[("0", "notebook")] == 1600.0  # last "maybe busy": the host process at t=1000
    assert idle[("0", "idle")] == 1600.0
    assert idle[("1", "solo")] == 600.0  # an exclusive GPU: the GPU's own figure


def test_idle_notebook_beside_a_busy_trainer_is_idle_since_it_got_the_gpu(node, containerd, kubelet):
    node.lib.set_value(0, "processes", [p for p in node.machine.spec.gpus[0].processes
                                        if p.pid in (1001, 2001)])
    attribution = attribution_of(node, kubelet)  # first seen at t=500
    clock = Clock(1000.0)
    sampler = sampler_of(node, containerd, clock)
    sampler.sample_once()
    clock.t = 4000.0
    text = render(node, sampler, attribution, clock)
    idle = {(s.labels["gpu"], s.labels["pod"]): s.value
            for s in samples_of(text, "gpu_topology_allocated_idle_seconds")}
    assert idle[("0", "notebook")] == 3500.0
    assert idle[("0", "trainer")] == 3000.0


# ---------------------------------------------------------------- faults
def test_unreadable_cgroup_unknown_runtime_and_vanished_pid_count_under_no_pod(node, containerd):
    procs = list(node.machine.spec.gpus[0].processes)
    unknown = ProcessSpec(6001, 64, 0, 0,
                          f"0::/kubepods/burstable/pod{uid(9)}/garden-7a3c")  # a runtime we do not know
    node.lib.set_value(0, "processes", [*procs, unknown, ProcessSpec(6002, 32)])
    os.makedirs(os.path.join(node.machine.proc_root, "6001"))
    with open(os.path.join(node.machine.proc_root, "6001", "cgroup"), "w") as f:
        f.write(unknown.cgroup)
    # the trainer's second process: its cgroup file cannot be read
    shutil.rmtree(os.path.join(node.machine.proc_root, "1002"))
    os.makedirs(os.path.join(node.machine.proc_root, "1002", "cgroup"))
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    text = render(node, sampler)
    assert per_pod(text, PROCS)[("0", "", "")] == 5.0  # 3001, 3002, 6001, 6002 and 1002
    assert per_pod(text, PROCS)[("0", "trainer", "main")] == 1.0
    assert per_pod(text, SM)[("1", "solo", "main")] == 90.0
    assert {s.labels["gpu"] for s in samples_of(text, "DCGM_FI_DEV_GPU_TEMP")} == {"0", "1", "2"}


def test_thousands_of_processes_on_one_gpu_are_sampled_and_mapped(node, containerd):
    many = [ProcessSpec(10_000 + k, 8, 0, 0, containerd_cgroup(1, 1)) for k in range(3000)]
    for p in many:
        os.makedirs(os.path.join(node.machine.proc_root, str(p.pid)))
        with open(os.path.join(node.machine.proc_root, str(p.pid), "cgroup"), "w") as f:
            f.write(p.cgroup or "")
    node.lib.set_value(0, "processes", many)
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    text = render(node, sampler)
    assert per_pod(text, PROCS)[("0", "trainer", "main")] == 3000.0
    assert per_pod(text, FB)[("0", "trainer", "main")] == 24000.0
    assert per_pod(text, SM)[("1", "solo", "main")] == 90.0
    assert containerd.calls == 1


def test_a_failing_process_listing_costs_that_gpus_per_pod_series_only(node, containerd):
    node.lib.fail("nvmlDeviceGetComputeRunningProcesses", node.lib.NVML_ERROR_UNKNOWN, index=1)
    node.lib.make_unsupported("nvmlDeviceGetMPSComputeRunningProcesses", 1)
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    text = render(node, sampler)
    assert not [s for s in samples_of(text, PROCS) if s.labels["gpu"] == "1"]
    assert per_pod(text, PROCS)[("0", "trainer", "main")] == 2.0
    assert {s.labels["gpu"] for s in samples_of(text, "DCGM_FI_DEV_GPU_TEMP")} == {"0", "1", "2"}


def test_the_runtime_down_leaves_processes_without_a_pod_until_it_answers(node, containerd, caplog):
    clock = Clock(0.0)
    sampler = Sampler(node.backend.sample_source(), node.topology, interval_s=1.0, clock=Clock(),
                      pods=pods_of(node, containerd, clock))
    containerd.fail()
    with caplog.at_level(logging.WARNING):
        sampler.sample_once()
        sampler.sample_once()
    text = render(node, sampler)
    assert per_pod(text, PROCS)[("0", "", "")] == 5.0
    assert per_pod(text, SM)[("1", "", "")] == 90.0
    assert len([r for r in caplog.records if "CRI ListContainers" in r.getMessage()]) == 1
    assert containerd.calls == 1  # not asked again within the retry period
    containerd.fail(False)
    clock.t = 31.0
    sampler.sample_once()
    text = render(node, sampler)
    assert per_pod(text, PROCS)[("0", "trainer", "main")] == 2.0


def test_the_runtime_is_asked_only_when_an_unknown_container_turns_up(node, containerd):
    sampler = sampler_of(node, containerd)
    for _ in range(3):
        sampler.sample_once()
    assert containerd.calls == 1
    newcomer = ProcessSpec(7001, 10, 0, 0, containerd_cgroup(6, 6))
    os.makedirs(os.path.join(node.machine.proc_root, "7001"))
    with open(os.path.join(node.machine.proc_root, "7001", "cgroup"), "w") as f:
        f.write(newcomer.cgroup or "")
    node.lib.set_value(1, "processes", [*node.machine.spec.gpus[1].processes, newcomer])
    containerd.containers.append(pod_container(cid(6), "idle", "ml", "main", uid(6)))
    sampler.sample_once()
    sampler.sample_once()
    assert containerd.calls == 2
    assert per_pod(render(node, sampler), PROCS)[("1", "idle", "main")] == 1.0


def test_a_container_the_runtime_does_not_list_is_not_asked_for_every_round(node, containerd):
    containerd.containers = [c for c in containerd.containers if c.id != cid(3)]
    sampler = sampler_of(node, containerd)
    for _ in range(3):
        sampler.sample_once()
    assert containerd.calls == 1
    assert per_pod(render(node, sampler), SM)[("1", "", "")] == 90.0


# ---------------------------------------------------------------- the service
def test_the_service_maps_processes_through_the_configured_proc_root_and_cri_socket(
        node, containerd):
    config = Config(metrics_address="127.0.0.1:0", proc_root=node.machine.proc_root,
                    cri_socket="unix://" + containerd.socket_path)
    service = MetricsService(node.backend, node.topology, config, hostname="h",
                             ready=lambda: True,
                             agent_metrics=AgentMetrics(CollectorRegistry(), node.backend))
    service.sampler.sample_once()
    body = service.render().decode()
    assert per_pod(body, SM)[("0", "trainer", "main")] == 70.0
    service.sampler.stop()


def test_the_readmes_per_pod_table_lists_exactly_the_per_pod_series():
    from pathlib import Path

    from agent.metrics.fields import POD_METRICS

    readme = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    table = readme.split("| Per-pod metric | Type | Unit | Meaning |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1:3] for line in table.strip().splitlines()[1:]]
    assert {name.strip().strip("`"): kind.strip() for name, kind in rows} == \
        {m.name: "gauge" for m in POD_METRICS}


def test_a_pid_that_leaves_and_comes_back_in_another_container_is_read_again(node, containerd):
    sampler = sampler_of(node, containerd)
    sampler.sample_once()
    assert per_pod(render(node, sampler), PROCS)[("1", "solo", "main")] == 1.0
    node.lib.set_value(1, "processes", [])  # the solo job ends...
    sampler.sample_once()
    # ...and the kernel gives its PID to a process of another pod
    with open(os.path.join(node.machine.proc_root, "4001", "cgroup"), "w") as f:
        f.write(containerd_cgroup(2, 2))
    node.lib.set_value(1, "processes", [ProcessSpec(4001, 10, 50, 0)])
    sampler.sample_once()
    text = render(node, sampler)
    assert per_pod(text, PROCS)[("1", "notebook", "jupyter")] == 1.0
    assert ("1", "solo", "main") not in per_pod(text, PROCS)
