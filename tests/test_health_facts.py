"""The watched facts: a GPU missing from NVML, row remapping, NVLinks down, the NVLink fabric and
the driver's recovery action become standing faults (``GPUHealthy`` reasons), read through the real
NVML backend on the simulator, and cleared when the fact is gone."""

from __future__ import annotations

import copy
import os

import pytest
import yaml
from waiting import eventually

from agent.config import Config
from agent.discovery import read_topology
from agent.errors import InputFormatError
from agent.health import HealthState, HealthWatcher
from agent.health.facts_check import FactsCheck
from agent.health.faults import FaultClass
from agent.hw.sim import machines
from agent.hw.sim.machines import SimulatedMachine
from agent.hw.sim.nvml_types import CONSTANTS
from agent.hw.sim.spec import machine_spec_from_dict
from agent.hw.sysfs import SysfsReader


def _spec(base: str = "dgx-h100", **gpu_faults: dict) -> dict:
    """A built-in machine's spec with ``gpu_faults`` (``"3": {...}``) on its GPUs."""
    with open(os.path.join(os.path.dirname(machines.__file__), "specs", f"{base}.yaml"), encoding="utf-8") as fh:
        data = copy.deepcopy(yaml.safe_load(fh))
    for index, faults in gpu_faults.items():
        data["gpus"][int(index.lstrip("g"))]["faults"] = faults
    return data


class Node:
    """A simulated machine read as the agent reads it: topology, health state, facts check."""

    def __init__(self, data: dict) -> None:
        self.sim = SimulatedMachine(machine_spec_from_dict(data, "test-spec"))
        self.backend = self.sim.backend()
        self.backend.init()
        self.topology = read_topology(self.backend, self.sim)
        self.state = HealthState(self.topology.gpu_count)
        self.occurrences: list = []
        self.state.add_occurrence_listener(self.occurrences.append)
        self.check = FactsCheck.for_topology(self.backend, self.topology)
        # the agent's own watcher, polling the facts at every step (no kernel log, no state file)
        self.watcher = HealthWatcher(self.backend, self.state, Config(health_recovery_s=3600), poll_ms=0,
                                     facts=self.check.standing, facts_interval_s=0)

    @property
    def fake(self):
        return self.sim.lib

    def poll(self) -> dict[str, object]:
        self.watcher.step()
        return {f.key: f for f in self.state.faults()}

    def close(self) -> None:
        self.backend.shutdown()
        self.sim.close()


@pytest.fixture
def make_node():
    nodes: list[Node] = []

    def make(data: dict) -> Node:
        nodes.append(Node(data))
        return nodes[-1]

    yield make
    for n in nodes:
        n.close()


def test_a_gpu_on_the_pci_bus_that_nvml_does_not_list_is_a_count_mismatch_naming_its_bus_id(make_node):
    node = make_node(_spec(g3={"missing_from_nvml": True}))
    assert node.topology.gpu_count == 7  # a smaller node, as NVML sees it
    faults = node.poll()
    fault = faults["gpu-count"]
    assert fault.cls is FaultClass.GPU_COUNT_MISMATCH and fault.gpus == ()
    assert "holds 8 NVIDIA GPUs, NVML lists 7" in fault.detail
    assert "00000000:61:00.0" in fault.detail
    assert [o.key for o in node.occurrences] == ["gpu-count"] and node.occurrences[0].source == "facts"


def test_zero_gpus_visible_while_the_pci_bus_holds_some_is_not_healthy(make_node):
    data = _spec("pcie-pairs")
    for g in data["gpus"]:
        g["faults"] = {"missing_from_nvml": True}
    node = make_node(data)
    assert node.topology.gpu_count == 0
    fault = node.poll()["gpu-count"]
    assert fault.cls.fatal and "NVML lists 0" in fault.detail


def test_a_node_with_every_gpu_listed_has_no_watched_fault(make_node):
    node = make_node(_spec())
    assert node.poll() == {} and node.occurrences == []


