"""A faithful fake of the ``pynvml`` module (package ``nvidia-ml-py``), driven by a machine
spec, so the real NVML code path (:mod:`agent.hw.nvml`) runs in tests and simulations.

:class:`FakeNvml` is a module-like object: it has pynvml's function names with the same
parameter names, pynvml's ``NVML_*`` constants with the same values, and exception classes
``NVMLError`` / ``NVMLError_<Name>`` with the same names and ``.value`` codes (``NVMLError(3)``
is an ``NVMLError_NotSupported``, as in pynvml). ``tests/test_fake_nvml.py`` checks all of
that against the installed pynvml. Return shapes follow the installed pynvml (13.x):
``nvmlDeviceGetPciInfo(h).busId`` is a ``str``; strings are ``str``; structs have the same
attribute names as pynvml's ctypes structs (the two that callers allocate and pass by
reference, ``c_nvmlGpuFabricInfoV_t``/``c_nvmlGpuFabricInfo_t``, and the field-value array
are real ctypes structures with pynvml's layout).

Hardware behaviour modelled, as on real machines:

* ``NVML_NVLINK_MAX_LINKS`` (36) link indices per GPU: an index outside it raises
  ``NVMLError_InvalidArgument``; one the GPU model does not have raises
  ``NVMLError_NotSupported``; a link the model has but the spec does not wire is inactive
  (state 0) and its remote end is not supported.
* A lost GPU raises ``NVMLError_GpuIsLost`` on every call with its handle (or one of its
  MIG devices' handles); getting its handle by index still works.
* Events are delivered only to event sets registered for that GPU and type; waits honour
  their timeout and raise ``NVMLError_Timeout`` when nothing arrives.
* Telemetry is deterministic per (spec name, GPU index) unless set with :meth:`set_value`;
  counters (energy, NVLink traffic) grow on every read.

Fault injection: :meth:`FakeNvml.lose_gpu`, :meth:`recover_gpu`, :meth:`make_unsupported`,
:meth:`make_missing`, :meth:`fail`, :meth:`fail_init`, :meth:`inject_xid`,
:meth:`inject_ecc_dbe`, :meth:`set_value`.

The machine spec model (:class:`MachineSpec`) and its YAML/JSON reader
(:func:`machine_spec_from_dict`, :func:`load_machine_spec`) live here too; the format is
documented on :func:`machine_spec_from_dict`.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import json
import os
import re
import string
import threading
import uuid as uuid_mod
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.errors import InputFormatError

# =========================================================================== constants
#: Every pynvml constant the fake defines, with pynvml's value (checked by a test).
CONSTANTS: dict[str, int] = {
    "NVML_SUCCESS": 0,
    # errors
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_ALREADY_INITIALIZED": 5,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_INSUFFICIENT_SIZE": 7,
    "NVML_ERROR_INSUFFICIENT_POWER": 8,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_IRQ_ISSUE": 11,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_CORRUPTED_INFOROM": 14,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_OPERATING_SYSTEM": 17,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_IN_USE": 19,
    "NVML_ERROR_MEMORY": 20,
    "NVML_ERROR_NO_DATA": 21,
    "NVML_ERROR_INSUFFICIENT_RESOURCES": 23,
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": 25,
    "NVML_ERROR_UNKNOWN": 999,
    # topology (nvmlGpuTopologyLevel_t)
    "NVML_TOPOLOGY_INTERNAL": 0,
    "NVML_TOPOLOGY_SINGLE": 10,
    "NVML_TOPOLOGY_MULTIPLE": 20,
    "NVML_TOPOLOGY_HOSTBRIDGE": 30,
    "NVML_TOPOLOGY_NODE": 40,
    "NVML_TOPOLOGY_SYSTEM": 50,
    # NVLink
    "NVML_NVLINK_MAX_LINKS": 36,
    "NVML_NVLINK_DEVICE_TYPE_GPU": 0,
    "NVML_NVLINK_DEVICE_TYPE_IBMNPU": 1,
    "NVML_NVLINK_DEVICE_TYPE_SWITCH": 2,
    "NVML_NVLINK_DEVICE_TYPE_UNKNOWN": 255,
    "NVML_NVLINK_VERSION_INVALID": 0,
    "NVML_NVLINK_VERSION_1_0": 1,
    "NVML_NVLINK_VERSION_2_0": 2,
    "NVML_NVLINK_VERSION_3_0": 4,
    "NVML_NVLINK_VERSION_4_0": 6,
    "NVML_NVLINK_VERSION_5_0": 7,
    # P2P
    "NVML_P2P_CAPS_INDEX_WRITE": 1,
    "NVML_P2P_CAPS_INDEX_NVLINK": 2,
    "NVML_P2P_CAPS_INDEX_ATOMICS": 3,
    "NVML_P2P_CAPS_INDEX_PCI": 4,
    "NVML_P2P_STATUS_OK": 0,
    "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED": 1,
    "NVML_P2P_STATUS_GPU_NOT_SUPPORTED": 2,
    "NVML_P2P_STATUS_NOT_SUPPORTED": 5,
    # features, MIG
    "NVML_FEATURE_DISABLED": 0,
    "NVML_FEATURE_ENABLED": 1,
    "NVML_DEVICE_MIG_DISABLE": 0,
    "NVML_DEVICE_MIG_ENABLE": 1,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE": 0,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE": 1,
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE": 2,
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE": 3,
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE": 4,
    # architectures
    "NVML_DEVICE_ARCH_VOLTA": 5,
    "NVML_DEVICE_ARCH_TURING": 6,
    "NVML_DEVICE_ARCH_AMPERE": 7,
    "NVML_DEVICE_ARCH_ADA": 8,
    "NVML_DEVICE_ARCH_HOPPER": 9,
    "NVML_DEVICE_ARCH_BLACKWELL": 10,
    "NVML_DEVICE_ARCH_UNKNOWN": 0xFFFFFFFF,
    # telemetry enums
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_CLOCK_GRAPHICS": 0,
    "NVML_CLOCK_SM": 1,
    "NVML_CLOCK_MEM": 2,
    "NVML_CLOCK_VIDEO": 3,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_VOLATILE_ECC": 0,
    "NVML_AGGREGATE_ECC": 1,
    "NVML_PCIE_UTIL_TX_BYTES": 0,
    "NVML_PCIE_UTIL_RX_BYTES": 1,
    "nvmlMemory_v2": 0x2000028,
    "nvmlGpuFabricInfo_v2": 0x2000024,
    "NVML_GPU_FABRIC_UUID_LEN": 16,
    "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED": 0,
    "NVML_GPU_FABRIC_STATE_NOT_STARTED": 1,
    "NVML_GPU_FABRIC_STATE_IN_PROGRESS": 2,
    "NVML_GPU_FABRIC_STATE_COMPLETED": 3,
    # field values
    "NVML_VALUE_TYPE_DOUBLE": 0,
    "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
    "NVML_VALUE_TYPE_SIGNED_INT": 5,
    "NVML_FI_DEV_ECC_SBE_VOL_TOTAL": 3,
    "NVML_FI_DEV_ECC_DBE_VOL_TOTAL": 4,
    "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 38,
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": 45,
    "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": 52,
    "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": 59,
    "NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL": 66,
    "NVML_FI_DEV_MEMORY_TEMP": 82,
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,
    "NVML_FI_DEV_NVLINK_LINK_COUNT": 91,
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 94,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 138,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 139,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX": 140,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX": 141,
    "NVML_FI_DEV_POWER_INSTANT": 186,
    # events
    "nvmlEventTypeSingleBitEccError": 1,
    "nvmlEventTypeDoubleBitEccError": 2,
    "nvmlEventTypePState": 4,
    "nvmlEventTypeXidCriticalError": 8,
    "nvmlEventTypeClock": 16,
    "nvmlEventTypeNone": 0,
    "nvmlEventTypeAll": 65439,
    # GPM
    "NVML_GPM_METRICS_GET_VERSION": 1,
    "NVML_GPM_SUPPORT_VERSION": 1,
    "NVML_GPM_METRIC_GRAPHICS_UTIL": 1,
    "NVML_GPM_METRIC_SM_UTIL": 2,
    "NVML_GPM_METRIC_SM_OCCUPANCY": 3,
    "NVML_GPM_METRIC_INTEGER_UTIL": 4,
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": 5,
    "NVML_GPM_METRIC_DRAM_BW_UTIL": 10,
    "NVML_GPM_METRIC_FP64_UTIL": 11,
    "NVML_GPM_METRIC_FP32_UTIL": 12,
    "NVML_GPM_METRIC_FP16_UTIL": 13,
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": 20,
    "NVML_GPM_METRIC_PCIE_RX_PER_SEC": 21,
    "NVML_GPM_METRIC_MAX": 477,
}
_C = CONSTANTS  # short alias for the implementation below
_NO_ID = 0xFFFFFFFF  # NVML's "no GPU/compute instance" in event and process records


# =========================================================================== exceptions
class NVMLError(Exception):
    """pynvml's base error: ``NVMLError(code)`` returns the subclass for ``code``."""

    _valClassMapping: dict[int, type] = {}
    _errcode_to_string: dict[int, str] = {
        1: "Uninitialized",
        2: "Invalid Argument",
        3: "Not Supported",
        4: "Insufficient Permissions",
        5: "Already Initialized",
        6: "Not Found",
        7: "Insufficient Size",
        8: "Insufficient External Power",
        9: "Driver Not Loaded",
        10: "Timeout",
        11: "Interrupt Request Issue",
        12: "NVML Shared Library Not Found",
        13: "Function Not Found",
        14: "Corrupted infoROM",
        15: "GPU is lost",
        16: "GPU requires restart",
        17: "The operating system has blocked the request.",
        18: "RM has detected an NVML/RM version mismatch.",
        20: "Insufficient Memory",
        999: "Unknown Error",
    }

    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _make_error_classes() -> dict[str, type]:
    classes: dict[str, type] = {}
    for name, value in CONSTANTS.items():
        if not name.startswith("NVML_ERROR_"):
            continue
        # NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost, exactly as pynvml names them
        cls_name = "NVMLError_" + string.capwords(name[len("NVML_ERROR_") :], "_").replace("_", "")

        def new(cls: type, *args: object, _value: int = value) -> NVMLError:
            return NVMLError.__new__(cls, _value)

        cls = type(cls_name, (NVMLError,), {"__new__": new, "__module__": __name__})
        NVMLError._valClassMapping[value] = cls
        classes[cls_name] = cls
    return classes


