"""The metrics we export and the NVML call that feeds each one.

Names, Prometheus types, units and help texts are dcgm-exporter's (its default counter list,
``tests/fixtures/dcgm/dcgm-exporter-default-counters.csv``) so that dashboards and alerts
written for dcgm-exporter work unchanged. Every series carries dcgm-exporter's labels
``gpu``, ``UUID``, ``pci_bus_id`` (NVML spelling ``00000000:3B:00.0``), ``device``
(``nvidia<minor>``), ``modelName``, ``Hostname``, ``DCGM_FI_DRIVER_VERSION`` and, when the GPU
is allocated, ``pod``/``namespace``/``container`` (one series per container on a shared GPU).

=========================================  =======  =====================================================
metric                                     type     NVML source (all through ``NvmlBackend.call``)
=========================================  =======  =====================================================
DCGM_FI_DEV_SM_CLOCK (MHz)                 gauge    nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)
DCGM_FI_DEV_MEM_CLOCK (MHz)                gauge    nvmlDeviceGetClockInfo(h, NVML_CLOCK_MEM)
DCGM_FI_DEV_MEMORY_TEMP (C)                gauge    nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_MEMORY_TEMP])
DCGM_FI_DEV_GPU_TEMP (C)                   gauge    nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)
DCGM_FI_DEV_POWER_USAGE (W)                gauge    nvmlDeviceGetPowerUsage(h) / 1000 (mW)
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)  counter  nvmlDeviceGetTotalEnergyConsumption(h)
DCGM_FI_DEV_PCIE_REPLAY_COUNTER            counter  nvmlDeviceGetPcieReplayCounter(h)
DCGM_FI_DEV_GPU_UTIL (%)                   gauge    nvmlDeviceGetUtilizationRates(h).gpu
DCGM_FI_DEV_MEM_COPY_UTIL (%)              gauge    nvmlDeviceGetUtilizationRates(h).memory
DCGM_FI_DEV_ENC_UTIL (%)                   gauge    nvmlDeviceGetEncoderUtilization(h)[0]
DCGM_FI_DEV_DEC_UTIL (%)                   gauge    nvmlDeviceGetDecoderUtilization(h)[0]
DCGM_FI_DEV_XID_ERRORS                     gauge    last XID of the NVML event stream (nvmlEventSetWait
                                                    via the health watcher -> ``record_xid``); 0 if none
DCGM_FI_DEV_FB_FREE / USED / RESERVED      gauge    nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2) bytes / 2**20
  (MiB)                                             (v1 without ``reserved`` where v2 is not supported)
DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL         counter  nvmlDeviceGetFieldValues: NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL,
                                                    else NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX + _RAW_RX
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS    counter  nvmlDeviceGetRemappedRows(h)[1]
DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS      counter  nvmlDeviceGetRemappedRows(h)[0]
DCGM_FI_DEV_ROW_REMAP_FAILURE              gauge    nvmlDeviceGetRemappedRows(h)[3]
DCGM_FI_DEV_ECC_SBE_VOL_TOTAL              counter  nvmlDeviceGetTotalEccErrors(h, CORRECTED, VOLATILE_ECC)
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL              counter  nvmlDeviceGetTotalEccErrors(h, UNCORRECTED, VOLATILE_ECC)
DCGM_FI_DEV_ECC_SBE_AGG_TOTAL              counter  nvmlDeviceGetTotalEccErrors(h, CORRECTED, AGGREGATE_ECC)
DCGM_FI_DEV_ECC_DBE_AGG_TOTAL              counter  nvmlDeviceGetTotalEccErrors(h, UNCORRECTED, AGGREGATE_ECC)
DCGM_FI_PROF_GR_ENGINE_ACTIVE (ratio)      gauge    GPM: NVML_GPM_METRIC_GRAPHICS_UTIL / 100
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE (ratio)    gauge    GPM: NVML_GPM_METRIC_ANY_TENSOR_UTIL / 100
DCGM_FI_PROF_DRAM_ACTIVE (ratio)           gauge    GPM: NVML_GPM_METRIC_DRAM_BW_UTIL / 100
DCGM_FI_PROF_PCIE_TX_BYTES (B/s)           gauge    GPM: NVML_GPM_METRIC_PCIE_TX_PER_SEC * 2**20 (MiB/s);
                                                    without GPM nvmlDeviceGetPcieThroughput(h, TX) * 1024
DCGM_FI_PROF_PCIE_RX_BYTES (B/s)           gauge    same with RX
=========================================  =======  =====================================================

GPM (``nvmlGpmQueryDeviceSupport``, ``nvmlGpmSampleAlloc/Get/Free``, ``nvmlGpmMetricsGet``)
exists on Hopper and newer; a ratio needs two samples, so ``DCGM_FI_PROF_*`` ratios appear
from the second sampling round on, and never on older GPUs (series absent, as
dcgm-exporter without DCP). ``DCGM_FI_DEV_VGPU_LICENSE_STATUS`` (vGPU guests only) is not
exported.

Our own metrics (no dcgm-exporter equivalent):

=============================================  =======  ====================================================
gpu_topology_info                              gauge    1 per GPU; labels numa_node, nvlink_island, nvlink_clique,
                                                        nearest_nic (from the Topology, read once)
gpu_topology_placement_quality_ratio           gauge    per container: set score / best score of any set of the
                                                        same size on this node (1.0 = ideal); label gpu_count
gpu_topology_allocated_idle_seconds            gauge    per allocated GPU and container: seconds since its
                                                        utilisation last exceeded the idle threshold
gpu_agent_preferred_allocation_seconds         hist.    GetPreferredAllocation latency
gpu_agent_registrations_total{resource}        counter  registrations with the kubelet
gpu_agent_kubelet_restarts_total               counter  kubelet restarts seen
gpu_agent_device_healthy{resource,device}      gauge    1 healthy / 0 unhealthy, as advertised to the kubelet
gpu_agent_nvml_errors_total{function}          counter  NvmlBackend.error_counts
gpu_agent_sampler_duration_seconds             gauge    duration of the last NVML sampling round
gpu_agent_samples_total                        counter  sampling rounds completed
gpu_agent_pod_resources_errors_total           counter  failed pod-resources List calls
=============================================  =======  ====================================================
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from agent.errors import AgentError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricDef:
    """One exported GPU metric: dcgm-exporter's name, Prometheus type and help text."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str


