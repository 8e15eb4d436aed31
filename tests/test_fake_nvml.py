"""The fake pynvml is faithful to the installed pynvml: names, parameters, constants, error
classes and struct fields; and it behaves like hardware (links, lost GPUs, events,
telemetry, fault injection)."""

from __future__ import annotations

import ast
import ctypes
import inspect
import pathlib
import re
import threading

import pynvml
import pytest

from agent.errors import InputFormatError
from agent.hw.sim.machines import load_spec
from agent.hw.sim.nvml import FakeNvml
from agent.hw.sim.nvml_core import TELEMETRY_FIELDS
from agent.hw.sim.nvml_types import CONSTANTS, ERROR_CLASSES, STRUCTS
from agent.hw.sim.spec import machine_spec_from_dict
from agent.hw.sim.spec_gpus import parse_mig_profile


@pytest.fixture(scope="module")
def h100_spec():
    return load_spec("dgx-h100")


@pytest.fixture
def h100(h100_spec):
    fake = FakeNvml(h100_spec)
    fake.nvmlInit()
    return fake


@pytest.fixture
def v100():
    fake = FakeNvml(load_spec("dgx1-v100"))
    fake.nvmlInit()
    return fake


# ---------------------------------------------------------------- fidelity to pynvml
def api_functions() -> list[str]:
    """The pynvml functions the fake implements: its public ``nvml*`` callables."""
    return sorted(n for n in dir(FakeNvml) if n.startswith("nvml") and inspect.isfunction(getattr(FakeNvml, n)))


@pytest.mark.parametrize("name", api_functions())
def test_every_fake_function_exists_in_pynvml_with_the_same_parameters(name):
    real = getattr(pynvml, name, None)
    assert real is not None, f"pynvml has no {name}"
    real_params = [(p.name, p.kind, p.default) for p in inspect.signature(real).parameters.values()]
    fake_params = [
        (p.name, p.kind, p.default)
        for p in inspect.signature(getattr(FakeNvml, name)).parameters.values()
    ][1:]  # drop self
    assert fake_params == real_params


def test_the_fake_implements_what_the_backend_and_metrics_call():
    needed = {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetCudaComputeCapability",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetNvLinkRemotePciInfo",
        "nvmlDeviceGetNvLinkRemoteDeviceType",
        "nvmlDeviceGetTopologyCommonAncestor",
        "nvmlDeviceGetP2PStatus",
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlSystemGetDriverVersion",
        "nvmlSystemGetCudaDriverVersion_v2",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetEncoderUtilization",
        "nvmlDeviceGetDecoderUtilization",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses",
        "nvmlDeviceGetProcessUtilization",
        "nvmlGpmQueryDeviceSupport",
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleGet",
        "nvmlGpmSampleFree",
        "nvmlGpmMetricsGet",
        "nvmlEventSetCreate",
        "nvmlDeviceRegisterEvents",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlEventSetWait_v2",
        "nvmlEventSetFree",
    }
    assert needed <= set(api_functions())


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_every_fake_constant_has_the_value_pynvml_gives_it(name):
    assert getattr(pynvml, name) == CONSTANTS[name] == getattr(FakeNvml, name)


@pytest.mark.parametrize("name", sorted(ERROR_CLASSES))
def test_every_fake_error_class_exists_in_pynvml_with_the_same_code(name):
    real_cls = getattr(pynvml, name)
    fake_cls = getattr(FakeNvml, name)
    assert fake_cls().value == real_cls().value
    # NVMLError(code) gives the subclass, in both
    assert type(FakeNvml.NVMLError(fake_cls().value)) is fake_cls
    assert type(pynvml.NVMLError(real_cls().value)).__name__ == name
    assert str(fake_cls()) == pynvml.NVMLError._errcode_to_string.get(
        real_cls().value, str(fake_cls())
    )


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_every_fake_struct_has_pynvmls_field_names(name):
    real = getattr(pynvml, name)
    fake = STRUCTS[name]
    real_fields = [f[0] for f in real._fields_]
    fake_fields = list(getattr(fake, "_fields", ())) or [f[0] for f in fake._fields_]
    assert fake_fields == real_fields


