"""NodePrepareResources / NodeUnprepareResources behind the gRPC servicers: one
implementation for every DRA API version, on plain records.

For each claim: read the ResourceClaim (namespace, name; the UID must match), take the
allocation results of this driver (one or several requests: GPU sets, single GPUs, MIG
devices), check that every device is ours (this node's pool, a device name we publish, every
GPU behind it healthy, no GPU twice, no GPU another prepared claim holds), write one CDI
spec for the claim (a set's device holds every member's device nodes; the environment
covers every GPU of the claim) and checkpoint the answer; log and report how the claim was
placed against the device plugin's choice (:mod:`agent.dra.placement`, ranked after the
answer on its own thread). The claim's opaque configuration says how its devices are shared
(:mod:`agent.dra.claim_sharing`: applied before the spec is written, undone at unprepare,
checkpointed with the claim). Problems are
reported per claim (the rest of the call is still served), each naming the claim and the
device. Idempotent: a claim already prepared answers from the checkpoint without reading the
API server again (nor ranks it again), also after an agent restart.

**No GPU is prepared for two claims.** A claim is refused while any GPU it would hold is held
by another prepared claim of the checkpoint (a GPU set holds every member; a whole GPU and a
MIG device of it conflict, two different MIG devices of one GPU do not). The scheduler's
counters normally forbid such an allocation; this is the defence for the window they cannot
cover (docs/design/dra-gpu-sets.md): at worst a pod fails to start, retried by
the kubelet until the other claim is unprepared, rather than two pods sharing a GPU.

**Dynamic MIG** (``dynamicMig``): a device named for a MIG profile on a placement
(:func:`agent.dra.devices.mig_slot_name`) is cut at prepare on exactly that placement and
destroyed at unprepare, write-ahead in the checkpoint (:mod:`agent.dra.mig_lifecycle`); such
a device conflicts with the whole GPU and with placements overlapping it. At start
(:meth:`ClaimPreparer.recover`) what a crash interrupted is settled.

Size: one job, preparing a claim and undoing it under one lock (the order of its steps is
what keeps a crash from leaving half a claim); reading claims, their sharing, the CDI specs
and the checkpoint are modules of their own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection, Mapping, Protocol, Sequence

from agent.config import Config
from agent.dra.cdi import CdiSpecWriter, cdi_device_id, spec_path
from agent.dra.checkpoint import (
    PREPARED,
    UNPREPARING,
    Checkpoint,
    PreparedClaim,
    PreparedDevice,
    claim_uid_problem,
)
from agent.dra.claim_sharing import ClaimSharing, SharedDevices
from agent.dra.claims import ClaimNotFound, ClaimReader, ClaimReadError
from agent.dra.conflicts import Holders, held_elsewhere, holders_of, mig_conflicts, shared_gpus
from agent.dra.devices import DeviceRef, MigSlot, parse_mig_slot_name
from agent.dra.mig_lifecycle import MigLifecycle, MigOperations, slot_ref
from agent.dra.placement import Prepared
from agent.dra.view import DraView
from agent.errors import shorten
from agent.nccl.host_dir import nccl_files_for
from agent.sharing.timeslice import NvidiaSmiTimeSlice

log = logging.getLogger(__name__)

#: Kubernetes object names: a namespace is a DNS label, a claim name a DNS subdomain. A
#: longer one cannot exist, so it is refused without asking the API server.
MAX_NAMESPACE_CHARS = 63
MAX_NAME_CHARS = 253
#: How much of a message built from several untrusted values (a list of refused devices,
#: the drivers of a claim) goes to the kubelet and the log.
MESSAGE_LIMIT = 600


class HealthView(Protocol):
    """What preparation reads of :class:`agent.health.HealthState`."""

    def is_healthy(self, index: int) -> bool: ...


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        # all three come from the kubelet as they are: a megabyte each would be a megabyte
        # in the reply and the log
        return (f"ResourceClaim {shorten(self.namespace)}/{shorten(self.name, MAX_NAME_CHARS)}"
                f" (uid {shorten(self.uid)})")


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    #: the error's cause is in the log already: the claim reader says once when reading
    #: claims starts failing, not once per claim
    logged: bool = False


class ClaimPreparer:
    """Prepares and unprepares claims. Thread-safe: the kubelet may call concurrently."""

    def __init__(
        self,
        view: DraView,
        config: Config,
        health: HealthView,
        claim_reader: ClaimReader,
        checkpoint: Checkpoint,
        *,
        node_name: str,
        on_prepared: Callable[[Prepared], None] | None = None,
        mig: MigOperations | None = None,
    ) -> None:
        self.driver_name = config.driver_name
        self.cdi_dir = config.cdi_dir
        self.node_name = node_name
        self.health = health
        self.claims = claim_reader
        self.checkpoint = checkpoint
        self.view = view
        # the claims' NCCL files: one owner of the host directory, kept across reloads
        self.nccl_files = nccl_files_for(config, None)
        self.cdi = CdiSpecWriter(view.topology, config, self.nccl_files)
        #: handed each claim prepared anew, to rank its placement (:mod:`agent.dra.placement`);
        #: must return at once
        self.on_prepared = on_prepared
        # the claims' sharing: intervals set with nvidia-smi, one MPS daemon per shared entry
        self.sharing = ClaimSharing(config.driver_name, config.mps_root, config.mps_control_binary,
                                    NvidiaSmiTimeSlice(config.nvidia_smi))
        #: dynamic MIG: devices cut at prepare (``config.dynamic_mig``) through ``mig``
        self.mig = MigLifecycle(mig, checkpoint, enabled=config.dynamic_mig == "on")
        self._lock = threading.Lock()

    def resume(self) -> None:
        """Supervise again the MPS daemons of the claims checkpointed by an earlier agent."""
        for c in self.checkpoint:
            if c.sharing:
                self.sharing.resume(str(ClaimRef(c.namespace, c.uid, c.name)), c.uid, c.sharing)

    def close(self) -> None:
        """Stop supervising the claims' MPS daemons; they keep serving their pods."""
        self.sharing.close()

    @property
    def devices(self) -> Mapping[str, DeviceRef]:
        """The devices claims are prepared from now, by name."""
        return self.view.devices

    def set_topology(self, view: DraView, config: Config) -> None:
        """Serve ``view`` with ``config`` from now on (read again after a kubelet restart or
        SIGHUP; its driver name and CDI directory are the running ones). Claims already
        prepared keep their checkpointed answer."""
        self.nccl_files = nccl_files_for(config, self.nccl_files)
        cdi = CdiSpecWriter(view.topology, config, self.nccl_files)
        with self._lock:
            self.view, self.cdi = view, cdi
            self.mig.report_foreign(view.topology)  # an instance made by hand since: said once

    # ------------------------------------------------------------------ prepare
    def prepare(self, ref: ClaimRef) -> PrepareResult:
        if problem := _ref_problem(ref):
            return PrepareResult(error=f"{ref}: {problem}")
        done = self.checkpoint.get(ref.uid)
        if done is not None and done.prepared:
            return self._answer_again(done)
        try:
            obj = self.claims.get(ref.namespace, ref.name)
        except ClaimNotFound:
            return PrepareResult(error=f"{ref}: not found in the API server")
        except ClaimReadError as exc:
            return PrepareResult(error=f"{ref}: cannot be read: {exc}", logged=True)
        view = self.view  # one view for the whole prepare, whatever set_topology does meanwhile
        try:
            chosen = self._devices_of(ref, obj, view.devices)
            # the claim's sharing checked before anything is cut: a MIG device not cut yet is
            # planned as the MIG device it will be
            planned = [(r, d if isinstance(d, DeviceRef) else slot_ref(d)) for r, d in chosen]
            plan = self.sharing.plan(str(ref), obj["status"]["allocation"], planned)
            requests = [r for r, _ in chosen]
        except ValueError as exc:
            return PrepareResult(error=str(exc))
        with self._lock:
            done = self.checkpoint.get(ref.uid)
            if done is not None and done.prepared:  # a concurrent call prepared it meanwhile
                return self._answer_again(done)
            # under the lock: two claims racing for one GPU are decided one after the other
            holders = self._holders()
            if conflicts := self._conflicts(ref, chosen, holders):
                return PrepareResult(error=f"{ref}: cannot prepare " + shorten("; ".join(conflicts), MESSAGE_LIMIT))
            try:
                refs, prepared = self.mig.devices(str(ref), chosen, self._answer(ref, chosen))
            except ValueError as exc:
                return PrepareResult(error=str(exc))
            except OSError as exc:
                return self._failed(ref, "record it in the checkpoint", self.checkpoint.path_of(ref.uid), exc)
            if any(isinstance(d, MigSlot) for _, d in chosen):
                try:  # planned again on the MIG devices cut (their UUIDs go to the MPS daemon)
                    plan = self.sharing.plan(str(ref), obj["status"]["allocation"], list(zip(requests, refs)))
                except ValueError as exc:
                    return PrepareResult(error=str(exc))
            written = self._share_and_write(ref, obj, list(zip(requests, refs)), plan)
            if isinstance(written, PrepareResult):
                return written
            path, sharing = written
            prepared = replace(prepared, spec_path=path, phase=PREPARED, sharing=sharing)
            try:
                self.checkpoint.add(prepared)
            except OSError as exc:
                # nothing half-prepared: a spec without its checkpoint entry would be a
                # device the runtime can inject and no unprepare after a restart removes
                if error := self._remove_spec(ref, path):
                    log.error("%s", error)
                self.sharing.discard(str(ref), ref.uid, sharing)
                return self._failed(ref, "record it in the checkpoint", self.checkpoint.path_of(ref.uid), exc)
        log.info("prepared %s: %s", ref, ", ".join(d.device for d in prepared.devices))
        self._rank_later(ref, view, [(r.name, r) for r in refs], {gpu for gpu, _ in holders})
        return PrepareResult(devices=prepared.devices)

    def _answer(self, ref: ClaimRef, chosen: Sequence[tuple[str, DeviceRef | MigSlot]]) -> PreparedClaim:
        """The claim prepared with ``chosen``, as the checkpoint records it."""
        return PreparedClaim(
            uid=ref.uid, namespace=ref.namespace, name=ref.name,
            spec_path=spec_path(self.cdi_dir, self.driver_name, ref.uid),
            devices=tuple(
                PreparedDevice(request, self.node_name, d.name, (cdi_device_id(self.driver_name, ref.uid, d.name),))
                for request, d in chosen
            ),
        )

    def _conflicts(self, ref: ClaimRef, chosen: Sequence[tuple[str, DeviceRef | MigSlot]],
                   holders: Holders) -> list[str]:
        """What other prepared claims hold of ``chosen`` (GPUs, MIG devices, memory slices)."""
        whole = [(r, d) for r, d in chosen if isinstance(d, DeviceRef)]
        return held_elsewhere(whole, holders, _name_of) + mig_conflicts(
            self.checkpoint, ref.uid, chosen, holders, _name_of, self.mig.switched_on)

    def recover(self) -> None:
        """At start, before serving: settle what a crash interrupted. A claim being
        unprepared is unprepared (its instances destroyed, its spec removed: the kubelet's
        retry then finds nothing to do); a claim being prepared keeps the instances made for
        it (an intent adopted or dropped) for its next prepare or unprepare. MIG instances no
        record names are logged and left alone."""
        for claim in self.checkpoint:
            ref = _claim_ref(claim)
            if claim.phase == UNPREPARING:
                error = self.unprepare(ref)
                log.info("%s: its unprepare, interrupted, %s", ref, f"failed again: {error}" if error else "is done")
            elif not claim.prepared:
                self.mig.settle_preparing(claim)
        self.mig.report_foreign(self.view.topology)

    def _rank_later(self, ref: ClaimRef, view: DraView, chosen: Sequence[tuple[str, DeviceRef]],
                    held: Collection[int]) -> None:
        """Hand the claim prepared anew to :attr:`on_prepared` with the GPUs free now (other
        claims held ``held``), to be ranked off the prepare path."""
        if self.on_prepared is None:
            return
        parts = [p for _, d in chosen for p in d.parts]
        unhealthy = frozenset(g.index for g in view.topology.gpus if not self.health.is_healthy(g.index))
        self.on_prepared(Prepared(str(ref), view.policy, tuple(p.gpu.index for p in parts),
                                  all(p.mig is None for p in parts), frozenset(held), unhealthy))

    def _holders(self) -> Holders:
        """(GPU index, MIG index or None) -> the prepared claim holding it and its device."""
        return holders_of(self.checkpoint, self.view.devices)

    @staticmethod
    def _failed(ref: ClaimRef, what: str, path: str, exc: OSError) -> PrepareResult:
        """The error for a file that could not be written, naming that file and the OS's
        reason (with the path it concerns when that is another one: a directory in the way)."""
        reason = exc.strerror or str(exc)
        if exc.filename and exc.filename != path:
            reason = f"{exc.filename}: {reason}"
        error = f"{ref}: cannot {what} {path}: {shorten(reason, MESSAGE_LIMIT)}"
        log.error("%s", error)
        return PrepareResult(error=error)

    def _share_and_write(self, ref: ClaimRef, obj: Mapping[str, Any], chosen: Sequence[tuple[str, DeviceRef]],
                         plan: Sequence[SharedDevices]) -> tuple[str, dict[str, Any] | None] | PrepareResult:
        """Apply the claim's sharing, then write its spec: (the spec's path, the sharing
        applied), or the error with nothing left applied."""
        try:
            shared = self.sharing.apply(str(ref), ref.uid, plan)
        except ValueError as exc:
            return PrepareResult(error=str(exc))
        sharing = shared.to_json() if shared is not None else None
        try:
            return self.cdi.write(ref.uid, [d for _, d in chosen], _other_devices(obj, self.driver_name),
                                  self.sharing.additions(sharing)), sharing
        except OSError as exc:
            self.sharing.discard(str(ref), ref.uid, sharing)
            return self._failed(ref, "write its CDI spec", spec_path(self.cdi_dir, self.driver_name, ref.uid), exc)

    def _remove_spec(self, ref: ClaimRef, path: str) -> str:
        """Remove the claim's spec and NCCL topology file (none there is fine); "" or the
        error."""
        try:
            self.cdi.remove(path, ref.uid)
        except OSError as exc:
            return f"{ref}: cannot remove its CDI spec {path} or its NCCL topology file: {exc.strerror or exc}"
        return ""

    def _answer_again(self, done: PreparedClaim) -> PrepareResult:
        """The checkpointed answer; the spec is written again if it went missing."""
        if not self.cdi.has_spec(done.spec_path):
            cut = self.mig.cut_devices(done, self.view.topology)
            refs = [self.devices[d.device] if d.device in self.devices else cut[d.device]
                    for d in done.devices if d.device in self.devices or d.device in cut]
            if len(refs) != len(done.devices):
                return PrepareResult(
                    error=f"{ClaimRef(done.namespace, done.uid, done.name)}: prepared before, but its devices"
                    f" {shorten([d.device for d in done.devices], MESSAGE_LIMIT)} are no longer on this node"
                )
            try:
                with self._lock:
                    self.cdi.write(done.uid, refs, device_additions=self.sharing.additions(done.sharing))
            except OSError as exc:
                ref = ClaimRef(done.namespace, done.uid, done.name)
                return self._failed(ref, "write its CDI spec", done.spec_path, exc)
        return PrepareResult(devices=done.devices)

    def _devices_of(self, ref: ClaimRef, obj: Mapping[str, Any],
                    devices: Mapping[str, DeviceRef]) -> list[tuple[str, DeviceRef | MigSlot]]:
        """(request name, device) for each of this driver's allocation results; raises
        ValueError naming every device that cannot be prepared."""
        uid = _get(obj, "metadata", "uid")
        if uid != ref.uid:
            raise ValueError(
                f"{ref}: the API server's claim has uid {shorten(repr(uid))}; it was deleted and created"
                " again, the kubelet's claim no longer exists"
            )
        allocation = _get(obj, "status", "allocation")
        if not isinstance(allocation, Mapping):
            raise ValueError(f"{ref}: not allocated (status.allocation is empty)")
        results = _get(allocation, "devices", "results") or []
        if not isinstance(results, Sequence):
            raise ValueError(f"{ref}: status.allocation.devices.results is not a list")
        ours = [r for r in results if isinstance(r, Mapping) and r.get("driver") == self.driver_name]
        if not ours:
            drivers = sorted({shorten(r.get("driver")) for r in results if isinstance(r, Mapping)})
            raise ValueError(
                f"{ref}: no device of driver {self.driver_name} is allocated (drivers in"
                f" status.allocation.devices.results: {shorten(', '.join(drivers), MESSAGE_LIMIT) or 'none'})"
            )
        chosen: list[tuple[str, DeviceRef | MigSlot]] = []
        problems: list[str] = []
        for r in ours:
            pool, name, request = str(r.get("pool", "")), str(r.get("device", "")), str(r.get("request", ""))
            what = (f"device {shorten(repr(name))} of pool {shorten(repr(pool))}"
                    f" (request {shorten(repr(request))})")
            if pool != self.node_name:
                problems.append(f"{what}: from another pool, this node serves pool {self.node_name!r}")
                continue
            device: DeviceRef | MigSlot | None = devices.get(name)
            if device is None and parse_mig_slot_name(name) is not None:
                try:
                    device = self.mig.slot(self.view.topology, name)
                except ValueError as exc:
                    problems.append(f"{what}: {exc}")
                    continue
            if device is None:
                known = shorten(", ".join(devices), 200) or "no devices"
                problems.append(f"{what}: unknown, this node has {known}")
                continue
            gpus = (device.gpu,) if isinstance(device, MigSlot) else device.gpus
            sick = [g for g in gpus if not self.health.is_healthy(g.index)]
            if sick:
                member = "" if len(gpus) == 1 else "a GPU set whose member "
                problems.append(f"{what}: {member}" + ", ".join(f"GPU {g.index} ({g.uuid})" for g in sick)
                                + (" is" if len(sick) == 1 else " are") + " unhealthy")
                continue
            chosen.append((request, device))
        problems += shared_gpus([(r, d) for r, d in chosen if isinstance(d, DeviceRef)])
        if problems:
            raise ValueError(f"{ref}: cannot prepare " + shorten("; ".join(problems), MESSAGE_LIMIT))
        return chosen

    # ------------------------------------------------------------------ unprepare
    def unprepare(self, ref: ClaimRef) -> str:
        """Remove the claim's CDI spec and forget it; "" on success (also for a claim never
        prepared here), else the error."""
        if not ref.uid:
            return f"{ref}: the claim's uid must not be empty"
        if claim_uid_problem(ref.uid):
            return f"{ref}: {claim_uid_problem(ref.uid)}"
        with self._lock:
            done = self.checkpoint.get(ref.uid)
            # the sharing first: while it cannot be undone the claim stays prepared (retried)
            if done is not None and done.sharing and (error := self.sharing.undo(str(ref), ref.uid, done.sharing)):
                return error
            path = done.spec_path if done is not None else spec_path(self.cdi_dir, self.driver_name, ref.uid)
            if error := self._remove_spec(ref, path):
                return error
            try:
                if done is not None and (error := self.mig.destroy(done)):
                    return f"{ref}: {error}"
                self.checkpoint.remove(ref.uid)
            except OSError as exc:
                return f"{ref}: cannot update the checkpoint in {self.checkpoint.directory}: {exc.strerror or exc}"
        if done is not None:
            log.info("unprepared %s", ref)
        return ""


