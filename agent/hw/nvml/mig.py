"""MIG through NVML, read: what a MIG-capable GPU can be cut into (:func:`read_geometry`)
and where its GPU instances sit (:func:`gi_placement`), every call through the wrapper
(:class:`agent.hw.nvml.calls.NvmlCalls`). Cutting it: :mod:`agent.hw.nvml.mig_control`.

The geometry is read with ``nvmlDeviceGetGpuInstanceProfileInfo`` for each
``NVML_GPU_INSTANCE_PROFILE_*`` the library names (a profile the GPU lacks answers
NotSupported) and ``nvmlDeviceGetGpuInstancePossiblePlacements`` for each profile found.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from agent.hw.nvml.calls import NvmlCalls, NvmlError
from agent.records import MigGeometry, MigPlacement, MigProfile

__all__ = ["absent_answers", "gi_placement", "read_geometry", "text_of"]

log = logging.getLogger(__name__)

#: the NVML_GPU_INSTANCE_PROFILE_* suffixes, in nvml.h order (those the library in use lacks
#: are skipped)
_GI_PROFILES = (
    "1_SLICE",
    "2_SLICE",
    "3_SLICE",
    "4_SLICE",
    "7_SLICE",
    "8_SLICE",
    "6_SLICE",
    "1_SLICE_REV1",
    "2_SLICE_REV1",
    "1_SLICE_REV2",
    "1_SLICE_GFX",
    "2_SLICE_GFX",
    "4_SLICE_GFX",
    "1_SLICE_NO_ME",
    "2_SLICE_NO_ME",
    "1_SLICE_ALL_ME",
    "2_SLICE_ALL_ME",
    "3_SLICE_GFX",
)
#: room for the possible placements of one profile (8 memory slices on today's GPUs)
_MAX_PLACEMENTS = 32


def absent_answers(b: NvmlCalls) -> tuple[int, ...]:
    """Answers that mean "not here" for a MIG query: unknown profile or instance, or an
    unprivileged agent (NVML keeps GPU instances to root)."""
    return (
        b.const("NVML_ERROR_INVALID_ARGUMENT"),
        b.const("NVML_ERROR_NOT_FOUND"),
        b.const("NVML_ERROR_NO_PERMISSION"),
    )


def text_of(raw: object) -> str:
    """NVML's text (``str`` or NUL-padded ``bytes``) as ``str``."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return text.rstrip("\x00").strip()


def profile_name(info: Any) -> str:
    """NVML's profile name without its ``"MIG "``: ``"3g.40gb"``, ``"1g.10gb+me"``."""
    text = text_of(info.name)
    return text[4:] if text.startswith("MIG ") else text


def _placements(b: NvmlCalls, index: int, h: Any, profile_id: int) -> tuple[MigPlacement, ...]:
    buffer = (b.const("c_nvmlGpuInstancePlacement_t") * _MAX_PLACEMENTS)()
    count = ctypes.c_uint(_MAX_PLACEMENTS)
    done = b.call(
        "nvmlDeviceGetGpuInstancePossiblePlacements",
        h,
        profile_id,
        buffer,
        ctypes.byref(count),
        gpu=index,
        absent=absent_answers(b),
    )
    if done is None:
        return ()
    return tuple(
        MigPlacement(int(buffer[k].start), int(buffer[k].size)) for k in range(int(count.value))
    )


def read_geometry(b: NvmlCalls, index: int, h: Any) -> MigGeometry | None:
    """The profiles and legal placements of GPU ``index`` (handle ``h``); None where NVML
    offers no profile (not MIG capable, an older driver, an unprivileged agent) or fails."""
    profiles: list[MigProfile] = []
    try:
        for suffix in _GI_PROFILES:
            constant = b.const(f"NVML_GPU_INSTANCE_PROFILE_{suffix}", None)
            if constant is None:
                continue
            info = b.call(
                "nvmlDeviceGetGpuInstanceProfileInfo",
                h,
                constant,
                gpu=index,
                absent=absent_answers(b),
            )
            if info is None:
                continue
            placements = _placements(b, index, h, int(info.id))
            if not placements:
                continue
            profiles.append(
                MigProfile(
                    name=profile_name(info),
                    nvml_profile=int(constant),
                    profile_id=int(info.id),
                    compute_slices=int(info.sliceCount),
                    memory_mib=int(info.memorySizeMB),
                    instance_count=int(info.instanceCount),
                    multiprocessors=int(info.multiprocessorCount),
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpegs=int(info.jpegCount),
                    ofas=int(info.ofaCount),
                    placements=placements,
                )
            )
    except NvmlError as exc:
        log.warning("GPU %d: its MIG profiles cannot be read (%s); it is offered whole", index, exc)
        return None
    if not profiles:
        return None
    return MigGeometry(
        memory_slices=max(p.start + p.size for q in profiles for p in q.placements),
        compute_slices=max(p.compute_slices for p in profiles),
        profiles=tuple(profiles),
    )


def gi_placement(b: NvmlCalls, index: int, h: Any, gi_id: int) -> tuple[MigPlacement, int] | None:
    """(placement, GPU-instance profile id) of GPU instance ``gi_id`` of GPU ``index``; None
    where NVML does not say (no such instance, an unprivileged agent)."""
    gi = b.call("nvmlDeviceGetGpuInstanceById", h, gi_id, gpu=index, absent=absent_answers(b))
    if gi is None:
        return None
    info = b.call("nvmlGpuInstanceGetInfo", gi, gpu=index, absent=absent_answers(b))
    if info is None or int(info.placement.size) == 0:
        return None
    return MigPlacement(int(info.placement.start), int(info.placement.size)), int(info.profileId)