def test_caller_allocated_structs_have_pynvmls_memory_layout():
    for name in (
        "c_nvmlGpuFabricInfoV_t",
        "c_nvmlGpuFabricInfo_t",
        "c_nvmlFieldValue_t",
        "c_nvmlValue_t",
    ):
        assert ctypes.sizeof(STRUCTS[name]) == ctypes.sizeof(getattr(pynvml, name)), name
    assert STRUCTS["c_nvmlGpuFabricInfoV_t"]().version == pynvml.c_nvmlGpuFabricInfoV_t().version


def test_pci_bus_id_has_the_type_the_installed_pynvml_returns(h100):
    real = pynvml.nvmlPciInfo_t()
    real.busId = b"00000000:1B:00.0"
    fake_info = h100.nvmlDeviceGetPciInfo(h100.nvmlDeviceGetHandleByIndex(0))
    assert type(fake_info.busId) is type(real.busId)
    assert fake_info.busId == "00000000:1B:00.0"
    assert (fake_info.domain, fake_info.bus, fake_info.device) == (0, 0x1B, 0)


def test_every_call_before_init_raises_uninitialized(h100_spec):
    fake = FakeNvml(h100_spec)
    with pytest.raises(FakeNvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 8


# ---------------------------------------------------------------- hardware behaviour
def test_nvlink_indices_beyond_the_gpu_raise_as_on_real_hardware(v100):
    h = v100.nvmlDeviceGetHandleByIndex(0)
    assert [v100.nvmlDeviceGetNvLinkState(h, k) for k in range(6)] == [1] * 6
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        v100.nvmlDeviceGetNvLinkState(h, 6)  # a V100 has 6 NVLinks
    with pytest.raises(FakeNvml.NVMLError_InvalidArgument):
        v100.nvmlDeviceGetNvLinkState(h, FakeNvml.NVML_NVLINK_MAX_LINKS)


def test_switch_links_report_a_switch_at_the_remote_end(h100):
    h = h100.nvmlDeviceGetHandleByIndex(0)
    kinds = {h100.nvmlDeviceGetNvLinkRemoteDeviceType(h, k) for k in range(18)}
    assert kinds == {FakeNvml.NVML_NVLINK_DEVICE_TYPE_SWITCH}
    remote = h100.nvmlDeviceGetNvLinkRemotePciInfo(h, 0).busId
    assert remote not in {
        h100.nvmlDeviceGetPciInfo(h100.nvmlDeviceGetHandleByIndex(i)).busId for i in range(8)
    }


def test_gpu_links_report_the_peer_gpus_bus_id(v100):
    h0 = v100.nvmlDeviceGetHandleByIndex(0)
    bus = {v100.nvmlDeviceGetPciInfo(v100.nvmlDeviceGetHandleByIndex(i)).busId: i for i in range(8)}
    peers = [bus[v100.nvmlDeviceGetNvLinkRemotePciInfo(h0, k).busId] for k in range(6)]
    assert sorted(peers) == [1, 2, 3, 3, 4, 4]


def test_a_lost_gpu_raises_gpu_is_lost_only_for_its_own_handles():
    fake = FakeNvml(load_spec("a100-mig"))
    fake.nvmlInit()
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)
    fake.lose_gpu(0)
    for fn, args in (
        ("nvmlDeviceGetUUID", (h0,)),
        ("nvmlDeviceGetPowerUsage", (h0,)),
        ("nvmlDeviceGetUUID", (mig,)),
        ("nvmlDeviceGetP2PStatus", (h1, h0, 2)),
    ):
        with pytest.raises(FakeNvml.NVMLError_GpuIsLost):
            getattr(fake, fn)(*args)
    assert fake.nvmlDeviceGetUUID(h1).startswith("GPU-")
    assert fake.nvmlDeviceGetHandleByIndex(0) is h0  # getting the handle still works
    fake.recover_gpu(0)
    assert fake.nvmlDeviceGetUUID(h0).startswith("GPU-")