def _claim_ref(claim: PreparedClaim) -> ClaimRef:
    return ClaimRef(claim.namespace, claim.uid, claim.name)


def _ref_problem(ref: ClaimRef) -> str:
    """Why the kubelet's ``ref`` names no claim that can exist ("" when it may)."""
    missing = [f for f in ("namespace", "uid", "name") if not getattr(ref, f)]
    if missing:
        return f"the claim's {', '.join(missing)} must not be empty"
    if claim_uid_problem(ref.uid):
        return claim_uid_problem(ref.uid)
    if len(ref.namespace) > MAX_NAMESPACE_CHARS or len(ref.name) > MAX_NAME_CHARS:
        return (f"not a ResourceClaim name (a namespace has at most {MAX_NAMESPACE_CHARS}"
                f" characters, a name at most {MAX_NAME_CHARS})")
    return ""


def _name_of(claim: PreparedClaim) -> str:
    return str(_claim_ref(claim))


def _other_devices(obj: Mapping[str, Any], driver_name: str) -> list[str]:
    """The names of the claim's devices from other drivers (a NIC of a network DRA driver
    allocated beside the GPUs): the claim's NCCL file names those the node knows."""
    results = _get(obj, "status", "allocation", "devices", "results") or []
    if not isinstance(results, Sequence):
        return []
    return [str(r.get("device", "")) for r in results
            if isinstance(r, Mapping) and r.get("driver") != driver_name and r.get("device")]


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj
