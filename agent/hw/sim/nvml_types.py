"""pynvml's constants, error classes and structs, as the fake NVML (:mod:`agent.hw.sim.nvml`)
exposes them: same names, values and ``.value`` codes as the installed pynvml (13.x);
``tests/test_fake_nvml.py`` checks all of that against it.

Structs have the same attribute names as pynvml's ctypes structs; the two that callers
allocate and pass by reference (``c_nvmlGpuFabricInfoV_t``/``c_nvmlGpuFabricInfo_t``) and the
field-value array are real ctypes structures with pynvml's layout.

The constants themselves are a table of their own (:mod:`agent.hw.sim.nvml_constants`).
"""

from __future__ import annotations

import ctypes
import string
from typing import Any

from agent.hw.sim.nvml_constants import CONSTANTS as CONSTANTS  # re-exported: the fake exposes both

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


