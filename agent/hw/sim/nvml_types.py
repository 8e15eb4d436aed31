"""pynvml's constants, error classes and structs, as the fake NVML (:mod:`agent.hw.sim.nvml`)
exposes them: same names, values and ``.value`` codes as the installed pynvml (13.x);
``tests/test_fake_nvml.py`` checks all of that against it.

Structs have the same attribute names as pynvml's ctypes structs; the two that callers
allocate and pass by reference (``c_nvmlGpuFabricInfoV_t``/``c_nvmlGpuFabricInfo_t``) and the
field-value array are real ctypes structures with pynvml's layout.

Size: most of it is a table, pynvml's constants one per line with pynvml's names and values,
each checked against the installed pynvml; the error classes and structs are pynvml's too.
"""

from __future__ import annotations

import ctypes
import string
from typing import Any

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
    # nvmlDeviceGetComputeMode
    "NVML_COMPUTEMODE_DEFAULT": 0,
    "NVML_COMPUTEMODE_EXCLUSIVE_THREAD": 1,
    "NVML_COMPUTEMODE_PROHIBITED": 2,
    "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS": 3,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE": 0,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE": 1,
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE": 2,
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE": 3,
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE": 4,
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE": 5,
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE": 6,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1": 7,
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1": 8,
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2": 9,
    "NVML_GPU_INSTANCE_PROFILE_COUNT": 0x12,
    "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE": 0,
    "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE": 1,
    "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE": 2,
    "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE": 3,
    "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE": 4,
    "NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE": 5,
    "NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE": 6,
    "NVML_COMPUTE_INSTANCE_PROFILE_COUNT": 9,
    "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED": 0,
    "nvmlGpuInstanceProfileInfo_v2": 0x02000098,
    "nvmlComputeInstanceProfileInfo_v2": 0x02000088,
    # architectures
    "NVML_DEVICE_ARCH_VOLTA": 5,
    "NVML_DEVICE_ARCH_TURING": 6,
    "NVML_DEVICE_ARCH_AMPERE": 7,
    "NVML_DEVICE_ARCH_ADA": 8,
    "NVML_DEVICE_ARCH_HOPPER": 9,
    "NVML_DEVICE_ARCH_BLACKWELL": 10,
    "NVML_DEVICE_ARCH_UNKNOWN": 0xFFFFFFFF,
    # nvmlDeviceGetBrand
    "NVML_BRAND_UNKNOWN": 0,
    "NVML_BRAND_QUADRO": 1,
    "NVML_BRAND_TESLA": 2,
    "NVML_BRAND_NVS": 3,
    "NVML_BRAND_GRID": 4,
    "NVML_BRAND_GEFORCE": 5,
    "NVML_BRAND_TITAN": 6,
    "NVML_BRAND_NVIDIA_VAPPS": 7,
    "NVML_BRAND_NVIDIA_VPC": 8,
    "NVML_BRAND_NVIDIA_VCS": 9,
    "NVML_BRAND_NVIDIA_VWS": 10,
    "NVML_BRAND_NVIDIA_CLOUD_GAMING": 11,
    "NVML_BRAND_QUADRO_RTX": 12,
    "NVML_BRAND_NVIDIA_RTX": 13,
    "NVML_BRAND_NVIDIA": 14,
    "NVML_BRAND_GEFORCE_RTX": 15,
    "NVML_BRAND_TITAN_RTX": 16,
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
        19: "In use by another client",
        20: "Insufficient Memory",
        23: "Insufficient Resources",
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
c_nvmlGpuInstanceInfo_t = _struct("c_nvmlGpuInstanceInfo_t", "device", "id", "profileId", "placement")
c_nvmlComputeInstanceProfileInfo_v2_t = _struct(
    "c_nvmlComputeInstanceProfileInfo_v2_t",
    "version",
    "id",
    "sliceCount",
    "instanceCount",
    "multiprocessorCount",
    "sharedCopyEngineCount",
    "sharedDecoderCount",
    "sharedEncoderCount",
    "sharedJpegCount",
    "sharedOfaCount",
    "name",
)
c_nvmlComputeInstanceInfo_t = _struct(
    "c_nvmlComputeInstanceInfo_t", "device", "gpuInstance", "id", "profileId", "placement"
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


class c_nvmlGpuFabricInfo_v2_t(ctypes.Structure):
    """pynvml's layout: callers set ``version = nvmlGpuFabricInfo_v2`` and pass ``byref``.
    pynvml names it ``c_nvmlGpuFabricInfo_v2_t`` and aliases ``c_nvmlGpuFabricInfoV_t``."""

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


class c_nvmlProcessUtilizationSample_t(ctypes.Structure):
    """One sample of ``nvmlDeviceGetProcessUtilization`` (pynvml returns a slice of an
    array of these)."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    """pynvml's layout: callers allocate arrays of it (possible placements) and pass one
    ``byref`` to create a GPU instance there."""

    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class c_nvmlComputeInstancePlacement_t(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfo_v2_t  # pynvml's alias

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
        c_nvmlGpuFabricInfo_v2_t,
        c_nvmlValue_t,
        c_nvmlFieldValue_t,
        c_metricInfo_t,
        c_nvmlProcessUtilizationSample_t,
        c_nvmlGpuInstancePlacement_t,
        c_nvmlGpuInstanceInfo_t,
        c_nvmlComputeInstancePlacement_t,
        c_nvmlComputeInstanceProfileInfo_v2_t,
        c_nvmlComputeInstanceInfo_t,
    )
}
STRUCTS["c_nvmlGpuFabricInfoV_t"] = c_nvmlGpuFabricInfoV_t


