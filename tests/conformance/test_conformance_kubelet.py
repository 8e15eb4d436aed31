"""The agent against the kubelet's own device manager and topology manager (v1.32).

Each test reads the JSON summaries of harness runs declared in ``conftest.CASES``: the
topology-manager policies in both scopes on one-, two- and eight-NUMA machines, every
device-list strategy and device specs, time-slicing, MIG single and mixed, the agent started
before the kubelet, a kubelet restart and SIGTERM.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import pytest
from dmharness_cases import CASES, MACHINES, POLICIES, SCOPES, Run

pytestmark = pytest.mark.conformance

MATRIX = [f"{p}/{s}/{m}" for m in MACHINES for p in POLICIES for s in SCOPES]
ALL = sorted(CASES)

#: Lines the managers log at E/W level that are about the kubelet's own situation, not the
#: plugin: a pod asking for more devices than are free (the harness fills the node on
#: purpose), and the ListAndWatch stream ending because the manager restarted or the agent
#: was stopped (the restart and SIGTERM steps).
EXPECTED_MANAGER_LINES = (
    re.compile(r"Unable to generate topology hints: requested number of devices unavailable"),
    re.compile(r'ListAndWatch ended unexpectedly for device plugin" err="(EOF|rpc error: code = Canceled|rpc error: code = Unavailable)'),
)

EXPECTED_DEVICES = {
    "single-gpu": 1, "dgx-h100": 8, "dgx-a100": 8,
}


def expected_capacity(name: str) -> int:
    case = CASES[name]
    if name == "time-slicing":
        return 32
    if name == "mig/single":
        return 8
    if name == "mig/mixed/1g.5gb":
        return 9
    if name == "mig/mixed/gpu":
        return 1
    return EXPECTED_DEVICES[case.machine or "dgx-h100"]


def blaming_lines(summary: dict[str, Any]) -> list[str]:
    lines = summary.get("managerWarningsAndErrors") or []
    return [line for line in lines if not any(p.search(line) for p in EXPECTED_MANAGER_LINES)]


def first_round(summary: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[int, set[str]]]]:
    """Each admission before the kubelet restart, with the free devices per NUMA node
    right before it (replayed from the summary: admitted pods hold their devices, a
    ``retry-after-X-ended`` phase gives X's back)."""
    numa_of = summary["allocatableDeviceNUMA"]
    free = {d for d in numa_of}
    held: dict[str, list[str]] = {}
    for pod in summary["pods"]:
        phase = pod["phase"]
        if phase.startswith("retry-after-") and phase.endswith("-ended"):
            free.update(held.pop(phase[len("retry-after-"):-len("-ended")], []))
        elif phase != "new":
            return
        by_node: dict[int, set[str]] = {}
        for d in free:
            for node in numa_of.get(d) or []:
                by_node.setdefault(node, set()).add(d)
        yield pod, by_node
        if pod["admit"]:
            held[pod["pod"]] = list(pod["devices"])
            free.difference_update(pod["devices"])


def get(harness, name: str) -> Run:
    run = harness.run(name)
    assert run.summary, f"no JSON summary\n{run.describe()}"
    return run


@pytest.mark.parametrize("case", ALL)
def test_agent_registers_serves_survives_a_kubelet_restart_and_stops_cleanly(harness, case):
    run = get(harness, case)
    s = run.summary
    why = run.describe()
    assert run.returncode == 0, why
    n = expected_capacity(case)
    if case != "defect/lost-gpu-at-start":
        assert (s["capacity"], s["allocatable"]) == (n, n), why
        assert s["endpointAfterRegistration"]["Unhealthy"] == [], why
    assert len(s["endpointAfterRegistration"]["Healthy"]) + len(s["endpointAfterRegistration"]["Unhealthy"]) == n
    restart = s["restart"]
    assert restart["mismatches"] == [], why
    restored, total = restart["podsRestoredFromCheckpoint"].split("/")
    assert restored == total and int(total) > 0, why
    assert restart["registrationSeconds"] < 2.0 and restart["capacityBackOK"], why
    sigterm = s["sigterm"]
    assert sigterm["allocatableZeroOK"] and sigterm["allocatableZeroSeconds"] < 2.0, why
    assert sigterm["agentExit"].startswith("exit 0 "), why
    assert set(sigterm["dirAfterExit"]) <= {"kubelet.sock", "kubelet_internal_checkpoint"}, why
    assert blaming_lines(s) == [], why


@pytest.mark.parametrize("case", MATRIX)
def test_pods_get_aligned_devices_whenever_one_numa_node_has_enough(harness, case):
    """Under every policy but ``none``, a pod whose GPUs fit on one NUMA node gets them
    from one node; ``single-numa-node`` never admits a pod spanning nodes."""
    run = get(harness, case)
    policy = run.case.policy
    checked = 0
    for pod, free_by_node in first_round(run.summary):
        fits_one_node = any(len(devs) >= pod["request"] for devs in free_by_node.values())
        fits_at_all = sum(len(devs) for devs in free_by_node.values()) >= pod["request"]
        where = f"{pod['pod']} ({pod['phase']}): {pod}\n{run.describe()}"
        if policy != "none" and fits_one_node:
            checked += 1
            assert pod["admit"], where
            assert len(pod["numaSet"]) == 1, where
        if policy in ("none", "best-effort") and fits_at_all:
            assert pod["admit"], where
        if policy == "single-numa-node" and pod["admit"]:
            assert len(pod["numaSet"]) == 1, where
    assert policy == "none" or checked > 0


@pytest.mark.parametrize("case", [c for c in MATRIX if c.startswith("none/")])
def test_under_policy_none_the_plugins_preferred_devices_keep_a_pod_on_one_numa_node(harness, case):
    """``none`` (the kubelet's default) aligns nothing itself: the device manager takes the
    plugin's GetPreferredAllocation answer as it is, so only the agent keeps a pod whose GPUs
    fit on one NUMA node on one node."""
    run = get(harness, case)
    checked = 0
    for pod, free_by_node in first_round(run.summary):
        if pod["admit"] and any(len(devs) >= pod["request"] for devs in free_by_node.values()):
            checked += 1
            where = f"{pod['pod']} ({pod['phase']}): {pod}\n{run.describe()}"
            if pod["request"] > 1:  # a single free device needs no choice: the kubelet may skip the call
                assert sorted(pod["pluginPreferredReconstructed"]) == pod["devices"], where
            assert len(pod["numaSet"]) == 1, where
    assert checked > 0


@pytest.mark.parametrize("case", [c for c in MATRIX if c.startswith("restricted/")])
def test_restricted_never_admits_a_pod_whose_hint_is_not_preferred(harness, case):
    run = get(harness, case)
    admitted = [p for p in run.summary["pods"] if p["admit"]]
    assert admitted, run.describe()
    for pod in admitted:
        assert pod["affinity"].endswith("*"), f"{pod}\n{run.describe()}"


@pytest.mark.parametrize("case", [c for c in MATRIX if "/dgx-a100" in c and c.split("/")[0] in ("restricted", "single-numa-node")])
def test_eight_numa_node_machine_rejects_what_cannot_align_and_places_the_rest(harness, case):
    """dgx-a100 has two GPUs per NUMA node: a 4-GPU pod cannot sit on one node."""
    run = get(harness, case)
    pods = {(p["pod"], p["phase"]): p for p in run.summary["pods"]}
    four = pods[("p3-gpu4", "new")]
    if run.case.policy == "single-numa-node":
        assert not four["admit"] and four["reason"] == "TopologyAffinityError", run.describe()
    else:
        assert four["admit"] and len(four["numaSet"]) == 2, run.describe()
    assert pods[("p2-gpu2", "new")]["admit"] and len(pods[("p2-gpu2", "new")]["numaSet"]) == 1


def admitted_new(run: Run) -> list[dict[str, Any]]:
    pods = [p for p in run.summary["pods"] if p["phase"] == "new" and p["admit"]]
    assert pods, run.describe()
    return pods


@pytest.mark.parametrize("case", ["strategy/envvar", "strategy/all-with-device-specs"])
def test_envvar_strategy_lists_exactly_the_allocated_devices(harness, case):
    run = get(harness, case)
    for pod in admitted_new(run):
        visible = pod["envs"]["NVIDIA_VISIBLE_DEVICES"]
        if case == "strategy/envvar":
            assert sorted(visible.split(",")) == sorted(pod["devices"]), pod
        else:  # volume-mounts is also on: NVIDIA's device plugin points the variable at the mounts
            assert visible == "/var/run/nvidia-container-devices", pod


#: where NVIDIA's volume-mounts strategy mounts one path per device (the device's ID)
VOLUME_MOUNTS_DIR = "/var/run/nvidia-container-devices"


@pytest.mark.parametrize("case", ["strategy/volume-mounts", "strategy/all-with-device-specs"])
def test_volume_mounts_strategy_mounts_one_path_per_allocated_device(harness, case):
    """One mount per allocated device under the volume-mounts directory; the one other mount
    allowed is the container's NCCL topology file, read-only at the path ``NCCL_TOPO_FILE``
    names (a separate feature, so it must not be counted as a device)."""
    run = get(harness, case)
    for pod in admitted_new(run):
        mounts = _mounts(pod)
        devices = sorted(path for path, _ in mounts if path.startswith(VOLUME_MOUNTS_DIR + "/"))
        assert devices == sorted(f"{VOLUME_MOUNTS_DIR}/{d}" for d in pod["devices"]), pod
        others = [(path, ro) for path, ro in mounts if not path.startswith(VOLUME_MOUNTS_DIR + "/")]
        nccl = pod["envs"].get("NCCL_TOPO_FILE")
        assert others == ([(nccl, True)] if nccl else []), pod
        if case == "strategy/volume-mounts":
            assert pod["envs"]["NVIDIA_VISIBLE_DEVICES"] == VOLUME_MOUNTS_DIR, pod


def _mounts(pod: dict[str, Any]) -> list[tuple[str, bool]]:
    """Container path and read-only flag of the pod's mounts (the harness writes
    ``HOST->CONTAINER ro=BOOL``)."""
    out = []
    for mount in pod.get("mounts") or []:
        container, flag = mount.split("->", 1)[1].rsplit(" ", 1)
        out.append((container, flag == "ro=true"))
    return out


@pytest.mark.parametrize("case", ["strategy/cdi-annotations", "strategy/all-with-device-specs"])
def test_cdi_annotations_strategy_names_every_allocated_device(harness, case):
    run = get(harness, case)
    for pod in admitted_new(run):
        annotations = pod.get("annotations") or {}
        (key, value), = [(k, v) for k, v in annotations.items() if k.startswith("cdi.k8s.io/")]
        assert sorted(value.split(",")) == sorted(f"nvidia.com/gpu={d}" for d in pod["devices"]), pod
        if case == "strategy/cdi-annotations":
            assert "NVIDIA_VISIBLE_DEVICES" not in pod["envs"], pod


@pytest.mark.parametrize("case", ["strategy/cdi-cri", "strategy/all-with-device-specs"])
def test_cdi_cri_strategy_passes_every_allocated_device_as_a_cdi_device(harness, case):
    run = get(harness, case)
    for pod in admitted_new(run):
        names = [c if isinstance(c, str) else c.get("name") or c.get("Name") for c in pod.get("cdiDevices") or []]
        assert sorted(names) == sorted(f"nvidia.com/gpu={d}" for d in pod["devices"]), pod


@pytest.mark.cases("strategy/all-with-device-specs", "strategy/envvar")
def test_device_specs_give_each_container_its_gpu_device_nodes(harness):
    run = get(harness, "strategy/all-with-device-specs")
    for pod in admitted_new(run):
        specs = [_spec_path(d) for d in pod.get("deviceNodes") or []]
        gpu_nodes = [p for p in specs if re.fullmatch(r"/dev/nvidia\d+", p)]
        assert len(gpu_nodes) == len(pod["devices"]) == len(set(gpu_nodes)), pod
    plain = get(harness, "strategy/envvar")
    assert all(not p.get("deviceNodes") for p in admitted_new(plain))


def _spec_path(node: str) -> str:
    """Container path of a device node (the harness writes ``HOST->CONTAINER PERMISSIONS``)."""
    return node.split("->", 1)[1].split()[0]


@pytest.mark.cases("time-slicing")
def test_time_sliced_replicas_are_advertised_with_their_gpus_numa_node(harness):
    run = get(harness, "time-slicing")
    numa = run.summary["allocatableDeviceNUMA"]
    assert all(re.fullmatch(r"GPU-[0-9a-f-]+::[0-3]", d) for d in numa), sorted(numa)
    assert all(len(nodes) == 1 for nodes in numa.values())
    for pod in admitted_new(run):
        assert len(pod["numaSet"]) == 1, pod


@pytest.mark.parametrize("case", ["mig/single", "mig/mixed/1g.5gb"])
def test_mig_devices_are_served_and_allocated_by_mig_uuid(harness, case):
    run = get(harness, case)
    numa = run.summary["allocatableDeviceNUMA"]
    assert all(d.startswith("MIG-") for d in numa), sorted(numa)
    for pod in admitted_new(run):
        assert all(d.startswith("MIG-") for d in pod["devices"]), pod
        assert sorted(pod["envs"]["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(pod["devices"]), pod


@pytest.mark.cases("mig/mixed/gpu")
def test_mixed_mig_still_serves_the_whole_gpu_with_mig_disabled(harness):
    run = get(harness, "mig/mixed/gpu")
    assert list(run.summary["allocatableDeviceNUMA"].values()) == [[1]]


@pytest.mark.parametrize("case", ["agent-first", "agent-first/pod-scope/eight-numa"])
def test_agent_started_before_the_kubelet_registers_once_the_kubelet_appears(harness, case):
    run = get(harness, case)
    assert run.summary["capacity"] == 8, run.describe()
    # generous: on a loaded 2-core machine the agent may still be starting when the
    # kubelet appears; an agent that never noticed the kubelet would not get here at all
    assert run.summary["managerStartToCapacitySeconds"] < 10.0, run.describe()
    assert "registered nvidia.com/gpu" in run.agent_log
