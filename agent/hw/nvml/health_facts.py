"""The health facts a poll reads (:class:`agent.hw.protocols.HealthFacts`), through the call
wrapper (:class:`agent.hw.nvml.calls.NvmlCalls`) and sysfs.

=====================  ==============================================================
fact                   source
=====================  ==============================================================
remapped_rows          nvmlDeviceGetRemappedRows(h): (corrRows, uncRows, isPending,
                       failureOccurred); Ampere and newer with HBM
nvlink_states          nvmlDeviceGetNvLinkState(h, link) for link in
                       0..NVML_NVLINK_MAX_LINKS-1 until InvalidArgument; a port
                       answering NotSupported is one the GPU does not have (the ports a
                       GPU has are learnt once, then only they are asked); unknown for
                       a GPU in MIG mode (nvmlDeviceGetMigMode: MIG turns NVLink P2P off)
fabric_state           nvmlDeviceGetGpuFabricInfoV (v2 struct), else
                       nvmlDeviceGetGpuFabricInfo: state and status
recovery_action        nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
pci_gpus               sysfs: NVIDIA display / 3D controllers on the PCI bus
                       (:meth:`agent.hw.sysfs.SysfsReader.nvidia_gpus`)
=====================  ==============================================================

A call that fails for one GPU (NotSupported, GPU lost, any NVML error) makes that fact
unknown (None) for that GPU; the error is counted (``NvmlCalls.error_counts``) and logged
once per function and GPU.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from agent.formats import BusIdError, sysfs_to_nvml_bus_id
from agent.hw.nvml.calls import NvmlCalls, NvmlError
from agent.hw.protocols import FabricState, RemappedRows

if TYPE_CHECKING:  # pragma: no cover
    from agent.hw.sysfs import SysfsReader

__all__ = ["NvmlHealthFacts"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_FABRIC_STATES = {0: "not-supported", 1: "not-started", 2: "in-progress", 3: "completed"}


class NvmlHealthFacts:
    """Reads the health facts of ``nvml``'s GPUs (module docstring); thread-safe as the
    wrapper is (the port cache is only ever filled with a complete answer)."""

    def __init__(self, nvml: NvmlCalls, sysfs: SysfsReader | None) -> None:
        self._nvml = nvml
        self._sysfs = sysfs
        self._ports: dict[int, tuple[int, ...]] = {}  # GPU -> the NVLink ports it has
        self._logged: set[tuple[str, int]] = set()

    def _guarded(self, what: str, index: int, read: Callable[[Any], _T | None]) -> _T | None:
        """``read(handle)`` for GPU ``index``; None (logged once) when NVML fails."""
        h = self._nvml.handle(index)
        if h is None:
            return None
        try:
            return read(h)
        except NvmlError as exc:
            if (what, index) not in self._logged:
                self._logged.add((what, index))
                log.warning("GPU %d: cannot read %s (%s); it stays unknown while this lasts", index, what, exc)
            return None

    # ------------------------------------------------------------------ facts
    def remapped_rows(self, index: int) -> RemappedRows | None:
        def read(h: Any) -> RemappedRows | None:
            raw = self._nvml.call("nvmlDeviceGetRemappedRows", h, gpu=index)
            if raw is None:
                return None
            corr, unc, pending, failed = (int(x) for x in raw)
            return RemappedRows(corr, unc, bool(pending), bool(failed))

        return self._guarded("row remapping", index, read)

    def nvlink_states(self, index: int) -> Mapping[int, bool] | None:
        return self._guarded("NVLink states", index, lambda h: self._read_ports(index, h))

    def _read_ports(self, index: int, h: Any) -> dict[int, bool] | None:
        nvml = self._nvml
        mig = nvml.call("nvmlDeviceGetMigMode", h, gpu=index)
        if mig is not None and int(mig[0]) == nvml.const("NVML_DEVICE_MIG_ENABLE", 1):
            return None
        enabled = nvml.const("NVML_FEATURE_ENABLED", 1)
        invalid = (nvml.const("NVML_ERROR_INVALID_ARGUMENT"),)
        known = self._ports.get(index)
        ports = known if known is not None else range(int(nvml.const("NVML_NVLINK_MAX_LINKS", 18)))
        states: dict[int, bool] = {}
        for link in ports:
            state = nvml.call("nvmlDeviceGetNvLinkState", h, link, gpu=index, absent=invalid)
            if state is None:
                if index in nvml.lost_gpus:
                    return None
                if known is not None:
                    return None  # a port it has answers nothing now: unknown, not "no port"
                continue  # a port the GPU does not have (NotSupported), or past the last one
            states[link] = int(state) == enabled
        if known is None:
            self._ports[index] = tuple(states)
        return states

    def fabric_state(self, index: int) -> FabricState | None:
        return self._guarded("fabric state", index, lambda h: self._read_fabric(index, h))

    def _read_fabric(self, index: int, h: Any) -> FabricState | None:
        nvml = self._nvml
        info: Any
        if nvml.has("nvmlDeviceGetGpuFabricInfoV") and nvml.has("c_nvmlGpuFabricInfoV_t"):
            info = nvml.const("c_nvmlGpuFabricInfoV_t")()
            info.version = nvml.const("nvmlGpuFabricInfo_v2")
            done = nvml.call("nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info), gpu=index)
        elif nvml.has("nvmlDeviceGetGpuFabricInfo") and nvml.has("c_nvmlGpuFabricInfo_t"):
            info = nvml.const("c_nvmlGpuFabricInfo_t")()
            done = nvml.call("nvmlDeviceGetGpuFabricInfo", h, ctypes.byref(info), gpu=index)
        else:
            return None
        if done is None:
            return None
        state = int(info.state)
        return FabricState(_FABRIC_STATES.get(state, f"state-{state}"), int(info.status))

    def recovery_action(self, index: int) -> int | None:
        return self._guarded("the GPU recovery action", index, lambda h: self._read_recovery(index, h))

    def _read_recovery(self, index: int, h: Any) -> int | None:
        nvml = self._nvml
        field = nvml.const("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            return None  # a pynvml older than the field
        values = nvml.call("nvmlDeviceGetFieldValues", h, [field], gpu=index)
        if not values:
            return None
        value = values[0]
        if int(value.nvmlReturn) != nvml.const("NVML_SUCCESS", 0):
            return None  # a driver without the field answers NotSupported in the entry
        return int(value.value.uiVal)

    def pci_gpus(self) -> tuple[str, ...] | None:
        if self._sysfs is None:
            return None
        out = []
        for bdf in self._sysfs.nvidia_gpus():
            try:
                out.append(sysfs_to_nvml_bus_id(bdf))
            except BusIdError:
                continue
        return tuple(out)
