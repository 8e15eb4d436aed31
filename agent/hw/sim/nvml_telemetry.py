"""The fake NVML's telemetry, GPM and event functions (a base of
:class:`agent.hw.sim.nvml.FakeNvml`), deterministic per (machine, GPU) unless set.

Units are NVML's: power in milliwatts, energy in millijoules since the driver loaded,
temperatures in degrees C, clocks in MHz, memory in bytes, PCIe throughput in KB/s,
utilisation in percent. Where the fake answers differently from what NVML documents (so a
test on the fake passes where a real GPU may answer otherwise; ``bench/real_gpu/`` compares
them on hardware):

* **NotSupported by architecture.** Real NVML answers NotSupported for
  ``nvmlDeviceGetTotalEccErrors`` on GPUs without ECC (GeForce, most workstation boards, or
  ECC turned off), for ``nvmlDeviceGetFieldValues``' memory temperature on GDDR boards, for
  ``nvmlDeviceGetPowerUsage``/``nvmlDeviceGetTotalEnergyConsumption`` on some boards and
  vGPU guests, and for ``nvmlDeviceGetPcieReplayCounter`` in some VMs; the fake answers
  all of them for every catalogued GPU. ``nvmlDeviceGetRemappedRows`` (Ampere+ with HBM),
  GPM (Hopper+) and per-process utilisation (Maxwell+, not in MIG mode) follow the
  architecture as NVML does.
* **Time.** Counters (energy, NVLink traffic) advance one simulated second per read;
  PCIe throughput (NVML: a 20 ms sample) and utilisation (NVML: an average over 1/6 s to
  1 s by product) are fixed figures.
* **Persistence mode** (``nvmlDeviceGetPersistenceMode``, :mod:`agent.hw.sim.nvml`) is always
  Enabled; on real Linux nodes it is Disabled unless ``nvidia-persistenced`` or
  ``nvidia-smi -pm 1`` set it, and NotSupported on Windows.
* **Events.** Real NVML delivers only events raised after the registration; the spec's
  ``faults.xids`` are raised again at every registration (a recurring XID), and
  ``inject_xid`` delivers at once; MIG instance ids in event data are always 0xFFFFFFFF.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from agent.hw.sim.nvml_core import FakeNvmlCore, _EventSet, _GpmSample, _Handle, api
from agent.hw.sim.nvml_types import (
    CONSTANTS,
    NVMLError,
    _err,
    c_nvmlFieldValue_t,
    c_nvmlGpmSupport_t,
    c_nvmlProcessInfo_t,
    c_nvmlProcessUtilizationSample_t,
    c_nvmlUtilization_t,
)
from agent.hw.sim.processes import ProcessSpec
from agent.hw.sim.spec_model import GpuSpec

_C = CONSTANTS
_NO_ID = 0xFFFFFFFF


class TelemetryApi(FakeNvmlCore):
    """Telemetry, GPM and event functions of the fake."""

    # ================================================================== telemetry
    def _t(self, handle: _Handle) -> tuple[GpuSpec, dict[str, Any]]:
        g, _ = self._dev(handle, mig_ok=False)
        return g, self._telemetry[g.index]

    @api
    def nvmlDeviceGetClockInfo(self, handle: _Handle, type: int) -> int:
        _, t = self._t(handle)
        key = {0: "sm_clock_mhz", 1: "sm_clock_mhz", 2: "mem_clock_mhz", 3: "video_clock_mhz"}.get(
            type
        )
        if key is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t[key])

    @api
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

    @api
    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        _, t = self._t(handle)
        if sensor != _C["NVML_TEMPERATURE_GPU"]:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t["gpu_temp_c"])

    @api
    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        _, t = self._t(handle)
        return int(t["power_w"]) * 1000

    @api
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        g, _ = self._t(handle)
        return g.model.tdp_w * 1000

    @api
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        g, _ = self._t(handle)
        with self._lock:
            return self._tick(g.index)["energy_mj"]

    @api
    def nvmlDeviceGetPcieReplayCounter(self, handle: _Handle) -> int:
        _, t = self._t(handle)
        return int(t["pcie_replay"])

    @api
    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        _, t = self._t(handle)
        return c_nvmlUtilization_t(gpu=int(t["gpu_util_pct"]), memory=int(t["mem_util_pct"]))

    @api
    def nvmlDeviceGetEncoderUtilization(self, handle: _Handle) -> list[int]:
        _, t = self._t(handle)
        return [int(t["enc_util_pct"]), 167000]

    @api
    def nvmlDeviceGetDecoderUtilization(self, handle: _Handle) -> list[int]:
        _, t = self._t(handle)
        return [int(t["dec_util_pct"]), 167000]

    @api
    def nvmlDeviceGetRemappedRows(self, device: _Handle) -> tuple[int, int, int, int]:
        g, t = self._t(device)
        if not g.model.hbm or (g.model.compute_capability or (0, 0)) < (8, 0):
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return (
            int(t["remapped_correctable"]),
            int(t["remapped_uncorrectable"]),
            int(t["remap_pending"]),
            int(t["remap_failure"]),
        )

    @api
    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, errorType: int, counterType: int) -> int:
        _, t = self._t(handle)
        kind = {0: "sbe", 1: "dbe"}.get(errorType)
        scope = {0: "volatile", 1: "aggregate"}.get(counterType)
        if kind is None or scope is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t[f"ecc_{kind}_{scope}"])

    @api
    def nvmlDeviceGetPcieThroughput(self, device: _Handle, counter: int) -> int:
        _, t = self._t(device)
        key = {0: "pcie_tx_kbps", 1: "pcie_rx_kbps"}.get(counter)
        if key is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return int(t[key])

    def _processes(self, handle: _Handle) -> list[Any]:
        g, mig = self._dev(handle)
        with self._lock:
            procs: list[ProcessSpec] = list(self._telemetry[g.index]["processes"])
        view = None if mig is None else self._mig(g, mig)
        gi = _NO_ID if view is None else view.gi.gi_id
        ci = _NO_ID if view is None else view.ci.ci_id
        # pynvml returns nvmlFriendlyObject copies of c_nvmlProcessInfo_t: same attributes
        return [
            c_nvmlProcessInfo_t(
                pid=p.pid,
                usedGpuMemory=p.used_memory_mib << 20,
                gpuInstanceId=gi,
                computeInstanceId=ci,
            )
            for p in procs
        ]

    @api
    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._processes(handle)

    @api
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._processes(handle)

    @api
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        self._dev(handle)
        return []  # no MPS control daemon is simulated: no MPS clients

    @api
    def nvmlDeviceGetProcessUtilization(self, handle: _Handle, timeStamp: int) -> list[Any]:
        """As NVML: one sample per process with some utilisation since ``timeStamp`` (CPU
        time in microseconds; 0: all the driver keeps), stamped now; NotFound when there is
        none; NotSupported on a GPU in MIG mode or older than Maxwell."""
        g, mig = self._dev(handle)
        if mig is not None or self._mig_on(g) or (g.model.compute_capability or (5, 0)) < (5, 0):
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        now_us = int(time.time() * 1_000_000)
        with self._lock:
            procs: list[ProcessSpec] = list(self._telemetry[g.index]["processes"])
        busy = [p for p in procs if p.sm_util or p.mem_util]
        if not busy or int(timeStamp) >= now_us:
            raise _err("NVML_ERROR_NOT_FOUND")
        return [
            c_nvmlProcessUtilizationSample_t(
                pid=p.pid, timeStamp=now_us, smUtil=p.sm_util, memUtil=p.mem_util
            )
            for p in busy
        ]

    @api
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
        return (g.model.compute_capability or (0, 0)) >= (9, 0)

    @api
    def nvmlGpmQueryDeviceSupport(self, device: _Handle) -> Any:
        g, _ = self._dev(device, mig_ok=False)
        return c_nvmlGpmSupport_t(
            version=_C["NVML_GPM_SUPPORT_VERSION"], isSupportedDevice=int(self._gpm_supported(g))
        )

    @api
    def nvmlGpmSampleAlloc(self) -> _GpmSample:
        return _GpmSample()

    @api
    def nvmlGpmSampleFree(self, gpmSample: _GpmSample) -> None:
        if not isinstance(gpmSample, _GpmSample):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")

    @api
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

    @api
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
    @api
    def nvmlEventSetCreate(self) -> _EventSet:
        s = _EventSet()
        with self._lock:
            self._event_sets.append(s)
        return s

    @api
    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        return g.model.supported_event_types

    @api
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
            before = eventSet.registered.get(g.index, 0)
            eventSet.registered[g.index] = before | eventTypes
        xid_type = _C["nvmlEventTypeXidCriticalError"]
        if eventTypes & xid_type and not before & xid_type:
            # the spec's recurring XIDs (faults.xids): the GPU raises them again, so a new
            # watcher sees them; real NVML delivers only events raised after registration
            for gpu, xid in self.spec.faults.xids:
                if gpu == g.index:
                    self._deliver(gpu, xid_type, xid)

    @api
    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> Any:
        return self._wait(eventSet, timeoutms)

    @api
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

    @api
    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        if not isinstance(eventSet, _EventSet):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        with self._lock:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)
        with eventSet.cond:
            eventSet.cond.notify_all()

