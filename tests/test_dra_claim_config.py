"""Claims that say how their devices are shared (NVIDIA's ``GpuConfig`` / ``MigDeviceConfig``),
over the real DRA socket: NVIDIA's example claims with only the driver name changed
(tests/fixtures/dra/claims/), time-slice intervals set through a stand-in nvidia-smi
(tests/fake_nvidia_smi.py, which records its runs), MPS daemons run by the stand-in control
program (tests/mps_control_standin.py), precedence, strict decoding and each refusal in
one line."""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import time
from dataclasses import replace

import pytest
import yaml
from waiting import eventually

from agent.discovery import load_topology
from tests.test_deviceplugin_mps import standin_program, write_program
from tests.test_dra_plugin import DRIVER, NODE, Node, env_of, spec_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIMS = os.path.join(ROOT, "tests", "fixtures", "dra", "claims")
FAKE_SMI = os.path.join(ROOT, "tests", "fake_nvidia_smi.py")


class SharingNode(Node):
    """A DRA node of a simulated machine whose nvidia-smi is the stand-in (recording its runs)
    and whose MPS control program is the stand-in."""

    def __init__(self, machine: str = "dgx-h100", smi_fail: str = "") -> None:
        super().__init__()
        self.machine = machine
        self.smi_record = os.path.join(self.root, "smi.jsonl")
        fail = f'FAKE_NVIDIA_SMI_FAIL="{smi_fail}" ' if smi_fail else ""
        smi = write_program(os.path.join(self.root, "nvidia-smi"), (
            f'#!/bin/sh\nFAKE_NVIDIA_SMI_MACHINE="{machine}" FAKE_NVIDIA_SMI_RECORD="{self.smi_record}" {fail}'
            f'PYTHONPATH="{ROOT}" exec "{sys.executable}" "{FAKE_SMI}" "$@"\n'))
        self.mps_root = os.path.join(self.root, "m")
        self.config = replace(self.config, nvidia_smi=smi, mps_root=self.mps_root,
                              mps_control_binary=standin_program(self.root))

    def start(self, topology=None, **kwargs):
        return super().start(topology or load_topology(self.machine), **kwargs)

    def claim(self, fixture: str | dict, devices: dict[str, list[str]], *, name: str = "c",
              class_configs: dict[str, list[dict]] | None = None) -> dict:
        """Store a claim (a fixture's file name, or its spec) allocated ``devices`` (request ->
        device names) with its configuration as Kubernetes' allocator fills
        ``status.allocation.devices.config``: each request's class configs (``FromClass``,
        scoped to that request), then the claim's own (``FromClaim``), in their order."""
        if isinstance(fixture, str):
            with open(os.path.join(CLAIMS, fixture), encoding="utf-8") as fh:
                fixture = yaml.safe_load(fh)
        claim = copy.deepcopy(fixture)
        claim["metadata"] = {"namespace": "default", "name": name}
        config = [{"source": "FromClass", "requests": [request], **c}
                  for request in devices for c in (class_configs or {}).get(request, [])]
        config += [{"source": "FromClaim", **c} for c in claim["spec"]["devices"].get("config", [])]
        claim["status"] = {"allocation": {"devices": {"config": config, "results": [
            {"request": request, "driver": DRIVER, "pool": NODE, "device": d}
            for request, names in devices.items() for d in names]}}}
        return self.api.put_claim(claim)

    def smi_runs(self) -> list[list[str]]:
        if not os.path.exists(self.smi_record):
            return []
        with open(self.smi_record, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]

    def intervals(self) -> list[tuple[str, str]]:
        """(GPU UUID, value) of every ``compute-policy --set-timeslice`` run, in order."""
        return [(run[2], run[4]) for run in self.smi_runs() if run[:1] == ["compute-policy"]]

    def daemon_dirs(self) -> list[str]:
        """The claims' MPS daemons' directories under the MPS root."""
        return sorted(d for d in os.listdir(self.mps_root) if d.startswith("claim-")) if os.path.isdir(self.mps_root) else []

    def mps_record(self, resource: str) -> list[dict]:
        path = os.path.join(self.mps_root, resource, "log", "standin.jsonl")
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]

    def daemon_pid(self, resource: str) -> int | None:
        try:
            with open(os.path.join(self.mps_root, resource, "pipe", "nvidia-cuda-mps-control.pid"),
                      encoding="ascii") as fh:
                return int(fh.read())
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        super().close()  # the plugin leaves its claims' daemons running, as an agent that stops does
        for resource in self.daemon_dirs():
            if (pid := self.daemon_pid(resource)) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