#: dcgm-exporter's default counters we export, in exposition order.
DCGM_METRICS: tuple[MetricDef, ...] = (
    MetricDef("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    MetricDef("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    MetricDef("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    MetricDef("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    MetricDef("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    MetricDef("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
              "Total energy consumption since boot (in mJ)."),
    MetricDef("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    MetricDef("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    MetricDef("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    MetricDef("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    MetricDef("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    MetricDef("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    MetricDef("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    MetricDef("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    MetricDef("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
    MetricDef("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
              "Total number of NVLink bandwidth counters for all lanes."),
    MetricDef("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
              "Number of remapped rows for uncorrectable errors"),
    MetricDef("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
              "Number of remapped rows for correctable errors"),
    MetricDef("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    MetricDef("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
              "Total number of single-bit volatile ECC errors."),
    MetricDef("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
              "Total number of double-bit volatile ECC errors."),
    MetricDef("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter",
              "Total number of single-bit persistent ECC errors."),
    MetricDef("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter",
              "Total number of double-bit persistent ECC errors."),
    MetricDef("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    MetricDef("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge",
              "Ratio of cycles the tensor (HMMA) pipe is active."),
    MetricDef("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
              "Ratio of cycles the device memory interface is active sending or receiving data."),
    MetricDef("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
              "The rate of data transmitted over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second."),
    MetricDef("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
              "The rate of data received over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second."),
)
DCGM_METRIC_NAMES: frozenset[str] = frozenset(m.name for m in DCGM_METRICS)

_MIB = 1 << 20
# NVML_GPM_METRIC_* ids -> (our metric, scale to dcgm-exporter's unit)
_GPM_METRICS: tuple[tuple[str, str, float], ...] = (
    ("NVML_GPM_METRIC_GRAPHICS_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.01),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.01),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "DCGM_FI_PROF_DRAM_ACTIVE", 0.01),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "DCGM_FI_PROF_PCIE_TX_BYTES", float(_MIB)),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "DCGM_FI_PROF_PCIE_RX_BYTES", float(_MIB)),
)
# union member of c_nvmlValue_t by NVML_VALUE_TYPE_* (0..6)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def field_value(fv: Any) -> float | None:
    """The number in one ``c_nvmlFieldValue_t``, None when NVML returned an error for it."""
    if getattr(fv, "nvmlReturn", 0) != 0:
        return None
    vtype = getattr(fv, "valueType", 0)
    if not 0 <= vtype < len(_VALUE_MEMBERS):
        return None
    return float(getattr(fv.value, _VALUE_MEMBERS[vtype]))


class GpuReader:
    """Reads one GPU's telemetry through an ``NvmlBackend``; keeps the GPM sample between
    rounds. Not thread-safe: owned by the sampler thread.

    Every NVML call goes through ``backend.call`` (NotSupported -> None, lost GPU -> None);
    any other NVML failure of one field is logged and that field left out, so one broken
    field or GPU never empties the others.
    """

    def __init__(self, backend: Any, index: int) -> None:
        self.backend = backend
        self.index = index
        self._gpm_supported: bool | None = None
        self._gpm_prev: Any = None
        self._memory_v2 = True
        self._warned: set[str] = set()

    # ---------------------------------------------------------------- helpers
    def _call(self, function: str, *args: Any) -> Any:
        try:
            return self.backend.call(function, *args, gpu=self.index)
        except AgentError as exc:
            if function not in self._warned:
                self._warned.add(function)
                log.warning("GPU %d: %s failed: %s", self.index, function, exc)
            return None

    def _const(self, name: str) -> Any:
        try:
            return self.backend.const(name)
        except (AttributeError, KeyError, AgentError):
            return None

    # ---------------------------------------------------------------- reading
    def read(self) -> dict[str, float]:
        """One round of telemetry: metric name -> value (dcgm-exporter units)."""
        try:
            h = self.backend.handle(self.index)
        except AgentError as exc:
            log.debug("GPU %d: no handle: %s", self.index, exc)
            return {}
        if h is None:
            return {}
        out: dict[str, float] = {}
        steps: tuple[Callable[[Any, dict[str, float]], None], ...] = (
            self._clocks, self._temperature, self._power, self._utilization,
            self._memory, self._fields, self._remapped_rows, self._ecc, self._gpm_or_pcie,
        )
        for step in steps:
            if self.index in getattr(self.backend, "lost_gpus", ()):
                break  # the GPU fell off during this round: stop calling it
            try:
                step(h, out)
            except (AttributeError, TypeError, ValueError, IndexError) as exc:
                # a malformed NVML answer (driver/library mismatch): drop the field, keep going
                if step.__name__ not in self._warned:
                    self._warned.add(step.__name__)
                    log.warning("GPU %d: %s: unexpected NVML answer: %s", self.index,
                                step.__name__, exc)
        return out

    def _clocks(self, h: Any, out: dict[str, float]) -> None:
        for const, name in (("NVML_CLOCK_SM", "DCGM_FI_DEV_SM_CLOCK"),
                            ("NVML_CLOCK_MEM", "DCGM_FI_DEV_MEM_CLOCK")):
            v = self._call("nvmlDeviceGetClockInfo", h, self._const(const))
            if v is not None:
                out[name] = float(v)

    def _temperature(self, h: Any, out: dict[str, float]) -> None:
        v = self._call("nvmlDeviceGetTemperature", h, self._const("NVML_TEMPERATURE_GPU"))
        if v is not None:
            out["DCGM_FI_DEV_GPU_TEMP"] = float(v)

    def _power(self, h: Any, out: dict[str, float]) -> None:
        mw = self._call("nvmlDeviceGetPowerUsage", h)
        if mw is not None:
            out["DCGM_FI_DEV_POWER_USAGE"] = mw / 1000.0
        mj = self._call("nvmlDeviceGetTotalEnergyConsumption", h)
        if mj is not None:
            out["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] = float(mj)
        replay = self._call("nvmlDeviceGetPcieReplayCounter", h)
        if replay is not None:
            out["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"] = float(replay)

    def _utilization(self, h: Any, out: dict[str, float]) -> None:
        u = self._call("nvmlDeviceGetUtilizationRates", h)
        if u is not None:
            out["DCGM_FI_DEV_GPU_UTIL"] = float(u.gpu)
            out["DCGM_FI_DEV_MEM_COPY_UTIL"] = float(u.memory)
        for fn, name in (("nvmlDeviceGetEncoderUtilization", "DCGM_FI_DEV_ENC_UTIL"),
                         ("nvmlDeviceGetDecoderUtilization", "DCGM_FI_DEV_DEC_UTIL")):
            v = self._call(fn, h)
            if v is not None:
                out[name] = float(v[0])

    def _memory(self, h: Any, out: dict[str, float]) -> None:
        mem = None
        if self._memory_v2:
            version = self._const("nvmlMemory_v2")
            mem = self._call("nvmlDeviceGetMemoryInfo", h, version) if version else None
            if mem is None:
                self._memory_v2 = False  # older driver: v1 from now on
        if mem is None:
            mem = self._call("nvmlDeviceGetMemoryInfo", h)
        if mem is None:
            return
        out["DCGM_FI_DEV_FB_FREE"] = float(mem.free // _MIB)
        out["DCGM_FI_DEV_FB_USED"] = float(mem.used // _MIB)
        reserved = getattr(mem, "reserved", None)
        if reserved is not None:
            out["DCGM_FI_DEV_FB_RESERVED"] = float(reserved // _MIB)

    def _fields(self, h: Any, out: dict[str, float]) -> None:
        names = ("NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL",
                 "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX", "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX")
        ids = [self._const(n) for n in names]
        wanted = [i for i in ids if i is not None]
        if not wanted:
            return
        values = self._call("nvmlDeviceGetFieldValues", h, wanted)
        if values is None:
            return
        got: dict[int, float] = {}
        for fv in values:
            v = field_value(fv)
            if v is not None:
                got[int(fv.fieldId)] = v
        mem_temp, c0, raw_tx, raw_rx = (got.get(i) if i is not None else None for i in ids)
        if mem_temp is not None:
            out["DCGM_FI_DEV_MEMORY_TEMP"] = mem_temp
        if c0 is not None:
            out["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] = c0
        elif raw_tx is not None and raw_rx is not None:
            out["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] = raw_tx + raw_rx

    def _remapped_rows(self, h: Any, out: dict[str, float]) -> None:
        rows = self._call("nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, _pending, failure = rows
            out["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"] = float(corr)
            out["DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"] = float(unc)
            out["DCGM_FI_DEV_ROW_REMAP_FAILURE"] = float(failure)

    def _ecc(self, h: Any, out: dict[str, float]) -> None:
        corrected = self._const("NVML_MEMORY_ERROR_TYPE_CORRECTED")
        uncorrected = self._const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED")
        volatile = self._const("NVML_VOLATILE_ECC")
        aggregate = self._const("NVML_AGGREGATE_ECC")
        for etype, ctype, name in (
            (corrected, volatile, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"),
            (uncorrected, volatile, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"),
            (corrected, aggregate, "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"),
            (uncorrected, aggregate, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"),
        ):
            v = self._call("nvmlDeviceGetTotalEccErrors", h, etype, ctype)
            if v is None:
                return  # ECC disabled or unsupported: all four are absent
            out[name] = float(v)

    # ---------------------------------------------------------------- GPM
    def _gpm_or_pcie(self, h: Any, out: dict[str, float]) -> None:
        if self._gpm_supported is None:
            support = self._call("nvmlGpmQueryDeviceSupport", h)
            self._gpm_supported = bool(support is not None and support.isSupportedDevice)
        if self._gpm_supported:
            self._gpm(h, out)
        if "DCGM_FI_PROF_PCIE_TX_BYTES" not in out:
            for const, name in (("NVML_PCIE_UTIL_TX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES"),
                                ("NVML_PCIE_UTIL_RX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES")):
                kb_s = self._call("nvmlDeviceGetPcieThroughput", h, self._const(const))
                if kb_s is not None:
                    out[name] = float(kb_s) * 1024.0

    def _gpm(self, h: Any, out: dict[str, float]) -> None:
        sample = self._call("nvmlGpmSampleAlloc")
        if sample is None:
            return
        if self._call("nvmlGpmSampleGet", h, sample) is None:
            self._call("nvmlGpmSampleFree", sample)
            return
        prev, self._gpm_prev = self._gpm_prev, sample
        if prev is None:
            return  # a ratio needs two samples: values from the next round on
        try:
            request = self._gpm_request(prev, sample)
            # pynvml fills the request in place and returns it
            result = self._call("nvmlGpmMetricsGet", request) if request is not None else None
            if result is not None:
                for k, (_const, name, scale) in enumerate(self._gpm_ids):
                    metric = result.metrics[k]
                    if getattr(metric, "nvmlReturn", 0) == 0:
                        out[name] = float(metric.value) * scale
        finally:
            self._call("nvmlGpmSampleFree", prev)

    def _gpm_request(self, sample1: Any, sample2: Any) -> Any:
        """A ``c_nvmlGpmMetricsGet_t`` from the library (the struct pynvml's
        ``nvmlGpmMetricsGet`` fills in place), or None if the library has none."""
        struct = self._const("c_nvmlGpmMetricsGet_t")
        if struct is None:
            return None
        ids = [(self._const(c), name, scale) for c, name, scale in _GPM_METRICS]
        self._gpm_ids = [(i, n, s) for i, n, s in ids if i is not None]
        request = struct()
        request.version = self._const("NVML_GPM_METRICS_GET_VERSION") or 1
        request.numMetrics = len(self._gpm_ids)
        request.sample1 = sample1
        request.sample2 = sample2
        for k, (metric_id, _name, _scale) in enumerate(self._gpm_ids):
            request.metrics[k].metricId = metric_id
        return request

    def close(self) -> None:
        """Free the GPM sample held between rounds."""
        if self._gpm_prev is not None:
            self._call("nvmlGpmSampleFree", self._gpm_prev)
            self._gpm_prev = None