def test_make_unsupported_can_target_one_gpu_or_all(h100):
    h0, h1 = h100.nvmlDeviceGetHandleByIndex(0), h100.nvmlDeviceGetHandleByIndex(1)
    h100.make_unsupported("nvmlDeviceGetPowerUsage", 1)
    assert h100.nvmlDeviceGetPowerUsage(h0) > 0
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        h100.nvmlDeviceGetPowerUsage(h1)
    h100.make_unsupported("nvmlDeviceGetTemperature")
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        h100.nvmlDeviceGetTemperature(h0, FakeNvml.NVML_TEMPERATURE_GPU)


def test_fail_and_make_missing_raise_the_chosen_errors(h100):
    h = h100.nvmlDeviceGetHandleByIndex(0)
    h100.fail("nvmlDeviceGetName", FakeNvml.NVML_ERROR_UNKNOWN, 0)
    with pytest.raises(FakeNvml.NVMLError_Unknown):
        h100.nvmlDeviceGetName(h)
    h100.make_missing("nvmlDeviceGetSerial")
    with pytest.raises(FakeNvml.NVMLError_FunctionNotFound):
        h100.nvmlDeviceGetSerial(h)


def test_fail_init_makes_nvml_init_raise(h100_spec):
    fake = FakeNvml(h100_spec)
    fake.fail_init(FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(FakeNvml.NVMLError_DriverNotLoaded):
        fake.nvmlInit()
    fake.fail_init(None)
    fake.nvmlInit()


def test_mig_devices_have_handles_uuids_and_attributes():
    fake = FakeNvml(load_spec("a100-mig"))
    fake.nvmlInit()
    h1 = fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetMigMode(h1) == [1, 1]
    assert fake.nvmlDeviceGetMaxMigDeviceCount(h1) == 7
    migs = [fake.nvmlDeviceGetMigDeviceHandleByIndex(h1, k) for k in range(4)]
    with pytest.raises(FakeNvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(h1, 4)
    attrs = [fake.nvmlDeviceGetAttributes(m) for m in migs]
    assert [a.gpuInstanceSliceCount for a in attrs] == [3, 2, 1, 1]
    assert all(fake.nvmlDeviceGetUUID(m).startswith("MIG-") for m in migs)
    assert fake.nvmlDeviceIsMigDeviceHandle(migs[0]).value == 1
    assert fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migs[2]) is h1
    h2 = fake.nvmlDeviceGetHandleByIndex(2)
    assert fake.nvmlDeviceGetMigMode(h2) == [0, 0]
    l40s = FakeNvml(load_spec("pcie-4gpu"))
    l40s.nvmlInit()
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        l40s.nvmlDeviceGetMigMode(l40s.nvmlDeviceGetHandleByIndex(0))


def test_fabric_info_is_filled_through_byref_where_supported():
    fake = FakeNvml(load_spec("gb200-tray"))
    fake.nvmlInit()
    info = FakeNvml.c_nvmlGpuFabricInfoV_t()
    fake.nvmlDeviceGetGpuFabricInfoV(fake.nvmlDeviceGetHandleByIndex(2), ctypes.byref(info))
    assert info.cliqueId == 1 and info.state == FakeNvml.NVML_GPU_FABRIC_STATE_COMPLETED
    assert bytes(info.clusterUuid).hex().startswith("3c7b5f0e")
    other = FakeNvml(load_spec("dgx-a100"))
    other.nvmlInit()
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        other.nvmlDeviceGetGpuFabricInfoV(other.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))


