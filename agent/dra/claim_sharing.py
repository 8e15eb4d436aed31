"""A claim's sharing, applied at NodePrepareResources and undone at NodeUnprepareResources.

From the claim's configuration (:mod:`agent.dra.claim_config`), per configuration entry
and the devices it applies to:

- ``TimeSlicing`` on whole GPUs (a ``GpuConfig``): the interval is set on each GPU
  (:class:`agent.sharing.timeslice.TimeSliceControl`) at prepare and set back to
  ``Default`` at unprepare, as NVIDIA's driver does. Refused on a GPU whose compute mode
  lets one process at a time (the time-slicing rule of :mod:`agent.sharing.timeslicing`).
  On a MIG device there is nothing to set.
- ``MPS``: one MPS control daemon for the entry's devices, supervised by the agent
  (:class:`agent.sharing.mps_daemon.MpsControlDaemon`), its pipe and log directories under
  ``<mpsRoot>/claim-<uid>-<n>/``, its defaults the entry's thread percentage and pinned
  memory limits; the prepare answers once it answers. Each of those devices' CDI entries
  gives a container ``CUDA_MPS_PIPE_DIRECTORY`` (the pipe directory, mounted at
  ``/tmp/nvidia-mps`` as NVIDIA's driver mounts it), the limits as
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (``<ordinal>=<MiB>M``, the devices in the daemon's order), and ``<mpsRoot>/shm`` as
  ``/dev/shm``. Refused on a GPU that cannot run MPS (:func:`agent.sharing.mps.mps_refusal`).
  The daemon quits at unprepare and its directories go. Unlike NVIDIA's driver the agent
  does not switch the GPU's compute mode (it never changes that GPU state; MPS serves in
  Default mode).

What was applied (:class:`ClaimSharingState`) goes into the claim's checkpoint entry: after
an agent restart the daemons are supervised again without being restarted (their pods keep
their MPS server) and an unprepare stops them and resets the intervals. Each refusal is one
line naming the claim, the request and the field.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from agent.containers import ContainerAdditions, Mount
from agent.dra.claim_config import (
    MPS,
    TIME_SLICING,
    ClaimConfigError,
    ConfigEntry,
    MpsSettings,
    config_for,
    read_configs,
)
from agent.dra.devices import DeviceRef
from agent.errors import AgentError
from agent.sharing.base import STOP_TIMEOUT_S
from agent.sharing.mps import (
    MPS_MEMORY_LIMIT_ENV,
    MPS_PIPE_ENV,
    MPS_THREAD_PERCENTAGE_ENV,
    mps_refusal,
)
from agent.sharing.mps_daemon import MpsControlDaemon, MpsDaemonSpec
from agent.sharing.mps_paths import MPS_SHM_PATH, mps_resource_dir, mps_shm_dir
from agent.sharing.timeslice import DEFAULT_INTERVAL, TimeSliceControl
from agent.sharing.timeslicing import REFUSED_COMPUTE_MODES

log = logging.getLogger(__name__)

#: Where a claim's MPS pipe directory is in its containers (NVIDIA's DRA driver's path).
MPS_CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
#: How long a prepare waits for the claim's MPS control daemon to answer (s).
MPS_READY_TIMEOUT_S = 15.0
#: MPS's own default active-thread percentage, given to a daemon whose entry sets none.
MPS_DEFAULT_THREAD_PERCENTAGE = 100


@dataclass(frozen=True)
class SharedDevices:
    """The plan for one configuration entry: its strategy and the devices it applies to."""

    entry: ConfigEntry
    devices: tuple[tuple[str, DeviceRef], ...]  # (request, device)

    @property
    def requests(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for r, _ in self.devices))


@dataclass(frozen=True)
class MpsDaemonState:
    """One claim MPS daemon as prepared: where it lives, what it serves, whose it is."""

    mps_root: str
    resource: str  # its directories: <mps_root>/<resource>/{pipe,log}
    uuids: tuple[str, ...]  # its CUDA_VISIBLE_DEVICES
    memory_limits_mib: tuple[int | None, ...]  # per ordinal
    thread_percentage: int | None  # the entry's (None: MPS's default)
    devices: tuple[str, ...]  # the DRA devices whose containers are its clients

    def spec(self) -> MpsDaemonSpec:
        percentage = MPS_DEFAULT_THREAD_PERCENTAGE if self.thread_percentage is None else self.thread_percentage
        return MpsDaemonSpec(self.resource, self.uuids, self.memory_limits_mib, percentage)


@dataclass(frozen=True)
class ClaimSharingState:
    """What a prepare applied: the intervals set, the MPS daemons started."""

    timesliced: tuple[tuple[str, str], ...] = ()  # (GPU UUID, interval)
    mps: tuple[MpsDaemonState, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "timesliced": [list(t) for t in self.timesliced],
            "mps": [{"mpsRoot": d.mps_root, "resource": d.resource, "uuids": list(d.uuids),
                     "memoryLimitsMiB": list(d.memory_limits_mib), "threadPercentage": d.thread_percentage,
                     "devices": list(d.devices)} for d in self.mps],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClaimSharingState:
        """Raises KeyError, TypeError or ValueError for data :meth:`to_json` did not write."""
        return cls(
            tuple((str(uuid), str(interval)) for uuid, interval in data["timesliced"]),
            tuple(MpsDaemonState(str(d["mpsRoot"]), str(d["resource"]), tuple(map(str, d["uuids"])),
                                 tuple(None if m is None else int(m) for m in d["memoryLimitsMiB"]),
                                 None if d["threadPercentage"] is None else int(d["threadPercentage"]),
                                 tuple(map(str, d["devices"])))
                  for d in data["mps"]),
        )


class ClaimSharing:
    """Plans, applies and undoes claims' sharing; keeps the claims' MPS supervisors.
    Callers serialise :meth:`apply` and :meth:`undo` of one claim (the preparer's lock)."""

    def __init__(self, driver_name: str, mps_root: str, mps_program: str, timeslice: TimeSliceControl,
                 *, ready_timeout_s: float = MPS_READY_TIMEOUT_S) -> None:
        self.driver_name = driver_name
        self.mps_root = mps_root
        self.mps_program = mps_program
        self.timeslice = timeslice
        self.ready_timeout_s = ready_timeout_s
        # Lock order: a leaf, held only to read or change the map.
        self._lock = threading.Lock()
        self._daemons: dict[str, list[MpsControlDaemon]] = {}  # claim UID -> its supervisors

    # ------------------------------------------------------------------ plan
    def plan(self, claim: str, allocation: Mapping[str, Any],
             chosen: Sequence[tuple[str, DeviceRef]]) -> tuple[SharedDevices, ...]:
        """What the claim's configuration asks of its ``chosen`` devices ((request, device)),
        checked against the node; ValueError with the one line when it cannot apply."""
        requests = [r for r, _ in chosen]
        try:
            entries = read_configs(allocation, self.driver_name)
            groups: dict[int, list[tuple[str, DeviceRef]]] = {}
            for request, device in chosen:
                mig = any(p.mig is not None for p in device.parts)
                entry = config_for(entries, request, mig, device.name)
                if entry is not None and entry.config.strategy is not None:
                    groups.setdefault(entries.index(entry), []).append((request, device))
            plan = tuple(SharedDevices(entries[i], tuple(devices)) for i, devices in sorted(groups.items()))
            for shared in plan:
                _check(shared)
        except ClaimConfigError as exc:
            raise ValueError(exc.line(claim, requests)) from None
        return tuple(s for s in plan if s.entry.config.strategy == MPS or s.entry.config.interval is not None)

    # ------------------------------------------------------------------ apply
    def apply(self, claim: str, uid: str, plan: Sequence[SharedDevices]) -> ClaimSharingState | None:
        """Set the intervals and start the daemons of ``plan`` (None when it asks nothing);
        ValueError with the one line when a step fails, after undoing the steps before."""
        if not plan:
            return None
        timesliced: list[tuple[str, str]] = []
        states: list[MpsDaemonState] = []
        daemons: list[MpsControlDaemon] = []
        try:
            for shared in plan:
                if shared.entry.config.strategy == TIME_SLICING:
                    self._set_intervals(claim, shared, timesliced)
            for shared in (s for s in plan if s.entry.config.strategy == MPS):
                state = _mps_state(self.mps_root, f"claim-{uid}-{len(states)}", shared)
                states.append(state)
                daemons.append(self._start(claim, shared, state))
        except ValueError:
            _stopped(daemons, states)
            if errors := self._reset(timesliced):
                log.error("%s: %s", claim, "; ".join(errors))
            raise
        with self._lock:
            self._daemons[uid] = daemons
        applied = ClaimSharingState(tuple(timesliced), tuple(states))
        log.info("%s: shared by %s", claim, _described(applied))
        return applied

    def _set_intervals(self, claim: str, shared: SharedDevices, done: list[tuple[str, str]]) -> None:
        interval = shared.entry.config.interval or DEFAULT_INTERVAL
        for request, device in shared.devices:
            for part in device.parts:
                if any(uuid == part.gpu.uuid for uuid, _ in done):
                    continue
                try:
                    self.timeslice.set_timeslice(part.gpu.uuid, interval)
                except AgentError as exc:
                    raise ValueError(ClaimConfigError(
                        (request,), "sharing.timeSlicingConfig.interval",
                        f"{interval} cannot be set on GPU {part.gpu.index}: {exc}", shared.entry.origin,
                    ).line(claim, ())) from None
                done.append((part.gpu.uuid, interval))

    def _start(self, claim: str, shared: SharedDevices, state: MpsDaemonState,
               adopt: bool = False) -> MpsControlDaemon:
        """Start the supervisor of ``state``'s daemon and wait until it answers (``adopt``:
        do not wait, keep a daemon answering already)."""
        changed = threading.Event()
        daemon = MpsControlDaemon(state.spec(), state.mps_root, self.mps_program, changed.set, adopt=adopt)
        daemon.start()
        if adopt:
            return daemon
        deadline = time.monotonic() + self.ready_timeout_s
        while not daemon.ready:
            left = deadline - time.monotonic()
            if left <= 0:
                daemon.stop(STOP_TIMEOUT_S)
                raise ValueError(ClaimConfigError(
                    shared.requests, "sharing.strategy",
                    f"{MPS}: the claim's MPS control daemon did not answer within {self.ready_timeout_s:g} s"
                    " (the agent's log says why)", shared.entry.origin,
                ).line(claim, ()))
            changed.wait(min(left, 0.5))
            changed.clear()
        return daemon

    # ------------------------------------------------------------------ undo
    def undo(self, claim: str, uid: str, state_json: Mapping[str, Any]) -> str:
        """Stop the claim's daemons and set its GPUs' intervals back to Default; "" or the
        error (the claim stays prepared: the kubelet retries)."""
        with self._lock:
            daemons = self._daemons.pop(uid, [])
        try:
            state = ClaimSharingState.from_json(state_json)
        except (KeyError, TypeError, ValueError) as exc:
            _stopped(daemons, ())
            log.error("%s: its checkpointed sharing cannot be read (%s); nothing more to undo", claim, exc)
            return ""
        _stopped(daemons, state.mps)
        if errors := self._reset(state.timesliced):
            return f"{claim}: cannot set the time-slice interval back to {DEFAULT_INTERVAL}: {'; '.join(errors)}"
        if daemons or state.timesliced:
            log.info("%s: sharing undone (%s)", claim, _described(state))
        return ""

    def discard(self, claim: str, uid: str, state_json: Mapping[str, Any] | None) -> None:
        """Undo the sharing of a claim that could not be prepared after all (an error is
        logged: the prepare's own error is what the kubelet gets)."""
        if state_json and (error := self.undo(claim, uid, state_json)):
            log.error("%s", error)

    def _reset(self, timesliced: Sequence[tuple[str, str]]) -> list[str]:
        errors = []
        for uuid, _ in timesliced:
            try:
                self.timeslice.set_timeslice(uuid, DEFAULT_INTERVAL)
            except AgentError as exc:
                errors.append(str(exc))
        return errors

    # ------------------------------------------------------------------ lifecycle
    def resume(self, claim: str, uid: str, state_json: Mapping[str, Any]) -> None:
        """Supervise again the daemons of a claim prepared before this agent started,
        keeping those that answer."""
        try:
            state = ClaimSharingState.from_json(state_json)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("%s: its checkpointed sharing cannot be read (%s); its MPS daemons are not supervised",
                      claim, exc)
            return
        daemons = [MpsControlDaemon(d.spec(), d.mps_root, self.mps_program, lambda: None, adopt=True)
                   for d in state.mps]
        for daemon in daemons:
            daemon.start()
        if daemons:
            with self._lock:
                self._daemons[uid] = daemons

    def close(self) -> None:
        """Stop supervising; the daemons keep serving their pods (the next agent adopts them)."""
        with self._lock:
            running, self._daemons = list(self._daemons.values()), {}
        for daemons in running:
            for daemon in daemons:
                daemon.detach(STOP_TIMEOUT_S)

    @staticmethod
    def additions(state_json: Mapping[str, Any] | None) -> dict[str, ContainerAdditions]:
        """What each device's containers get of the claim's sharing (its CDI entry), by
        device name."""
        if not state_json:
            return {}
        out: dict[str, ContainerAdditions] = {}
        for d in ClaimSharingState.from_json(state_json).mps:
            envs = {MPS_PIPE_ENV: MPS_CONTAINER_PIPE_DIR}
            if d.thread_percentage is not None:
                envs[MPS_THREAD_PERCENTAGE_ENV] = str(d.thread_percentage)
            if limits := [f"{i}={m}M" for i, m in enumerate(d.memory_limits_mib) if m]:
                envs[MPS_MEMORY_LIMIT_ENV] = ",".join(limits)
            mounts = (Mount(MPS_CONTAINER_PIPE_DIR, mps_resource_dir(d.mps_root, d.resource, "pipe")),
                      Mount(MPS_SHM_PATH, mps_shm_dir(d.mps_root)))
            for name in d.devices:
                out[name] = ContainerAdditions(envs, mounts)
        return out


def _stopped(daemons: Sequence[MpsControlDaemon], states: Sequence[MpsDaemonState]) -> None:
    """Stop the supervisors (each tells its daemon to quit) and remove the daemons'
    directories (their pipes and logs: a claim's are its own)."""
    for daemon in daemons:
        daemon.stop(STOP_TIMEOUT_S)
    for state in states:
        path = os.path.join(state.mps_root, state.resource)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the MPS directory %s of an unprepared claim: %s", path, exc.strerror or exc)


def _check(shared: SharedDevices) -> None:
    """ClaimConfigError where the node cannot give ``shared`` its strategy."""
    config, origin = shared.entry.config, shared.entry.origin
    for request, device in shared.devices:
        for part in device.parts:
            gpu = part.gpu
            if config.strategy == TIME_SLICING and config.interval is not None \
                    and gpu.compute_mode in REFUSED_COMPUTE_MODES:
                raise ClaimConfigError((request,), "sharing.strategy", (
                    f"{TIME_SLICING}: GPU {gpu.index} of device {device.name} is in compute mode {gpu.compute_mode},"
                    " which lets one process at a time use it (Prohibited: none); set it to Default with"
                    f" nvidia-smi -c DEFAULT -i {gpu.index}"), origin)
            if config.strategy == MPS and (why := mps_refusal(gpu)) is not None:
                raise ClaimConfigError((request,), "sharing.strategy",
                                       f"{MPS}: GPU {gpu.index} of device {device.name} cannot run MPS: {why}", origin)
    if config.strategy == MPS:
        _limits(shared, config.mps or MpsSettings())


def _limits(shared: SharedDevices, mps: MpsSettings) -> tuple[int | None, ...]:
    """The pinned memory limit of each of ``shared``'s devices (daemon ordinal order), MiB;
    ClaimConfigError for a key naming no device or a limit beyond a device's memory."""
    parts = [p for _, d in shared.devices for p in d.parts]
    uuids = [p.uuid for p in parts]
    at = "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"
    limits: list[tuple[int | None, str]] = [(mps.pinned_limit_mib, at)] * len(parts)  # (MiB, the field that set it)
    for key, mib in mps.per_device_mib:
        field = f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.{key}"
        if key in uuids:
            limits[uuids.index(key)] = (mib, field)
        elif key.isdigit() and int(key) < len(parts):
            limits[int(key)] = (mib, field)
        else:
            raise ClaimConfigError(shared.requests, field, (
                f"not a device of this configuration: expected an index 0-{len(parts) - 1}"
                f" or one of the UUIDs {', '.join(uuids)}"), shared.entry.origin)
    for ordinal, (part, (limit, field)) in enumerate(zip(parts, limits)):
        memory = part.mig.memory_mib if part.mig is not None else part.gpu.memory_mib
        if limit is not None and memory and limit > memory:
            raise ClaimConfigError(shared.requests, field, (
                f"{limit} MiB is more than device {ordinal} ({part.uuid}) has: {memory} MiB"), shared.entry.origin)
    return tuple(limit for limit, _ in limits)


def _mps_state(mps_root: str, resource: str, shared: SharedDevices) -> MpsDaemonState:
    mps = shared.entry.config.mps or MpsSettings()
    parts = [p for _, d in shared.devices for p in d.parts]
    return MpsDaemonState(mps_root, resource, tuple(p.uuid for p in parts), _limits(shared, mps),
                          mps.thread_percentage, tuple(d.name for _, d in shared.devices))


def _described(state: ClaimSharingState) -> str:
    parts = [f"time-slice interval {interval} on {uuid}" for uuid, interval in state.timesliced]
    parts += [f"MPS daemon {d.resource} for {', '.join(d.devices)}" for d in state.mps]
    return "; ".join(parts) or "nothing"
