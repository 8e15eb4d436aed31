"""The MIG layout of one simulated GPU: its MIG mode, GPU instances and compute instances, as
the fake NVML (:mod:`agent.hw.sim.nvml_mig`) creates and destroys them.

A GPU starts with the layout its machine spec states (the spec's MIG devices, each a GPU
instance with one compute instance, on the placements the spec reader assigned). The layout
is plain data: :meth:`MigGpuState.to_json` / :meth:`MigGpuState.load_json` carry it across
agent restarts.

MIG device numbers (``serial``): every compute instance gets the next number of its GPU,
never reused; it is what a MIG device handle names and what its UUID is made from. The spec's
devices get 0, 1, ... in spec order, so their UUIDs are those of a spec without dynamic MIG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.hw.sim.mig_geometry import geometry_for
from agent.hw.sim.spec_model import GpuSpec
from agent.records import MigGeometry, MigPlacement, MigProfile

__all__ = ["ComputeInstance", "GpuInstance", "MigDeviceView", "MigGpuState"]


@dataclass
class ComputeInstance:
    ci_id: int
    serial: int  # the MIG device's number on its GPU (handle, UUID)
    profile: int  # NVML_COMPUTE_INSTANCE_PROFILE_* (equal to the CI profile's id)
    start: int  # compute slice within the GPU instance
    slices: int


@dataclass
class GpuInstance:
    gi_id: int
    name: str  # the GPU instance's profile: "3g.40gb"
    slices: int  # compute slices
    memory_gb: int  # as the profile name says
    profile: MigProfile | None  # None: a GPU model without known geometry
    placement: MigPlacement | None
    cis: list[ComputeInstance] = field(default_factory=list)


@dataclass(frozen=True)
class MigDeviceView:
    """One MIG device (a compute instance in its GPU instance) as the device functions see it."""

    gi: GpuInstance
    ci: ComputeInstance

    @property
    def profile(self) -> str:
        """``"3g.40gb"``, or ``"1c.3g.40gb"`` for a compute instance smaller than its GI."""
        return (
            self.gi.name
            if self.ci.slices == self.gi.slices
            else f"{self.ci.slices}c.{self.gi.name}"
        )

    @property
    def gi_slices(self) -> int:
        return self.gi.slices

    @property
    def ci_slices(self) -> int:
        return self.ci.slices

    @property
    def memory_mib(self) -> int:
        if self.gi.profile is not None:
            return self.gi.profile.memory_mib
        # ~95% of the nominal size, as real profiles report a little less than their name
        return self.gi.memory_gb * 1024 * 95 // 100 // 128 * 128


#: compute-instance profile (NVML_COMPUTE_INSTANCE_PROFILE_*) by compute slices
CI_PROFILES: dict[int, int] = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


def ci_slice_choices(gi_slices: int) -> tuple[int, ...]:
    """The compute-instance sizes a GPU instance of ``gi_slices`` offers (nvidia-smi mig
    -lcip): 1c..3c on a 3g, 1c/2c/4c on a 4g, 1c..4c and 7c on a 7g."""
    return {1: (1,), 2: (1, 2), 3: (1, 2, 3), 4: (1, 2, 4), 7: (1, 2, 3, 4, 7)}.get(
        gi_slices, (gi_slices,)
    )


class MigGpuState:
    """The MIG mode and layout of one GPU; the fake holds its lock around every use."""

    def __init__(self, geometry: MigGeometry | None, current: bool, pending: bool) -> None:
        self.geometry = geometry
        self.current = current
        self.pending = pending
        self.gis: list[GpuInstance] = []
        self.next_serial = 0
        #: GPU instances running processes (:meth:`FakeNvml.occupy_mig`)
        self.busy: set[int] = set()

    @classmethod
    def from_spec(cls, g: GpuSpec) -> MigGpuState:
        """The layout the spec states: its MIG devices, GI ids 1, 2, ... in spec order."""
        state = cls(
            geometry_for(g.model.name) if g.model.mig else None, g.mig_enabled, g.mig_enabled
        )
        for k, d in enumerate(g.mig_devices):
            gi_name = d.gi_profile
            profile = state.geometry.profile(gi_name) if state.geometry is not None else None
            gi = GpuInstance(k + 1, gi_name, d.gi_slices, d.memory_gb, profile, d.placement)
            gi.cis.append(ComputeInstance(0, k, CI_PROFILES.get(d.ci_slices, 0), 0, d.ci_slices))
            state.gis.append(gi)
        state.next_serial = len(g.mig_devices)
        return state

    # ------------------------------------------------------------------ queries
    def devices(self) -> list[MigDeviceView]:
        """The MIG devices in NVML's index order (creation order)."""
        return sorted(
            (MigDeviceView(gi, ci) for gi in self.gis for ci in gi.cis), key=lambda v: v.ci.serial
        )

    def device(self, serial: int) -> MigDeviceView | None:
        return next((v for v in self.devices() if v.ci.serial == serial), None)

    def gi(self, gi_id: int) -> GpuInstance | None:
        return next((gi for gi in self.gis if gi.gi_id == gi_id), None)

    def taken(self) -> list[tuple[MigProfile, MigPlacement]]:
        return [
            (gi.profile, gi.placement)
            for gi in self.gis
            if gi.profile is not None and gi.placement is not None
        ]

    def new_gi_id(self) -> int:
        used = {gi.gi_id for gi in self.gis}
        return next(i for i in range(1, len(used) + 2) if i not in used)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict[str, Any]:
        return {
            "mig_mode": {"current": self.current, "pending": self.pending},
            "next_serial": self.next_serial,
            "gpu_instances": [
                {
                    "id": gi.gi_id,
                    "profile": gi.name,
                    "slices": gi.slices,
                    "memory_gb": gi.memory_gb,
                    "placement": None
                    if gi.placement is None
                    else [gi.placement.start, gi.placement.size],
                    "compute_instances": [
                        {
                            "id": ci.ci_id,
                            "serial": ci.serial,
                            "profile": ci.profile,
                            "start": ci.start,
                            "slices": ci.slices,
                        }
                        for ci in gi.cis
                    ],
                }
                for gi in self.gis
            ],
        }

    def load_json(self, data: Any) -> None:
        """Replace the layout by one :meth:`to_json` wrote; ValueError (saying what) when it
        is not one."""
        if not isinstance(data, dict):
            raise ValueError("expected a mapping")
        mode = data["mig_mode"]
        gis = []
        for raw in data["gpu_instances"]:
            name = str(raw["profile"])
            profile = self.geometry.profile(name) if self.geometry is not None else None
            if self.geometry is not None and profile is None:
                raise ValueError(f"no MIG profile {name!r} on this GPU")
            placement = (
                None
                if raw["placement"] is None
                else MigPlacement(*(int(x) for x in raw["placement"]))
            )
            gi = GpuInstance(
                int(raw["id"]), name, int(raw["slices"]), int(raw["memory_gb"]), profile, placement
            )
            gi.cis = [
                ComputeInstance(
                    int(c["id"]),
                    int(c["serial"]),
                    int(c["profile"]),
                    int(c["start"]),
                    int(c["slices"]),
                )
                for c in raw["compute_instances"]
            ]
            gis.append(gi)
        self.current, self.pending = bool(mode["current"]), bool(mode["pending"])
        self.next_serial = int(data["next_serial"])
        self.gis = gis