# ---------------------------------------------------------------- events
def test_an_injected_xid_reaches_a_registered_event_set(h100):
    es = h100.nvmlEventSetCreate()
    h3 = h100.nvmlDeviceGetHandleByIndex(3)
    h100.nvmlDeviceRegisterEvents(h3, FakeNvml.nvmlEventTypeXidCriticalError, es)
    h100.inject_xid(3, 79)
    h100.inject_xid(4, 48)  # GPU 4 is not registered: not delivered
    data = h100.nvmlEventSetWait_v2(es, 1000)
    assert (data.device, data.eventType, data.eventData) == (
        h3,
        FakeNvml.nvmlEventTypeXidCriticalError,
        79,
    )
    with pytest.raises(FakeNvml.NVMLError_Timeout):
        h100.nvmlEventSetWait_v2(es, 0)
    h100.nvmlEventSetFree(es)


def test_a_waiter_is_woken_by_an_event_from_another_thread(h100):
    es = h100.nvmlEventSetCreate()
    h100.nvmlDeviceRegisterEvents(
        h100.nvmlDeviceGetHandleByIndex(0), FakeNvml.nvmlEventTypeDoubleBitEccError, es
    )
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(h100.nvmlEventSetWait_v2(es, 30_000)))
    waiter.start()
    h100.inject_ecc_dbe(0)
    waiter.join(60)
    assert not waiter.is_alive()
    assert got[0].eventType == FakeNvml.nvmlEventTypeDoubleBitEccError
    assert h100.nvmlDeviceGetTotalEccErrors(h100.nvmlDeviceGetHandleByIndex(0), 1, 0) == 1


def test_losing_a_registered_gpu_wakes_the_waiter_with_gpu_is_lost(h100):
    es = h100.nvmlEventSetCreate()
    h100.nvmlDeviceRegisterEvents(
        h100.nvmlDeviceGetHandleByIndex(5), FakeNvml.nvmlEventTypeXidCriticalError, es
    )
    h100.lose_gpu(5)
    with pytest.raises(FakeNvml.NVMLError_GpuIsLost):
        h100.nvmlEventSetWait_v2(es, 1000)


# ---------------------------------------------------------------- telemetry
def test_telemetry_functions_return_sane_shapes(h100):
    h = h100.nvmlDeviceGetHandleByIndex(0)
    mem = h100.nvmlDeviceGetMemoryInfo(h)
    assert mem.total == 81559 << 20 and mem.free + mem.used == mem.total
    v2 = h100.nvmlDeviceGetMemoryInfo(h, version=FakeNvml.nvmlMemory_v2)
    assert v2.free + v2.used + v2.reserved == v2.total and v2.reserved > 0
    util = h100.nvmlDeviceGetUtilizationRates(h)
    assert 0 <= util.gpu <= 100 and 0 <= util.memory <= 100
    assert 0 < h100.nvmlDeviceGetTemperature(h, FakeNvml.NVML_TEMPERATURE_GPU) < 100
    assert 0 < h100.nvmlDeviceGetPowerUsage(h) <= 700_000
    assert h100.nvmlDeviceGetClockInfo(h, FakeNvml.NVML_CLOCK_SM) > 0
    assert h100.nvmlDeviceGetClockInfo(h, FakeNvml.NVML_CLOCK_MEM) == 2619
    enc, period = h100.nvmlDeviceGetEncoderUtilization(h)
    assert 0 <= enc <= 100 and period > 0
    assert len(h100.nvmlDeviceGetDecoderUtilization(h)) == 2
    assert h100.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    assert h100.nvmlDeviceGetPcieThroughput(h, FakeNvml.NVML_PCIE_UTIL_TX_BYTES) > 0
    assert h100.nvmlDeviceGetPcieReplayCounter(h) == 0
    assert h100.nvmlDeviceGetComputeRunningProcesses(h) == []


