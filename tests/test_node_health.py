"""The GPUHealthy Node condition and the Events on the Node (issue 35), against the stand-in
API server with the access of the project's manifests (``daemonset/nodefeature``: RBAC on
nodes/status and events, the own-node-condition admission policy), through the agent's own
publisher and client. The real-binary tier (``GPU_AGENT_K8S_BINARIES``) holds no API server,
so the stand-in is the one backend.

Faults are driven through the health state the sources write (``HealthState.set_fault``,
``clear_fault``, ``record``); the agent end to end is the last test.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.config import Config
from agent.health import HealthState
from agent.health.faults import Fault, FaultClass, Occurrence, Watching
from agent.health.node_api import KubeNodeApi
from agent.health.node_condition import MAX_MESSAGE_BYTES, derive_condition
from agent.health.node_publisher import NodeHealthPublisher
from agent.kube import CoreObjects
from agent.records import Gpu
from tests.agent_run import reap
from tests.testbed.apiserver_auth import Access, service_account
from tests.testbed.apiserver_stub import ApiServerStub, _selected

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = "gpu-topology-agent"
NODE = "node-1"
GPUS = {i: Gpu(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="NVIDIA H100 80GB HBM3",
               pci_bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(8)}


def _settled(state: HealthState) -> HealthState:
    """``state`` as the watcher leaves it after its start-up read (these tests are the watcher)."""
    state.settled.set()
    return state


def xid79(gpu: int = 3, since: float = 0.0) -> Fault:
    return Fault(f"xid-79/gpu-{gpu}", FaultClass.NODE_REBOOT_REQUIRED, (gpu,), "Reboot the node.",
                 "XID 79: GPU has fallen off the bus", 79, since or time.time())


def xid48(gpu: int = 5) -> Fault:
    return Fault(f"xid-48/gpu-{gpu}", FaultClass.GPU_RESET_REQUIRED, (gpu,), "Reset the GPU.",
                 "XID 48: double-bit ECC error", 48, time.time())


def xid13(gpu: int = 0) -> Occurrence:
    return Occurrence(f"xid-13/gpu-{gpu}", FaultClass.APPLICATION, (gpu,), "XID 13: Graphics Engine Exception",
                      "Restart the application.", 13, at=time.time(), source="kernel-log")


def connect(api: ApiServerStub, token: str) -> client.ApiClient:
    cfg = api.configuration()
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


@pytest.fixture
def api():
    access = Access.from_deploy("nodefeature")
    access.add_token("node-1-agent", service_account(NS, "gpu-topology-agent", NODE))
    stub = ApiServerStub(access=access).start()
    for node in (NODE, "node-2"):
        stub.add_node(node)
        stub.set_node_condition(node, {"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "kubelet is posting ready status",
                                       "lastTransitionTime": "2026-01-01T00:00:00Z"})
    yield stub
    stub.stop()


def publisher(api: ApiServerStub, state: HealthState) -> NodeHealthPublisher:
    pub = NodeHealthPublisher(KubeNodeApi(CoreObjects(lambda: connect(api, "node-1-agent"))), state, NODE, GPUS)
    pub.start()
    return pub


def condition(api: ApiServerStub) -> dict:
    return api.node_condition(NODE, "GPUHealthy") or {}


def wait_condition(api: ApiServerStub, status: str, reason: str | None = None, timeout_s: float = 10.0) -> dict:
    assert api.wait_until(lambda: condition(api).get("status") == status
                          and reason in (None, condition(api).get("reason")), timeout_s), condition(api)
    return condition(api)


def writes(api: ApiServerStub) -> int:
    return api.count("PATCH") + api.count("POST", "/events")


# ---------------------------------------------------------------------- the condition (pure)
def test_the_reason_is_the_most_severe_fault_and_the_message_names_each_gpu_and_its_action():
    got = derive_condition([xid48(5), xid79(3)], Watching.YES, GPUS)
    assert (got.status, got.reason) == ("False", "NodeRebootRequired")
    assert got.message == ("GPU 3 (00000000:1B:00.0, GPU-00000003-0000-0000-0000-000000000000): XID 79: GPU has"
                           " fallen off the bus. Reboot the node.; GPU 5 (00000000:1D:00.0,"
                           " GPU-00000005-0000-0000-0000-000000000000): XID 48: double-bit ECC error. Reset the GPU.")


def test_application_faults_alone_keep_the_node_healthy_and_not_watching_is_unknown_unless_a_fault_is_known():
    app = Fault("xid-13/gpu-0", FaultClass.APPLICATION, (0,), "Restart the application.", "XID 13", 13, 1.0)
    assert derive_condition([app], Watching.YES, GPUS).status == "True"
    assert derive_condition([], Watching.YES, GPUS).reason == "GPUsHealthy"
    unknown = derive_condition([app], Watching.WATCHER_FAILED, GPUS)
    assert (unknown.status, unknown.reason) == ("Unknown", "HealthWatcherFailed")
    assert derive_condition([xid79()], Watching.NVML_UNAVAILABLE, GPUS).status == "False"


def test_a_message_of_many_faults_is_cut_at_1_kib_with_a_tail_saying_how_many_more():
    faults = [xid48(g) for g in range(8)] + [xid79(g) for g in range(8)]
    message = derive_condition(faults, Watching.YES, GPUS).message
    assert len(message.encode()) <= MAX_MESSAGE_BYTES
    kept = message.count("; GPU ") + 1
    assert message.endswith(f"… and {16 - kept} more") and 0 < kept < 16, message
    huge = Fault("x", FaultClass.CONTACT_SUPPORT, (0,), "", "é" * 5000, None, 1.0)
    assert len(derive_condition([huge], Watching.YES, GPUS).message.encode()) <= MAX_MESSAGE_BYTES


# ---------------------------------------------------------------------- the condition on the Node
def test_condition_set_kept_across_a_message_change_and_cleared_to_true(api):
    state = _settled(HealthState(8))
    pub = publisher(api, state)
    try:
        healthy = wait_condition(api, "True", "GPUsHealthy")
        assert healthy["message"] == "All 8 GPUs are healthy."
        state.set_fault(xid48(5))
        first = wait_condition(api, "False", "GPUResetRequired")
        time.sleep(1.1)  # timestamps have whole seconds: a reset would show
        state.set_fault(xid79(3))  # a second, worse fault: new reason and message, same status
        second = wait_condition(api, "False", "NodeRebootRequired")
        assert "GPU 3 (00000000:1B:00.0" in second["message"] and "GPU 5 (00000000:1D:00.0" in second["message"]
        assert second["lastTransitionTime"] == first["lastTransitionTime"]
        state.clear_fault("xid-79/gpu-3")
        state.clear_fault("xid-48/gpu-5")
        cleared = wait_condition(api, "True", "GPUsHealthy")
        assert cleared["lastTransitionTime"] >= second["lastTransitionTime"]
        assert cleared["lastTransitionTime"] != first["lastTransitionTime"]
    finally:
        pub.stop()
    assert api.node_condition(NODE, "Ready")["reason"] == "KubeletReady", "the kubelet's condition was touched"
    assert api.node_condition("node-2", "GPUHealthy") is None


def test_a_restarted_agent_keeps_the_standing_conditions_transition_time(api):
    state = _settled(HealthState(8))
    state.set_fault(xid79(3))
    pub = publisher(api, state)
    before = wait_condition(api, "False")
    pub.stop()
    time.sleep(1.1)
    again = _settled(HealthState(8))
    again.set_fault(xid79(3))  # re-derived by the sources at start
    pub = publisher(api, again)
    try:
        assert api.wait_until(lambda: condition(api)["lastHeartbeatTime"] != before["lastHeartbeatTime"])
        assert condition(api)["lastTransitionTime"] == before["lastTransitionTime"]
    finally:
        pub.stop()


# ---------------------------------------------------------------------- Events
def test_events_of_one_fault_and_gpu_are_one_object_whose_count_grows(api):
    state = _settled(HealthState(8))
    pub = publisher(api, state)
    try:
        state.record(xid13(0))
        assert api.wait_until(lambda: [e.get("count") for e in api.core_events()] == [1])
        state.record(xid13(0))
        assert api.wait_until(lambda: [e.get("count") for e in api.core_events()] == [2])
        state.record(xid13(1))  # another GPU: another Event
        state.record(Occurrence("xid-79/gpu-3", FaultClass.NODE_REBOOT_REQUIRED, (3,), "XID 79 cleared by reboot",
                                recovered=True))
        assert api.wait_until(lambda: len(api.core_events()) == 3)
    finally:
        pub.stop()
    events = {(e["reason"], e["message"].split(":")[0]): e for e in api.core_events("default")}
    gpu0 = events[("ApplicationXID", "GPU 0 (00000000")]
    assert gpu0["type"] == "Warning" and gpu0["count"] == 2
    assert gpu0["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert gpu0["message"].endswith("XID 13: Graphics Engine Exception. Action: Restart the application.")
    assert events[("GPUFaultCleared", "GPU 3 (00000000")]["type"] == "Normal"
    # what `kubectl describe node` asks for (one of its two queries has the node's name as UID)
    describe = {"fieldSelector": "involvedObject.kind=Node,involvedObject.name=node-1,involvedObject.uid=node-1"}
    assert len([e for e in api.core_events() if _selected(e, describe)]) == 3


def test_a_storm_of_10000_occurrences_costs_a_handful_of_writes(api):
    state = _settled(HealthState(8))
    pub = publisher(api, state)
    storm = Occurrence("xid-95/gpu-3", FaultClass.CONTACT_SUPPORT, (3,), "XID 95: uncontained ECC error",
                       "Reset the GPU.", 95)
    try:
        wait_condition(api, "True")
        state.set_fault(xid79(3))
        wait_condition(api, "False")
        before = writes(api)
        slowest_s = 0.0
        for _ in range(20):  # 10,000 over two seconds: the publisher wakes between batches
            started = time.monotonic()
            for _ in range(500):
                state.record(storm)
            slowest_s = max(slowest_s, time.monotonic() - started)
            time.sleep(0.1)
        time.sleep(0.5)
        during = writes(api) - before
    finally:
        pub.stop()
    assert 1 <= during <= 4, during  # the burst (3), then one update per 30 s
    assert len(api.core_events()) == 1 and 1 <= api.core_events()[0]["count"] < 10_000
    assert slowest_s < 0.5, f"the listener blocked the watcher: {slowest_s:.2f} s for 500"


# ---------------------------------------------------------------------- outages
def test_an_api_server_that_goes_away_gets_the_newest_state_when_it_returns(api, caplog):
    state = _settled(HealthState(8))
    pub = publisher(api, state)
    try:
        wait_condition(api, "True")
        api.go_down()
        state.set_fault(xid48(5))
        time.sleep(0.5)
        state.clear_fault("xid-48/gpu-5")
        state.set_fault(xid79(2))
        for _ in range(100):
            state.record(xid13(4))
        time.sleep(1.5)
        patches = api.count("PATCH")
        api.come_up()
        newest = wait_condition(api, "False", "NodeRebootRequired", 20)
        assert "GPU 2 (" in newest["message"] and "GPU 5" not in newest["message"]
        assert api.wait_until(lambda: [e["count"] for e in api.core_events()] == [100], 20)
    finally:
        pub.stop()
    assert api.count("PATCH") - patches <= 3
    failed = [r for r in caplog.records if "GPUHealthy condition and Events of Node node-1 failed" in r.getMessage()]
    assert len(failed) == 1 and "API server unreachable" in failed[0].getMessage()


# ---------------------------------------------------------------------- who may write what
def test_the_admission_policy_refuses_another_nodes_status_and_another_condition(api):
    core = client.CoreV1Api(connect(api, "node-1-agent"))
    smp = "application/strategic-merge-patch+json"
    ours = {"type": "GPUHealthy", "status": "True", "reason": "GPUsHealthy", "message": "ok"}
    core.patch_node_status(NODE, {"status": {"conditions": [ours]}}, _content_type=smp)
    refused = [
        lambda: core.patch_node_status("node-2", {"status": {"conditions": [ours]}}, _content_type=smp),
        lambda: core.patch_node_status(NODE, {"status": {"conditions": [{**ours, "type": "Ready"}]}},
                                       _content_type=smp),
        lambda: core.patch_node_status(NODE, {"status": {"capacity": {"nvidia.com/gpu": "16"}}}, _content_type=smp),
    ]
    messages = []
    for attempt in refused:
        with pytest.raises(ApiException) as exc:
            attempt()
        assert exc.value.status == 422
        messages.append(json.loads(exc.value.body)["message"])
    assert "ValidatingAdmissionPolicy 'gpu-topology-agent-own-node-condition'" in messages[0]
    assert "may only write its own Node's status, not Node node-2" in messages[0]
    assert all("may change only the GPUHealthy condition" in m for m in messages[1:])
    assert api.node_condition("node-2", "GPUHealthy") is None
    assert api.node_condition(NODE, "Ready")["reason"] == "KubeletReady"


def test_without_the_rbac_of_the_plain_manifests_the_write_is_forbidden_and_said_once(caplog):
    access = Access.from_deploy("base")  # health.nodeCondition off there: no RBAC
    access.add_token("t", service_account(NS, "gpu-topology-agent", NODE))
    with ApiServerStub(access=access) as stub:
        stub.add_node(NODE)
        pub = NodeHealthPublisher(KubeNodeApi(CoreObjects(lambda: connect(stub, "t"))), _settled(HealthState(8)), NODE, GPUS)
        pub.start()
        try:
            assert stub.wait_until(lambda: stub.count("GET", "/status") >= 2, 10)
        finally:
            pub.stop()
    said = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and "GPUHealthy" in r.getMessage()]
    assert len(said) == 1 and 'cannot get resource "nodes/status"' in said[0], said


def test_dry_run_logs_what_it_would_write_and_off_builds_nothing(caplog):
    caplog.set_level(logging.INFO)
    state = _settled(HealthState(8))
    assert NodeHealthPublisher.from_config(Config(node_condition="off", node_name=NODE), state, GPUS) is None
    pub = NodeHealthPublisher.from_config(Config(node_condition="dry-run", node_name=NODE), state, GPUS)
    assert pub is not None
    state.set_fault(xid79(3))
    state.record(xid13(0))
    pub.round()
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "dry-run: would set Node node-1 condition GPUHealthy=False reason NodeRebootRequired" in said
    assert "dry-run: would create Warning Event ApplicationXID on Node node-1" in said


# ---------------------------------------------------------------------- the agent, through --kernel-log
# dgx-h100's GPUs as the driver prints them in Xid lines (its GPU 3 is NVML's 00000000:61:00.0)
BUS = ["0000:1b:00", "0000:43:00", "0000:52:00", "0000:61:00", "0000:9d:00", "0000:c3:00", "0000:d1:00", "0000:df:00"]


class Agent:
    """The agent on a simulated dgx-h100 with a kernel log file, a boot ID and a health state
    file, writing its Node's condition to ``api`` through a kubeconfig."""

    def __init__(self, api: ApiServerStub, root) -> None:
        from tests.test_labels_nodefeature import write_kubeconfig

        self.api, self.root = api, root
        self.kernel_log = root / "kmsg.log"
        self.kernel_log.write_text("")
        (root / "proc/sys/kernel/random").mkdir(parents=True)
        self.boot("boot-1")
        (root / "k").mkdir()
        self.kubeconfig = write_kubeconfig(str(root / "kubeconfig"), api.url, "node-1-agent")
        self.proc: subprocess.Popen[str] | None = None

    def boot(self, boot_id: str) -> None:
        (self.root / "proc/sys/kernel/random/boot_id").write_text(boot_id + "\n")

    def xid(self, gpu: int, number: int) -> None:
        with open(self.kernel_log, "a", encoding="utf-8") as f:
            f.write(f"NVRM: Xid (PCI:{BUS[gpu]}): {number}, pid=4242, name=python3, Ch 00000008\n")

    def start(self) -> None:
        root = self.root
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "NODE_NAME", "CONFIG_FILE")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--simulate", "dgx-h100", "--kubelet-dir", str(root / "k"),
             "--metrics-address", "127.0.0.1:0", "--probe-address", "127.0.0.1:0",
             "--pod-resources-socket", str(root / "podres.sock"), "--features-dir", str(root / "f"),
             "--kernel-log", str(self.kernel_log), "--health-state-file", str(root / "state.json"),
             "--proc-root", str(root / "proc"), "--kubeconfig", self.kubeconfig, "--node-name", NODE,
             "--node-condition", "on"],
            cwd=ROOT, env={**env, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self) -> str:
        assert self.proc is not None
        self.proc.terminate()
        try:
            _, stderr = self.proc.communicate(timeout=30)
        finally:
            reap(self.proc)
        assert self.proc.returncode == 0, stderr
        return stderr