ERROR_CLASSES: dict[str, type] = _make_error_classes()
globals().update(ERROR_CLASSES)


def _err(name: str) -> NVMLError:
    return NVMLError(_C[name])


# =========================================================================== structs
class _Struct:
    """A plain record with pynvml's attribute names (``_fields`` lists them in order)."""

    _fields: tuple[str, ...] = ()

    def __init__(self, **values: Any) -> None:
        for name in self._fields:
            setattr(self, name, values.pop(name, 0))
        if values:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(values)}")

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"


def _struct(name: str, *fields: str) -> type:
    return type(name, (_Struct,), {"_fields": fields, "__module__": __name__})


nvmlPciInfo_t = _struct(
    "nvmlPciInfo_t",
    "busIdLegacy",
    "domain",
    "bus",
    "device",
    "pciDeviceId",
    "pciSubSystemId",
    "busId",
)
c_nvmlMemory_t = _struct("c_nvmlMemory_t", "total", "free", "used")
c_nvmlMemory_v2_t = _struct("c_nvmlMemory_v2_t", "version", "total", "reserved", "free", "used")
c_nvmlUtilization_t = _struct("c_nvmlUtilization_t", "gpu", "memory")
c_nvmlEventData_t = _struct(
    "c_nvmlEventData_t", "device", "eventType", "eventData", "gpuInstanceId", "computeInstanceId"
)
c_nvmlDeviceAttributes = _struct(
    "c_nvmlDeviceAttributes",
    "multiprocessorCount",
    "sharedCopyEngineCount",
    "sharedDecoderCount",
    "sharedEncoderCount",
    "sharedJpegCount",
    "sharedOfaCount",
    "gpuInstanceSliceCount",
    "computeInstanceSliceCount",
    "memorySizeMB",
)
c_nvmlGpuInstanceProfileInfo_v2_t = _struct(
    "c_nvmlGpuInstanceProfileInfo_v2_t",
    "version",
    "id",
    "isP2pSupported",
    "sliceCount",
    "instanceCount",
    "multiprocessorCount",
    "copyEngineCount",
    "decoderCount",
    "encoderCount",
    "jpegCount",
    "ofaCount",
    "memorySizeMB",
    "name",
)
c_nvmlProcessInfo_t = _struct(
    "c_nvmlProcessInfo_t", "pid", "usedGpuMemory", "gpuInstanceId", "computeInstanceId"
)
c_nvmlGpmSupport_t = _struct("c_nvmlGpmSupport_t", "version", "isSupportedDevice")
c_metricInfo_t = _struct("c_metricInfo_t", "shortName", "longName", "unit")
c_nvmlGpmMetric_t = _struct("c_nvmlGpmMetric_t", "metricId", "nvmlReturn", "value", "metricInfo")


class c_nvmlGpmMetricsGet_t(_Struct):
    """Caller-allocated request of :meth:`FakeNvml.nvmlGpmMetricsGet` (pynvml's field names;
    ``metrics`` holds ``NVML_GPM_METRIC_MAX`` entries)."""

    _fields = ("version", "numMetrics", "sample1", "sample2", "metrics")
    metrics: list[Any]  # set by _Struct.__init__ (0 when not given)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if not self.metrics:
            self.metrics = [
                c_nvmlGpmMetric_t(metricInfo=c_metricInfo_t())
                for _ in range(_C["NVML_GPM_METRIC_MAX"])
            ]


class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    """pynvml's layout: callers allocate it and pass ``byref(info)``."""

    _fields_ = [
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
    ]


class c_nvmlGpuFabricInfoV_t(ctypes.Structure):
    """pynvml's layout: callers set ``version = nvmlGpuFabricInfo_v2`` and pass ``byref``."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]

    def __init__(self) -> None:
        super().__init__(version=CONSTANTS["nvmlGpuFabricInfo_v2"])


class c_nvmlValue_t(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t(ctypes.Structure):
    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


#: Struct classes the fake exposes under pynvml's names (checked against pynvml by a test).
STRUCTS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        nvmlPciInfo_t,
        c_nvmlMemory_t,
        c_nvmlMemory_v2_t,
        c_nvmlUtilization_t,
        c_nvmlEventData_t,
        c_nvmlDeviceAttributes,
        c_nvmlGpuInstanceProfileInfo_v2_t,
        c_nvmlGpmSupport_t,
        c_nvmlGpmMetric_t,
        c_nvmlGpmMetricsGet_t,
        c_nvmlGpuFabricInfo_t,
        c_nvmlGpuFabricInfoV_t,
        c_nvmlValue_t,
        c_nvmlFieldValue_t,
        c_metricInfo_t,
    )
}


# =========================================================================== GPU models
@dataclass(frozen=True)
class GpuModel:
    """What NVML reports for one product; a spec may override any of it per GPU."""

    name: str
    memory_mib: int
    compute_capability: tuple[int, int]
    architecture: str  # volta | turing | ampere | ada | hopper | blackwell
    nvlinks: int  # NVLink ports the chip has (0: none)
    mig: bool = False  # MIG capable
    hbm: bool = True  # has a memory temperature sensor and row remapping (HBM)
    pci_device_id: int = 0x000010DE  # (device << 16) | vendor, as NVML packs it
    tdp_w: int = 300
    max_sm_clock_mhz: int = 1410
    mem_clock_mhz: int = 1215
    sm_count: int = 108

    @property
    def arch_constant(self) -> int:
        return _C.get(
            f"NVML_DEVICE_ARCH_{self.architecture.upper()}", _C["NVML_DEVICE_ARCH_UNKNOWN"]
        )

    @property
    def nvlink_version(self) -> int:
        return {
            "volta": _C["NVML_NVLINK_VERSION_2_0"],
            "ampere": _C["NVML_NVLINK_VERSION_3_0"],
            "hopper": _C["NVML_NVLINK_VERSION_4_0"],
            "blackwell": _C["NVML_NVLINK_VERSION_5_0"],
        }.get(self.architecture, _C["NVML_NVLINK_VERSION_INVALID"])


#: Real product names and what NVML reports for them (memory as nvidia-smi shows it).
GPU_MODELS: dict[str, GpuModel] = {
    m.name: m
    for m in (
        GpuModel(
            "Tesla V100-SXM2-16GB",
            16160,
            (7, 0),
            "volta",
            6,
            pci_device_id=0x1DB110DE,
            max_sm_clock_mhz=1530,
            mem_clock_mhz=877,
            sm_count=80,
        ),
        GpuModel(
            "Tesla V100-SXM3-32GB",
            32510,
            (7, 0),
            "volta",
            6,
            pci_device_id=0x1DB810DE,
            tdp_w=350,
            max_sm_clock_mhz=1597,
            mem_clock_mhz=958,
            sm_count=80,
        ),
        GpuModel(
            "NVIDIA A100-SXM4-40GB",
            40960,
            (8, 0),
            "ampere",
            12,
            mig=True,
            pci_device_id=0x20B010DE,
            tdp_w=400,
        ),
        GpuModel(
            "NVIDIA A100-SXM4-80GB",
            81920,
            (8, 0),
            "ampere",
            12,
            mig=True,
            pci_device_id=0x20B210DE,
            tdp_w=400,
            mem_clock_mhz=1593,
        ),
        GpuModel(
            "NVIDIA A100 80GB PCIe",
            81920,
            (8, 0),
            "ampere",
            12,
            mig=True,
            pci_device_id=0x20B510DE,
            mem_clock_mhz=1512,
        ),
        GpuModel(
            "NVIDIA H100 80GB HBM3",
            81559,
            (9, 0),
            "hopper",
            18,
            mig=True,
            pci_device_id=0x233010DE,
            tdp_w=700,
            max_sm_clock_mhz=1980,
            mem_clock_mhz=2619,
            sm_count=132,
        ),
        GpuModel(
            "NVIDIA H200",
            143771,
            (9, 0),
            "hopper",
            18,
            mig=True,
            pci_device_id=0x233510DE,
            tdp_w=700,
            max_sm_clock_mhz=1980,
            mem_clock_mhz=3201,
            sm_count=132,
        ),
        GpuModel(
            "NVIDIA GB200",
            189471,
            (10, 0),
            "blackwell",
            18,
            mig=True,
            pci_device_id=0x294110DE,
            tdp_w=1200,
            max_sm_clock_mhz=2062,
            mem_clock_mhz=3996,
            sm_count=152,
        ),
        GpuModel(
            "NVIDIA L40S",
            46068,
            (8, 9),
            "ada",
            0,
            hbm=False,
            pci_device_id=0x26B910DE,
            tdp_w=350,
            max_sm_clock_mhz=2520,
            mem_clock_mhz=9001,
            sm_count=142,
        ),
        GpuModel(
            "NVIDIA A10",
            23028,
            (8, 6),
            "ampere",
            0,
            hbm=False,
            pci_device_id=0x223610DE,
            tdp_w=150,
            max_sm_clock_mhz=1695,
            mem_clock_mhz=6251,
            sm_count=72,
        ),
    )
}


def _generic_model(name: str, nvlinks: int) -> GpuModel:
    return GpuModel(name, 16384, (8, 0), "ampere", nvlinks, hbm=False)


# =========================================================================== machine spec
@dataclass(frozen=True)
class MigDeviceSpec:
    """One MIG device: ``profile`` like ``"3g.40gb"`` or ``"1c.3g.40gb"``."""

    profile: str
    gi_slices: int
    ci_slices: int
    memory_gb: int


@dataclass(frozen=True)
class GpuSpec:
    index: int
    model: GpuModel
    bus_id: str  # NVML spelling
    uuid: str
    numa_node: int | None = None
    cpulist: str | None = None
    host_bridge: str = "pci0000:00"
    switches: tuple[str, ...] = ()
    minor_number: int = 0
    mig_enabled: bool = False
    mig_devices: tuple[MigDeviceSpec, ...] = ()
    fabric_cluster_uuid: str | None = None
    fabric_clique_id: int | None = None
    gpu_numa_id: int | None = None  # nvmlDeviceGetNumaNodeId (GPU memory node on Grace)
    board: str | None = None  # GPUs on one multi-GPU board are NVML_TOPOLOGY_INTERNAL


@dataclass(frozen=True)
class NicSpec:
    name: str
    bus_id: str  # any spelling
    numa_node: int | None = None
    host_bridge: str = "pci0000:00"
    switches: tuple[str, ...] = ()


@dataclass(frozen=True)
class NvSwitchSpec:
    links_per_gpu: int
    bus_ids: tuple[str, ...]  # NVML spelling; links are spread over them
    gpus: tuple[int, ...] | None = None  # None: every GPU


@dataclass(frozen=True)
class FaultSpec:
    lost_gpus: tuple[int, ...] = ()
    unsupported: tuple[tuple[str, int | None], ...] = ()
    init_error: str | None = None  # an NVML_ERROR_* suffix: "library_not_found"


@dataclass(frozen=True)
class MachineSpec:
    """Everything the fake NVML and the fake sysfs tree of one machine are built from."""

    name: str
    gpus: tuple[GpuSpec, ...]
    numa_nodes: Mapping[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    nics: tuple[NicSpec, ...] = ()
    nvlink_pairs: tuple[tuple[int, int, int], ...] = ()
    nvswitch: NvSwitchSpec | None = None
    pcie_levels: Mapping[tuple[int, int], int] = field(default_factory=dict)  # NVML values
    product_name: str | None = None
    driver_version: str = "550.54.15"
    cuda_driver_version: int = 12040
    faults: FaultSpec = FaultSpec()
    description: str = ""


_BUS_RE = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def nvml_bus_id(bus_id: str) -> str:
    """Either spelling -> NVML's ``00000000:3B:00.0``; ValueError otherwise."""
    m = _BUS_RE.match(str(bus_id).strip())
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(m[1], 16):08X}:{int(m[2], 16):02X}:{int(m[3], 16):02X}.{m[4]}"