def test_telemetry_is_deterministic_per_machine_and_gpu(h100_spec):
    a, b = FakeNvml(h100_spec), FakeNvml(h100_spec)
    for fake in (a, b):
        fake.nvmlInit()
    read = [
        [f.nvmlDeviceGetUtilizationRates(f.nvmlDeviceGetHandleByIndex(i)).gpu for i in range(8)]
        for f in (a, b)
    ]
    assert read[0] == read[1]
    assert len(set(read[0])) > 1  # GPUs differ from each other


def test_counters_grow_between_reads(h100):
    h = h100.nvmlDeviceGetHandleByIndex(0)
    first = h100.nvmlDeviceGetTotalEnergyConsumption(h)
    second = h100.nvmlDeviceGetTotalEnergyConsumption(h)
    assert second > first
    fid = FakeNvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    v1 = h100.nvmlDeviceGetFieldValues(h, [fid])[0].value.ullVal
    v2 = h100.nvmlDeviceGetFieldValues(h, [fid])[0].value.ullVal
    assert v2 > v1


def test_field_values_answer_per_field_with_their_own_return_code(h100):
    h = h100.nvmlDeviceGetHandleByIndex(0)
    values = h100.nvmlDeviceGetFieldValues(h, [FakeNvml.NVML_FI_DEV_MEMORY_TEMP, 9999, (138, 0)])
    assert [v.fieldId for v in values] == [82, 9999, 138]
    assert (
        values[0].nvmlReturn == 0 and values[0].valueType == FakeNvml.NVML_VALUE_TYPE_UNSIGNED_INT
    )
    assert 20 < values[0].value.uiVal < 110
    assert values[1].nvmlReturn == FakeNvml.NVML_ERROR_NOT_SUPPORTED
    assert values[2].nvmlReturn == 0 and values[2].scopeId == 0
    l40s = FakeNvml(load_spec("pcie-4gpu"))
    l40s.nvmlInit()
    no_hbm = l40s.nvmlDeviceGetFieldValues(
        l40s.nvmlDeviceGetHandleByIndex(0), [FakeNvml.NVML_FI_DEV_MEMORY_TEMP]
    )
    assert no_hbm[0].nvmlReturn == FakeNvml.NVML_ERROR_NOT_SUPPORTED


def test_set_value_drives_telemetry_and_rejects_unknown_knobs(h100):
    h = h100.nvmlDeviceGetHandleByIndex(2)
    h100.set_value(2, "gpu_util_pct", 0)
    h100.set_value(2, "gpu_temp_c", 91)
    h100.set_value(2, "processes", [(4242, 1000)])
    assert h100.nvmlDeviceGetUtilizationRates(h).gpu == 0
    assert h100.nvmlDeviceGetTemperature(h, 0) == 91
    procs = h100.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 1000 << 20)]
    with pytest.raises(ValueError, match="gpu_util_pct"):
        h100.set_value(2, "util", 1)
    assert "gpu_util_pct" in TELEMETRY_FIELDS


def test_gpm_works_on_hopper_and_is_not_supported_before(h100, v100):
    h = h100.nvmlDeviceGetHandleByIndex(0)
    assert h100.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    s1, s2 = h100.nvmlGpmSampleAlloc(), h100.nvmlGpmSampleAlloc()
    h100.nvmlGpmSampleGet(h, s1)
    h100.nvmlGpmSampleGet(h, s2)
    req = FakeNvml.c_nvmlGpmMetricsGet_t()
    req.version, req.numMetrics, req.sample1, req.sample2 = 1, 2, s1, s2
    req.metrics[0].metricId = FakeNvml.NVML_GPM_METRIC_GRAPHICS_UTIL
    req.metrics[1].metricId = 9999
    h100.nvmlGpmMetricsGet(req)
    assert req.metrics[0].nvmlReturn == 0 and 0 <= req.metrics[0].value <= 100
    assert req.metrics[1].nvmlReturn == FakeNvml.NVML_ERROR_NOT_SUPPORTED
    hv = v100.nvmlDeviceGetHandleByIndex(0)
    assert v100.nvmlGpmQueryDeviceSupport(hv).isSupportedDevice == 0
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        v100.nvmlGpmSampleGet(hv, v100.nvmlGpmSampleAlloc())
    with pytest.raises(FakeNvml.NVMLError_NotSupported):
        v100.nvmlDeviceGetRemappedRows(hv)  # no row remapping before Ampere


