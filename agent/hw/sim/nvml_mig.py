"""The fake NVML's MIG functions: MIG mode, the GPU's MIG geometry (profiles and their
possible placements, from :mod:`agent.hw.sim.mig_geometry`), GPU and compute instances
created and destroyed as on a real GPU, and the MIG device handles they make.

pynvml's names, parameters, return types and errors (``tests/test_fake_nvml.py`` holds them
to the installed pynvml). Behaviour modelled, as NVML documents it:

* profile info and possible placements answer whatever the MIG mode (a property of the
  product); a profile the GPU lacks is ``NotSupported``; the possible placements are every
  legal one, taken or not (``nvmlDeviceGetGpuInstancePossiblePlacements_v2``);
* creating a GPU instance needs MIG mode on (``NotSupported`` otherwise), a legal placement
  of the profile (``InvalidArgument``) and free memory and compute slices
  (``InsufficientResources``: overlapping or taken);
* destroying a GPU instance that still holds compute instances, or a compute instance whose
  GPU instance runs processes (:meth:`MigApi.occupy_mig`), is ``InUse``; a handle to an
  instance destroyed since is ``InvalidArgument``, an unknown id ``NotFound``;
* ``nvmlDeviceSetMigMode``: on Ampere the change stays pending until a GPU reset (the
  activation status says ``RESET_REQUIRED``); on Hopper and newer it takes effect at once on
  a GPU without processes (``InUse`` otherwise); disabling with GPU instances left is
  ``InUse``.

Every change of layout or mode is handed to :meth:`MigApi._mig_changed`, which writes the
simulator's state file where one is kept (:meth:`MigApi.keep_mig_state`).

Size: above 400 lines because it is pynvml's MIG API, one short method per function with
pynvml's own name and parameters, each holding NVML's documented errors; the layout itself
lives apart (:mod:`agent.hw.sim.nvml_mig_state`).
"""

from __future__ import annotations

import re
import uuid as uuid_mod
from collections.abc import Callable
from typing import Any

from agent.hw.sim.mig_geometry import fits
from agent.hw.sim.mig_state_file import load_mig_state, save_mig_state
from agent.hw.sim.nvml_core import FakeNvmlCore, _Handle, _InstanceHandle, api
from agent.hw.sim.nvml_mig_state import (
    CI_PROFILES,
    ComputeInstance,
    GpuInstance,
    MigGpuState,
    ci_slice_choices,
)
from agent.hw.sim.nvml_types import (
    CONSTANTS,
    _err,
    c_nvmlComputeInstanceInfo_t,
    c_nvmlComputeInstancePlacement_t,
    c_nvmlComputeInstanceProfileInfo_v2_t,
    c_nvmlGpuInstanceInfo_t,
    c_nvmlGpuInstancePlacement_t,
    c_nvmlGpuInstanceProfileInfo_v2_t,
)
from agent.hw.sim.spec_model import GpuSpec
from agent.records import MigPlacement, MigProfile

_C = CONSTANTS
#: architectures whose MIG mode changes without a GPU reset
_LIVE_MIG_MODE = frozenset({"hopper", "blackwell"})


def _memory_gb(profile_name: str) -> int:
    """``"3g.40gb"`` -> 40."""
    m = re.match(r"\d+g\.(\d+)gb", profile_name)
    return int(m[1]) if m else 0


def mig_uuid(gpu_uuid: str, serial: int) -> str:
    """The UUID of MIG device ``serial`` of the GPU ``gpu_uuid``: stable, never reused."""
    return "MIG-" + str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f"{gpu_uuid}/mig/{serial}"))


class _HandleArray(type):
    """``c_nvmlGpuInstance_t * n`` makes an array the fake fills with handles, as callers of
    ``nvmlDeviceGetGpuInstances`` allocate one with pynvml."""

    def __mul__(cls, n: int) -> Callable[[], list[Any]]:
        return lambda: [None] * n


class c_nvmlGpuInstance_t(metaclass=_HandleArray):
    """pynvml's GPU instance handle type (arrays of it: ``(c_nvmlGpuInstance_t * n)()``)."""


class c_nvmlComputeInstance_t(metaclass=_HandleArray):
    """pynvml's compute instance handle type."""


class _GiHandle(_InstanceHandle):
    __slots__ = ("gi_id",)

    def __init__(self, gpu: int, gi_id: int) -> None:
        super().__init__(gpu)
        self.gi_id = gi_id

    def __repr__(self) -> str:
        return f"<fake nvmlGpuInstance gpu={self.gpu} gi={self.gi_id}>"


