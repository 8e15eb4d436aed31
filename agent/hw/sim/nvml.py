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

Constants, errors and structs: :mod:`agent.hw.sim.nvml_types`; state, fault injection and
the library functions: :mod:`agent.hw.sim.nvml_core`; telemetry, GPM and events:
:mod:`agent.hw.sim.nvml_telemetry`.

Size: :class:`FakeNvml` is pynvml's device, MIG and NVLink functions, one short method each
with pynvml's own name and parameters, which ``tests/test_fake_nvml.py`` compares one by one
with the installed pynvml; the state and the telemetry halves already live apart.
"""

from __future__ import annotations

import ctypes
import uuid as uuid_mod
import zlib
from typing import Any

from agent.formats import parse_cpulist, sysfs_to_nvml_bus_id
from agent.hw.pcie import PciePlace, pcie_level
from agent.hw.sim.nvml_core import _Handle, _Link, api
from agent.hw.sim.nvml_mig import MigApi, mig_uuid
from agent.hw.sim.nvml_telemetry import TelemetryApi
from agent.hw.sim.nvml_types import (
    CONSTANTS,
    ERROR_CLASSES,
    STRUCTS,
    _err,
    c_nvmlDeviceAttributes,
    c_nvmlGpuFabricInfo_t,
    c_nvmlGpuFabricInfoV_t,
    c_nvmlMemory_t,
    c_nvmlMemory_v2_t,
)
from agent.hw.sim.spec_model import GpuSpec
from agent.hw.sim.sysfs_tree import placement_path

_C = CONSTANTS
#: GPU generations whose driver answers the fabric-info query (NVSwitch fabric, GB200 NVL)
_FABRIC_ARCHITECTURES = frozenset({"hopper", "blackwell"})


def _pcie_place(g: GpuSpec) -> PciePlace:
    """Where the spec puts GPU ``g`` in the PCIe tree: the place the fake sysfs gives it."""
    cpus = frozenset(parse_cpulist(g.cpulist)) if g.cpulist else None
    return PciePlace(placement_path(g.host_bridge, g.switches, g.bus_id), g.numa_node, cpus)


class FakeNvml(TelemetryApi, MigApi):
    """A module-like fake of ``pynvml`` for one machine (see the module docstring).

    Thread-safe: every function takes the fake's lock, except the event wait which blocks on
    its event set's own condition.
    """

    # ================================================================== devices
    @api
    def nvmlDeviceGetCount(self) -> int:
        return len(self.spec.gpus)

    @api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not isinstance(index, int) or not 0 <= index < len(self._handles):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self._handles[index]

    @api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        key = uuid.decode() if isinstance(uuid, bytes) else uuid
        if key not in self._by_uuid:
            raise _err("NVML_ERROR_NOT_FOUND")
        return self._handles[self._by_uuid[key]]

    @api
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> _Handle:
        key = pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId
        try:
            index = self._by_bus[sysfs_to_nvml_bus_id(key)]
        except (ValueError, KeyError):
            raise _err("NVML_ERROR_NOT_FOUND") from None
        return self._handles[index]

    @api
    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        return g.index

    @api
    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        g, mig = self._dev(handle)
        return g.uuid if mig is None else mig_uuid(g.uuid, mig)

    @api
    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        g, mig = self._dev(handle)
        if g.model.name is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")  # the spec names no model
        return g.model.name if mig is None else f"{g.model.name} MIG {self._mig(g, mig).profile}"

    @api
    def nvmlDeviceGetSerial(self, handle: _Handle) -> str:
        g, _ = self._dev(handle, mig_ok=False)
        return f"{1320000000000 + zlib.crc32(g.uuid.encode()) % 1000000000:013d}"

    @api
    def nvmlDeviceGetArchitecture(self, device: _Handle) -> int:
        g, _ = self._dev(device)
        return g.model.arch_constant

    @api
    def nvmlDeviceGetBrand(self, handle: _Handle) -> int:
        g, _ = self._dev(handle)
        if g.model.brand is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return int(_C[f"NVML_BRAND_{g.model.brand}"])

    @api
    def nvmlDeviceGetPersistenceMode(self, handle: _Handle) -> int:
        """Always Enabled (NVML: Disabled unless set; :mod:`agent.hw.sim.nvml_telemetry`)."""
        self._dev(handle, mig_ok=False)
        return _C["NVML_FEATURE_ENABLED"]

    @api
    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        if g.minor_number is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return g.minor_number

    @api
    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        g, _ = self._dev(handle)
        if g.model.compute_capability is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return g.model.compute_capability

    @api
    def nvmlDeviceGetComputeMode(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        return int(_C[f"NVML_COMPUTEMODE_{g.compute_mode.upper()}"])

    @api
    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        g, mig = self._dev(handle)
        mib = 1 << 20
        if g.model.memory_mib is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")  # the spec states no memory size
        with self._lock:
            if mig is None:
                total = g.model.memory_mib * mib
                reserved = min(g.model.memory_mib // 100, 600) * mib
                used = int(self._telemetry[g.index]["memory_used_mib"]) * mib
            else:
                total = self._mig(g, mig).memory_mib * mib
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

    @api
    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    @api
    def nvmlDeviceGetPciInfo_v3(self, handle: _Handle) -> Any:
        g, _ = self._dev(handle, mig_ok=False)
        return self._pci_info(g.bus_id, g.model.pci_device_id)

    @api
    def nvmlDeviceGetNumaNodeId(self, handle: _Handle) -> int:
        g, _ = self._dev(handle, mig_ok=False)
        if g.gpu_numa_id is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return g.gpu_numa_id

    @api
    def nvmlDeviceGetCpuAffinity(self, handle: _Handle, cpuSetSize: int) -> list[int]:
        g, _ = self._dev(handle, mig_ok=False)
        words = [0] * cpuSetSize
        for cpu in parse_cpulist(g.cpulist or ""):
            if cpu // 64 < cpuSetSize:
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    # ------------------------------------------------------------------ MIG
    @api
    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        g, _ = self._dev(device, mig_ok=False)
        if g.model.mig is None:
            # the spec does not say: answer as a driver without the function, so the
            # capability stays unknown (NotSupported would say "not capable")
            raise _err("NVML_ERROR_FUNCTION_NOT_FOUND")
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        with self._lock:  # [current, pending]: on Ampere a change waits for a GPU reset
            state = self._mig_state[g.index]
            return [int(state.current), int(state.pending)]

    @api
    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Handle) -> int:
        g, _ = self._dev(device, mig_ok=False)
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        geometry = self._mig_state[g.index].geometry
        return geometry.compute_slices if geometry is not None else 7

    @api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Handle, index: int) -> _Handle:
        g, _ = self._dev(device, mig_ok=False)
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        geometry = self._mig_state[g.index].geometry
        if not isinstance(index, int) or not 0 <= index < (geometry.compute_slices if geometry else 7):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        with self._lock:  # the MIG devices that exist now, in creation order
            state = self._mig_state[g.index]
            if not state.current:
                raise _err("NVML_ERROR_INVALID_ARGUMENT")
            devices = state.devices()
            if index >= len(devices):
                raise _err("NVML_ERROR_NOT_FOUND")
            return _Handle(g.index, devices[index].ci.serial)

    @api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: _Handle) -> _Handle:
        g, mig = self._dev(migDevice)
        if mig is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self._handles[g.index]

    @api
    def nvmlDeviceIsMigDeviceHandle(self, device: _Handle) -> ctypes.c_uint:
        _, mig = self._dev(device)
        return ctypes.c_uint(0 if mig is None else 1)

    @api
    def nvmlDeviceGetGpuInstanceId(self, device: _Handle) -> int:
        g, mig = self._dev(device)
        if mig is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self._mig(g, mig).gi.gi_id

    @api
    def nvmlDeviceGetComputeInstanceId(self, device: _Handle) -> int:
        g, mig = self._dev(device)
        if mig is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self._mig(g, mig).ci.ci_id

    @api
    def nvmlDeviceGetAttributes(self, device: _Handle) -> Any:
        return self.nvmlDeviceGetAttributes_v2(device)

    @api
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
                memorySizeMB=g.model.memory_mib or 0,
            )
        d = self._mig(g, mig)
        p = d.gi.profile
        return c_nvmlDeviceAttributes(
            multiprocessorCount=(p.multiprocessors if p is not None else g.model.sm_count * d.gi_slices // 7)
            * d.ci_slices // d.gi_slices,
            sharedCopyEngineCount=p.copy_engines if p is not None else d.gi_slices,
            sharedDecoderCount=p.decoders if p is not None else d.gi_slices // 2,
            sharedEncoderCount=0,
            sharedJpegCount=p.jpegs if p is not None else int(d.gi_slices == 7),
            sharedOfaCount=p.ofas if p is not None else int(d.gi_slices == 7),
            gpuInstanceSliceCount=d.gi_slices,
            computeInstanceSliceCount=d.ci_slices,
            memorySizeMB=d.memory_mib,
        )

    # ------------------------------------------------------------------ NVLink / topology
    def _link(self, device: _Handle, link: int) -> _Link | None:
        g, _ = self._dev(device, mig_ok=False)
        if not isinstance(link, int) or not 0 <= link < _C["NVML_NVLINK_MAX_LINKS"]:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        if link >= len(self._links[g.index]):
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return self._links[g.index][link]

    @api
    def nvmlDeviceGetNvLinkState(self, device: _Handle, link: int) -> int:
        wired = self._link(device, link)
        return _C["NVML_FEATURE_ENABLED"] if wired is not None else _C["NVML_FEATURE_DISABLED"]

    @api
    def nvmlDeviceGetNvLinkVersion(self, device: _Handle, link: int) -> int:
        if self._link(device, link) is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return self.spec.gpus[device.gpu].model.nvlink_version

    @api
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

    @api
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        wired = self._link(handle, link)
        if wired is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return wired.kind

    def _topology_level(self, a: GpuSpec, b: GpuSpec) -> int | None:
        """NVML's level of two GPUs: the spec's ``pcie_levels``, else the one PCIe rule
        (:func:`agent.hw.pcie.pcie_level`) on the places the fake sysfs gives them; None
        where that rule cannot tell."""
        if a.index == b.index or (a.board is not None and a.board == b.board):
            return _C["NVML_TOPOLOGY_INTERNAL"]
        key = (min(a.index, b.index), max(a.index, b.index))
        if key in self.spec.pcie_levels:
            return self.spec.pcie_levels[key]
        level = pcie_level(_pcie_place(a), _pcie_place(b), len(self.spec.numa_nodes))
        return int(level) if level is not None else None

    @api
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: _Handle, device2: _Handle) -> int:
        a, _ = self._dev(device1, mig_ok=False)
        b, _ = self._dev(device2, mig_ok=False)
        level = self._topology_level(a, b)
        if level is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")  # the spec does not place them apart
        return level

    @api
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
        level = self._topology_level(a, b)
        if nvlinked or (level is not None and level < _C["NVML_TOPOLOGY_SYSTEM"]):
            return _C["NVML_P2P_STATUS_OK"]
        return _C["NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED"]

    def _fill_fabric(self, device: _Handle, info: Any) -> None:
        g, _ = self._dev(device, mig_ok=False)
        target = getattr(info, "_obj", info)  # byref(struct) or the struct itself
        if g.fabric_clique_id is None:
            # A Hopper or newer GPU outside any fabric answers SUCCESS with state
            # NOT_SUPPORTED (seen: an H200 in a VM, driver 580.159.04); older ones have no
            # fabric info at all
            if g.model.architecture not in _FABRIC_ARCHITECTURES:
                raise _err("NVML_ERROR_NOT_SUPPORTED")
            if not isinstance(target, (c_nvmlGpuFabricInfo_t, c_nvmlGpuFabricInfoV_t)):
                raise _err("NVML_ERROR_INVALID_ARGUMENT")
            target.state = _C["NVML_GPU_FABRIC_STATE_NOT_SUPPORTED"]
            target.status = _C["NVML_SUCCESS"]
            return
        if not isinstance(target, (c_nvmlGpuFabricInfo_t, c_nvmlGpuFabricInfoV_t)):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        raw = uuid_mod.UUID(g.fabric_cluster_uuid).bytes if g.fabric_cluster_uuid else bytes(16)
        for k in range(16):
            target.clusterUuid[k] = raw[k]
        target.status = _C["NVML_SUCCESS"]
        target.cliqueId = g.fabric_clique_id
        target.state = _C["NVML_GPU_FABRIC_STATE_COMPLETED"]

    @api
    def nvmlDeviceGetGpuFabricInfo(self, device: _Handle, gpuFabricInfo: Any) -> int:
        self._fill_fabric(device, gpuFabricInfo)
        return _C["NVML_SUCCESS"]

    @api
    def nvmlDeviceGetGpuFabricInfoV(self, device: _Handle, gpuFabricInfo: Any) -> int:
        target = getattr(gpuFabricInfo, "_obj", gpuFabricInfo)
        if getattr(target, "version", None) != _C["nvmlGpuFabricInfo_v2"]:
            raise _err("NVML_ERROR_ARGUMENT_VERSION_MISMATCH")
        self._fill_fabric(device, gpuFabricInfo)
        return _C["NVML_SUCCESS"]



# pynvml's constants, error classes and struct classes, as attributes of the module-like fake
for _name, _value in {**CONSTANTS, **ERROR_CLASSES, **STRUCTS}.items():
    setattr(FakeNvml, _name, _value)
del _name, _value