def test_a_row_remapping_failure_is_a_memory_error_and_a_pending_remap_needs_a_gpu_reset(make_node):
    node = make_node(_spec(g1={"row_remap_failure": True}, g2={"row_remap_pending": True}))
    faults = node.poll()
    assert faults["remap-failure/gpu-1"].cls is FaultClass.MEMORY_ERROR
    assert faults["remap-failure/gpu-1"].gpus == (1,)
    assert faults["remap-pending/gpu-2"].cls is FaultClass.GPU_RESET_REQUIRED
    assert set(faults) == {"remap-failure/gpu-1", "remap-pending/gpu-2"}


def test_a_pending_remap_applied_by_a_reset_clears_with_a_recovery_occurrence(make_node):
    node = make_node(_spec(g2={"row_remap_pending": True}))
    assert "remap-pending/gpu-2" in node.poll()
    node.fake.set_value(2, "remap_pending", 0)
    assert node.poll() == {}
    assert [(o.key, o.recovered) for o in node.occurrences] == [("remap-pending/gpu-2", False),
                                                                ("remap-pending/gpu-2", True)]


def test_an_nvlink_the_topology_has_going_down_is_nvlink_down_and_clears_when_it_is_back(make_node):
    node = make_node(_spec("dgx1-v100"))
    remote = node.fake.nvmlDeviceGetNvLinkRemotePciInfo(node.fake.nvmlDeviceGetHandleByIndex(0), 0).busId
    (peer,) = [g.index for g in node.topology.gpus if g.pci_bus_id == remote]
    assert node.poll() == {}  # the first look: every link discovery saw is up
    node.fake.set_nvlink_down(0, 0)
    faults = node.poll()
    assert set(faults) == {"nvlink-down/gpu-0", f"nvlink-down/gpu-{peer}"}  # a link has two ends
    assert faults["nvlink-down/gpu-0"].cls is FaultClass.NVLINK_DOWN
    assert "NVLink port 0 down" in faults["nvlink-down/gpu-0"].detail
    node.fake.set_nvlink_down(0, 0, down=False)
    assert node.poll() == {}


def test_an_nvlink_down_before_the_agent_started_is_found_against_the_gpus_peers(make_node):
    node = make_node(_spec(g5={"nvlink_down": [0, 3]}))
    faults = node.poll()
    assert set(faults) == {"nvlink-down/gpu-5"}
    assert "16 NVLinks active where its NVLink peers have 18" in faults["nvlink-down/gpu-5"].detail


def test_a_gpu_in_mig_mode_is_not_reported_for_its_inactive_nvlinks(make_node):
    data = _spec("dgx-a100")
    data["gpus"][1]["mig"] = ["3g.20gb"]
    data["gpus"][1]["faults"] = {"nvlink_down": list(range(6))}  # as MIG mode may show them
    node = make_node(data)
    assert node.poll() == {}


def test_a_fabric_registration_in_progress_on_an_nvswitch_machine_is_fabric_not_ready(make_node):
    node = make_node(_spec(g2={"fabric_state": "in-progress"}, g4={"fabric_state": "completed",
                                                                     "fabric_status": "unknown"}))
    faults = node.poll()
    assert faults["fabric/gpu-2"].cls is FaultClass.FABRIC_NOT_READY
    assert "in-progress" in faults["fabric/gpu-2"].detail
    assert "registration failed" in faults["fabric/gpu-4"].detail
    node.fake.set_fabric_state(2, "completed")
    assert "fabric/gpu-2" not in node.poll()


def test_the_drivers_recovery_action_node_reboot_is_node_reboot_required_saying_the_driver_reported_it(make_node):
    node = make_node(_spec(g6={"recovery_action": "node_reboot"}))
    fault = node.poll()["recovery-action/gpu-6"]
    assert fault.cls is FaultClass.NODE_REBOOT_REQUIRED and fault.gpus == (6,)
    assert "Reboot the node" in fault.action and "the driver reports it" in fault.action
    node.fake.set_value(6, "recovery_action", CONSTANTS["NVML_GPU_RECOVERY_ACTION_GPU_RESET"])
    assert node.poll()["recovery-action/gpu-6"].cls is FaultClass.GPU_RESET_REQUIRED
    node.fake.set_value(6, "recovery_action", CONSTANTS["NVML_GPU_RECOVERY_ACTION_NONE"])
    assert node.poll() == {}