class _CiHandle(_InstanceHandle):
    __slots__ = ("gi_id", "ci_id")

    def __init__(self, gpu: int, gi_id: int, ci_id: int) -> None:
        super().__init__(gpu)
        self.gi_id = gi_id
        self.ci_id = ci_id

    def __repr__(self) -> str:
        return f"<fake nvmlComputeInstance gpu={self.gpu} gi={self.gi_id} ci={self.ci_id}>"


def _target(ref: Any) -> Any:
    """The object behind ``ctypes.byref(x)`` (or ``x`` itself)."""
    return getattr(ref, "_obj", ref)


class MigApi(FakeNvmlCore):
    """The MIG half of :class:`agent.hw.sim.nvml.FakeNvml` (see the module docstring)."""

    c_nvmlGpuInstance_t = c_nvmlGpuInstance_t
    c_nvmlComputeInstance_t = c_nvmlComputeInstance_t
    #: the simulator's MIG state file (None: the layout lives in memory only)
    _state_file: str | None = None

    # ------------------------------------------------------------------ simulator controls
    def occupy_mig(self, index: int, gi_id: int, busy: bool = True) -> None:
        """Processes run (``busy``) or no longer run in GPU instance ``gi_id`` of GPU
        ``index``: its compute instances cannot be destroyed while they do."""
        with self._lock:
            state = self._mig_state[self._gpu(index).index]
            if busy:
                state.busy.add(gi_id)
            else:
                state.busy.discard(gi_id)

    def keep_mig_state(self, path: str) -> None:
        """Start from the MIG layout in the state file ``path`` and write every change to it
        (:mod:`agent.hw.sim.mig_state_file`); InputFormatError naming it when it is corrupt."""
        with self._lock:
            load_mig_state(path, self.spec, self._mig_state)
            self._state_file = path

    def _mig_changed(self) -> None:
        """Called under the lock after every change of MIG layout or mode."""
        if self._state_file is not None:
            save_mig_state(self._state_file, self.spec, self._mig_state)

    # ------------------------------------------------------------------ helpers
    def _capable(self, device: _Handle) -> tuple[GpuSpec, MigGpuState]:
        g, _ = self._dev(device, mig_ok=False)
        if not g.model.mig:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return g, self._mig_state[g.index]

    def _profile_by_id(self, state: MigGpuState, profile_id: int) -> MigProfile:
        if not isinstance(profile_id, int) or state.geometry is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        for p in state.geometry.profiles:
            if p.profile_id == profile_id:
                return p
        raise _err("NVML_ERROR_INVALID_ARGUMENT")

    def _gi_of(self, handle: object) -> tuple[GpuSpec, MigGpuState, GpuInstance]:
        if not isinstance(handle, _GiHandle) or not 0 <= handle.gpu < len(self.spec.gpus):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        state = self._mig_state[handle.gpu]
        gi = state.gi(handle.gi_id)
        if gi is None:  # destroyed since
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self.spec.gpus[handle.gpu], state, gi

    def _ci_of(self, handle: object) -> tuple[GpuSpec, MigGpuState, GpuInstance, ComputeInstance]:
        if not isinstance(handle, _CiHandle) or not 0 <= handle.gpu < len(self.spec.gpus):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        state = self._mig_state[handle.gpu]
        gi = state.gi(handle.gi_id)
        ci = next((c for c in gi.cis if c.ci_id == handle.ci_id), None) if gi is not None else None
        if gi is None or ci is None:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return self.spec.gpus[handle.gpu], state, gi, ci

    @staticmethod
    def _fill_count(countRef: Any, needed: int, buffer: Any) -> bool:
        """Set ``*countRef``; False when the caller's buffer is too small (or absent)."""
        count = _target(countRef)
        room = int(count.value) if hasattr(count, "value") else 0
        if buffer is None:
            count.value = needed
            return False
        if room < needed:
            count.value = needed
            raise _err("NVML_ERROR_INSUFFICIENT_SIZE")
        count.value = needed
        return True

    # ------------------------------------------------------------------ MIG mode
    @api
    def nvmlDeviceSetMigMode(self, device: _Handle, mode: int) -> int:
        g, state = self._capable(device)
        if mode not in (_C["NVML_DEVICE_MIG_DISABLE"], _C["NVML_DEVICE_MIG_ENABLE"]):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        on = mode == _C["NVML_DEVICE_MIG_ENABLE"]
        with self._lock:
            if not on and state.gis:
                raise _err("NVML_ERROR_IN_USE")
            if state.current == on and state.pending == on:
                return int(_C["NVML_SUCCESS"])
            if g.model.architecture not in _LIVE_MIG_MODE:
                state.pending = on  # Ampere: applied at the next GPU reset
                self._mig_changed()
                return int(_C["NVML_ERROR_RESET_REQUIRED"])
            if self._telemetry[g.index]["processes"]:
                raise _err("NVML_ERROR_IN_USE")
            state.current = state.pending = on
            self._mig_changed()
            return int(_C["NVML_SUCCESS"])

    # ------------------------------------------------------------------ geometry
    @api
    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: _Handle, profile: int, version: int = 2
    ) -> Any:
        _, state = self._capable(device)
        if version not in (1, 2):
            raise _err("NVML_ERROR_FUNCTION_NOT_FOUND")
        if not isinstance(profile, int) or not 0 <= profile < _C["NVML_GPU_INSTANCE_PROFILE_COUNT"]:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        p = (
            next((p for p in state.geometry.profiles if p.nvml_profile == profile), None)
            if state.geometry is not None
            else None
        )
        if p is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return c_nvmlGpuInstanceProfileInfo_v2_t(
            version=_C["nvmlGpuInstanceProfileInfo_v2"] if version == 2 else 0,
            id=p.profile_id,
            isP2pSupported=0,
            sliceCount=p.compute_slices,
            instanceCount=p.instance_count,
            multiprocessorCount=p.multiprocessors,
            copyEngineCount=p.copy_engines,
            decoderCount=p.decoders,
            encoderCount=p.encoders,
            jpegCount=p.jpegs,
            ofaCount=p.ofas,
            memorySizeMB=p.memory_mib,
            name=f"MIG {p.name}",
        )

    @api
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: _Handle, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        _, state = self._capable(device)
        p = self._profile_by_id(state, profileId)
        if self._fill_count(countRef, len(p.placements), placementsRef):
            for k, placement in enumerate(p.placements):
                placementsRef[k].start = placement.start
                placementsRef[k].size = placement.size
        return int(_C["NVML_SUCCESS"])

    @api
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: _Handle, profileId: int) -> int:
        _, state = self._capable(device)
        p = self._profile_by_id(state, profileId)
        with self._lock:
            if not state.current:
                return 0
            taken = state.taken()
            free = [pl for pl in p.placements if fits(state.geometry, p, pl, taken)]  # type: ignore[arg-type]
            assert state.geometry is not None
            compute_left = state.geometry.compute_slices - sum(gi.slices for gi in state.gis)
            same = sum(1 for q, _ in taken if q.profile_id == p.profile_id)
            return max(0, min(len(free), compute_left // p.compute_slices, p.instance_count - same))

    # ------------------------------------------------------------------ GPU instances
    @api
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: _Handle, profileId: int, placement: Any
    ) -> _GiHandle:
        g, state = self._capable(device)
        p = self._profile_by_id(state, profileId)
        where = _target(placement)
        if not isinstance(where, c_nvmlGpuInstancePlacement_t):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        wanted = MigPlacement(int(where.start), int(where.size))
        with self._lock:
            if not state.current:
                raise _err("NVML_ERROR_NOT_SUPPORTED")
            if wanted not in p.placements:
                raise _err("NVML_ERROR_INVALID_ARGUMENT")
            assert state.geometry is not None
            if not fits(state.geometry, p, wanted, state.taken()):
                raise _err("NVML_ERROR_INSUFFICIENT_RESOURCES")
            gi = GpuInstance(
                state.new_gi_id(), p.name, p.compute_slices, _memory_gb(p.name), p, wanted
            )
            state.gis.append(gi)
            self._mig_changed()
            return _GiHandle(g.index, gi.gi_id)

    @api
    def nvmlDeviceGetGpuInstances(
        self, device: _Handle, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        g, state = self._capable(device)
        p = self._profile_by_id(state, profileId)
        with self._lock:
            if not state.current:
                raise _err("NVML_ERROR_NOT_SUPPORTED")
            ids = [
                gi.gi_id
                for gi in state.gis
                if gi.profile is not None and gi.profile.profile_id == p.profile_id
            ]
        if self._fill_count(countRef, len(ids), gpuInstancesRef):
            for k, gi_id in enumerate(ids):
                gpuInstancesRef[k] = _GiHandle(g.index, gi_id)
        return int(_C["NVML_SUCCESS"])

    @api
    def nvmlDeviceGetGpuInstanceById(self, device: _Handle, gpuInstanceId: int) -> _GiHandle:
        g, state = self._capable(device)
        if not isinstance(gpuInstanceId, int):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        with self._lock:
            if not state.current:
                raise _err("NVML_ERROR_NOT_SUPPORTED")
            if state.gi(gpuInstanceId) is None:
                raise _err("NVML_ERROR_NOT_FOUND")
        return _GiHandle(g.index, gpuInstanceId)

    @api
    def nvmlGpuInstanceGetInfo(self, gpuInstance: _GiHandle) -> Any:
        with self._lock:
            g, _, gi = self._gi_of(gpuInstance)
            placement = gi.placement or MigPlacement(0, 0)
            return c_nvmlGpuInstanceInfo_t(
                device=self._handles[g.index],
                id=gi.gi_id,
                profileId=gi.profile.profile_id if gi.profile is not None else 0,
                placement=c_nvmlGpuInstancePlacement_t(placement.start, placement.size),
            )

    @api
    def nvmlGpuInstanceDestroy(self, gpuInstance: _GiHandle) -> int:
        with self._lock:
            _, state, gi = self._gi_of(gpuInstance)
            if gi.cis or gi.gi_id in state.busy:
                raise _err("NVML_ERROR_IN_USE")
            state.gis.remove(gi)
            self._mig_changed()
        return int(_C["NVML_SUCCESS"])

    # ------------------------------------------------------------------ compute instances
    @api
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: _GiHandle, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        with self._lock:
            g, _, gi = self._gi_of(device)
        if version not in (1, 2):
            raise _err("NVML_ERROR_FUNCTION_NOT_FOUND")
        if (
            engProfile != _C["NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED"]
            or not isinstance(profile, int)
            or not 0 <= profile < _C["NVML_COMPUTE_INSTANCE_PROFILE_COUNT"]
        ):
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        slices = next((s for s, c in CI_PROFILES.items() if c == profile), None)
        if slices is None or slices not in ci_slice_choices(gi.slices):
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        sms = (
            gi.profile.multiprocessors
            if gi.profile is not None
            else g.model.sm_count * gi.slices // 7
        )
        name = gi.name if slices == gi.slices else f"{slices}c.{gi.name}"
        return c_nvmlComputeInstanceProfileInfo_v2_t(
            version=_C["nvmlComputeInstanceProfileInfo_v2"] if version == 2 else 0,
            id=profile,
            sliceCount=slices,
            instanceCount=gi.slices // slices,
            multiprocessorCount=sms * slices // gi.slices,
            sharedCopyEngineCount=gi.profile.copy_engines if gi.profile is not None else gi.slices,
            sharedDecoderCount=gi.profile.decoders if gi.profile is not None else 0,
            sharedEncoderCount=0,
            sharedJpegCount=gi.profile.jpegs if gi.profile is not None else 0,
            sharedOfaCount=gi.profile.ofas if gi.profile is not None else 0,
            name=f"MIG {name}",
        )

    @api
    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: _GiHandle, profileId: int
    ) -> _CiHandle:
        with self._lock:
            g, state, gi = self._gi_of(gpuInstance)
            slices = next((s for s, c in CI_PROFILES.items() if c == profileId), None)
            if slices is None or slices not in ci_slice_choices(gi.slices):
                raise _err("NVML_ERROR_INVALID_ARGUMENT")
            used = {s for c in gi.cis for s in range(c.start, c.start + c.slices)}
            start = next(
                (
                    s
                    for s in range(0, gi.slices - slices + 1, slices)
                    if not used & set(range(s, s + slices))
                ),
                None,
            )
            if start is None:
                raise _err("NVML_ERROR_INSUFFICIENT_RESOURCES")
            ids = {c.ci_id for c in gi.cis}
            ci = ComputeInstance(
                next(i for i in range(len(ids) + 1) if i not in ids),
                state.next_serial,
                profileId,
                start,
                slices,
            )
            state.next_serial += 1
            gi.cis.append(ci)
            self._mig_changed()
            return _CiHandle(g.index, gi.gi_id, ci.ci_id)

    @api
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: _GiHandle, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        with self._lock:
            g, _, gi = self._gi_of(gpuInstance)
            ids = [c.ci_id for c in gi.cis if c.profile == profileId]
        if self._fill_count(countRef, len(ids), computeInstancesRef):
            for k, ci_id in enumerate(ids):
                computeInstancesRef[k] = _CiHandle(g.index, gi.gi_id, ci_id)
        return int(_C["NVML_SUCCESS"])

    @api
    def nvmlComputeInstanceGetInfo(self, computeInstance: _CiHandle) -> Any:
        with self._lock:
            g, _, gi, ci = self._ci_of(computeInstance)
            return c_nvmlComputeInstanceInfo_t(
                device=self._handles[g.index],
                gpuInstance=_GiHandle(g.index, gi.gi_id),
                id=ci.ci_id,
                profileId=ci.profile,
                placement=c_nvmlComputeInstancePlacement_t(ci.start, ci.slices),
            )

    @api
    def nvmlComputeInstanceDestroy(self, computeInstance: _CiHandle) -> int:
        with self._lock:
            _, state, gi, ci = self._ci_of(computeInstance)
            if gi.gi_id in state.busy:
                raise _err("NVML_ERROR_IN_USE")
            gi.cis.remove(ci)
            self._mig_changed()
        return int(_C["NVML_SUCCESS"])
