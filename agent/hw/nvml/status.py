"""What a node check reads of each GPU beyond discovery and telemetry, through the call
wrapper (:class:`agent.hw.nvml.calls.NvmlCalls`): persistence mode and the state of each
NVLink port.

=======================  ===========================================================
GpuStatus field          NVML source
=======================  ===========================================================
persistence_mode         nvmlDeviceGetPersistenceMode(h) == NVML_FEATURE_ENABLED
                         (None: NotSupported, as on Windows and some vGPU guests)
nvlink_ports             nvmlDeviceGetNvLinkState(h, link) for link in
                         0..NVML_NVLINK_MAX_LINKS-1, until InvalidArgument: True
                         active, False inactive; a port answering NotSupported is one
                         the GPU does not have and is left out
=======================  ===========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.hw.nvml.calls import NvmlCalls

__all__ = ["GpuStatus", "read_gpu_status"]


@dataclass(frozen=True)
class GpuStatus:
    """One GPU's persistence mode and NVLink port states; None where NVML does not say (a
    lost GPU says nothing)."""

    index: int
    persistence_mode: bool | None = None
    #: per NVLink port the GPU has: True active, False inactive (empty: no NVLink)
    nvlink_ports: tuple[bool, ...] | None = None

    @property
    def nvlinks_active(self) -> int:
        return sum(self.nvlink_ports or ())


def read_gpu_status(nvml: NvmlCalls, index: int) -> GpuStatus:
    """GPU ``index``'s :class:`GpuStatus` (an initialised wrapper)."""
    h = nvml.handle(index)
    if h is None:
        return GpuStatus(index)
    mode = nvml.call("nvmlDeviceGetPersistenceMode", h, gpu=index)
    enabled = nvml.const("NVML_FEATURE_ENABLED", 1)
    invalid = (nvml.const("NVML_ERROR_INVALID_ARGUMENT"),)
    ports: list[bool] = []
    for link in range(int(nvml.const("NVML_NVLINK_MAX_LINKS", 18))):
        state = nvml.call("nvmlDeviceGetNvLinkState", h, link, gpu=index, absent=invalid)
        if state is None:
            if index in nvml.lost_gpus:
                return GpuStatus(index, None if mode is None else int(mode) == enabled, None)
            continue  # a port this GPU does not have (NotSupported) or past the last one
        ports.append(int(state) == enabled)
    return GpuStatus(index, None if mode is None else int(mode) == enabled, tuple(ports))