# ---------------------------------------------------------------- spec reader
_MINIMAL = {"name": "m", "gpus": [{"bus_id": "0000:3b:00.0", "model": "NVIDIA A10"}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, r"unknown keys \['colour'\]"),
        ({"gpus": []}, "gpus: a machine needs at least one GPU"),
        ({"gpus": [{"bus_id": "3b:00"}]}, r"gpus\[0\].bus_id: not a PCI bus id"),
        (
            {"gpus": [{"bus_id": "0000:3b:00.0", "mig": ["1g.5gb"], "model": "NVIDIA A10"}]},
            "not MIG capable",
        ),
        (
            {
                "gpus": [
                    {
                        "bus_id": "0000:3b:00.0",
                        "model": "NVIDIA A100-SXM4-40GB",
                        "mig": ["3g.20gb", "4g.20gb", "1g.5gb"],
                    }
                ]
            },
            "more than 7",
        ),
        ({"nvlink": {"pairs": [[0, 0, 1]]}}, r"nvlink.pairs\[0\]"),
        (
            {
                "gpus": [
                    {"bus_id": "0000:3b:00.0", "model": "Tesla V100-SXM2-16GB"},
                    {"bus_id": "0000:3c:00.0", "model": "Tesla V100-SXM2-16GB"},
                ],
                "nvlink": {"pairs": [[0, 1, 7]]},
            },
            "wired with 7 NVLinks but Tesla V100-SXM2-16GB has 6",
        ),
        ({"numa_nodes": {"0": {"cpus": "zero"}}}, "numa_nodes.0.cpus: not a cpulist"),
        ({"faults": {"init_error": "no_such_thing"}}, "faults.init_error: unknown NVML error"),
        ({"pcie_levels": {"0-1": "PIX"}}, "pcie_levels.0-1"),
    ],
)
def test_a_bad_spec_is_an_input_format_error_naming_the_key(change, message):
    with pytest.raises(InputFormatError, match=message):
        machine_spec_from_dict({**_MINIMAL, **change}, source="bad.yaml")


def test_mig_profiles_parse_gpu_and_compute_slices():
    assert (parse_mig_profile("3g.40gb").gi_slices, parse_mig_profile("3g.40gb").ci_slices) == (
        3,
        3,
    )
    assert parse_mig_profile("1c.3g.40gb").ci_slices == 1
    with pytest.raises(ValueError):
        parse_mig_profile("3g")


# ---------------------------------------------------------------- every NVML name in use
# The tests above compare what the fake *defines* with pynvml. These read the source of the
# agent's NVML package and of the simulator (AST) for every NVML name they *use* (functions
# called through the wrapper or on the library, constants, struct fields, error classes) and
# hold each to the real pynvml, so that a name the fake invents, or one a newer pynvml
# renamed, fails here and not on a GPU node.
_NVML_PACKAGES = ("agent/hw/nvml", "agent/hw/sim")
_NVML_NAME = re.compile(r"^(nvml[A-Z]\w*|NVML_[A-Z0-9_]*[A-Z0-9]|NVMLError(_\w+)?|c_nvml\w+|nvmlEventType\w+)$")
#: a name made in an f-string: its fixed part
_NVML_PREFIX = re.compile(r"^(NVML_|nvml|c_nvml)\w*$")
#: the wrapper methods taking an NVML function's name: (method, where the name is, how many
#: arguments the wrapper adds itself)
_WRAPPERS = {"call": (0, 0), "_call": (1, 0), "ask": (0, 1)}