_PROFILE_RE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb$")


def parse_mig_profile(profile: str) -> MigDeviceSpec:
    """``"1g.10gb"`` / ``"1c.3g.40gb"`` -> :class:`MigDeviceSpec`; ValueError otherwise."""
    m = _PROFILE_RE.match(profile.strip())
    if m is None:
        raise ValueError(
            f"not a MIG profile: {profile!r} (expected e.g. '3g.40gb' or '1c.3g.40gb')"
        )
    gi = int(m[2])
    ci = int(m[1]) if m[1] else gi
    if not (1 <= ci <= gi <= 8):
        raise ValueError(f"MIG profile {profile!r}: slices out of range")
    return MigDeviceSpec(profile.strip(), gi, ci, int(m[3]))


def synthetic_gpu_uuid(machine: str, index: int) -> str:
    """A stable, realistic-looking GPU UUID for GPU ``index`` of ``machine``."""
    return "GPU-" + str(
        uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"gpu-topology-agent/{machine}/{index}")
    )


def _mig_uuid(gpu_uuid: str, slot: int) -> str:
    return "MIG-" + str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"{gpu_uuid}/mig/{slot}"))


_LEVEL_NAMES = {
    "BOARD": 0,
    "INTERNAL": 0,
    "PIX": 10,
    "SINGLE": 10,
    "PXB": 20,
    "MULTIPLE": 20,
    "PHB": 30,
    "HOSTBRIDGE": 30,
    "NODE": 40,
    "SYS": 50,
    "SYSTEM": 50,
}


