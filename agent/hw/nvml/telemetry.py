"""GPU telemetry through the NVML call wrapper, as typed samples.

``NvmlSampler(nvml).sample(index)`` reads one GPU and returns a frozen
:class:`~agent.hw.protocols.GpuSample`: every field is a number in the unit its name says, or
None where NVML has no answer (NotSupported, an older driver, a field that failed). The
metrics layer gets a sampler from the backend (``Telemetry.sample_source()``) and maps these
fields to dcgm-exporter's names; it never calls NVML itself.

=================================  =====================================================
GpuSample field                    NVML source (all through ``NvmlCalls.call``)
=================================  =====================================================
sm_clock_mhz, mem_clock_mhz        nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM / NVML_CLOCK_MEM)
gpu_temp_c                         nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)
memory_temp_c                      nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_MEMORY_TEMP])
power_mw                           nvmlDeviceGetPowerUsage(h)
energy_mj                          nvmlDeviceGetTotalEnergyConsumption(h)
pcie_replays                       nvmlDeviceGetPcieReplayCounter(h)
gpu_util_pct, memory_util_pct      nvmlDeviceGetUtilizationRates(h).gpu / .memory
encoder_util_pct, decoder_util_pct nvmlDeviceGetEncoderUtilization(h)[0], ...Decoder...
fb_free/used/reserved_bytes        nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2) (v1 without
                                   ``reserved`` where v2 is not supported)
nvlink_bandwidth_total             nvmlDeviceGetFieldValues: NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL,
                                   else NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX + _RAW_RX
remapped_rows_correctable,         nvmlDeviceGetRemappedRows(h)[0], [1], [3]
  _uncorrectable, row_remap_failure
ecc_{sbe,dbe}_{volatile,aggregate} nvmlDeviceGetTotalEccErrors(h, CORRECTED/UNCORRECTED,
                                   VOLATILE_ECC/AGGREGATE_ECC); all four or none
graphics/tensor/dram_active_pct    GPM: NVML_GPM_METRIC_GRAPHICS_UTIL / _ANY_TENSOR_UTIL /
                                   _DRAM_BW_UTIL (between this round's and the last one's)
pcie_tx/rx_bytes_per_s             GPM: NVML_GPM_METRIC_PCIE_TX/RX_PER_SEC * 2**20 (MiB/s);
                                   without GPM nvmlDeviceGetPcieThroughput(h, TX/RX) * 1024
processes                          the GPU's processes and what each uses
                                   (:mod:`agent.hw.nvml.processes`)
=================================  =====================================================

GPM (``nvmlGpmQueryDeviceSupport``, ``nvmlGpmSampleAlloc/Get/Free``, ``nvmlGpmMetricsGet``)
exists on Hopper and newer; a ratio needs two samples, so the GPM fields are filled from
the second round on, and never on older GPUs.

A GPU that is lost (or has no handle, or answers nothing) gives no sample; one that is lost during its round
gives what was read before. An NVML failure of one field is logged once and that field left
None; a malformed answer (driver/library mismatch) drops the fields of that step only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.errors import AgentError
from agent.hw.nvml.calls import NvmlCalls
from agent.hw.nvml.processes import GpuProcessReader
from agent.hw.protocols import GpuSample, ProcessSample, SampleSource

__all__ = ["NvmlSampler"]

log = logging.getLogger(__name__)

_MIB = 1 << 20
# union member of c_nvmlValue_t by NVML_VALUE_TYPE_* (0..6)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
# NVML_GPM_METRIC_* -> GpuSample field, and the factor to the field's unit
_GPM_METRICS: tuple[tuple[str, str, float], ...] = (
    ("NVML_GPM_METRIC_GRAPHICS_UTIL", "graphics_active_pct", 1.0),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "tensor_active_pct", 1.0),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "dram_active_pct", 1.0),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "pcie_tx_bytes_per_s", float(_MIB)),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "pcie_rx_bytes_per_s", float(_MIB)),
)


@dataclass
class _GpuState:
    gpm_supported: bool | None = None
    gpm_prev: Any = None
    memory_v2: bool = True
    values: dict[str, float | int] = field(default_factory=dict)
    processes: tuple[tuple[ProcessSample, ...], bool] | None = None


_Step = Callable[[int, Any, "_GpuState"], None]


class NvmlSampler(SampleSource):
    """Reads GPU telemetry through the NVML call wrapper (module docstring); keeps each
    GPU's GPM sample between rounds. Not thread-safe: owned by one sampling thread."""

    def __init__(self, backend: NvmlCalls) -> None:
        self.backend = backend
        self._state: dict[int, _GpuState] = {}
        self._warned: set[tuple[int, str]] = set()
        self._processes = GpuProcessReader(backend)

    # ---------------------------------------------------------------- helpers
    def _call(self, index: int, function: str, *args: Any) -> Any:
        try:
            return self.backend.call(function, *args, gpu=index)
        except AgentError as exc:
            if (index, function) not in self._warned:
                self._warned.add((index, function))
                log.warning("GPU %d: %s failed: %s", index, function, exc)
            return None

    def _const(self, name: str) -> Any:
        return self.backend.const(name, None)

    # ---------------------------------------------------------------- reading
    def sample(self, index: int) -> GpuSample | None:
        """One round of GPU ``index``; None when the GPU is lost, has no handle or NVML
        answered none of its fields."""
        if index in self.backend.lost_gpus:
            return None  # the health watcher probes lost GPUs
        try:
            h = self.backend.handle(index)
        except AgentError as exc:
            log.debug("GPU %d: no handle: %s", index, exc)
            return None
        if h is None:
            return None
        state = self._state.setdefault(index, _GpuState())
        state.values, state.processes = {}, None
        steps: tuple[_Step, ...] = (
            self._clocks, self._temperature, self._power, self._utilization,
            self._memory, self._fields, self._remapped_rows, self._ecc, self._gpm_or_pcie,
            self._process_step,
        )
        for step in steps:
            if index in self.backend.lost_gpus:
                break  # the GPU fell off during this round: stop calling it
            try:
                step(index, h, state)
            except (AttributeError, TypeError, ValueError, IndexError) as exc:
                # a malformed NVML answer (driver/library mismatch): drop the field, keep going
                name = step.__name__
                if (index, name) not in self._warned:
                    self._warned.add((index, name))
                    log.warning("GPU %d: %s: unexpected NVML answer: %s", index, name, exc)
        values, state.values = state.values, {}
        processes, state.processes = state.processes, None
        if not values:
            return None
        procs, util = processes if processes is not None else (None, False)
        return GpuSample(index=index, processes=procs, process_utilization=util,
                         **values)  # type: ignore[arg-type]

    def _clocks(self, index: int, h: Any, state: _GpuState) -> None:
        for const, name in (("NVML_CLOCK_SM", "sm_clock_mhz"), ("NVML_CLOCK_MEM", "mem_clock_mhz")):
            v = self._call(index, "nvmlDeviceGetClockInfo", h, self._const(const))
            if v is not None:
                state.values[name] = int(v)

    def _temperature(self, index: int, h: Any, state: _GpuState) -> None:
        v = self._call(index, "nvmlDeviceGetTemperature", h, self._const("NVML_TEMPERATURE_GPU"))
        if v is not None:
            state.values["gpu_temp_c"] = int(v)

    def _power(self, index: int, h: Any, state: _GpuState) -> None:
        for function, name in (("nvmlDeviceGetPowerUsage", "power_mw"),
                               ("nvmlDeviceGetTotalEnergyConsumption", "energy_mj"),
                               ("nvmlDeviceGetPcieReplayCounter", "pcie_replays")):
            v = self._call(index, function, h)
            if v is not None:
                state.values[name] = int(v)

    def _utilization(self, index: int, h: Any, state: _GpuState) -> None:
        u = self._call(index, "nvmlDeviceGetUtilizationRates", h)
        if u is not None:
            state.values["gpu_util_pct"] = int(u.gpu)
            state.values["memory_util_pct"] = int(u.memory)
        for function, name in (("nvmlDeviceGetEncoderUtilization", "encoder_util_pct"),
                               ("nvmlDeviceGetDecoderUtilization", "decoder_util_pct")):
            v = self._call(index, function, h)
            if v is not None:
                state.values[name] = int(v[0])

    def _memory(self, index: int, h: Any, state: _GpuState) -> None:
        mem = None
        if state.memory_v2:
            version = self._const("nvmlMemory_v2")
            mem = self._call(index, "nvmlDeviceGetMemoryInfo", h, version) if version else None
            if mem is None:
                state.memory_v2 = False  # older driver: v1 from now on
        if mem is None:
            mem = self._call(index, "nvmlDeviceGetMemoryInfo", h)
        if mem is None:
            return
        state.values["fb_free_bytes"] = int(mem.free)
        state.values["fb_used_bytes"] = int(mem.used)
        reserved = getattr(mem, "reserved", None)  # v2 only
        if reserved is not None:
            state.values["fb_reserved_bytes"] = int(reserved)

    def _fields(self, index: int, h: Any, state: _GpuState) -> None:
        names = ("NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_NVLINK_BANDWIDTH_C0_TOTAL",
                 "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX", "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX")
        ids = [self._const(n) for n in names]
        wanted = [i for i in ids if i is not None]
        if not wanted:
            return
        answers = self._call(index, "nvmlDeviceGetFieldValues", h, wanted)
        if answers is None:
            return
        got: dict[int, float] = {}
        for fv in answers:
            v = field_value(fv)
            if v is not None:
                got[int(fv.fieldId)] = v
        mem_temp, c0, raw_tx, raw_rx = (got.get(i) if i is not None else None for i in ids)
        if mem_temp is not None:
            state.values["memory_temp_c"] = mem_temp
        if c0 is not None:
            state.values["nvlink_bandwidth_total"] = c0
        elif raw_tx is not None and raw_rx is not None:
            state.values["nvlink_bandwidth_total"] = raw_tx + raw_rx

    def _process_step(self, index: int, h: Any, state: _GpuState) -> None:
        state.processes = self._processes.read(index, h)

    def _remapped_rows(self, index: int, h: Any, state: _GpuState) -> None:
        rows = self._call(index, "nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, _pending, failure = rows
            state.values["remapped_rows_correctable"] = int(corr)
            state.values["remapped_rows_uncorrectable"] = int(unc)
            state.values["row_remap_failure"] = int(failure)

    def _ecc(self, index: int, h: Any, state: _GpuState) -> None:
        corrected = self._const("NVML_MEMORY_ERROR_TYPE_CORRECTED")
        uncorrected = self._const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED")
        volatile = self._const("NVML_VOLATILE_ECC")
        aggregate = self._const("NVML_AGGREGATE_ECC")
        read: dict[str, int] = {}
        for etype, ctype, name in (
            (corrected, volatile, "ecc_sbe_volatile"),
            (uncorrected, volatile, "ecc_dbe_volatile"),
            (corrected, aggregate, "ecc_sbe_aggregate"),
            (uncorrected, aggregate, "ecc_dbe_aggregate"),
        ):
            v = self._call(index, "nvmlDeviceGetTotalEccErrors", h, etype, ctype)
            if v is None:
                return  # ECC disabled or unsupported: all four are absent
            read[name] = int(v)
        state.values.update(read)

    # ---------------------------------------------------------------- GPM
    def _gpm_or_pcie(self, index: int, h: Any, state: _GpuState) -> None:
        if state.gpm_supported is None:
            support = self._call(index, "nvmlGpmQueryDeviceSupport", h)
            state.gpm_supported = bool(support is not None and support.isSupportedDevice)
        if state.gpm_supported:
            self._gpm(index, h, state)
        if "pcie_tx_bytes_per_s" not in state.values:
            for const, name in (("NVML_PCIE_UTIL_TX_BYTES", "pcie_tx_bytes_per_s"),
                                ("NVML_PCIE_UTIL_RX_BYTES", "pcie_rx_bytes_per_s")):
                kb_s = self._call(index, "nvmlDeviceGetPcieThroughput", h, self._const(const))
                if kb_s is not None:
                    state.values[name] = float(kb_s) * 1024.0

    def _gpm(self, index: int, h: Any, state: _GpuState) -> None:
        sample = self._call(index, "nvmlGpmSampleAlloc")
        if sample is None:
            return
        if self._call(index, "nvmlGpmSampleGet", h, sample) is None:
            self._call(index, "nvmlGpmSampleFree", sample)
            return
        prev, state.gpm_prev = state.gpm_prev, sample
        if prev is None:
            return  # a ratio needs two samples: values from the next round on
        try:
            metrics = [(self._const(c), name, scale) for c, name, scale in _GPM_METRICS]
            wanted = [(i, name, scale) for i, name, scale in metrics if i is not None]
            request = self._gpm_request(prev, sample, [i for i, _n, _s in wanted])
            # pynvml fills the request in place and returns it
            result = (self._call(index, "nvmlGpmMetricsGet", request)
                      if request is not None else None)
            if result is not None:
                for k, (_id, name, scale) in enumerate(wanted):
                    metric = result.metrics[k]
                    if getattr(metric, "nvmlReturn", 0) == 0:
                        state.values[name] = float(metric.value) * scale
        finally:
            self._call(index, "nvmlGpmSampleFree", prev)

    def _gpm_request(self, sample1: Any, sample2: Any, metric_ids: Sequence[int]) -> Any:
        """A ``c_nvmlGpmMetricsGet_t`` of the library (the struct pynvml's
        ``nvmlGpmMetricsGet`` fills in place), or None if the library has none."""
        struct = self._const("c_nvmlGpmMetricsGet_t")
        if struct is None:
            return None
        request = struct()
        request.version = self._const("NVML_GPM_METRICS_GET_VERSION") or 1
        request.numMetrics = len(metric_ids)
        request.sample1 = sample1
        request.sample2 = sample2
        for k, metric_id in enumerate(metric_ids):
            request.metrics[k].metricId = metric_id
        return request

    def close(self) -> None:
        """Free the GPM samples held between rounds."""
        for index, state in self._state.items():
            if state.gpm_prev is not None:
                self._call(index, "nvmlGpmSampleFree", state.gpm_prev)
                state.gpm_prev = None


def field_value(fv: Any) -> float | None:
    """The number in one ``c_nvmlFieldValue_t``, None when NVML returned an error for it."""
    if getattr(fv, "nvmlReturn", 0) != 0:
        return None
    vtype = getattr(fv, "valueType", 0)
    if not 0 <= vtype < len(_VALUE_MEMBERS):
        return None
    return float(getattr(fv.value, _VALUE_MEMBERS[vtype]))