def _nvml_sources() -> list[tuple[str, ast.Module]]:
    root = pathlib.Path(__file__).resolve().parent.parent
    files = sorted(p for pkg in _NVML_PACKAGES for p in (root / pkg).glob("*.py"))
    assert files
    return [(str(p.relative_to(root)), ast.parse(p.read_text(), str(p))) for p in files]


def _used_names() -> tuple[dict[str, set[str]], dict[str, set[tuple[str, int]]], dict[str, set[str]]]:
    """(NVML name -> files using it, function -> {(file, positional argument count)},
    camelCase attribute read -> files) over the agent's NVML package and the simulator. A
    name made in an f-string (``f"NVML_BRAND_{suffix}"``) is kept as a pattern,
    ``NVML_BRAND_*``."""
    names: dict[str, set[str]] = {}
    arities: dict[str, set[tuple[str, int]]] = {}
    fields: dict[str, set[str]] = {}
    for path, tree in _nvml_sources():
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        in_fstrings = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in n.values}
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.Constant) \
                    and _NVML_PREFIX.match(str(node.values[0].value)):
                pattern = "".join(re.escape(v.value) if isinstance(v, ast.Constant) else "*" for v in node.values)
                names.setdefault(pattern.replace("\\", ""), set()).add(path)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings \
                    and _NVML_NAME.match(node.value):
                names.setdefault(node.value, set()).add(path)
            elif isinstance(node, ast.Attribute) and _NVML_NAME.match(node.attr) and node.attr not in defined \
                    and (not node.attr.startswith("nvml") or id(node) in called or node.attr.startswith("nvmlEvent")):
                names.setdefault(node.attr, set()).add(path)
            elif isinstance(node, ast.Attribute) and re.fullmatch(r"[a-z]+[A-Z]\w*", node.attr) \
                    and id(node) not in called and node.attr not in defined:
                fields.setdefault(node.attr, set()).add(path)
            if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            func = node.func
            method = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if method in _WRAPPERS and path.startswith("agent/hw/nvml"):
                at, added = _WRAPPERS[method]
                if len(node.args) > at and isinstance(node.args[at], ast.Constant) and str(node.args[at].value).startswith("nvml"):
                    arities.setdefault(node.args[at].value, set()).add((path, len(node.args) - at - 1 + added))
            elif isinstance(func, ast.Attribute) and func.attr.startswith("nvml") and path.startswith("agent/hw/nvml"):
                arities.setdefault(func.attr, set()).add((path, len(node.args)))
    return names, arities, fields


_NAMES, _ARITIES, _FIELDS = _used_names()
_REAL_FIELDS = {f[0] for n in dir(pynvml) if isinstance(getattr(pynvml, n), type)
                and issubclass(getattr(pynvml, n), (ctypes.Structure, ctypes.Union))
                for f in getattr(getattr(pynvml, n), "_fields_", ())}


def test_the_source_scan_finds_the_nvml_names_in_use():
    # a scan that finds nothing would pass every test below
    assert {"nvmlDeviceGetNvLinkState", "NVML_FEATURE_ENABLED", "nvmlEventTypeXidCriticalError",
            "c_nvmlGpuFabricInfoV_t", "NVMLError"} <= set(_NAMES)
    assert {"nvmlDeviceGetTopologyCommonAncestor", "nvmlDeviceGetPersistenceMode", "nvmlInit"} <= set(_ARITIES)
    assert {"busId", "clusterUuid", "gpuInstanceSliceCount", "eventData"} <= set(_FIELDS)


