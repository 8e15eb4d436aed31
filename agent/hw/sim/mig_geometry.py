"""MIG geometry of the simulated GPUs: profiles, slices and legal placements, from public facts.

Source: NVIDIA's *Multi-Instance GPU User Guide* ("Supported MIG Profiles" per product: A30,
A100 40/80 GB, H100 80/94 GB, H200, B200; the placement diagrams of "A100 MIG profiles" and
``nvidia-smi mig -lgipp`` outputs quoted there), and the ``NVML_GPU_INSTANCE_PROFILE_*``
constants of ``nvml.h``. Memory sizes are the profile's share of the GPU's memory slices as
NVML reports them (``memorySizeMB``), rounded as nvidia-smi prints them; multiprocessor and
engine counts are those of the guide's tables. Where the guide publishes no figure (GB200's
engine counts) the Hopper/Blackwell layout is used and said so below.

One layout family per slice count:

* 8 memory slices, 7 compute slices (A100, H100, H200, B200, GB200)::

      profile   const   placements (start: memory slice, size)
      1g        0       0..6, size 1       (instances: 7)
      1g+me     7       0..6, size 1       (1: holds the media engines)
      1g double 9       0, 2, 4, 6, size 2 (4)
      2g        1       0, 2, 4, size 2    (3)
      3g        2       0, 4, size 4       (2)
      4g        3       0, size 4          (1)
      7g        4       0, size 8          (1)

* 4 memory slices, 4 compute slices (A30)::

      1g 0..3 size 1; 1g+me 0..3 size 1; 2g 0, 2 size 2; 2g+me 0, 2 size 2; 4g 0 size 4
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.records import MigGeometry, MigPlacement, MigProfile

__all__ = ["geometry_for", "MIG_MODELS", "fits", "place_all"]

# NVML_GPU_INSTANCE_PROFILE_* (nvml.h)
P_1_SLICE, P_2_SLICE, P_3_SLICE, P_4_SLICE, P_7_SLICE = 0, 1, 2, 3, 4
P_1_SLICE_REV1, P_2_SLICE_REV1, P_1_SLICE_REV2 = 7, 8, 9

#: per product: (GB per memory slice as nvidia-smi names profiles, MiB per memory slice,
#: multiprocessors of 1g/2g/3g/4g/7g, decoders and JPEG engines of 1g/2g/3g/4g/7g)
_EIGHT_SLICE: dict[str, tuple[tuple[str, ...], int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {
    # names of 1g, 1g-double, 2g, 3g, 4g, 7g memory; MiB per slice; SMs; decoders; jpegs
    "NVIDIA A100-SXM4-40GB": (("5gb", "10gb", "10gb", "20gb", "20gb", "40gb"), 4864,
                              (14, 28, 42, 56, 98), (0, 1, 2, 2, 5), (0, 0, 0, 0, 1)),
    "NVIDIA A100-SXM4-80GB": (("10gb", "20gb", "20gb", "40gb", "40gb", "80gb"), 9856,
                              (14, 28, 42, 56, 98), (0, 1, 2, 2, 5), (0, 0, 0, 0, 1)),
    "NVIDIA A100 80GB PCIe": (("10gb", "20gb", "20gb", "40gb", "40gb", "80gb"), 9856,
                              (14, 28, 42, 56, 98), (0, 1, 2, 2, 5), (0, 0, 0, 0, 1)),
    "NVIDIA H100 80GB HBM3": (("10gb", "20gb", "20gb", "40gb", "40gb", "80gb"), 9984,
                              (16, 32, 60, 64, 132), (1, 1, 2, 2, 7), (1, 1, 2, 2, 7)),
    "NVIDIA H100 NVL": (("12gb", "24gb", "24gb", "47gb", "47gb", "94gb"), 11904,
                        (16, 32, 60, 64, 132), (1, 1, 2, 2, 7), (1, 1, 2, 2, 7)),
    "NVIDIA H200": (("18gb", "35gb", "35gb", "71gb", "71gb", "141gb"), 17792,
                    (16, 32, 60, 64, 132), (1, 1, 2, 2, 7), (1, 1, 2, 2, 7)),
    # 22784 MiB a slice: eight of them fit the 183359 MiB nvidia-smi shows for a B200
    "NVIDIA B200": (("23gb", "45gb", "45gb", "90gb", "90gb", "180gb"), 22784,
                    (18, 36, 72, 72, 148), (1, 1, 2, 2, 7), (1, 1, 2, 2, 7)),
    # GB200: the guide names the profiles; engine counts as B200's (not published apart)
    "NVIDIA GB200": (("23gb", "46gb", "46gb", "93gb", "93gb", "186gb"), 23552,
                     (18, 36, 72, 72, 152), (1, 1, 2, 2, 7), (1, 1, 2, 2, 7)),
}

#: the GPUs the table knows, by NVML name
MIG_MODELS = frozenset(_EIGHT_SLICE) | {"NVIDIA A30"}


def _placements(starts: range | tuple[int, ...], size: int) -> tuple[MigPlacement, ...]:
    return tuple(MigPlacement(s, size) for s in starts)


def _eight_slice(names: tuple[str, ...], slice_mib: int, sms: tuple[int, ...],
                 dec: tuple[int, ...], jpg: tuple[int, ...]) -> MigGeometry:
    m1, m1d, m2, m3, m4, m7 = names
    p = MigProfile
    return MigGeometry(
        memory_slices=8,
        compute_slices=7,
        profiles=(
            p(f"1g.{m1}", P_1_SLICE, 19, 1, slice_mib, 7, sms[0], 1, dec[0], 0, jpg[0], 0,
              _placements(range(7), 1)),
            p(f"1g.{m1}+me", P_1_SLICE_REV1, 20, 1, slice_mib, 1, sms[0], 1, max(dec[0], 1), 0,
              1, 1, _placements(range(7), 1)),
            p(f"1g.{m1d}", P_1_SLICE_REV2, 15, 1, 2 * slice_mib, 4, sms[0], 1, dec[0], 0, jpg[0],
              0, _placements((0, 2, 4, 6), 2)),
            p(f"2g.{m2}", P_2_SLICE, 14, 2, 2 * slice_mib, 3, sms[1], 2, dec[1], 0, jpg[1], 0,
              _placements((0, 2, 4), 2)),
            p(f"3g.{m3}", P_3_SLICE, 9, 3, 4 * slice_mib, 2, sms[2], 3, dec[2], 0, jpg[2], 0,
              _placements((0, 4), 4)),
            p(f"4g.{m4}", P_4_SLICE, 5, 4, 4 * slice_mib, 1, sms[3], 4, dec[3], 0, jpg[3], 0,
              _placements((0,), 4)),
            p(f"7g.{m7}", P_7_SLICE, 0, 7, 8 * slice_mib, 1, sms[4], 7, dec[4], 0, jpg[4], 1,
              _placements((0,), 8)),
        ),
    )


def _a30() -> MigGeometry:
    p = MigProfile
    return MigGeometry(
        memory_slices=4,
        compute_slices=4,
        profiles=(
            p("1g.6gb", P_1_SLICE, 14, 1, 5836, 4, 14, 1, 0, 0, 0, 0, _placements(range(4), 1)),
            p("1g.6gb+me", P_1_SLICE_REV1, 21, 1, 5836, 1, 14, 1, 1, 0, 1, 1,
              _placements(range(4), 1)),
            p("2g.12gb", P_2_SLICE, 5, 2, 11813, 2, 28, 2, 2, 0, 0, 0, _placements((0, 2), 2)),
            p("2g.12gb+me", P_2_SLICE_REV1, 6, 2, 11813, 1, 28, 2, 2, 0, 1, 1,
              _placements((0, 2), 2)),
            p("4g.24gb", P_4_SLICE, 0, 4, 24062, 1, 56, 4, 4, 0, 1, 1, _placements((0,), 4)),
        ),
    )


def geometry_for(model_name: str | None) -> MigGeometry | None:
    """The MIG geometry of a GPU named ``model_name`` as NVML names it, or None when the
    table does not know it (a MIG-capable GPU the simulator has no published layout for
    offers no profiles: dynamic MIG leaves it whole)."""
    if model_name is None:
        return None
    if model_name == "NVIDIA A30":
        return _a30()
    row = _EIGHT_SLICE.get(model_name)
    return None if row is None else _eight_slice(*row)


def fits(geometry: MigGeometry, profile: MigProfile, placement: MigPlacement,
         taken: Sequence[tuple[MigProfile, MigPlacement]]) -> bool:
    """Whether a GPU instance of ``profile`` may be created at ``placement`` beside the
    ``taken`` ones, as NVML decides it: a legal placement of the profile, no memory slice
    shared, enough compute slices left and fewer than ``instance_count`` of the profile."""
    if placement not in profile.placements:
        return False
    used = {s for _, p in taken for s in p.slices}
    if used & set(placement.slices):
        return False
    if sum(p.compute_slices for p, _ in taken) + profile.compute_slices > geometry.compute_slices:
        return False
    return sum(1 for p, _ in taken if p.profile_id == profile.profile_id) < profile.instance_count


def place_all(geometry: MigGeometry, profiles: Sequence[MigProfile]) -> tuple[MigPlacement, ...] | None:
    """Placements for GPU instances of ``profiles`` created in that order: the first legal
    assignment (each instance at its lowest start that still lets the rest fit), or None
    when they cannot all be placed. A layout like 3g + 2g + 1g + 1g on an A100 needs the
    3g at slice 4: taking each instance's first free placement alone would refuse it."""
    chosen: list[tuple[MigProfile, MigPlacement]] = []

    def extend(k: int) -> bool:
        if k == len(profiles):
            return True
        for placement in profiles[k].placements:
            if fits(geometry, profiles[k], placement, chosen):
                chosen.append((profiles[k], placement))
                if extend(k + 1):
                    return True
                chosen.pop()
        return False

    return tuple(p for _, p in chosen) if extend(0) else None
