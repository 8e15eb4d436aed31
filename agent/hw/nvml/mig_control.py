"""Cutting GPUs into MIG instances through NVML: :class:`NvmlMig`, the backend's
:class:`agent.hw.protocols.MigControl`.

A MIG instance is a GPU instance created on an exact placement
(``nvmlDeviceCreateGpuInstanceWithPlacement``) with one compute instance of the profile
spanning it; destroying one destroys its compute instances, then the GPU instance. Every
NVML answer other than success becomes a :class:`agent.errors.MigError` (insufficient
resources, in use, reset required, not found) naming the GPU, the profile and placement or
the instance, and NVML's answer. MIG mode is switched on only where that needs no GPU reset
(Hopper and newer): the agent never resets a GPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from agent.errors import MigError, MigInsufficientResources, MigInUse, MigNotFound, MigResetRequired
from agent.hw.nvml.calls import NvmlCalls, NvmlError
from agent.hw.nvml.mig import absent_answers, read_geometry, text_of
from agent.records import MigGeometry, MigInstance, MigPlacement

__all__ = ["NvmlMig"]

#: NVML errors and the MigError each becomes
_MIG_ERRORS: tuple[tuple[str, type[MigError]], ...] = (
    ("NVML_ERROR_INSUFFICIENT_RESOURCES", MigInsufficientResources),
    ("NVML_ERROR_IN_USE", MigInUse),
    ("NVML_ERROR_RESET_REQUIRED", MigResetRequired),
    ("NVML_ERROR_NOT_FOUND", MigNotFound),
    ("NVML_ERROR_INVALID_ARGUMENT", MigNotFound),
)


class NvmlMig:
    """:class:`agent.hw.protocols.MigControl` on the call wrapper: every NVML answer other
    than success becomes a :class:`MigError` naming the GPU, the profile or instance and
    NVML's answer. Operations are serialised; the geometry is read once per GPU."""

    def __init__(self, b: NvmlCalls) -> None:
        self._b = b
        self._lock = threading.Lock()
        self._geometry: dict[int, MigGeometry | None] = {}

    # ------------------------------------------------------------------ helpers
    def _do(self, what: str, function: str, *args: Any, index: int) -> Any:
        """``function(*args)`` for GPU ``index``; its failure a MigError saying ``what``."""
        b = self._b
        try:
            result = b.call(function, *args, gpu=index)
        except NvmlError as exc:
            cls = next((c for name, c in _MIG_ERRORS if b.const(name, None) == exc.code), MigError)
            raise cls(
                f"GPU {index}: {what}: NVML {function} answered {exc.__cause__} "
                f"(NVML error {exc.code})"
            ) from exc
        if result is None:
            why = "is lost" if index in b.lost_gpus else "does not support it"
            raise MigError(f"GPU {index}: {what}: the GPU {why} (NVML {function})")
        return result

    def _handle(self, index: int, what: str) -> Any:
        h = self._b.handle(index)
        if h is None:
            raise MigError(f"GPU {index}: {what}: the GPU is lost")
        return h

    def _geometry_of(self, index: int, h: Any) -> MigGeometry | None:
        if index not in self._geometry:
            self._geometry[index] = read_geometry(self._b, index, h)
        return self._geometry[index]

    def _full_ci_profile(self, index: int, gi: Any, slices: int, what: str) -> int:
        """The id of the compute-instance profile spanning a GPU instance of ``slices``."""
        b = self._b
        constant = b.const(f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE", None)
        if constant is None:
            raise MigError(f"GPU {index}: {what}: NVML names no {slices}-slice compute profile")
        info = self._do(
            what,
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            gi,
            constant,
            b.const("NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED"),
            index=index,
        )
        return int(info.id)

    def _handles(
        self, index: int, function: str, owner: Any, profile_id: int, room: int, kind: str
    ) -> list[Any]:
        """The GPU instances (``kind`` ``c_nvmlGpuInstance_t``) or compute instances of one
        profile NVML lists for ``owner``; empty where it lists none."""
        b = self._b
        buffer = (b.const(kind) * room)()
        count = ctypes.c_uint(room)
        if (
            b.call(
                function,
                owner,
                profile_id,
                buffer,
                ctypes.byref(count),
                gpu=index,
                absent=absent_answers(b),
            )
            is None
        ):
            return []
        return [buffer[k] for k in range(int(count.value))]

    def _cis(self, index: int, gi: Any) -> list[Any]:
        """Every compute instance of GPU instance handle ``gi``."""
        b = self._b
        out: list[Any] = []
        for slices in (1, 2, 3, 4, 6, 7, 8):
            constant = b.const(f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE", None)
            if constant is None:
                continue
            info = b.call(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                gi,
                constant,
                b.const("NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED"),
                gpu=index,
                absent=absent_answers(b),
            )
            if info is not None:
                out += self._handles(
                    index,
                    "nvmlGpuInstanceGetComputeInstances",
                    gi,
                    int(info.id),
                    int(info.instanceCount) or 8,
                    "c_nvmlComputeInstance_t",
                )
        return out

    def _uuids(self, index: int, h: Any) -> dict[tuple[int, int], str]:
        """MIG device UUID by (GPU instance id, compute instance id)."""
        b = self._b
        out: dict[tuple[int, int], str] = {}
        absent = absent_answers(b)
        for slot in range(int(b.call("nvmlDeviceGetMaxMigDeviceCount", h, gpu=index) or 0)):
            mh = b.call("nvmlDeviceGetMigDeviceHandleByIndex", h, slot, gpu=index, absent=absent)
            if mh is None:
                continue
            gi = b.call("nvmlDeviceGetGpuInstanceId", mh, gpu=index)
            ci = b.call("nvmlDeviceGetComputeInstanceId", mh, gpu=index)
            uuid = b.call("nvmlDeviceGetUUID", mh, gpu=index)
            if gi is not None and ci is not None and uuid is not None:
                out[(int(gi), int(ci))] = text_of(uuid)
        return out

    # ------------------------------------------------------------------ MigControl
    def mig_instances(self, index: int) -> tuple[MigInstance, ...]:
        """Every GPU instance on GPU ``index`` (each with its first compute instance; a GPU
        instance without one, as a create cut short leaves it, has ``ci_id``/``uuid`` None)."""
        with self._lock:
            h = self._handle(index, "listing MIG instances")
            geometry = self._geometry_of(index, h)
            if geometry is None:
                return ()
            uuids = self._uuids(index, h)
            out: list[MigInstance] = []
            for p in geometry.profiles:
                for gi in self._handles(
                    index,
                    "nvmlDeviceGetGpuInstances",
                    h,
                    p.profile_id,
                    p.instance_count,
                    "c_nvmlGpuInstance_t",
                ):
                    info = self._do(
                        f"reading a {p.name} GPU instance",
                        "nvmlGpuInstanceGetInfo",
                        gi,
                        index=index,
                    )
                    cis = [
                        self._do(
                            "reading a compute instance",
                            "nvmlComputeInstanceGetInfo",
                            c,
                            index=index,
                        )
                        for c in self._cis(index, gi)
                    ]
                    ci_id = min((int(c.id) for c in cis), default=None)
                    out.append(
                        MigInstance(
                            parent_index=index,
                            profile=p.name,
                            placement=MigPlacement(
                                int(info.placement.start), int(info.placement.size)
                            ),
                            gi_id=int(info.id),
                            ci_id=ci_id,
                            uuid=uuids.get((int(info.id), ci_id)) if ci_id is not None else None,
                        )
                    )
            return tuple(sorted(out, key=lambda m: (m.placement.start, m.gi_id)))

    def create_mig(self, index: int, profile: str, start: int) -> MigInstance:
        """A GPU instance of ``profile`` at memory slice ``start`` and one compute instance
        spanning it; the GPU instance is destroyed again when the compute instance fails."""
        what = f"creating a {profile} MIG instance at memory slice {start}"
        with self._lock:
            h = self._handle(index, what)
            geometry = self._geometry_of(index, h)
            p = geometry.profile(profile) if geometry is not None else None
            if p is None:
                offered = ", ".join(q.name for q in geometry.profiles) if geometry else "none"
                raise MigError(
                    f"GPU {index}: {what}: the GPU has no such MIG profile (its profiles: {offered})"
                )
            placement = next((pl for pl in p.placements if pl.start == start), None)
            if placement is None:
                starts = ", ".join(str(pl.start) for pl in p.placements)
                raise MigError(
                    f"GPU {index}: {what}: not a legal placement of {profile} (starts: {starts})"
                )
            where = self._b.const("c_nvmlGpuInstancePlacement_t")()
            where.start, where.size = placement.start, placement.size
            gi = self._do(
                what,
                "nvmlDeviceCreateGpuInstanceWithPlacement",
                h,
                p.profile_id,
                ctypes.byref(where),
                index=index,
            )
            gi_id = int(self._do(what, "nvmlGpuInstanceGetInfo", gi, index=index).id)
            try:
                ci_profile = self._full_ci_profile(index, gi, p.compute_slices, what)
                ci = self._do(
                    what, "nvmlGpuInstanceCreateComputeInstance", gi, ci_profile, index=index
                )
                ci_id = int(self._do(what, "nvmlComputeInstanceGetInfo", ci, index=index).id)
            except MigError:
                self._b.call(
                    "nvmlGpuInstanceDestroy", gi, gpu=index, absent=absent_answers(self._b)
                )
                raise
            uuid = self._uuids(index, h).get((gi_id, ci_id))
            return MigInstance(index, profile, placement, gi_id, ci_id, uuid)

    def destroy_mig(self, index: int, gi_id: int) -> None:
        """GPU instance ``gi_id`` of GPU ``index``: its compute instances, then itself."""
        what = f"destroying MIG GPU instance {gi_id}"
        with self._lock:
            h = self._handle(index, what)
            gi = self._do(what, "nvmlDeviceGetGpuInstanceById", h, gi_id, index=index)
            for ci in self._cis(index, gi):
                self._do(what, "nvmlComputeInstanceDestroy", ci, index=index)
            self._do(what, "nvmlGpuInstanceDestroy", gi, index=index)

    def enable_mig(self, index: int) -> None:
        """MIG mode on for GPU ``index``. Before Hopper a change waits for a GPU reset: the
        mode is left alone and :class:`MigResetRequired` raised."""
        self._set_mode(index, on=True)

    def disable_mig(self, index: int) -> None:
        """MIG mode off for GPU ``index``, which holds no GPU instance (as :meth:`enable_mig`:
        at once on Hopper and newer, else MigResetRequired and the mode left alone)."""
        self._set_mode(index, on=False)

    def _set_mode(self, index: int, *, on: bool) -> None:
        b = self._b
        what = f"switching MIG mode {'on' if on else 'off'}"
        with self._lock:
            h = self._handle(index, what)
            wanted = b.const("NVML_DEVICE_MIG_ENABLE" if on else "NVML_DEVICE_MIG_DISABLE")
            current, pending = self._do(what, "nvmlDeviceGetMigMode", h, index=index)
            if int(current) == wanted:
                return
            arch = b.call("nvmlDeviceGetArchitecture", h, gpu=index)
            before_hopper = arch is not None and int(arch) < b.const("NVML_DEVICE_ARCH_HOPPER")
            if int(pending) == wanted or before_hopper:
                raise MigResetRequired(
                    f"GPU {index}: {what} needs a GPU reset on this GPU "
                    "(before Hopper); the agent never resets a GPU"
                )
            self._do(what, "nvmlDeviceSetMigMode", h, wanted, index=index)
            current, _ = self._do(what, "nvmlDeviceGetMigMode", h, index=index)
            if int(current) != wanted:
                raise MigResetRequired(
                    f"GPU {index}: {what}: the change is pending a GPU reset; "
                    "the agent never resets a GPU"
                )