def test_xid_lines_on_a_running_agent_set_the_condition_and_events_a_restart_keeps_a_reboot_clears(api, tmp_path):
    agent = Agent(api, tmp_path)
    agent.start()
    try:
        assert wait_condition(api, "True", "GPUsHealthy", 60)["message"] == "All 8 GPUs are healthy."
        agent.xid(0, 13)  # an application XID alone: an Event, the node stays healthy
        assert api.wait_until(lambda: [e["reason"] for e in api.core_events()] == ["ApplicationXID"], 20)
        agent.xid(3, 79)
        fallen = wait_condition(api, "False", "NodeRebootRequired", 20)
        assert "GPU 3 (00000000:61:00.0, GPU-" in fallen["message"] and fallen["message"].endswith("Reboot the node.")
        assert condition(api)["status"] == "False"
    finally:
        agent.stop()
    seen = len(api.condition_history(NODE, "GPUHealthy"))
    agent.start()  # same boot: the standing fault is restored, never a True in between
    try:
        assert api.wait_until(lambda: condition(api)["lastHeartbeatTime"] != fallen["lastHeartbeatTime"], 60)
        assert condition(api)["lastTransitionTime"] == fallen["lastTransitionTime"]
        assert {c["status"] for c in api.condition_history(NODE, "GPUHealthy")[seen:]} == {"False"}
    finally:
        agent.stop()
    agent.boot("boot-2")  # a reboot (a new boot ID, a new kernel log) clears it
    agent.kernel_log.unlink()
    agent.kernel_log.write_text("")
    agent.start()
    try:
        wait_condition(api, "True", "GPUsHealthy", 60)
    finally:
        agent.stop()



def test_the_first_condition_waits_for_the_health_sources_start_up_read(api):
    state = HealthState(8)  # the watcher has not yet read the kernel log since boot
    pub = publisher(api, state)
    try:
        time.sleep(1.0)
        assert api.condition_history(NODE, "GPUHealthy") == []  # not True on an empty state
        state.set_fault(xid79(3))  # the start-up read finds a fault before the agent started
        state.settled.set()
        wait_condition(api, "False", "NodeRebootRequired")
        assert {c["status"] for c in api.condition_history(NODE, "GPUHealthy")} == {"False"}
    finally:
        pub.stop()