@pytest.fixture
def node():
    n = SharingNode()
    yield n
    n.close()


def uid(claim: dict) -> str:
    return claim["metadata"]["uid"]


def error_of(node: Node, claim: dict) -> str:
    return node.prepare(claim).claims[uid(claim)].error


def device_entry(node: Node, claim: dict, device: str) -> dict:
    (entry,) = [d for d in spec_of(node, uid(claim))["devices"] if d["name"] == f"{uid(claim)}-{device}"]
    return entry["containerEdits"]


def device_env(node: Node, claim: dict, device: str) -> dict[str, str]:
    return dict(e.split("=", 1) for e in device_entry(node, claim, device).get("env", []))


def alive(pid: int | None) -> bool:
    """The process runs (a zombie left to its parent counts as ended)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def commands(node: SharingNode, resource: str) -> list[str]:
    return [r["command"] for r in node.mps_record(resource) if "command" in r]


# ---------------------------------------------------------------------- NVIDIA's examples
def test_nvidias_time_slicing_claim_sets_long_on_its_gpu_and_default_again_at_unprepare(node):
    node.start()
    gpu0 = node.topology.gpus[0].uuid
    claim = node.claim("timeslicing-long.yaml", {"gpu": ["gpu-0"]})
    assert error_of(node, claim) == ""
    assert node.intervals() == [(gpu0, "3")]
    assert device_env(node, claim, "gpu-0") == {} and node.daemon_dirs() == []
    assert node.unprepare(claim).claims[uid(claim)].error == ""
    assert node.intervals() == [(gpu0, "3"), (gpu0, "0")]


def test_nvidias_mps_claim_runs_one_daemon_with_its_limits_and_hands_its_containers_the_pipe(node):
    node.start()
    gpu3 = node.topology.gpus[3]
    claim = node.claim("mps-limits.yaml", {"mps-gpu": ["gpu-3"]})
    assert error_of(node, claim) == ""
    resource = f"claim-{uid(claim)}-0"
    assert node.daemon_dirs() == [resource]
    (start,) = [r["start"] for r in node.mps_record(resource) if "start" in r]
    assert start == {"CUDA_VISIBLE_DEVICES": gpu3.uuid,
                     "CUDA_MPS_PIPE_DIRECTORY": os.path.join(node.mps_root, resource, "pipe"),
                     "CUDA_MPS_LOG_DIRECTORY": os.path.join(node.mps_root, resource, "log")}
    assert "set_default_device_pinned_mem_limit 0 10240M" in commands(node, resource)
    assert "set_default_active_thread_percentage 50" in commands(node, resource)
    edits = device_entry(node, claim, "gpu-3")
    assert device_env(node, claim, "gpu-3") == {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
                                                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
                                                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M"}
    assert [(m["containerPath"], m["hostPath"]) for m in edits["mounts"]] == [
        ("/tmp/nvidia-mps", os.path.join(node.mps_root, resource, "pipe")),
        ("/dev/shm", os.path.join(node.mps_root, "shm"))]
    assert env_of(spec_of(node, uid(claim)))["NVIDIA_VISIBLE_DEVICES"] == gpu3.uuid
    assert node.intervals() == []
    pid = node.daemon_pid(resource)
    assert node.unprepare(claim).claims[uid(claim)].error == ""
    assert eventually(lambda: not alive(pid), 5.0), "told to quit"
    assert node.daemon_dirs() == [], "its pipe and log directories are gone"


def test_nvidias_two_request_claim_time_slices_one_gpu_and_shares_the_other_by_mps(node):
    node.start()
    gpus = node.topology.gpus
    claim = node.claim("timeslicing-and-mps.yaml", {"ts-gpu": ["gpu-0"], "mps-gpu": ["gpu-1"]})
    assert error_of(node, claim) == ""
    assert node.intervals() == [(gpus[0].uuid, "3")]
    (start,) = [r["start"] for r in node.mps_record(f"claim-{uid(claim)}-0") if "start" in r]
    assert start["CUDA_VISIBLE_DEVICES"] == gpus[1].uuid
    assert device_env(node, claim, "gpu-0") == {}, "the time-sliced GPU's containers are no MPS clients"
    assert device_env(node, claim, "gpu-1")["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"


def test_nvidias_mig_device_claim_with_mps_runs_the_daemon_on_the_mig_device():
    node = SharingNode("a100-mig")
    try:
        node.start()
        mig = node.topology.gpus[0].mig_devices[0]
        claim = node.claim("mig-mps.yaml", {"mig": ["gpu-0-mig-0"]})
        assert error_of(node, claim) == ""
        (start,) = [r["start"] for r in node.mps_record(f"claim-{uid(claim)}-0") if "start" in r]
        assert start["CUDA_VISIBLE_DEVICES"] == mig.uuid
        assert device_env(node, claim, "gpu-0-mig-0")["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        assert node.intervals() == []
    finally:
        node.close()


# ---------------------------------------------------------------------- one claim, several pods
def test_a_claim_prepared_again_while_prepared_keeps_its_one_daemon_until_unprepared(node):
    node.start()
    claim = node.claim("mps-limits.yaml", {"mps-gpu": ["gpu-2"]})
    first = node.prepare(claim).claims[uid(claim)]
    again = node.prepare(claim).claims[uid(claim)]  # the kubelet asks again (a second pod, a retry)
    assert first.error == again.error == "" and list(first.devices) == list(again.devices)
    resource = f"claim-{uid(claim)}-0"
    assert len([r for r in node.mps_record(resource) if "start" in r]) == 1
    assert node.daemon_dirs() == [resource]
    pid = node.daemon_pid(resource)
    assert node.unprepare(claim).claims[uid(claim)].error == ""
    assert eventually(lambda: not alive(pid), 5.0) and node.daemon_dirs() == []


def test_after_an_agent_restart_the_claims_daemon_keeps_serving_and_unprepare_undoes_everything(node):
    node.start()
    gpus = node.topology.gpus
    claim = node.claim("timeslicing-and-mps.yaml", {"ts-gpu": ["gpu-4"], "mps-gpu": ["gpu-5"]})
    assert error_of(node, claim) == ""
    resource = f"claim-{uid(claim)}-0"
    pid, told = node.daemon_pid(resource), len(commands(node, resource))
    node.restart()
    assert error_of(node, claim) == "", "answered from the checkpoint"
    # the new agent's supervisor asks the daemon first; one that replaced it would then
    # tell it to quit and start another at once
    assert eventually(lambda: len(commands(node, resource)) > told, 5.0)
    time.sleep(1.0)
    assert node.daemon_pid(resource) == pid, "its pods keep their MPS server"
    assert [r for r in node.mps_record(resource) if "start" in r or r.get("command") == "quit"] == [
        r for r in node.mps_record(resource) if "start" in r]
    assert len([r for r in node.mps_record(resource) if "start" in r]) == 1
    assert node.unprepare(claim).claims[uid(claim)].error == ""
    assert eventually(lambda: not alive(pid), 5.0) and node.daemon_dirs() == []
    assert node.intervals() == [(gpus[4].uuid, "3"), (gpus[4].uuid, "0")]


def test_a_claim_spec_removed_meanwhile_is_written_again_with_its_mps_entries(node):
    node.start()
    claim = node.claim("mps-limits.yaml", {"mps-gpu": ["gpu-6"]})
    assert error_of(node, claim) == ""
    before = spec_of(node, uid(claim))
    os.unlink(node.plugin.preparer.checkpoint.get(uid(claim)).spec_path)
    assert error_of(node, claim) == ""
    assert spec_of(node, uid(claim)) == before


# ---------------------------------------------------------------------- precedence
def gpu_config(strategy: str | None = None, **sharing) -> dict:
    params: dict = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    if strategy:
        params["sharing"] = {"strategy": strategy, **sharing}
    return {"opaque": {"driver": DRIVER, "parameters": params}}


def two_requests(*config: dict) -> dict:
    return {"spec": {"devices": {"requests": [
        {"name": n, "exactly": {"deviceClassName": "gpu.gpu-agent.io"}} for n in ("a", "b")],
        "config": list(config)}}}


def test_the_claims_entry_overrides_its_class_and_a_later_entry_an_earlier_one(node):
    node.start()
    gpus = node.topology.gpus
    class_short = gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Short"})
    claim = node.claim(two_requests(gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Medium"}),
                                    {"requests": ["b"], **gpu_config("TimeSlicing",
                                                                     timeSlicingConfig={"interval": "Long"})}),
                       {"a": ["gpu-0"], "b": ["gpu-1"]}, class_configs={"a": [class_short], "b": [class_short]})
    assert error_of(node, claim) == ""
    assert sorted(node.intervals()) == sorted([(gpus[0].uuid, "2"), (gpus[1].uuid, "3")])


def test_a_class_config_applies_where_the_claim_says_nothing(node):
    node.start()
    claim = node.claim(two_requests(), {"a": ["gpu-0"], "b": ["gpu-1"]},
                       class_configs={"b": [gpu_config("MPS", mpsConfig={"defaultActiveThreadPercentage": 25})]})
    assert error_of(node, claim) == ""
    assert device_env(node, claim, "gpu-0") == {}
    assert device_env(node, claim, "gpu-1")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert node.intervals() == []


def test_a_request_scoped_entry_applies_to_its_request_only_and_a_gpu_set_gets_every_member(node):
    node.start()
    gpus = node.topology.gpus
    claim = node.claim(two_requests({"requests": ["a"], **gpu_config("TimeSlicing")}),
                       {"a": ["gpuset-2-m30"], "b": ["gpu-0"]})
    assert error_of(node, claim) == ""
    assert node.intervals() == [(gpus[4].uuid, "0"), (gpus[5].uuid, "0")]


def test_configuration_of_other_drivers_is_left_to_them(node):
    node.start()
    other = {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"anything": ["goes", 1]}}}
    claim = node.claim(two_requests(other), {"a": ["gpu-0"]})
    assert error_of(node, claim) == ""
    assert node.intervals() == [] and node.daemon_dirs() == []


def test_the_agents_own_api_group_is_read_as_nvidias(node):
    node.start()
    config = gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Short"})
    config["opaque"]["parameters"]["apiVersion"] = "resource.gpu-agent.io/v1beta1"
    claim = node.claim(two_requests(config), {"a": ["gpu-7"]})
    assert error_of(node, claim) == ""
    assert node.intervals() == [(node.topology.gpus[7].uuid, "1")]


# ---------------------------------------------------------------------- refusals
def mps(**mps_config) -> dict:
    return gpu_config("MPS", mpsConfig=mps_config)


REFUSALS = [
    (mps(defaultActiveThreadPercentage=150),
     "sharing.mpsConfig.defaultActiveThreadPercentage: 150 is not a percentage 0-100"),
    (mps(defaultActiveThreadPercentage="50"), "sharing.mpsConfig.defaultActiveThreadPercentage: '50' is not an integer"),
    (mps(defaultPinnedDeviceMemoryLimit="10Gx"), "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: '10Gx' is not a quantity"),
    (mps(defaultPinnedDeviceMemoryLimit="1k"), "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 1k is below 1Mi"),
    (mps(defaultPinnedDeviceMemoryLimit="100Gi"),
     "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 102400 MiB is more than device 0"),
    (mps(defaultPerDevicePinnedMemoryLimit={"1": "1Gi"}),
     "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.1: not a device of this configuration: expected an index 0-0"),
    (mps(multiUser=True), "sharing.mpsConfig.multiUser: true is not supported"),
    (mps(pinnedLimit="1Gi"), "sharing.mpsConfig.pinnedLimit: unknown field"),
    (gpu_config("TimeSlicing", timeSlicingConfig={"interval": "VeryLong"}),
     "sharing.timeSlicingConfig.interval: 'VeryLong' is not an interval: expected one of Default, Short, Medium, Long"),
    (gpu_config("TimeSlicing", mpsConfig={}), "sharing.mpsConfig: not allowed with strategy TimeSlicing"),
    (gpu_config("Exclusive"), "sharing.strategy: 'Exclusive' is not a strategy: expected TimeSlicing or MPS"),
    ({"opaque": {"driver": DRIVER, "parameters": {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}}},
     "apiVersion: 'resource.nvidia.com/v1' is not one of resource.nvidia.com/v1beta1, resource.gpu-agent.io/v1beta1"),
    ({"opaque": {"driver": DRIVER, "parameters": {"apiVersion": "resource.nvidia.com/v1beta1",
                                                  "kind": "VfioDeviceConfig"}}},
     "kind: VfioDeviceConfig is not served by this driver"),
    ({"opaque": {"driver": DRIVER, "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                                                  "metadata": {"name": "x"}}}},
     "metadata: unknown field (expected apiVersion, kind, sharing)"),
]


@pytest.mark.parametrize(("config", "expected"), REFUSALS, ids=[e.split(":")[0] + str(i) for i, (_, e) in
                                                                enumerate(REFUSALS)])
def test_a_config_that_cannot_apply_refuses_the_prepare_in_one_line_naming_claim_request_and_field(
        node, config, expected):
    node.start()
    claim = node.claim(two_requests({"requests": ["a"], **config}), {"a": ["gpu-0"]})
    error = error_of(node, claim)
    assert error.startswith(f"ResourceClaim default/c (uid {uid(claim)}) request a: {expected}"), error
    assert "\n" not in error and error.endswith("(the claim's spec.devices.config[0])")
    assert node.intervals() == [] and node.daemon_dirs() == []
    assert node.plugin.preparer.checkpoint.get(uid(claim)) is None
    fixed = node.claim(two_requests({"requests": ["a"], **gpu_config("TimeSlicing")}), {"a": ["gpu-0"]}, name="c")
    assert error_of(node, fixed) == "", "nothing was left held"


def test_an_interval_or_a_gpu_config_for_a_mig_device_is_refused_in_one_line():
    node = SharingNode("a100-mig")
    try:
        node.start()
        mig_config = {"requests": ["a"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}}}
        claim = node.claim(two_requests(mig_config), {"a": ["gpu-0-mig-0"]})
        assert "request a: sharing.timeSlicingConfig: unknown field (expected strategy, mpsConfig)" in error_of(node, claim)
        claim = node.claim(two_requests({"requests": ["a"], **gpu_config("TimeSlicing")}), {"a": ["gpu-0-mig-0"]})
        assert ("request a: kind: GpuConfig cannot configure device gpu-0-mig-0 (a MIG device): use MigDeviceConfig"
                in error_of(node, claim))
        # an entry for every request skips the devices of the other kind, as NVIDIA's driver does
        claim = node.claim(two_requests(gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Long"})),
                           {"a": ["gpu-0-mig-0"], "b": ["gpu-2"]})
        assert error_of(node, claim) == ""
        assert node.intervals() == [(node.topology.gpus[2].uuid, "3")]
    finally:
        node.close()


def compute_mode_machine(tmp_path, mode: str) -> str:
    path = tmp_path / "machine.yaml"
    path.write_text(yaml.safe_dump({"name": "modes", "gpus": [
        {"model": "NVIDIA A10", "bus_id": "0000:17:00.0"},
        {"model": "NVIDIA A10", "bus_id": "0000:65:00.0", "compute_mode": mode}]}))
    return str(path)


@pytest.mark.parametrize(("mode", "config", "refused"), [
    ("Prohibited", mps(), "MPS: GPU 1 of device gpu-1 cannot run MPS: NVML reports its compute mode Prohibited"),
    ("Exclusive_Thread", mps(), "MPS: GPU 1 of device gpu-1 cannot run MPS: NVML reports its compute mode Exclusive_Thread"),
    ("Exclusive_Process", gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Long"}),
     "TimeSlicing: GPU 1 of device gpu-1 is in compute mode Exclusive_Process"),
])
def test_sharing_a_gpu_whose_compute_mode_forbids_it_is_refused_in_one_line(tmp_path, mode, config, refused):
    node = SharingNode(compute_mode_machine(tmp_path, mode))
    try:
        node.start()
        claim = node.claim(two_requests(config), {"a": ["gpu-1"]})
        error = error_of(node, claim)
        assert f"request a: sharing.strategy: {refused}" in error and "\n" not in error, error
        assert node.intervals() == [] and node.daemon_dirs() == []
        claim = node.claim(two_requests(config), {"a": ["gpu-0"]}, name="ok")
        assert error_of(node, claim) == "", "the GPU in Default mode serves it"
    finally:
        node.close()


def test_an_interval_nvidia_smi_cannot_set_refuses_the_prepare_in_one_line_and_holds_nothing():
    node = SharingNode(smi_fail="compute-policy")
    try:
        node.start()
        claim = node.claim("timeslicing-long.yaml", {"gpu": ["gpu-0"]})
        error = error_of(node, claim)
        assert (f"request gpu: sharing.timeSlicingConfig.interval: Long cannot be set on GPU 0: nvidia-smi"
                f" compute-policy -i {node.topology.gpus[0].uuid} --set-timeslice 3 (Long): exit status 4:"
                " Insufficient Permissions") in error and "\n" not in error, error
        assert node.plugin.preparer.checkpoint.get(uid(claim)) is None
    finally:
        node.close()
