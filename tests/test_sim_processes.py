"""The simulator's GPU processes: the machine spec's ``processes:`` schema, the fake NVML's
process functions answering as the real ones (pynvml's shapes, NotFound, NotSupported), and
the fake ``/proc`` holding their cgroup files."""

from __future__ import annotations

import ctypes
import os

import pynvml
import pytest

from agent.errors import InputFormatError
from agent.hw.sim.machines import SimulatedMachine
from agent.hw.sim.nvml import FakeNvml
from agent.hw.sim.processes import ProcessSpec
from agent.hw.sim.spec import machine_spec_from_dict

CGROUP = ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5c1e3b2a_6f7d_4c8e"
          "_9a0b_1d2e3f4a5b6c.slice/cri-containerd-" + "ab" * 32 + ".scope")


def spec_with(processes, *, model="NVIDIA H100 80GB HBM3", more=None, **gpu):
    return machine_spec_from_dict({
        "name": "procs",
        "gpus": [{"bus_id": "0000:18:00.0", "model": model, "processes": processes, **gpu},
                 *(more or [])],
    }, source="procs.yaml")


def fake(spec) -> FakeNvml:
    lib = FakeNvml(spec)
    lib.nvmlInit()
    return lib


# ---------------------------------------------------------------- schema
def test_processes_are_read_with_defaults():
    spec = spec_with([{"pid": 10, "used_memory_mib": 512, "sm_util": 40, "mem_util": 7,
                       "cgroup": CGROUP}, {"pid": 11}])
    assert spec.gpus[0].processes == (ProcessSpec(10, 512, 40, 7, CGROUP), ProcessSpec(11))


@pytest.mark.parametrize(("processes", "message"), [
    ("pid 1", "gpus[0].processes: expected a list"),
    ([5], "gpus[0].processes[0]: expected a mapping"),
    ([{"used_memory_mib": 1}], "gpus[0].processes[0].pid: required"),
    ([{"pid": 0}], "gpus[0].processes[0].pid: expected 1 to"),
    ([{"pid": "12"}], "gpus[0].processes[0].pid: expected an integer"),
    ([{"pid": 1, "sm_util": 101}], "gpus[0].processes[0].sm_util: expected 0 to 100"),
    ([{"pid": 1, "mem_util": -1}], "gpus[0].processes[0].mem_util: expected 0 to 100"),
    ([{"pid": 1, "used_memory_mib": -5}], "used_memory_mib: expected >= 0"),
    ([{"pid": 1, "cgroup": ""}], "gpus[0].processes[0].cgroup: expected the /proc/<pid>/cgroup"),
    ([{"pid": 1, "gpu": 0}], "unknown keys ['gpu']"),
    ([{"pid": 1}, {"pid": 1}], "processes[1].pid: 1 given twice"),
])
def test_a_bad_process_entry_is_one_clear_error(processes, message):
    with pytest.raises(InputFormatError) as err:
        spec_with(processes)
    assert str(err.value).startswith("procs.yaml: ") and message in str(err.value), str(err.value)


def test_one_pid_on_two_gpus_must_have_one_cgroup():
    with pytest.raises(InputFormatError, match=r"gpus\[1\].processes: PID 7 has another cgroup"):
        spec_with([{"pid": 7, "cgroup": CGROUP}],
                  more=[{"bus_id": "0000:19:00.0", "processes": [{"pid": 7, "cgroup": "0::/"}]}])


# ---------------------------------------------------------------- fake NVML
def test_running_processes_have_pynvmls_attributes_in_bytes():
    lib = fake(spec_with([{"pid": 10, "used_memory_mib": 512}]))
    (p,) = lib.nvmlDeviceGetComputeRunningProcesses(lib.nvmlDeviceGetHandleByIndex(0))
    assert (p.pid, p.usedGpuMemory) == (10, 512 << 20)
    real_fields = [f[0] for f in pynvml.c_nvmlProcessInfo_t._fields_]
    assert all(hasattr(p, name) for name in real_fields)


def test_process_utilization_samples_are_pynvmls_struct_for_busy_processes_only():
    lib = fake(spec_with([{"pid": 10, "sm_util": 40, "mem_util": 7}, {"pid": 11}]))
    samples = lib.nvmlDeviceGetProcessUtilization(lib.nvmlDeviceGetHandleByIndex(0), 0)
    assert [(s.pid, s.smUtil, s.memUtil, s.encUtil, s.decUtil) for s in samples] == [(10, 40, 7, 0, 0)]
    assert [f[0] for f in type(samples[0])._fields_] == \
        [f[0] for f in pynvml.c_nvmlProcessUtilizationSample_t._fields_]
    assert ctypes.sizeof(samples[0]) == ctypes.sizeof(pynvml.c_nvmlProcessUtilizationSample_t)


def test_process_utilization_is_not_found_when_no_sample_is_newer_than_the_timestamp():
    lib = fake(spec_with([{"pid": 10, "sm_util": 40}]))
    h = lib.nvmlDeviceGetHandleByIndex(0)
    (s,) = lib.nvmlDeviceGetProcessUtilization(h, 0)
    with pytest.raises(FakeNvml.NVMLError_NotFound):
        lib.nvmlDeviceGetProcessUtilization(h, s.timeStamp + 60_000_000)
    idle = fake(spec_with([{"pid": 11, "used_memory_mib": 100}]))
    with pytest.raises(FakeNvml.NVMLError_NotFound):
        idle.nvmlDeviceGetProcessUtilization(idle.nvmlDeviceGetHandleByIndex(0), 0)


def test_process_utilization_is_not_supported_in_mig_mode():
    lib = fake(spec_with([{"pid": 10, "sm_util": 40}], model="NVIDIA A100-SXM4-80GB",
                         mig=["3g.40gb"]))
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetProcessUtilization(lib.nvmlDeviceGetHandleByIndex(0), 0)


def test_mps_client_list_is_empty_without_a_simulated_mps_daemon():
    lib = fake(spec_with([{"pid": 10}]))
    assert lib.nvmlDeviceGetMPSComputeRunningProcesses(lib.nvmlDeviceGetHandleByIndex(0)) == []


def test_a_gpu_with_processes_reports_their_use_as_its_own():
    lib = fake(spec_with([{"pid": 10, "used_memory_mib": 9000, "sm_util": 55, "mem_util": 30},
                          {"pid": 11, "used_memory_mib": 3000, "sm_util": 12, "mem_util": 4}]))
    h = lib.nvmlDeviceGetHandleByIndex(0)
    rates = lib.nvmlDeviceGetUtilizationRates(h)
    assert (rates.gpu, rates.memory) == (67, 34), "time-sliced processes add up"
    memory = lib.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
    assert memory.used == 12000 << 20


# ---------------------------------------------------------------- fake /proc
def test_the_fake_proc_holds_the_cgroup_of_each_process_that_has_one():
    spec = spec_with([{"pid": 10, "cgroup": CGROUP}, {"pid": 11}],
                     more=[{"bus_id": "0000:19:00.0", "processes": [{"pid": 10, "cgroup": CGROUP}]}])
    with SimulatedMachine(spec) as sim:
        with open(os.path.join(sim.proc_root, "10", "cgroup")) as f:
            assert f.read() == CGROUP + "\n"
        assert not os.path.exists(os.path.join(sim.proc_root, "11"))  # "it has just exited"
        root = sim.proc_root
    assert not os.path.exists(root)  # removed with the machine
