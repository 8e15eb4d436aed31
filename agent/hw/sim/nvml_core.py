"""The fake NVML's state, fault injection, handles and library functions; the device,
MIG and NVLink functions are in :mod:`agent.hw.sim.nvml`, telemetry, GPM and events in
:mod:`agent.hw.sim.nvml_telemetry`.

Size: :class:`FakeNvmlCore` is the one object whose state (handles, lost GPUs, injected faults,
event sets) both halves of the fake read and the fault-injection methods change; splitting it
would split that state across modules.
"""

from __future__ import annotations

import collections
import functools
import threading
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from agent.hw.sim.nvml_mig_state import MigDeviceView, MigGpuState
from agent.hw.sim.nvml_types import (
    CONSTANTS,
    NVMLError,
    _err,
    c_nvmlEventData_t,
    nvmlPciInfo_t,
)
from agent.hw.sim.processes import ProcessSpec
from agent.hw.sim.spec_model import GpuSpec, MachineSpec

_C = CONSTANTS
_T = TypeVar("_T")
_NO_ID = 0xFFFFFFFF  # NVML's "no GPU/compute instance" in event and process records


# =========================================================================== the fake
class _Handle:
    """A device handle (pynvml's ``c_nvmlDevice_t``): a GPU, or MIG device ``mig`` of it."""

    __slots__ = ("gpu", "mig")

    def __init__(self, gpu: int, mig: int | None = None) -> None:
        self.gpu = gpu
        self.mig = mig

    def __repr__(self) -> str:
        return f"<fake nvmlDevice gpu={self.gpu}{'' if self.mig is None else f' mig={self.mig}'}>"


class _InstanceHandle:
    """A GPU instance or compute instance handle (pynvml's ``c_nvmlGpuInstance_t`` /
    ``c_nvmlComputeInstance_t``) of GPU ``gpu``: :mod:`agent.hw.sim.nvml_mig`."""

    __slots__ = ("gpu",)

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu


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


def api(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a pynvml function of the fake and applies the library-wide checks first:
    initialised, not removed, fault injection, lost GPU."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: FakeNvmlCore, *args: Any, **kwargs: Any) -> Any:
        self._check(name, args)
        return fn(self, *args, **kwargs)

    return wrapper


class FakeNvmlCore:
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
        self._mig_state = [MigGpuState.from_spec(g) for g in spec.gpus]
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
        # a GPU with no NVLink wired answers NotSupported on every port, not "disabled"
        # (seen: an H200 in a VM, driver 580.159.04, all 18 ports)
        return [ports if any(port is not None for port in ports) else [] for ports in links]

    def _default_telemetry(self, g: GpuSpec) -> dict[str, Any]:
        seed = zlib.crc32(f"{self.spec.name}:{g.index}".encode())
        util = 20 + seed % 71  # 20..90
        mem_util = util // 2
        used_mib = min((g.model.memory_mib or 0) // 2, 1024 + (seed >> 16) % 20000)
        if g.processes:  # the GPU's figures are its processes' (time-sliced: they add up)
            util = min(100, sum(p.sm_util for p in g.processes))
            mem_util = min(100, sum(p.mem_util for p in g.processes))
            used_mib = sum(p.used_memory_mib for p in g.processes)
        temp = 32 + (seed >> 8) % 30
        return {
            "gpu_util_pct": util,
            "mem_util_pct": mem_util,
            "enc_util_pct": 0,
            "dec_util_pct": (seed >> 4) % 5,
            "gpu_temp_c": temp,
            "memory_temp_c": temp + 6,
            "power_w": round(g.model.tdp_w * (0.25 + 0.6 * util / 100)),
            "sm_clock_mhz": g.model.max_sm_clock_mhz - (seed >> 12) % 200,
            "mem_clock_mhz": g.model.mem_clock_mhz,
            "video_clock_mhz": 1275,
            "memory_used_mib": used_mib,
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
            "processes": list(g.processes),
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
        ``processes`` is a list of :class:`~agent.hw.sim.processes.ProcessSpec` or of
        ``(pid, used_mib)`` (a process without utilisation or cgroup)."""
        if field not in TELEMETRY_FIELDS:
            raise ValueError(
                f"unknown telemetry field {field!r}; expected one of {', '.join(TELEMETRY_FIELDS)}"
            )
        if field == "processes":
            value = [p if isinstance(p, ProcessSpec) else ProcessSpec(int(p[0]), int(p[1]))
                     for p in value]
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
    @staticmethod
    def _stated(value: _T | None) -> _T:
        """A fact the spec states; NotSupported where it states none (as NVML answers)."""
        if value is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return value

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
            gpu = next((a.gpu for a in args if isinstance(a, (_Handle, _InstanceHandle))), None)
            for key in ((name, gpu), (name, None)):
                if key in self._failures:
                    raise NVMLError(self._failures[key])
            if any(isinstance(a, (_Handle, _InstanceHandle)) and a.gpu in self._lost for a in args):
                raise _err("NVML_ERROR_GPU_IS_LOST")
            if (name, gpu) in self._unsupported or (name, None) in self._unsupported:
                raise _err("NVML_ERROR_NOT_SUPPORTED")

    def _dev(self, handle: object, *, mig_ok: bool = True) -> tuple[GpuSpec, int | None]:
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu < len(self.spec.gpus):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        if handle.mig is not None and not mig_ok:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return self.spec.gpus[handle.gpu], handle.mig

    def _mig(self, g: GpuSpec, serial: int) -> MigDeviceView:
        """MIG device ``serial`` of GPU ``g`` (a handle to one destroyed since: InvalidArgument)."""
        with self._lock:
            view = self._mig_state[g.index].device(serial)
        if view is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return view

    def _mig_on(self, g: GpuSpec) -> bool:
        """Whether GPU ``g`` is in MIG mode now."""
        with self._lock:
            return self._mig_state[g.index].current

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
    @api
    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    @api
    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._lock:
            if self._init_error is not None:
                raise NVMLError(self._init_error)
            self._initialized += 1

    @api
    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._initialized > 0:
                self._initialized -= 1

    @api
    def nvmlErrorString(self, result: int) -> str:
        return NVMLError._errcode_to_string.get(result, "Unknown Error")

    @api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self._stated(self.spec.driver_version)

    @api
    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12." + self._stated(self.spec.driver_version)

    @api
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._stated(self.spec.cuda_driver_version)

    @api
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self._stated(self.spec.cuda_driver_version)

