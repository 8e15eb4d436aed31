"""Dynamic MIG at prepare and unprepare: the MIG instance of each dynamic MIG device cut on
exactly its allocated placement, destroyed again, and what a crash interrupted settled.

**Write-ahead.** Every step is recorded in the claim's checkpoint file before it is taken
(:class:`agent.dra.checkpoint.MigRecord`): the intent (GPU, profile, placement) before
``create_mig``, the instance (GPU instance, compute instance, UUID) after it; ``destroying``
before ``destroy_mig``, the record dropped after it. An instance is the agent's only while a
record names it, so whatever point a crash hits:

- an intent without its result: the instance with exactly that profile and placement that
  no other record names is the one the agent made (adopted: kept for the claim, or destroyed
  when the claim is being unprepared); none there, nothing was made;
- ``destroying``: destroyed if an instance with that GPU instance id *and* UUID is still there
  (an id reused by an instance made since is not ours);
- an instance no record names (made by hand, by mig-parted, by another tool) is never
  destroyed nor adopted, only logged once at start and refused to claims it overlaps.

Every NVML step goes through :class:`MigOperations` (the hardware backend's MigControl,
handed over by the daemon); its failures are :class:`agent.errors.MigError`. Not
thread-safe: the preparer calls it under its lock. **MIG mode**: a Hopper-or-newer GPU with
MIG off is switched on before its first instance is cut, and off again once its last
instance is gone (only a GPU the agent switched on, only while this agent runs: a GPU left
in MIG mode by a crash stays so, its placements still offered).

Size: one job, the write-ahead life of the instances a claim cuts (cut, settle, destroy,
recover); each step is short, and splitting them would split the one record they share.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Collection, Iterable, Protocol, Sequence

from agent.containers import ContainerDevice
from agent.dra.checkpoint import (
    CREATED,
    CREATING,
    DESTROYING,
    PREPARING,
    UNPREPARING,
    Checkpoint,
    MigRecord,
    PreparedClaim,
)
from agent.dra.devices import DeviceRef, MigSlot, mig_slot
from agent.errors import MigError, MigInUse, MigNotFound, MigResetRequired, shorten
from agent.records import MigDevice, MigInstance
from agent.topology.model import Gpu, Topology

log = logging.getLogger(__name__)

#: The first compute capability whose GPUs switch MIG mode without a reset (Hopper).
MIG_MODE_WITHOUT_RESET = (9, 0)


class MigOperations(Protocol):
    """What dynamic MIG needs of the hardware backend (its ``MigControl``). Errors are
    :class:`agent.errors.MigError` subclasses."""

    def mig_instances(self, index: int) -> tuple[MigInstance, ...]: ...

    def create_mig(self, index: int, profile: str, start: int) -> MigInstance: ...

    def destroy_mig(self, index: int, gi_id: int) -> None: ...

    def enable_mig(self, index: int) -> None: ...

    def disable_mig(self, index: int) -> None: ...


class MigRefused(Exception):
    """A dynamic MIG device (``device``, its name; "" for all) that cannot be prepared now;
    the message says why (one line, naming the GPU)."""

    def __init__(self, message: str, device: str = "") -> None:
        super().__init__(message)
        self.device = device


def describe(gpu: Gpu) -> str:
    return f"GPU {gpu.index} ({gpu.uuid})"


def slot_ref(slot: MigSlot, record: MigRecord | None = None) -> DeviceRef:
    """The device a container gets for ``slot`` cut as ``record`` says (None: not cut yet,
    the device it will be, its UUID unknown: what a claim's sharing is planned on). The MIG
    device's NVML index is not known before the topology is read again: the GPU instance id
    stands in for it (the CDI spec names the device by UUID)."""
    gi_id = record.gi_id if record is not None else None
    mig = MigDevice(record.uuid if record is not None else "", slot.gpu.index, gi_id or 0, slot.profile.name,
                    slot.profile.memory_mib, gi_id=gi_id, ci_id=record.ci_id if record is not None else None)
    return DeviceRef(slot.name, (ContainerDevice(slot.gpu, mig),))


def _matches(record: MigRecord, instance: MigInstance) -> bool:
    """``instance`` is the one ``record`` names (id and UUID: an id is reused by NVML)."""
    return instance.gi_id == record.gi_id and instance.uuid == record.uuid


def _created(record: MigRecord, instance: MigInstance) -> MigRecord:
    assert instance.uuid is not None
    return replace(record, state=CREATED, gi_id=instance.gi_id, ci_id=instance.ci_id, uuid=instance.uuid)


def _whole(instance: MigInstance) -> bool:
    """A usable MIG device: its compute instance made and its UUID known (a create cut short
    leaves a GPU instance without them)."""
    return instance.ci_id is not None and instance.uuid is not None


def _where(profile: str, start: int, size: int) -> str:
    return f"{profile} on memory slices {start}-{start + size - 1}"


class MigLifecycle:
    """Cuts and destroys the MIG instances of claims' dynamic MIG devices through ``ops``,
    write-ahead in ``checkpoint``. ``ops`` None: the backend cuts nothing (every dynamic
    MIG device is refused; records left by an earlier agent stay until one can act)."""

    def __init__(self, ops: MigOperations | None, checkpoint: Checkpoint, *, enabled: bool = True) -> None:
        self.ops = ops
        self.checkpoint = checkpoint
        self.enabled = enabled  # dynamic MIG devices are prepared (``dra.dynamicMig``)
        #: GPUs whose MIG mode this agent switched on (the topology says so once read again)
        self.switched_on: set[int] = set()
        #: the instances not made by the agent logged so far: (GPU, GPU instance id, UUID)
        self._reported: set[tuple[int, int, str | None]] = set()

    # ------------------------------------------------------------------ ownership
    def _owned(self, uid: str, mine: Iterable[MigRecord] = ()) -> set[tuple[int, int]]:
        """(GPU, GPU instance id) of every instance a record names: every other claim's, and
        ``mine`` for claim ``uid``."""
        records = [r for c in self.checkpoint if c.uid != uid for r in c.mig] + list(mine)
        return {(r.gpu, r.gi_id) for r in records if r.state != CREATING and r.gi_id is not None}

    def _instances(self, gpu: int) -> tuple[MigInstance, ...]:
        assert self.ops is not None
        return self.ops.mig_instances(gpu)

    def _present(self, record: MigRecord) -> bool:
        return any(_matches(record, i) for i in self._instances(record.gpu))

    def _write(self, claim: PreparedClaim) -> PreparedClaim:
        self.checkpoint.add(claim)
        return claim

    def _settle(self, claim: PreparedClaim, *, for_prepare: bool) -> PreparedClaim:
        """``claim`` with each record settled against the GPUs now: an intent adopted (the
        unowned instance of exactly its profile and placement) or dropped; for a prepare, an
        instance being destroyed that is still there is the claim's again (dropped when
        gone). Written when anything changed; MigError when a GPU cannot be listed."""
        settled: list[MigRecord] = []
        for record in claim.mig:
            if record.state == CREATING:
                owned = self._owned(claim.uid, settled)
                found = next((i for i in self._instances(record.gpu)
                              if (record.gpu, i.gi_id) not in owned and i.profile == record.profile
                              and i.placement.start == record.start and i.placement.size == record.size), None)
                where = _where(record.profile, record.start, record.size)
                if found is None:
                    log.info("claim %s: GPU %d has no %s, the create it was about to make: nothing to undo",
                             claim.uid, record.gpu, where)
                    continue
                if not _whole(found):  # cut short: of no use to the claim, destroyed (the intent says whose)
                    self._destroy_half_made(claim.uid, found)
                    continue
                log.info("claim %s: adopted GPU instance %d (%s) on GPU %d, %s: created before the agent"
                         " could record it", claim.uid, found.gi_id, found.uuid, record.gpu, where)
                settled.append(_created(record, found))
            elif record.state == DESTROYING and for_prepare:
                if self._present(record):
                    settled.append(replace(record, state=CREATED))
            else:
                settled.append(record)
        if tuple(settled) == claim.mig:
            return claim
        return self._write(replace(claim, mig=tuple(settled)))

    # ------------------------------------------------------------------ prepare
    def slot(self, topology: Topology, name: str) -> MigSlot:
        """The slot dynamic MIG device ``name`` stands for; ValueError saying why it cannot be
        prepared here (dynamic MIG off, or no such slot on ``topology``)."""
        if not self.enabled:
            raise ValueError("a dynamic MIG device, and dynamic MIG is off on this node (dra.dynamicMig)")
        return mig_slot(topology, name)

    def devices(self, claim_name: str, chosen: Sequence[tuple[str, DeviceRef | MigSlot]],
                pending: PreparedClaim) -> tuple[list[DeviceRef], PreparedClaim]:
        """The claim's devices (``chosen``: request, device), its dynamic MIG devices cut
        (:meth:`cut`), and the claim as recorded (``pending`` when none is dynamic);
        ValueError naming the claim (``claim_name``), the device and the request that
        cannot be cut, OSError when the checkpoint cannot be written."""
        slots = [(r, d) for r, d in chosen if isinstance(d, MigSlot)]
        if not slots:
            return [d for _, d in chosen if isinstance(d, DeviceRef)], pending
        try:
            claim, cut = self.cut(pending, slots)
        except MigRefused as exc:
            request = next((r for r, s in slots if s.name == exc.device), slots[0][0])
            raise ValueError(f"{claim_name}: cannot prepare device {exc.device or slots[0][1].name!r}"
                             f" (request {shorten(repr(request))}): {exc}") from exc
        return [cut[d.name] if isinstance(d, MigSlot) else d for _, d in chosen], claim

    def cut_devices(self, claim: PreparedClaim, topology: Topology) -> dict[str, DeviceRef]:
        """The devices ``claim``'s MIG instances were cut for, by name, as recorded (those
        whose GPU ``topology`` still has)."""
        slots = {m.device: (slot_of(topology, m), m) for m in claim.mig}
        return {name: slot_ref(slot, m) for name, (slot, m) in slots.items() if slot is not None}

    def cut(self, pending: PreparedClaim,
            slots: Sequence[tuple[str, MigSlot]]) -> tuple[PreparedClaim, dict[str, DeviceRef]]:
        """Cut an instance for each (request, slot) of claim ``pending`` (its answer-to-be),
        reusing those an earlier try cut; returns the claim as recorded (phase preparing,
        every instance recorded) and each slot's device by name. MigRefused naming the
        device's GPU and why when one cannot be cut (those cut stay recorded for the claim:
        a retry uses them, the unprepare destroys them); OSError when the checkpoint cannot
        be written."""
        if self.ops is None:
            raise MigRefused("dynamic MIG is not available: the hardware backend cannot create MIG instances")
        earlier = self.checkpoint.get(pending.uid)
        claim = replace(pending, phase=PREPARING, mig=earlier.mig if earlier is not None else ())
        try:
            claim = self._settle(self._write(claim), for_prepare=True)
        except MigError as exc:
            raise MigRefused(f"cannot settle its MIG instances: {exc}") from exc
        refs: dict[str, DeviceRef] = {}
        for _, slot in slots:
            try:
                claim, record = self._cut_one(claim, slot)
            except MigRefused as exc:
                raise MigRefused(str(exc), slot.name) from exc
            refs[slot.name] = slot_ref(slot, record)
        return claim, refs

    def _cut_one(self, claim: PreparedClaim, slot: MigSlot) -> tuple[PreparedClaim, MigRecord]:
        gpu, profile, placement = slot.gpu, slot.profile, slot.placement
        where = _where(profile.name, placement.start, placement.size)
        self._mig_mode_on(gpu)
        try:
            instances = self._instances(gpu.index)
        except MigError as exc:
            raise MigRefused(f"{describe(gpu)}: cannot list its MIG instances: {exc}") from exc
        earlier = next((r for r in claim.mig if r.device == slot.name and r.state == CREATED), None)
        if earlier is not None:
            if any(_matches(earlier, i) for i in instances):
                return claim, earlier  # a repeated prepare: the instance is there
            log.warning("claim %s: GPU instance %d (%s) of GPU %d is gone (destroyed by someone else): cut"
                        " again", claim.uid, earlier.gi_id, earlier.uuid, gpu.index)
            claim = self._write(replace(claim, mig=tuple(r for r in claim.mig if r is not earlier)))
        in_way = [i for i in instances if set(i.placement.slices) & set(placement.slices)]
        if in_way:
            owned = self._owned("", ())
            i = in_way[0]
            whose = "made by the agent for another claim" if (gpu.index, i.gi_id) in owned else \
                "not made by the agent (left alone)"
            raise MigRefused(f"{describe(gpu)}: {where} overlaps MIG instance {i.profile} on memory slices"
                             f" {i.placement.start}-{i.placement.start + i.placement.size - 1}"
                             f" (GPU instance {i.gi_id}, {whose})")
        intent = MigRecord(slot.name, gpu.index, profile.name, placement.start, placement.size)
        claim = self._write(replace(claim, mig=(*claim.mig, intent)))
        assert self.ops is not None
        try:
            instance = self.ops.create_mig(gpu.index, profile.name, placement.start)
        except MigError as exc:
            # NVML may have made part of it before failing: what exists is settled as after a crash
            try:
                claim = self._settle(claim, for_prepare=True)
            except MigError:
                pass  # the intent stays: settled at the next try or the unprepare
            adopted = next((r for r in claim.mig if r.device == slot.name and r.state == CREATED), None)
            if adopted is None:
                raise MigRefused(f"{describe(gpu)}: cannot create MIG instance {where}: {exc}") from exc
            return claim, adopted
        if not _whole(instance):
            try:
                self._destroy_half_made(claim.uid, instance)
            except MigError as exc:
                raise MigRefused(f"{describe(gpu)}: MIG instance {where} was made without a compute instance and"
                                 f" cannot be destroyed: {exc}") from exc
            claim = self._write(replace(claim, mig=tuple(r for r in claim.mig if r is not intent)))
            raise MigRefused(f"{describe(gpu)}: MIG instance {where} was made without a compute instance or a UUID:"
                             " destroyed again")
        record = _created(intent, instance)
        claim = self._write(replace(claim, mig=tuple(record if r is intent else r for r in claim.mig)))
        if (instance.profile, instance.placement) != (profile.name, placement):
            made = _where(instance.profile, instance.placement.start, instance.placement.size)
            raise MigRefused(f"{describe(gpu)}: asked for MIG instance {where}, NVML made {made}"
                             " (kept for the claim until it is unprepared)")
        log.info("claim %s: created MIG instance %s on GPU %d (GPU instance %d, compute instance %d, %s)",
                 claim.uid, where, gpu.index, instance.gi_id, instance.ci_id, instance.uuid)
        return claim, record

    def _mig_mode_on(self, gpu: Gpu) -> None:
        """Switch MIG mode on for ``gpu`` where it is off: Hopper and newer, a free GPU (no
        claim holds it whole: checked before; no process: NVML says); MigRefused otherwise."""
        if gpu.mig_enabled or gpu.index in self.switched_on:
            return
        assert self.ops is not None
        cc = gpu.compute_capability
        capability = f"{cc[0]}.{cc[1]}" if cc else "unknown"
        reset = (f"{describe(gpu)} has MIG mode off and switching it on needs a GPU reset ({gpu.name}, compute"
                 f" capability {capability}), which the agent never does: switch MIG mode on by hand"
                 f" (nvidia-smi -i {gpu.index} -mig 1, then reset the GPU)")
        if cc is None or cc < MIG_MODE_WITHOUT_RESET:
            raise MigRefused(reset)
        try:
            self.ops.enable_mig(gpu.index)
        except MigResetRequired as exc:
            raise MigRefused(reset) from exc
        except MigInUse as exc:
            raise MigRefused(f"{describe(gpu)} has MIG mode off and runs processes: MIG mode is switched on only"
                             f" on a free GPU ({exc})") from exc
        except MigError as exc:
            raise MigRefused(f"{describe(gpu)}: cannot switch MIG mode on: {exc}") from exc
        self.switched_on.add(gpu.index)
        log.info("GPU %d (%s): MIG mode switched on (dynamic MIG)", gpu.index, gpu.uuid)

    def _destroy_half_made(self, uid: str, instance: MigInstance) -> None:
        """Destroy the GPU instance an intent of claim ``uid`` made without its compute
        instance (the intent stays recorded until the caller drops it)."""
        assert self.ops is not None
        try:
            self.ops.destroy_mig(instance.parent_index, instance.gi_id)
        except MigNotFound:
            pass
        log.info("claim %s: destroyed GPU instance %d on GPU %d, %s, made without its compute instance", uid,
                 instance.gi_id, instance.parent_index,
                 _where(instance.profile, instance.placement.start, instance.placement.size))

    # ------------------------------------------------------------------ unprepare
    def destroy(self, claim: PreparedClaim) -> str:
        """Destroy every instance ``claim``'s records name (an intent settled first), each
        recorded ``destroying`` before and dropped after; "" when none is left, else the
        error naming the GPU (the rest stays recorded for the next try). OSError when the
        checkpoint cannot be written."""
        if not claim.mig:
            return ""
        if self.ops is None:
            return "its MIG instances cannot be destroyed: the hardware backend cannot destroy MIG instances"
        try:
            claim = self._settle(claim, for_prepare=False)
        except MigError as exc:
            return f"cannot settle its MIG instances: {exc}"
        claim = self._write(replace(claim, phase=UNPREPARING, mig=tuple(
            replace(r, state=DESTROYING) if r.state == CREATED else r for r in claim.mig)))
        records = claim.mig
        for record in records:
            where = _where(record.profile, record.start, record.size)
            try:
                if self._present(record):
                    assert record.gi_id is not None
                    self.ops.destroy_mig(record.gpu, record.gi_id)
                    log.info("claim %s: destroyed MIG instance %s on GPU %d (GPU instance %d, %s)",
                             claim.uid, where, record.gpu, record.gi_id, record.uuid)
            except MigNotFound:
                pass
            except MigError as exc:
                return f"cannot destroy MIG instance {where} of GPU {record.gpu} (GPU instance {record.gi_id}): {exc}"
            claim = self._write(replace(claim, mig=tuple(r for r in claim.mig if r is not record)))
        self._switch_off({r.gpu for r in records})
        return ""

    def _switch_off(self, gpus: Collection[int]) -> None:
        """Switch MIG mode off again on those of ``gpus`` the agent switched on, once no GPU
        instance is left on them: the GPU is whole again, as its published full-GPU device
        says. A failure is logged; the GPU stays in MIG mode (its MIG devices still serve)."""
        assert self.ops is not None
        for gpu in sorted(set(gpus) & self.switched_on):
            try:
                if self.ops.mig_instances(gpu):
                    continue
                self.ops.disable_mig(gpu)
            except MigError as exc:
                log.warning("GPU %d keeps MIG mode on, its last MIG instance gone: %s", gpu, exc)
                continue
            self.switched_on.discard(gpu)
            log.info("GPU %d: MIG mode switched off again (the agent switched it on; no MIG instance left)", gpu)

    # ------------------------------------------------------------------ start
    def settle_preparing(self, claim: PreparedClaim) -> None:
        """At start: settle the intents of a claim whose prepare was interrupted (adopted or
        dropped); its instances stay the claim's until its prepare or unprepare."""
        if self.ops is None or not claim.mig:
            return
        try:
            self._settle(claim, for_prepare=True)
        except (MigError, OSError) as exc:
            log.error("claim %s: cannot settle its MIG instances at start (%s); settled at its next prepare"
                      " or unprepare", claim.uid, exc)

    def report_foreign(self, topology: Topology) -> None:
        """Log, per GPU in MIG mode, the instances no record names not logged before: never
        touched, their memory slices never offered nor cut (:mod:`agent.dra.migslots`)."""
        if self.ops is None or not self.enabled:
            return
        owned = self._owned("")
        for gpu in topology.gpus:
            if not gpu.mig_enabled or gpu.mig_geometry is None:
                continue
            try:
                foreign = [i for i in self.ops.mig_instances(gpu.index) if (gpu.index, i.gi_id) not in owned
                           and (gpu.index, i.gi_id, i.uuid) not in self._reported]
            except MigError as exc:
                log.warning("GPU %d: cannot list its MIG instances (%s)", gpu.index, exc)
                continue
            self._reported |= {(gpu.index, i.gi_id, i.uuid) for i in foreign}
            if foreign:
                log.info("GPU %d (%s): %d MIG instance(s) not made by the agent, left alone: %s", gpu.index, gpu.uuid,
                         len(foreign), ", ".join(f"{_where(i.profile, i.placement.start, i.placement.size)}"
                                                 f" (GPU instance {i.gi_id})" for i in foreign))


def slot_of(topology: Topology, record: MigRecord) -> MigSlot | None:
    """The slot ``record``'s device stands for on ``topology`` (None: no longer there)."""
    try:
        return mig_slot(topology, record.device)
    except ValueError:
        return None