@pytest.mark.parametrize("name", sorted(_NAMES))
def test_every_nvml_name_the_agent_or_the_simulator_uses_exists_in_pynvml(name):
    if "*" in name:
        matching = [n for n in dir(pynvml) if re.fullmatch(name.replace("*", r"\w+"), n)]
        assert matching, f"pynvml has no name like {name} (made in {sorted(_NAMES[name])})"
        return
    if name in _REAL_FIELDS:  # a struct field named like a function (nvmlReturn): the test below
        return
    assert hasattr(pynvml, name), f"pynvml has no {name} (used in {sorted(_NAMES[name])})"
    fake = getattr(FakeNvml, name, None)
    real = getattr(pynvml, name)
    if fake is not None and isinstance(real, int) and not isinstance(real, bool):
        assert fake == real, f"{name}: the fake says {fake}, pynvml {real}"


@pytest.mark.parametrize("name", sorted(_ARITIES))
def test_every_nvml_call_passes_as_many_arguments_as_pynvml_takes(name):
    real = getattr(pynvml, name)
    params = list(inspect.signature(real).parameters.values())
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params), name
    required = sum(1 for p in params if p.default is p.empty)
    for path, count in sorted(_ARITIES[name]):
        assert required <= count <= len(params), (
            f"{path} calls {name} with {count} arguments; pynvml's takes {[p.name for p in params]}")
    fake = getattr(FakeNvml, name, None)
    if fake is not None:  # and the fake answers the same call (parameter names: the test above)
        fake_params = list(inspect.signature(fake).parameters)[1:]
        assert fake_params == [p.name for p in params]


@pytest.mark.parametrize("field", sorted(_FIELDS))
def test_every_struct_field_the_agent_reads_is_a_field_of_a_pynvml_struct(field):
    assert field in _REAL_FIELDS, f"{field} (read in {sorted(_FIELDS[field])}) is no field of a pynvml struct"


@pytest.mark.parametrize("name", sorted(ERROR_CLASSES))
def test_every_fake_error_class_has_pynvmls_class_hierarchy(name):
    def lineage(cls: type) -> list[str]:
        return [c.__name__ for c in cls.__mro__ if c not in (Exception, BaseException, object)]

    assert lineage(getattr(FakeNvml, name)) == lineage(getattr(pynvml, name))
    assert issubclass(getattr(FakeNvml, name), FakeNvml.NVMLError)


def test_the_library_mismatch_error_the_wrapper_recognises_is_pynvmls():
    # agent/hw/nvml/calls.py recognises it by name (pynvml raises it for a function the
    # driver lacks): it must exist under that name and not be an NVMLError
    assert pynvml.NVMLLibraryMismatchError.__name__ == "NVMLLibraryMismatchError"
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)


def test_the_fake_answers_every_call_as_a_real_h200_did(tmp_path):
    """The agent's NVML calls on the fake of the lent H200 VM give the same kinds of outcome
    (success and its type, or the NVMLError class) as on the real GPU
    (tests/fixtures/real_gpu/README.md). The real one differed three ways before: NVLink
    ports NotSupported, not disabled, on a GPU with none wired; fabric info answered with
    state NOT_SUPPORTED, not refused; every event type supported."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    fixtures = root / "tests" / "fixtures" / "real_gpu"
    tool = root / "bench" / "real_gpu" / "nvml_calls.py"
    fake = tmp_path / "fake.json"
    subprocess.run([sys.executable, str(tool), "--simulate", str(fixtures / "h200-vm.yaml"), "--out", str(fake)],
                   check=True, timeout=120, cwd=root)
    result = subprocess.run([sys.executable, str(tool), "--compare", str(fixtures / "h200-vm-nvml-calls.json"),
                             str(fake)], capture_output=True, text=True, timeout=60, cwd=root)
    # calls the agent makes since that recording (the MIG geometry of a MIG-capable GPU):
    # the next lent GPU records them; any other difference fails
    newer = {"nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstancePossiblePlacements"}
    found = [line for line in result.stdout.splitlines()
             if not (line.split(":")[0] in newer and line.endswith("not on the real GPU"))]
    assert found == [] or found == ["no differences"], result.stdout
