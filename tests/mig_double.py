"""A test double of the hardware backend's MigControl (agent.hw.protocols.MigControl) for
in-process tests of dynamic MIG: GPUs with a MIG mode and GPU instances, NVML's answers
(overlap: insufficient resources; an instance running processes: in use; Ampere's mode
change: reset required; an unknown instance: not found), and a crash switch: the N-th step
(each call counts before and after its effect; a create also between its GPU instance and
its compute instance) raises :class:`Crash`, as a SIGKILL
at that point would stop the agent. The GPUs' state outlives the preparer that used it, as a
real GPU's outlives the agent process."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field

from agent.errors import MigError, MigInsufficientResources, MigInUse, MigNotFound, MigResetRequired
from agent.records import MigGeometry, MigInstance


class Crash(BaseException):
    """The agent process dies here (nothing of the agent catches a BaseException)."""


@dataclass
class SimGpu:
    geometry: MigGeometry
    mig_on: bool = True
    hopper: bool = True  # switches MIG mode without a reset
    busy: bool = False  # runs processes
    instances: dict[int, MigInstance] = field(default_factory=dict)


class MigDouble:
    """``gpus``: GPU index -> :class:`SimGpu`. ``crash_at``: the step that raises Crash
    (None: never); ``steps`` counts them. ``calls`` logs every call."""

    def __init__(self, gpus: dict[int, SimGpu]) -> None:
        self.gpus = gpus
        self.crash_at: int | None = None
        self.steps = 0
        self.calls: list[tuple] = []
        self._uuids = itertools.count()

    def _step(self) -> None:
        self.steps += 1
        if self.crash_at is not None and self.steps == self.crash_at:
            self.crash_at = None
            raise Crash(f"killed at step {self.steps}")

    def _gpu(self, index: int) -> SimGpu:
        if index not in self.gpus:
            raise MigError(f"GPU {index}: not MIG capable")
        return self.gpus[index]

    # -- the MigControl protocol
    def mig_instances(self, index: int) -> tuple[MigInstance, ...]:
        self.calls.append(("mig_instances", index))
        g = self._gpu(index)
        if not g.mig_on:
            raise MigError(f"GPU {index}: MIG mode is off")
        return tuple(g.instances[k] for k in sorted(g.instances))

    def create_mig(self, index: int, profile: str, start: int) -> MigInstance:
        self.calls.append(("create_mig", index, profile, start))
        self._step()
        g = self._gpu(index)
        if not g.mig_on:
            raise MigError(f"GPU {index}: MIG mode is off")
        p = g.geometry.profile(profile)
        placement = next((pl for pl in p.placements if pl.start == start), None) if p else None
        if p is None or placement is None:
            raise MigError(f"GPU {index}: no placement {profile} at {start} (invalid argument)")
        if any(set(i.placement.slices) & set(placement.slices) for i in g.instances.values()):
            raise MigInsufficientResources(f"GPU {index}: {profile} at {start}: insufficient resources")
        gi = next(i for i in itertools.count(1) if i not in g.instances)
        g.instances[gi] = MigInstance(index, profile, placement, gi, None, None)  # the GPU instance alone
        self._step()
        inst = MigInstance(index, profile, placement, gi, 0, f"MIG-{uuid.UUID(int=next(self._uuids) + (index << 64))}")
        g.instances[gi] = inst  # and its compute instance
        self._step()
        return inst

    def destroy_mig(self, index: int, gi_id: int) -> None:
        self.calls.append(("destroy_mig", index, gi_id))
        self._step()
        g = self._gpu(index)
        if gi_id not in g.instances:
            raise MigNotFound(f"GPU {index}: no GPU instance {gi_id}")
        if g.busy:
            raise MigInUse(f"GPU {index}: GPU instance {gi_id} is in use")
        del g.instances[gi_id]
        self._step()

    def enable_mig(self, index: int) -> None:
        self.calls.append(("enable_mig", index))
        g = self._gpu(index)
        if not g.hopper:
            raise MigResetRequired(f"GPU {index}: MIG mode change pending a GPU reset")
        if g.busy:
            raise MigInUse(f"GPU {index}: in use")
        g.mig_on = True

    def disable_mig(self, index: int) -> None:
        self.calls.append(("disable_mig", index))
        g = self._gpu(index)
        if g.instances:
            raise MigInUse(f"GPU {index}: GPU instances remain")
        g.mig_on = False

    # -- what tests set up and read
    def make_by_hand(self, index: int, profile: str, start: int) -> MigInstance:
        """An instance someone else made (nvidia-smi mig -cgi), not counted as a step."""
        crash, self.crash_at = self.crash_at, None
        steps = self.steps
        try:
            return self.create_mig(index, profile, start)
        finally:
            self.crash_at, self.steps = crash, steps
            self.calls.pop()

    def layout(self, index: int) -> set[tuple[str, int]]:
        return {(i.profile, i.placement.start) for i in self.gpus[index].instances.values()}