def test_an_nvml_failure_on_one_gpus_query_leaves_the_other_gpus_checked(make_node):
    node = make_node(_spec(g1={"row_remap_failure": True}, g2={"row_remap_failure": True}))
    node.fake.fail("nvmlDeviceGetRemappedRows", CONSTANTS["NVML_ERROR_UNKNOWN"], 1)
    node.fake.fail("nvmlDeviceGetFieldValues", CONSTANTS["NVML_ERROR_UNKNOWN"], 1)
    node.fake.lose_gpu(3)
    observed = node.check.observe()
    assert "remap-failure/gpu-1" not in observed and "recovery-action/gpu-1" not in observed
    assert not any(key.endswith("/gpu-3") for key in observed)
    assert observed["remap-failure/gpu-2"].cls is FaultClass.MEMORY_ERROR
    assert "recovery-action/gpu-4" in observed and "nvlink-down/gpu-1" in observed


def test_a_fact_unknown_this_round_neither_clears_nor_raises_its_fault(make_node):
    node = make_node(_spec(g2={"row_remap_failure": True}))
    assert "remap-failure/gpu-2" in node.poll()
    node.fake.fail("nvmlDeviceGetRemappedRows", CONSTANTS["NVML_ERROR_UNKNOWN"], 2)
    assert "remap-failure/gpu-2" in node.poll()
    assert len(node.occurrences) == 1


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ({"recovery_action": "reboot"}, "gpus[2].faults.recovery_action: expected one of"),
        ({"fabric_state": "done"}, "gpus[2].faults.fabric_state: expected one of not_started"),
        ({"nvlink_down": [18]}, "gpus[2].faults.nvlink_down: GPU indices must be 0..17"),
        ({"lost": True}, "gpus[2].faults: unknown keys ['lost']"),
    ],
)
def test_a_bad_fault_in_a_machine_spec_is_one_clear_line(faults, message):
    with pytest.raises(InputFormatError) as err:
        machine_spec_from_dict(_spec(g2=faults), "spec.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_gpus_given_to_a_vm_or_virtual_functions_are_not_gpus_nvml_should_list(tmp_path):
    base = tmp_path / "bus" / "pci" / "devices"
    for bdf, extra in [("0000:1b:00.0", None), ("0000:43:00.0", "vfio-pci"), ("0000:52:00.0", "nvidia"),
                       ("0000:61:00.0", "physfn"), ("0000:9d:00.0", "")]:
        d = base / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        if extra == "physfn":
            os.symlink("../0000:1b:00.0", d / "physfn")
        elif extra:
            drv = tmp_path / "bus" / "pci" / "drivers" / extra
            drv.mkdir(parents=True, exist_ok=True)
            os.symlink(drv, d / "driver")
    assert SysfsReader(str(tmp_path)).nvidia_gpus() == ["0000:1b:00.0", "0000:52:00.0", "0000:9d:00.0"]


def test_a_running_agent_reports_a_gpu_missing_from_nvml_in_its_log(tmp_path):
    from agent_run import AgentRun

    spec = tmp_path / "lost-gpu.yaml"
    spec.write_text(yaml.safe_dump(_spec(g3={"missing_from_nvml": True}, g1={"recovery_action": "gpu_reset"})))
    agent = AgentRun(["--simulate", str(spec), "--kubelet-dir", str(tmp_path / "k"), "--metrics-address",
                      "127.0.0.1:0", "--features-dir", str(tmp_path / "features.d"),
                      "--health-facts-interval-s", "0.2"], str(tmp_path / "agent.log"))
    try:
        assert eventually(lambda: agent.lines("GPUCountMismatch"), 30.0), agent.log()[-3000:]
        assert eventually(lambda: agent.lines("GPUResetRequired"), 10.0), agent.log()[-3000:]
    finally:
        agent.stop()
    (line,) = agent.lines("GPUCountMismatch")
    assert "not listed: 00000000:61:00.0" in line
    assert len(agent.lines("GPUResetRequired")) == 1  # said once, not every round