class _SpecReader:
    """Reads a spec mapping with error messages naming the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> InputFormatError:
        return InputFormatError(f"{self.source}: {where}: {what}")

    def mapping(self, value: object, where: str) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(where, f"expected a mapping, got {type(value).__name__}")
        return value

    def seq(self, value: object, where: str) -> Sequence[Any]:
        if value is None:
            return []
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise self.fail(where, f"expected a list, got {type(value).__name__}")
        return value

    def int_(self, value: object, where: str, *, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(where, f"must be >= {minimum}, got {value}")
        return value

    def str_(self, value: object, where: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(where, f"expected a non-empty string, got {value!r}")
        return value.strip()

    def bus_id(self, value: object, where: str) -> str:
        try:
            return nvml_bus_id(self.str_(value, where))
        except ValueError:
            raise self.fail(where, f"not a PCI bus id: {value!r} (e.g. '0000:3b:00.0')") from None

    def cpulist(self, value: object, where: str) -> str:
        text = self.str_(str(value), where) if isinstance(value, int) else self.str_(value, where)
        if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
            raise self.fail(where, f"not a cpulist: {value!r} (e.g. '0-19,40-59')")
        return text


_GPU_KEYS = {
    "model",
    "name",
    "bus_id",
    "uuid",
    "numa_node",
    "cpus",
    "host_bridge",
    "switches",
    "minor_number",
    "memory_mib",
    "compute_capability",
    "nvlinks",
    "mig",
    "fabric",
    "gpu_numa_id",
    "board",
}
_TOP_KEYS = {
    "name",
    "description",
    "product_name",
    "driver_version",
    "cuda_driver_version",
    "numa_nodes",
    "gpu_defaults",
    "gpus",
    "nvlink",
    "nics",
    "pcie_levels",
    "faults",
}


def machine_spec_from_dict(data: Mapping[str, Any], source: str = "<spec>") -> MachineSpec:
    """Build a :class:`MachineSpec` from a YAML/JSON mapping; InputFormatError names the key.

    Format (keys not listed are rejected)::

        name: dgx-h100                      # required
        description: free text
        product_name: DGX H100              # DMI product name (sysfs)
        driver_version: "550.54.15"
        cuda_driver_version: 12040          # or "12.4"
        numa_nodes:                         # id: {cpus: cpulist, distances: [..]}
          0: {cpus: "0-55,112-167", distances: [10, 21]}
        gpu_defaults: {model: "NVIDIA H100 80GB HBM3"}   # merged under every GPU entry
        gpus:                               # in NVML index order
          - bus_id: "0000:1b:00.0"          # either spelling
            model: "NVIDIA H100 80GB HBM3"  # a known model (GPU_MODELS) or any name
            numa_node: 0                    # sysfs numa_node (null: firmware gave none)
            cpus: "0-55,112-167"            # local_cpulist; default: its NUMA node's cpus
            host_bridge: "pci0000:15"       # PCIe tree, as sysfs PciDeviceSpec
            switches: [sw-a, sw-a1]         #   outermost first
            # optional: uuid, minor_number, memory_mib, compute_capability: [9, 0],
            # nvlinks (ports), mig: [3g.40gb, 1g.10gb] (enables MIG; [] = enabled, empty),
            # fabric: {cluster_uuid: ..., clique_id: 1}, gpu_numa_id, board
        nvlink:
          pairs: [[0, 1, 2], ...]           # a, b, bonded links (direct NVLinks/bridges)
          nvswitch: {links_per_gpu: 18, bus_ids: [...], gpus: [...]}  # all GPUs by default
        nics:
          - {name: mlx5_0, bus_id: "0000:1a:00.0", numa_node: 0, host_bridge: ..., switches: [..]}
        pcie_levels: {"0-1": PIX}           # overrides NVML's common ancestor for GPU pairs
        faults:
          lost_gpus: [3]
          unsupported: [{function: nvmlDeviceGetGpuFabricInfoV, gpu: 0}]  # gpu optional
          init_error: library_not_found     # nvmlInit fails with this NVML error
    """
    r = _SpecReader(source)
    data = r.mapping(data, "top level")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise r.fail("top level", f"unknown keys {unknown}; expected some of {sorted(_TOP_KEYS)}")
    name = r.str_(data.get("name"), "name")

    numa: dict[int, tuple[str, tuple[int, ...]]] = {}
    raw_numa = r.mapping(data.get("numa_nodes"), "numa_nodes")
    for key, node in raw_numa.items():
        where = f"numa_nodes.{key}"
        try:
            node_id = int(key)
        except (TypeError, ValueError):
            raise r.fail(where, "NUMA node ids must be integers") from None
        node = r.mapping(node, where)
        cpus = r.cpulist(node.get("cpus"), f"{where}.cpus")
        distances = tuple(
            r.int_(d, f"{where}.distances") for d in r.seq(node.get("distances"), where)
        )
        numa[node_id] = (cpus, distances)
    if numa:
        for node_id, (_, distances) in numa.items():
            if distances and len(distances) != len(numa):
                raise r.fail(f"numa_nodes.{node_id}.distances", f"expected {len(numa)} values")
        numa = {
            k: (c, d or tuple(10 if j == k else 21 for j in sorted(numa)))
            for k, (c, d) in numa.items()
        }

    defaults = r.mapping(data.get("gpu_defaults"), "gpu_defaults")
    raw_gpus = r.seq(data.get("gpus"), "gpus")
    if not raw_gpus:
        raise r.fail("gpus", "a machine needs at least one GPU")
    gpus: list[GpuSpec] = []
    for i, raw in enumerate(raw_gpus):
        where = f"gpus[{i}]"
        entry = {**defaults, **r.mapping(raw, where)}
        unknown = sorted(set(entry) - _GPU_KEYS)
        if unknown:
            raise r.fail(where, f"unknown keys {unknown}; expected some of {sorted(_GPU_KEYS)}")
        model_name = r.str_(entry.get("model", entry.get("name", "NVIDIA GPU")), f"{where}.model")
        model = GPU_MODELS.get(model_name) or _generic_model(model_name, 0)
        overrides: dict[str, Any] = {}
        if "memory_mib" in entry:
            overrides["memory_mib"] = r.int_(entry["memory_mib"], f"{where}.memory_mib", minimum=1)
        if "compute_capability" in entry:
            cc = r.seq(entry["compute_capability"], f"{where}.compute_capability")
            if len(cc) != 2:
                raise r.fail(f"{where}.compute_capability", "expected [major, minor]")
            overrides["compute_capability"] = (
                r.int_(cc[0], f"{where}.compute_capability"),
                r.int_(cc[1], f"{where}.compute_capability"),
            )
        if "nvlinks" in entry:
            ports = r.int_(entry["nvlinks"], f"{where}.nvlinks", minimum=0)
            if ports > _C["NVML_NVLINK_MAX_LINKS"]:
                raise r.fail(
                    f"{where}.nvlinks", f"at most {_C['NVML_NVLINK_MAX_LINKS']} NVLinks per GPU"
                )
            overrides["nvlinks"] = ports
        if overrides:
            model = replace(model, **overrides)
        node = entry.get("numa_node")
        if node is not None:
            node = r.int_(node, f"{where}.numa_node", minimum=0)
            if numa and node not in numa:
                raise r.fail(f"{where}.numa_node", f"NUMA node {node} is not in numa_nodes")
        raw_cpus = entry.get("cpus")
        cpulist = (
            r.cpulist(raw_cpus, f"{where}.cpus")
            if raw_cpus is not None
            else (numa[node][0] if node is not None and node in numa else None)
        )
        mig_enabled = False
        mig: list[MigDeviceSpec] = []
        if entry.get("mig") is not None:
            if not model.mig:
                raise r.fail(f"{where}.mig", f"{model.name} is not MIG capable")
            mig_enabled = True
            for j, prof in enumerate(r.seq(entry["mig"], f"{where}.mig")):
                try:
                    mig.append(parse_mig_profile(r.str_(prof, f"{where}.mig[{j}]")))
                except ValueError as exc:
                    raise r.fail(f"{where}.mig[{j}]", str(exc)) from None
            if sum(d.gi_slices for d in mig) > 7 or len(mig) > 7:
                raise r.fail(f"{where}.mig", "more than 7 compute slices / devices on one GPU")
        fabric = r.mapping(entry.get("fabric"), f"{where}.fabric")
        clique = fabric.get("clique_id")
        gpus.append(
            GpuSpec(
                index=i,
                model=model,
                bus_id=r.bus_id(entry.get("bus_id"), f"{where}.bus_id"),
                uuid=r.str_(entry["uuid"], f"{where}.uuid")
                if entry.get("uuid")
                else synthetic_gpu_uuid(name, i),
                numa_node=node,
                cpulist=cpulist,
                host_bridge=r.str_(entry.get("host_bridge", "pci0000:00"), f"{where}.host_bridge"),
                switches=tuple(
                    r.str_(s, f"{where}.switches")
                    for s in r.seq(entry.get("switches"), f"{where}.switches")
                ),
                minor_number=r.int_(
                    entry.get("minor_number", i), f"{where}.minor_number", minimum=0
                ),
                mig_enabled=mig_enabled,
                mig_devices=tuple(mig),
                fabric_cluster_uuid=str(uuid_mod.UUID(str(fabric["cluster_uuid"])))
                if fabric.get("cluster_uuid")
                else None,
                fabric_clique_id=r.int_(clique, f"{where}.fabric.clique_id", minimum=0)
                if clique is not None
                else None,
                gpu_numa_id=r.int_(entry["gpu_numa_id"], f"{where}.gpu_numa_id", minimum=0)
                if entry.get("gpu_numa_id") is not None
                else None,
                board=str(entry["board"]) if entry.get("board") is not None else None,
            )
        )
    seen_bus: set[str] = set()
    for g in gpus:
        if g.bus_id in seen_bus:
            raise r.fail(f"gpus[{g.index}].bus_id", f"{g.bus_id} given twice")
        seen_bus.add(g.bus_id)

    n = len(gpus)
    nvlink = r.mapping(data.get("nvlink"), "nvlink")
    unknown = sorted(set(nvlink) - {"pairs", "nvswitch"})
    if unknown:
        raise r.fail("nvlink", f"unknown keys {unknown}; expected 'pairs' and/or 'nvswitch'")
    pairs: list[tuple[int, int, int]] = []
    seen_pairs: set[tuple[int, int]] = set()
    for j, raw in enumerate(r.seq(nvlink.get("pairs"), "nvlink.pairs")):
        where = f"nvlink.pairs[{j}]"
        item = r.seq(raw, where)
        if len(item) != 3:
            raise r.fail(where, "expected [gpu_a, gpu_b, links]")
        a, b, count = (r.int_(x, where, minimum=0) for x in item)
        if a == b or a >= n or b >= n or count < 1:
            raise r.fail(where, f"needs two distinct GPUs of 0..{n - 1} and at least one link")
        pair = (min(a, b), max(a, b))
        if pair in seen_pairs:
            raise r.fail(where, f"pair {pair[0]}-{pair[1]} given twice")
        seen_pairs.add(pair)
        pairs.append((pair[0], pair[1], count))
    switch: NvSwitchSpec | None = None
    if nvlink.get("nvswitch") is not None:
        sw = r.mapping(nvlink["nvswitch"], "nvlink.nvswitch")
        per_gpu = r.int_(sw.get("links_per_gpu"), "nvlink.nvswitch.links_per_gpu", minimum=1)
        bus_ids = tuple(
            r.bus_id(b, "nvlink.nvswitch.bus_ids")
            for b in r.seq(sw.get("bus_ids"), "nvlink.nvswitch.bus_ids")
        ) or tuple(f"00000000:{0xC0 + k:02X}:00.0" for k in range(4))
        members = sw.get("gpus")
        member_t = None
        if members is not None:
            member_t = tuple(
                r.int_(x, "nvlink.nvswitch.gpus", minimum=0)
                for x in r.seq(members, "nvlink.nvswitch.gpus")
            )
            if any(x >= n for x in member_t):
                raise r.fail("nvlink.nvswitch.gpus", f"GPU indices must be 0..{n - 1}")
        switch = NvSwitchSpec(per_gpu, bus_ids, member_t)
    # every GPU must have the ports its wiring uses
    used = [0] * n
    for a, b, count in pairs:
        used[a] += count
        used[b] += count
    if switch is not None:
        for i in switch.gpus if switch.gpus is not None else range(n):
            used[i] += switch.links_per_gpu
    for g in gpus:
        if used[g.index] > g.model.nvlinks:
            raise r.fail(
                f"gpus[{g.index}]",
                f"wired with {used[g.index]} NVLinks but {g.model.name} has {g.model.nvlinks}"
                " (set 'nvlinks' for another model)",
            )

    nics: list[NicSpec] = []
    for j, raw in enumerate(r.seq(data.get("nics"), "nics")):
        where = f"nics[{j}]"
        e = r.mapping(raw, where)
        nnode = e.get("numa_node")
        nics.append(
            NicSpec(
                name=r.str_(e.get("name"), f"{where}.name"),
                bus_id=r.bus_id(e.get("bus_id"), f"{where}.bus_id"),
                numa_node=r.int_(nnode, f"{where}.numa_node", minimum=0)
                if nnode is not None
                else None,
                host_bridge=r.str_(e.get("host_bridge", "pci0000:00"), f"{where}.host_bridge"),
                switches=tuple(
                    r.str_(s, f"{where}.switches")
                    for s in r.seq(e.get("switches"), f"{where}.switches")
                ),
            )
        )

    levels: dict[tuple[int, int], int] = {}
    for key, value in r.mapping(data.get("pcie_levels"), "pcie_levels").items():
        where = f"pcie_levels.{key}"
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(key))
        if m is None or int(m[1]) == int(m[2]) or max(int(m[1]), int(m[2])) >= n:
            raise r.fail(where, f"keys are 'a-b' with two distinct GPUs of 0..{n - 1}")
        level = _LEVEL_NAMES.get(str(value).strip().upper())
        if level is None:
            raise r.fail(where, f"expected one of BOARD PIX PXB PHB NODE SYS, got {value!r}")
        a, b = sorted((int(m[1]), int(m[2])))
        levels[(a, b)] = level

    faults_raw = r.mapping(data.get("faults"), "faults")
    lost = tuple(
        r.int_(x, "faults.lost_gpus", minimum=0)
        for x in r.seq(faults_raw.get("lost_gpus"), "faults.lost_gpus")
    )
    if any(x >= n for x in lost):
        raise r.fail("faults.lost_gpus", f"GPU indices must be 0..{n - 1}")
    unsupported: list[tuple[str, int | None]] = []
    for j, raw in enumerate(r.seq(faults_raw.get("unsupported"), "faults.unsupported")):
        e = r.mapping(raw, f"faults.unsupported[{j}]")
        gpu = e.get("gpu")
        unsupported.append(
            (
                r.str_(e.get("function"), f"faults.unsupported[{j}].function"),
                r.int_(gpu, f"faults.unsupported[{j}].gpu", minimum=0) if gpu is not None else None,
            )
        )
    init_error = faults_raw.get("init_error")
    if init_error is not None:
        init_error = r.str_(init_error, "faults.init_error").upper()
        if f"NVML_ERROR_{init_error}" not in _C:
            raise r.fail("faults.init_error", f"unknown NVML error {init_error.lower()!r}")

    cuda = data.get("cuda_driver_version", 12040)
    if isinstance(cuda, str):
        m = re.fullmatch(r"(\d+)\.(\d+)", cuda.strip())
        if m is None:
            raise r.fail("cuda_driver_version", f"expected e.g. 12040 or '12.4', got {cuda!r}")
        cuda = int(m[1]) * 1000 + int(m[2]) * 10
    return MachineSpec(
        name=name,
        gpus=tuple(gpus),
        numa_nodes=numa,
        nics=tuple(nics),
        nvlink_pairs=tuple(pairs),
        nvswitch=switch,
        pcie_levels=levels,
        product_name=str(data["product_name"]) if data.get("product_name") else None,
        driver_version=str(data.get("driver_version", "550.54.15")),
        cuda_driver_version=r.int_(cuda, "cuda_driver_version", minimum=1000),
        faults=FaultSpec(lost, tuple(unsupported), init_error),
        description=str(data.get("description", "")),
    )


def load_machine_spec(path: str) -> MachineSpec:
    """Read a YAML or JSON machine spec file; InputFormatError if unreadable or invalid."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise InputFormatError(f"cannot read machine spec {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputFormatError(
            f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {first}"
        ) from None
    if not isinstance(data, Mapping):
        raise InputFormatError(f"{path}: a machine spec is a mapping with 'name' and 'gpus'")
    return machine_spec_from_dict(data, source=os.path.basename(path))


def pcie_tree_level(
    a: tuple[str, tuple[str, ...], int | None, str | None],
    b: tuple[str, tuple[str, ...], int | None, str | None],
) -> int:
    """NVML topology level of two devices given as (host_bridge, switches, numa_node, board):
    the same rules as the sysfs tree (contract 1)."""
    hb_a, sw_a, numa_a, board_a = a
    hb_b, sw_b, numa_b, board_b = b
    if board_a is not None and board_a == board_b:
        return _C["NVML_TOPOLOGY_INTERNAL"]
    if hb_a == hb_b:
        if sw_a and sw_b and sw_a[-1] == sw_b[-1]:
            return _C["NVML_TOPOLOGY_SINGLE"]
        if set(sw_a) & set(sw_b):
            return _C["NVML_TOPOLOGY_MULTIPLE"]
        return _C["NVML_TOPOLOGY_HOSTBRIDGE"]
    if numa_a is not None and numa_a == numa_b:
        return _C["NVML_TOPOLOGY_NODE"]
    return _C["NVML_TOPOLOGY_SYSTEM"]


# =========================================================================== the fake
class _Handle:
    """A device handle (pynvml's ``c_nvmlDevice_t``): a GPU, or MIG device ``mig`` of it."""

    __slots__ = ("gpu", "mig")

    def __init__(self, gpu: int, mig: int | None = None) -> None:
        self.gpu = gpu
        self.mig = mig

    def __repr__(self) -> str:
        return f"<fake nvmlDevice gpu={self.gpu}{'' if self.mig is None else f' mig={self.mig}'}>"


class _EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # gpu -> event type mask
        self.queue: collections.deque[object] = collections.deque()
        self.cond = threading.Condition()
        self.freed = False


class _GpmSample:
    def __init__(self) -> None:
        self.gpu: int | None = None
        self.seq = 0
        self.values: dict[str, float] = {}


class _Link:
    __slots__ = ("kind", "remote_gpu", "remote_bus_id")

    def __init__(self, kind: int, remote_gpu: int | None, remote_bus_id: str) -> None:
        self.kind = kind
        self.remote_gpu = remote_gpu
        self.remote_bus_id = remote_bus_id


#: Telemetry knobs :meth:`FakeNvml.set_value` accepts.
TELEMETRY_FIELDS = (
    "gpu_util_pct",
    "mem_util_pct",
    "enc_util_pct",
    "dec_util_pct",
    "gpu_temp_c",
    "memory_temp_c",
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "video_clock_mhz",
    "memory_used_mib",
    "pcie_tx_kbps",
    "pcie_rx_kbps",
    "pcie_replay",
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "ecc_sbe_aggregate",
    "ecc_dbe_aggregate",
    "remapped_correctable",
    "remapped_uncorrectable",
    "remap_pending",
    "remap_failure",
    "sm_active_pct",
    "sm_occupancy_pct",
    "tensor_active_pct",
    "dram_active_pct",
    "fp64_active_pct",
    "fp32_active_pct",
    "fp16_active_pct",
    "processes",
)


def _api(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a pynvml function of the fake and applies the library-wide checks first:
    initialised, not removed, fault injection, lost GPU."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        self._check(name, args)
        return fn(self, *args, **kwargs)

    wrapper._nvml_api = True  # type: ignore[attr-defined]
    return wrapper


class FakeNvml:
    """A module-like fake of ``pynvml`` for one machine (see the module docstring).

    Thread-safe: every function takes the fake's lock, except the event wait which blocks on
    its event set's own condition.
    """

    NVMLError = NVMLError

    def __init__(self, spec: MachineSpec) -> None:
        self.spec = spec
        self._lock = threading.RLock()
        self._initialized = 0
        self._init_error: int | None = (
            _C[f"NVML_ERROR_{spec.faults.init_error}"] if spec.faults.init_error else None
        )
        self._lost: set[int] = set(spec.faults.lost_gpus)
        self._unsupported: set[tuple[str, int | None]] = set(spec.faults.unsupported)
        self._missing: set[str] = set()
        self._failures: dict[tuple[str, int | None], int] = {}
        self._event_sets: list[_EventSet] = []
        #: how often each function was called (for tests: "no NVML on the request path")
        self.calls: collections.Counter[str] = collections.Counter()
        self._handles = [_Handle(g.index) for g in spec.gpus]
        self._mig_handles = [
            [_Handle(g.index, k) for k in range(len(g.mig_devices))] for g in spec.gpus
        ]
        self._by_uuid = {g.uuid: g.index for g in spec.gpus}
        self._by_bus = {g.bus_id: g.index for g in spec.gpus}
        self._links = self._wire(spec)
        self._telemetry = [self._default_telemetry(g) for g in spec.gpus]
        self._counters = [
            {"energy_mj": 10_000_000 + 7919 * (1 + g.index) * 1000, "nvlink_kib": 0, "reads": 0}
            for g in spec.gpus
        ]

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _wire(spec: MachineSpec) -> list[list[_Link | None]]:
        links: list[list[_Link | None]] = [[None] * g.model.nvlinks for g in spec.gpus]
        nxt = [0] * len(spec.gpus)

        def take(i: int) -> int:
            k = nxt[i]
            nxt[i] += 1
            return k

        gpu_type, switch_type = (
            _C["NVML_NVLINK_DEVICE_TYPE_GPU"],
            _C["NVML_NVLINK_DEVICE_TYPE_SWITCH"],
        )
        for a, b, count in spec.nvlink_pairs:
            for _ in range(count):
                links[a][take(a)] = _Link(gpu_type, b, spec.gpus[b].bus_id)
                links[b][take(b)] = _Link(gpu_type, a, spec.gpus[a].bus_id)
        if spec.nvswitch is not None:
            members = (
                spec.nvswitch.gpus if spec.nvswitch.gpus is not None else range(len(spec.gpus))
            )
            for i in members:
                for k in range(spec.nvswitch.links_per_gpu):
                    bus = spec.nvswitch.bus_ids[k % len(spec.nvswitch.bus_ids)]
                    links[i][take(i)] = _Link(switch_type, None, bus)
        return links

    def _default_telemetry(self, g: GpuSpec) -> dict[str, Any]:
        seed = zlib.crc32(f"{self.spec.name}:{g.index}".encode())
        util = 20 + seed % 71  # 20..90
        temp = 32 + (seed >> 8) % 30
        return {
            "gpu_util_pct": util,
            "mem_util_pct": util // 2,
            "enc_util_pct": 0,
            "dec_util_pct": (seed >> 4) % 5,
            "gpu_temp_c": temp,
            "memory_temp_c": temp + 6,
            "power_w": round(g.model.tdp_w * (0.25 + 0.6 * util / 100)),
            "sm_clock_mhz": g.model.max_sm_clock_mhz - (seed >> 12) % 200,
            "mem_clock_mhz": g.model.mem_clock_mhz,
            "video_clock_mhz": 1275,
            "memory_used_mib": min(g.model.memory_mib // 2, 1024 + (seed >> 16) % 20000),
            "pcie_tx_kbps": 1000 + (seed >> 3) % 50000,
            "pcie_rx_kbps": 2000 + (seed >> 5) % 80000,
            "pcie_replay": 0,
            "ecc_sbe_volatile": 0,
            "ecc_dbe_volatile": 0,
            "ecc_sbe_aggregate": (seed >> 20) % 3,
            "ecc_dbe_aggregate": 0,
            "remapped_correctable": 0,
            "remapped_uncorrectable": 0,
            "remap_pending": 0,
            "remap_failure": 0,
            "sm_active_pct": max(0, util - 5),
            "sm_occupancy_pct": util // 3,
            "tensor_active_pct": util // 4,
            "dram_active_pct": util // 2,
            "fp64_active_pct": 0,
            "fp32_active_pct": util // 5,
            "fp16_active_pct": util // 6,
            "processes": [],
        }

    # ------------------------------------------------------------------ fault injection
    def lose_gpu(self, index: int) -> None:
        """GPU ``index`` falls off the bus: every call with its handle raises
        ``NVMLError_GpuIsLost``, and waiters on event sets registered for it are woken with
        that error."""
        with self._lock:
            self._gpu(index)
            self._lost.add(index)
            sets = [s for s in self._event_sets if index in s.registered and not s.freed]
        for s in sets:
            with s.cond:
                s.queue.append(_err("NVML_ERROR_GPU_IS_LOST"))
                s.cond.notify_all()

    def recover_gpu(self, index: int) -> None:
        """GPU ``index`` answers again (as after a reset)."""
        with self._lock:
            self._gpu(index)
            self._lost.discard(index)

    def make_unsupported(self, function_name: str, index: int | None = None) -> None:
        """``function_name`` raises ``NVMLError_NotSupported`` (for GPU ``index`` only, or for
        every call when None)."""
        with self._lock:
            self._unsupported.add((function_name, index))

    def make_missing(self, function_name: str) -> None:
        """``function_name`` raises ``NVMLError_FunctionNotFound`` (an older driver)."""
        with self._lock:
            self._missing.add(function_name)

    def fail(self, function_name: str, error_code: int, index: int | None = None) -> None:
        """``function_name`` raises ``NVMLError(error_code)`` (for GPU ``index`` or always)."""
        with self._lock:
            self._failures[(function_name, index)] = error_code

    def fail_init(self, error_code: int | None) -> None:
        """``nvmlInit`` raises ``NVMLError(error_code)`` (None: it works again)."""
        with self._lock:
            self._init_error = error_code

    def inject_xid(self, index: int, xid: int) -> None:
        """Deliver an XID critical error event for GPU ``index`` to the event sets
        registered for it."""
        self._deliver(index, _C["nvmlEventTypeXidCriticalError"], xid)

    def inject_ecc_dbe(self, index: int) -> None:
        """A double-bit ECC error on GPU ``index``: counters grow and a
        ``nvmlEventTypeDoubleBitEccError`` event is delivered."""
        with self._lock:
            t = self._telemetry[self._gpu(index).index]
            t["ecc_dbe_volatile"] += 1
            t["ecc_dbe_aggregate"] += 1
        self._deliver(index, _C["nvmlEventTypeDoubleBitEccError"], 0)

    def set_value(self, index: int, field: str, value: Any) -> None:
        """Set telemetry knob ``field`` (one of :data:`TELEMETRY_FIELDS`) of GPU ``index``.
        ``processes`` is a list of ``(pid, used_mib)``."""
        if field not in TELEMETRY_FIELDS:
            raise ValueError(
                f"unknown telemetry field {field!r}; expected one of {', '.join(TELEMETRY_FIELDS)}"
            )
        with self._lock:
            self._telemetry[self._gpu(index).index][field] = value

    def _deliver(self, index: int, event_type: int, data: int) -> None:
        with self._lock:
            self._gpu(index)
            handle = self._handles[index]
            sets = [
                s
                for s in self._event_sets
                if not s.freed and s.registered.get(index, 0) & event_type
            ]
        for s in sets:
            with s.cond:
                s.queue.append(
                    c_nvmlEventData_t(
                        device=handle,
                        eventType=event_type,
                        eventData=data,
                        gpuInstanceId=_NO_ID,
                        computeInstanceId=_NO_ID,
                    )
                )
                s.cond.notify_all()

    # ------------------------------------------------------------------ helpers
    @classmethod
    def api_functions(cls) -> list[str]:
        """The names of the pynvml functions this fake implements."""
        return sorted(n for n, v in vars(cls).items() if getattr(v, "_nvml_api", False))

    def _gpu(self, index: int) -> GpuSpec:
        if not isinstance(index, int) or not 0 <= index < len(self.spec.gpus):
            raise ValueError(f"no GPU {index!r} on {self.spec.name} ({len(self.spec.gpus)} GPUs)")
        return self.spec.gpus[index]

    def _check(self, name: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self.calls[name] += 1
            if name in self._missing:
                raise _err("NVML_ERROR_FUNCTION_NOT_FOUND")
            if not self._initialized and name not in (
                "nvmlInit",
                "nvmlInitWithFlags",
                "nvmlErrorString",
            ):
                raise _err("NVML_ERROR_UNINITIALIZED")
            gpu = next((a.gpu for a in args if isinstance(a, _Handle)), None)
            for key in ((name, gpu), (name, None)):
                if key in self._failures:
                    raise NVMLError(self._failures[key])
            if any(isinstance(a, _Handle) and a.gpu in self._lost for a in args):
                raise _err("NVML_ERROR_GPU_IS_LOST")
            if (name, gpu) in self._unsupported or (name, None) in self._unsupported:
                raise _err("NVML_ERROR_NOT_SUPPORTED")

    def _dev(self, handle: object, *, mig_ok: bool = True) -> tuple[GpuSpec, int | None]:
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu < len(self.spec.gpus):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        if handle.mig is not None and not mig_ok:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return self.spec.gpus[handle.gpu], handle.mig

    def _mig(self, g: GpuSpec, slot: int) -> MigDeviceSpec:
        return g.mig_devices[slot]

    @staticmethod
    def _mig_memory_mib(d: MigDeviceSpec) -> int:
        # ~95% of the nominal size, as real profiles report a little less than their name
        return d.memory_gb * 1024 * 95 // 100 // 128 * 128

    def _pci_info(self, bus_id: str, device_id: int) -> Any:
        domain, bus, rest = bus_id.split(":")
        dev = rest.split(".")[0]
        return nvmlPciInfo_t(
            busIdLegacy=f"{int(domain, 16):04X}:{bus}:{rest}",
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(dev, 16),
            pciDeviceId=device_id,
            pciSubSystemId=0x147D10DE,
            busId=bus_id,
        )

    def _tick(self, i: int) -> dict[str, int]:
        """Advance GPU ``i``'s counters as if one second passed since the last read."""
        c = self._counters[i]
        c["reads"] += 1
        c["energy_mj"] += int(self._telemetry[i]["power_w"]) * 1000
        c["nvlink_kib"] += 1024 * sum(1 for link in self._links[i] if link is not None)
        return c

    def _nvlinked(self, a: int, b: int) -> bool:
        if any(link is not None and link.remote_gpu == b for link in self._links[a]):
            return True
        sw = self.spec.nvswitch
        if sw is None:
            return False
        members = set(sw.gpus if sw.gpus is not None else range(len(self.spec.gpus)))
        if a not in members or b not in members:
            return False
        ga, gb = self.spec.gpus[a], self.spec.gpus[b]
        if ga.fabric_clique_id is not None and gb.fabric_clique_id is not None:
            return (ga.fabric_cluster_uuid, ga.fabric_clique_id) == (
                gb.fabric_cluster_uuid,
                gb.fabric_clique_id,
            )
        return True

    # ================================================================== library
    @_api
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @_api
    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._lock:
            if self._init_error is not None:
                raise NVMLError(self._init_error)
            self._initialized += 1

    @_api
    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._initialized > 0:
                self._initialized -= 1

    @_api
    def nvmlErrorString(self, result: int) -> str:
        return NVMLError._errcode_to_string.get(result, "Unknown Error")

    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.spec.driver_version

    @_api
    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12." + self.spec.driver_version

    @_api
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.spec.cuda_driver_version

    @_api
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.spec.cuda_driver_version

    # ================================================================== devices
    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self.spec.gpus)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not isinstance(index, int) or not 0 <= index < len(self._handles):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self._handles[index]

    @_api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        key = uuid.decode() if isinstance(uuid, bytes) else uuid
        if key not in self._by_uuid:
            raise _err("NVML_ERROR_NOT_FOUND")
        return self._handles[self._by_uuid[key]]

    @_api
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> _Handle:
        key = pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId
        try:
            index = self._by_bus[nvml_bus_id(key)]
        except (ValueError, KeyError):
            raise _err("NVML_ERROR_NOT_FOUND") from None
        return self._handles[index]

    @_api
    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        return g.index

    @_api
    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        g, mig = self._dev(handle)
        return g.uuid if mig is None else _mig_uuid(g.uuid, mig)

    @_api
    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        g, mig = self._dev(handle)
        return g.model.name if mig is None else f"{g.model.name} MIG {self._mig(g, mig).profile}"

    @_api
    def nvmlDeviceGetSerial(self, handle: _Handle) -> str:
        g, _ = self._dev(handle, mig_ok=False)
        return f"{1320000000000 + zlib.crc32(g.uuid.encode()) % 1000000000:013d}"

    @_api
    def nvmlDeviceGetArchitecture(self, device: _Handle) -> int:
        g, _ = self._dev(device)
        return g.model.arch_constant

    @_api
    def nvmlDeviceGetPersistenceMode(self, handle: _Handle) -> int:
        self._dev(handle, mig_ok=False)
        return _C["NVML_FEATURE_ENABLED"]

    @_api
    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        return g.minor_number

    @_api
    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        g, _ = self._dev(handle)
        return g.model.compute_capability

    @_api
    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        g, mig = self._dev(handle)
        mib = 1 << 20
        with self._lock:
            if mig is None:
                total = g.model.memory_mib * mib
                reserved = min(g.model.memory_mib // 100, 600) * mib
                used = int(self._telemetry[g.index]["memory_used_mib"]) * mib
            else:
                total = self._mig_memory_mib(self._mig(g, mig)) * mib
                reserved, used = 0, 13 * mib
        used = min(used, total - reserved)
        if not version:
            # v1 counts the reserved memory as used, as the driver does
            return c_nvmlMemory_t(total=total, free=total - reserved - used, used=used + reserved)
        if version != _C["nvmlMemory_v2"]:
            raise _err("NVML_ERROR_ARGUMENT_VERSION_MISMATCH")
        return c_nvmlMemory_v2_t(
            version=version, total=total, reserved=reserved, free=total - reserved - used, used=used
        )

    @_api
    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    @_api
    def nvmlDeviceGetPciInfo_v3(self, handle: _Handle) -> Any:
        g, _ = self._dev(handle, mig_ok=False)
        return self._pci_info(g.bus_id, g.model.pci_device_id)

    @_api
    def nvmlDeviceGetNumaNodeId(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        if g.gpu_numa_id is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return g.gpu_numa_id

    @_api
    def nvmlDeviceGetCpuAffinity(self, handle: _Handle, cpuSetSize: int) -> list[int]:
        g, _ = self._dev(handle, mig_ok=False)
        words = [0] * cpuSetSize
        for part in (g.cpulist or "").split(","):
            if not part:
                continue
            lo, _, hi = part.partition("-")
            for cpu in range(int(lo), int(hi or lo) + 1):
                if cpu // 64 < cpuSetSize:
                    words[cpu // 64] |= 1 << (cpu % 64)
        return words

    # ------------------------------------------------------------------ MIG
    @_api
    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        g, _ = self._dev(device, mig_ok=False)
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        mode = _C["NVML_DEVICE_MIG_ENABLE"] if g.mig_enabled else _C["NVML_DEVICE_MIG_DISABLE"]
        return [mode, mode]

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Handle) -> int:
        g, _ = self._dev(device, mig_ok=False)
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return 7

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Handle, index: int) -> _Handle:
        g, _ = self._dev(device, mig_ok=False)
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        if not isinstance(index, int) or not 0 <= index < 7:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        if not g.mig_enabled:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        if index >= len(g.mig_devices):
            raise _err("NVML_ERROR_NOT_FOUND")
        return self._mig_handles[g.index][index]

    @_api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: _Handle) -> _Handle:
        g, mig = self._dev(migDevice)
        if mig is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self._handles[g.index]

    @_api
    def nvmlDeviceIsMigDeviceHandle(self, device: _Handle) -> ctypes.c_uint:
        _, mig = self._dev(device)
        return ctypes.c_uint(0 if mig is None else 1)

    @_api
    def nvmlDeviceGetGpuInstanceId(self, device: _Handle) -> int:
        g, mig = self._dev(device)
        if mig is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return 1 + mig  # GPU instance ids as nvidia-smi numbers them for a fresh layout

    @_api
    def nvmlDeviceGetComputeInstanceId(self, device: _Handle) -> int:
        _, mig = self._dev(device)
        if mig is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return 0

    @_api
    def nvmlDeviceGetAttributes(self, device: _Handle) -> Any:
        return self.nvmlDeviceGetAttributes_v2(device)

    @_api
    def nvmlDeviceGetAttributes_v2(self, device: _Handle) -> Any:
        g, mig = self._dev(device)
        if mig is None:
            return c_nvmlDeviceAttributes(
                multiprocessorCount=g.model.sm_count,
                sharedCopyEngineCount=7,
                sharedDecoderCount=5,
                sharedEncoderCount=0,
                sharedJpegCount=1,
                sharedOfaCount=1,
                gpuInstanceSliceCount=7,
                computeInstanceSliceCount=7,
                memorySizeMB=g.model.memory_mib,
            )
        d = self._mig(g, mig)
        return c_nvmlDeviceAttributes(
            multiprocessorCount=g.model.sm_count * d.ci_slices // 7,
            sharedCopyEngineCount=d.gi_slices,
            sharedDecoderCount=d.gi_slices // 2,
            sharedEncoderCount=0,
            sharedJpegCount=1 if d.gi_slices == 7 else 0,
            sharedOfaCount=1 if d.gi_slices == 7 else 0,
            gpuInstanceSliceCount=d.gi_slices,
            computeInstanceSliceCount=d.ci_slices,
            memorySizeMB=self._mig_memory_mib(d),
        )

    @_api
    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: _Handle, profile: int, version: int = 2
    ) -> Any:
        g, _ = self._dev(device, mig_ok=False)
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        slices = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}.get(profile)
        if slices is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        total_gb = -(-g.model.memory_mib // 1024)
        mem_gb = {
            1: total_gb // 8,
            2: total_gb // 4,
            3: total_gb // 2,
            4: total_gb // 2,
            7: total_gb,
        }[slices]
        return c_nvmlGpuInstanceProfileInfo_v2_t(
            version=0x2000098 if version == 2 else 0,
            id=profile,
            isP2pSupported=0,
            sliceCount=slices,
            instanceCount=7 // slices if slices != 4 else 1,
            multiprocessorCount=g.model.sm_count * slices // 7,
            copyEngineCount=slices,
            decoderCount=slices // 2,
            encoderCount=0,
            jpegCount=0,
            ofaCount=0,
            memorySizeMB=self._mig_memory_mib(MigDeviceSpec("", slices, slices, mem_gb)),
            name=f"MIG {slices}g.{mem_gb}gb",
        )

    # ------------------------------------------------------------------ NVLink / topology
    def _link(self, device: _Handle, link: int) -> _Link | None:
        g, _ = self._dev(device, mig_ok=False)
        if not isinstance(link, int) or not 0 <= link < _C["NVML_NVLINK_MAX_LINKS"]:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        if link >= len(self._links[g.index]):
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return self._links[g.index][link]

    @_api
    def nvmlDeviceGetNvLinkState(self, device: _Handle, link: int) -> int:
        wired = self._link(device, link)
        return _C["NVML_FEATURE_ENABLED"] if wired is not None else _C["NVML_FEATURE_DISABLED"]

    @_api
    def nvmlDeviceGetNvLinkVersion(self, device: _Handle, link: int) -> int:
        if self._link(device, link) is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return self.spec.gpus[device.gpu].model.nvlink_version

    @_api
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: _Handle, link: int) -> Any:
        wired = self._link(device, link)
        if wired is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        device_id = (
            self.spec.gpus[wired.remote_gpu].model.pci_device_id
            if wired.remote_gpu is not None
            else 0x22A310DE
        )
        return self._pci_info(wired.remote_bus_id, device_id)

    @_api
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        wired = self._link(handle, link)
        if wired is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return wired.kind

    @_api
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: _Handle, device2: _Handle) -> int:
        a, _ = self._dev(device1, mig_ok=False)
        b, _ = self._dev(device2, mig_ok=False)
        if a.index == b.index:
            return _C["NVML_TOPOLOGY_INTERNAL"]
        key = (min(a.index, b.index), max(a.index, b.index))
        if key in self.spec.pcie_levels:
            return self.spec.pcie_levels[key]
        return pcie_tree_level(
            (a.host_bridge, a.switches, a.numa_node, a.board),
            (b.host_bridge, b.switches, b.numa_node, b.board),
        )

    @_api
    def nvmlDeviceGetP2PStatus(self, device1: _Handle, device2: _Handle, p2pIndex: int) -> int:
        a, _ = self._dev(device1, mig_ok=False)
        b, _ = self._dev(device2, mig_ok=False)
        if a.index == b.index:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        nvlinked = self._nvlinked(a.index, b.index)
        if p2pIndex == _C["NVML_P2P_CAPS_INDEX_NVLINK"]:
            return _C["NVML_P2P_STATUS_OK"] if nvlinked else _C["NVML_P2P_STATUS_NOT_SUPPORTED"]
        if p2pIndex not in (0, 1, 3, 4):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        level = self.nvmlDeviceGetTopologyCommonAncestor(device1, device2)
        if nvlinked or level < _C["NVML_TOPOLOGY_SYSTEM"]:
            return _C["NVML_P2P_STATUS_OK"]
        return _C["NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED"]

    def _fill_fabric(self, device: _Handle, info: Any) -> None:
        g, _ = self._dev(device, mig_ok=False)
        if g.fabric_clique_id is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        target = getattr(info, "_obj", info)  # byref(struct) or the struct itself
        if not isinstance(target, (c_nvmlGpuFabricInfo_t, c_nvmlGpuFabricInfoV_t)):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        raw = uuid_mod.UUID(g.fabric_cluster_uuid).bytes if g.fabric_cluster_uuid else bytes(16)
        for k in range(16):
            target.clusterUuid[k] = raw[k]
        target.status = _C["NVML_SUCCESS"]
        target.cliqueId = g.fabric_clique_id
        target.state = _C["NVML_GPU_FABRIC_STATE_COMPLETED"]

    @_api
    def nvmlDeviceGetGpuFabricInfo(self, device: _Handle, gpuFabricInfo: Any) -> int:
        self._fill_fabric(device, gpuFabricInfo)
        return _C["NVML_SUCCESS"]

    @_api
    def nvmlDeviceGetGpuFabricInfoV(self, device: _Handle, gpuFabricInfo: Any) -> int:
        target = getattr(gpuFabricInfo, "_obj", gpuFabricInfo)
        if getattr(target, "version", None) != _C["nvmlGpuFabricInfo_v2"]:
            raise _err("NVML_ERROR_ARGUMENT_VERSION_MISMATCH")
        self._fill_fabric(device, gpuFabricInfo)
        return _C["NVML_SUCCESS"]

    # ================================================================== telemetry
    def _t(self, handle: _Handle) -> tuple[GpuSpec, dict[str, Any]]:
        g, _ = self._dev(handle, mig_ok=False)
        return g, self._telemetry[g.index]

    @_api
    def nvmlDeviceGetClockInfo(self, handle: _Handle, type: int) -> int:
        _, t = self._t(handle)
        key = {0: "sm_clock_mhz", 1: "sm_clock_mhz", 2: "mem_clock_mhz", 3: "video_clock_mhz"}.get(
            type
        )
        if key is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t[key])

    @_api
    def nvmlDeviceGetMaxClockInfo(self, handle: _Handle, type: int) -> int:
        g, _ = self._t(handle)
        values = {
            0: g.model.max_sm_clock_mhz,
            1: g.model.max_sm_clock_mhz,
            2: g.model.mem_clock_mhz,
            3: 1950,
        }
        if type not in values:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return values[type]

    @_api
    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        _, t = self._t(handle)
        if sensor != _C["NVML_TEMPERATURE_GPU"]:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t["gpu_temp_c"])

    @_api
    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        _, t = self._t(handle)
        return int(t["power_w"]) * 1000

    @_api
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        g, _ = self._t(handle)
        return g.model.tdp_w * 1000

    @_api
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        g, _ = self._t(handle)
        with self._lock:
            return self._tick(g.index)["energy_mj"]

    @_api
    def nvmlDeviceGetPcieReplayCounter(self, handle: _Handle) -> int:
        _, t = self._t(handle)
        return int(t["pcie_replay"])

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        _, t = self._t(handle)
        return c_nvmlUtilization_t(gpu=int(t["gpu_util_pct"]), memory=int(t["mem_util_pct"]))

    @_api
    def nvmlDeviceGetEncoderUtilization(self, handle: _Handle) -> list[int]:
        _, t = self._t(handle)
        return [int(t["enc_util_pct"]), 167000]

    @_api
    def nvmlDeviceGetDecoderUtilization(self, handle: _Handle) -> list[int]:
        _, t = self._t(handle)
        return [int(t["dec_util_pct"]), 167000]

    @_api
    def nvmlDeviceGetRemappedRows(self, device: _Handle) -> tuple[int, int, int, int]:
        g, t = self._t(device)
        if not g.model.hbm or g.model.compute_capability < (8, 0):
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return (
            int(t["remapped_correctable"]),
            int(t["remapped_uncorrectable"]),
            int(t["remap_pending"]),
            int(t["remap_failure"]),
        )

    @_api
    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, errorType: int, counterType: int) -> int:
        _, t = self._t(handle)
        kind = {0: "sbe", 1: "dbe"}.get(errorType)
        scope = {0: "volatile", 1: "aggregate"}.get(counterType)
        if kind is None or scope is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t[f"ecc_{kind}_{scope}"])

    @_api
    def nvmlDeviceGetPcieThroughput(self, device: _Handle, counter: int) -> int:
        _, t = self._t(device)
        key = {0: "pcie_tx_kbps", 1: "pcie_rx_kbps"}.get(counter)
        if key is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t[key])

    def _processes(self, handle: _Handle) -> list[Any]:
        g, mig = self._dev(handle)
        with self._lock:
            procs = list(self._telemetry[g.index]["processes"])
        gi = _NO_ID if mig is None else 1 + mig
        ci = _NO_ID if mig is None else 0
        return [
            c_nvmlProcessInfo_t(
                pid=int(pid),
                usedGpuMemory=int(used_mib) << 20,
                gpuInstanceId=gi,
                computeInstanceId=ci,
            )
            for pid, used_mib in procs
        ]

    @_api
    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._processes(handle)

    @_api
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._processes(handle)

    @_api
    def nvmlDeviceGetFieldValues(
        self, handle: _Handle, fieldIds: Sequence[int | tuple[int, int]]
    ) -> Any:
        g, t = self._t(handle)
        values = (c_nvmlFieldValue_t * len(fieldIds))()
        with self._lock:
            c = self._tick(g.index)
            links = sum(1 for link in self._links[g.index] if link is not None)
            known: dict[int, tuple[int, Any]] = {
                _C["NVML_FI_DEV_ECC_SBE_VOL_TOTAL"]: (3, t["ecc_sbe_volatile"]),
                _C["NVML_FI_DEV_ECC_DBE_VOL_TOTAL"]: (3, t["ecc_dbe_volatile"]),
                _C["NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]: (3, c["energy_mj"]),
                _C["NVML_FI_DEV_PCIE_REPLAY_COUNTER"]: (3, t["pcie_replay"]),
                _C["NVML_FI_DEV_POWER_INSTANT"]: (1, int(t["power_w"]) * 1000),
            }
            if g.model.hbm:
                known[_C["NVML_FI_DEV_MEMORY_TEMP"]] = (1, t["memory_temp_c"])
            if g.model.nvlinks:
                known.update(
                    {
                        _C["NVML_FI_DEV_NVLINK_LINK_COUNT"]: (1, links),
                        _C["NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL"]: (3, c["nvlink_kib"] * 2),
                        _C["NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"]: (3, c["nvlink_kib"]),
                        _C["NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"]: (3, c["nvlink_kib"]),
                        _C["NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX"]: (3, c["nvlink_kib"] * 17 // 16),
                        _C["NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX"]: (3, c["nvlink_kib"] * 17 // 16),
                        _C["NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"]: (3, 0),
                        _C["NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"]: (3, 0),
                        _C["NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"]: (3, 0),
                        _C["NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"]: (3, 0),
                    }
                )
        for k, fid in enumerate(fieldIds):
            if isinstance(fid, tuple):
                values[k].fieldId, values[k].scopeId = fid
            else:
                values[k].fieldId = fid
            values[k].timestamp = 1_700_000_000_000_000 + c["reads"] * 1_000_000
            entry = known.get(values[k].fieldId)
            if entry is None:
                values[k].nvmlReturn = _C["NVML_ERROR_NOT_SUPPORTED"]
                continue
            vtype, value = entry
            values[k].valueType = vtype
            values[k].nvmlReturn = _C["NVML_SUCCESS"]
            if vtype == 1:
                values[k].value.uiVal = int(value)
            else:
                values[k].value.ullVal = int(value)
        return values

    # ------------------------------------------------------------------ GPM
    def _gpm_supported(self, g: GpuSpec) -> bool:
        return g.model.compute_capability >= (9, 0)

    @_api
    def nvmlGpmQueryDeviceSupport(self, device: _Handle) -> Any:
        g, _ = self._dev(device, mig_ok=False)
        return c_nvmlGpmSupport_t(
            version=_C["NVML_GPM_SUPPORT_VERSION"], isSupportedDevice=int(self._gpm_supported(g))
        )

    @_api
    def nvmlGpmSampleAlloc(self) -> _GpmSample:
        return _GpmSample()

    @_api
    def nvmlGpmSampleFree(self, gpmSample: _GpmSample) -> None:
        if not isinstance(gpmSample, _GpmSample):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")

    @_api
    def nvmlGpmSampleGet(self, device: _Handle, gpmSample: _GpmSample) -> _GpmSample:
        g, t = self._t(device)
        if not self._gpm_supported(g):
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        if not isinstance(gpmSample, _GpmSample):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        with self._lock:
            gpmSample.gpu = g.index
            gpmSample.seq = self._tick(g.index)["reads"]
            gpmSample.values = {k: v for k, v in t.items() if isinstance(v, (int, float))}
        return gpmSample

    @_api
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        s1, s2 = getattr(metricsGet, "sample1", None), getattr(metricsGet, "sample2", None)
        if (
            getattr(metricsGet, "version", None) != _C["NVML_GPM_METRICS_GET_VERSION"]
            or not isinstance(s1, _GpmSample)
            or not isinstance(s2, _GpmSample)
            or s1.gpu is None
            or s1.gpu != s2.gpu
        ):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        v = s2.values
        metric_values = {
            _C["NVML_GPM_METRIC_GRAPHICS_UTIL"]: v["gpu_util_pct"],
            _C["NVML_GPM_METRIC_SM_UTIL"]: v["sm_active_pct"],
            _C["NVML_GPM_METRIC_SM_OCCUPANCY"]: v["sm_occupancy_pct"],
            _C["NVML_GPM_METRIC_INTEGER_UTIL"]: v["fp32_active_pct"] / 2,
            _C["NVML_GPM_METRIC_ANY_TENSOR_UTIL"]: v["tensor_active_pct"],
            _C["NVML_GPM_METRIC_DRAM_BW_UTIL"]: v["dram_active_pct"],
            _C["NVML_GPM_METRIC_FP64_UTIL"]: v["fp64_active_pct"],
            _C["NVML_GPM_METRIC_FP32_UTIL"]: v["fp32_active_pct"],
            _C["NVML_GPM_METRIC_FP16_UTIL"]: v["fp16_active_pct"],
            _C["NVML_GPM_METRIC_PCIE_TX_PER_SEC"]: v["pcie_tx_kbps"] / 1024,
            _C["NVML_GPM_METRIC_PCIE_RX_PER_SEC"]: v["pcie_rx_kbps"] / 1024,
        }
        for k in range(min(int(metricsGet.numMetrics), len(metricsGet.metrics))):
            m = metricsGet.metrics[k]
            if m.metricId in metric_values:
                m.value = float(metric_values[m.metricId])
                m.nvmlReturn = _C["NVML_SUCCESS"]
            else:
                m.value = 0.0
                m.nvmlReturn = _C["NVML_ERROR_NOT_SUPPORTED"]
        return metricsGet

    # ================================================================== events
    @_api
    def nvmlEventSetCreate(self) -> _EventSet:
        s = _EventSet()
        with self._lock:
            self._event_sets.append(s)
        return s

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        self._dev(handle, mig_ok=False)
        return (
            _C["nvmlEventTypeSingleBitEccError"]
            | _C["nvmlEventTypeDoubleBitEccError"]
            | _C["nvmlEventTypePState"]
            | _C["nvmlEventTypeXidCriticalError"]
            | _C["nvmlEventTypeClock"]
        )

    @_api
    def nvmlDeviceRegisterEvents(
        self, handle: _Handle, eventTypes: int, eventSet: _EventSet
    ) -> None:
        g, _ = self._dev(handle, mig_ok=False)
        if not isinstance(eventSet, _EventSet) or eventSet.freed:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        supported = self.nvmlDeviceGetSupportedEventTypes(handle)
        if eventTypes & ~supported:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        with self._lock:
            eventSet.registered[g.index] = eventSet.registered.get(g.index, 0) | eventTypes

    @_api
    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> Any:
        return self._wait(eventSet, timeoutms)

    @_api
    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> Any:
        return self._wait(eventSet, timeoutms)

    def _wait(self, eventSet: _EventSet, timeoutms: int) -> Any:
        if not isinstance(eventSet, _EventSet) or eventSet.freed:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        with eventSet.cond:
            if not eventSet.queue:
                eventSet.cond.wait_for(
                    lambda: bool(eventSet.queue), timeout=max(0, timeoutms) / 1000
                )
            if not eventSet.queue:
                raise _err("NVML_ERROR_TIMEOUT")
            item = eventSet.queue.popleft()
        if isinstance(item, NVMLError):
            raise item
        return item

    @_api
    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        if not isinstance(eventSet, _EventSet):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        with self._lock:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)
        with eventSet.cond:
            eventSet.cond.notify_all()


# pynvml's constants, error classes and struct classes, as attributes of the module-like fake
for _name, _value in {**CONSTANTS, **ERROR_CLASSES, **STRUCTS}.items():
    setattr(FakeNvml, _name, _value)
del _name, _value
