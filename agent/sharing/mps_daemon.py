"""MPS control daemons: one per MPS-shared resource, started and supervised by the agent
(the supervisor of :mod:`agent.sharing.mps`).

What the control program is told follows NVIDIA's MPS control daemon (the device plugin's
``mps-control-daemon``), so a node runs the same MPS setup under either:

* start: ``<program> -d`` with ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` set
  to ``<mpsRoot>/<resource>/pipe`` and ``.../log``, and (beyond NVIDIA's, which leaves it
  unset) ``CUDA_VISIBLE_DEVICES`` = the shared GPUs' UUIDs in index order, so the daemon's
  servers see only them. Nothing else of the agent's environment is passed, as NVIDIA's.
* then, each as one more ``<program>`` run with the command on its standard input:
  ``set_default_device_pinned_mem_limit <device> <MiB>M`` per GPU (the GPU's memory /
  replicas; ``<device>`` the GPU's CUDA ordinal in ``CUDA_VISIBLE_DEVICES``) and
  ``set_default_active_thread_percentage <100 / replicas>``.
* answering: ``get_default_active_thread_percentage`` succeeds (NVIDIA's health check);
  asked at start and every ``probe_s`` after.
* stop: ``quit``.

Unlike NVIDIA's daemon it does not switch the GPUs' compute mode with ``nvidia-smi`` (the
agent never changes GPU state; MPS runs in the Default mode too; Exclusive_Process is the
operator's choice), and a daemon that stops answering is restarted here, with capped
exponential backoff, instead of by a pod restart. A daemon already answering on the pipe
directory at start (left by an agent that crashed) is told to quit first, so the one
serving always has this configuration's GPUs and limits; unless the supervisor is told to
``adopt`` it (a DRA claim's daemon, whose pipe directory is the claim's own and whose
settings the checkpoint kept: its pods keep their MPS server across an agent restart), and
:meth:`MpsControlDaemon.detach` stops supervising without telling the daemon to quit.

The replicas are served only while their daemon answers (:attr:`MpsControlDaemon.ready`):
the device-plugin manager registers the resource once it first answers and reports its
devices Unhealthy while it does not.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from agent.errors import AgentError
from agent.retry import Backoff, Outage
from agent.sharing.base import PROBE_INTERVAL_S
from agent.sharing.mps_paths import (
    mps_memory_limit_mib,
    mps_resource_dir,
    mps_shm_dir,
    mps_thread_percentage,
)
from agent.topology.model import Topology
from agent.worker import Worker

log = logging.getLogger(__name__)

#: How long one control-program run may take (s).
COMMAND_TIMEOUT_S = 5.0
#: Restarts wait 0.5 s, 1 s, 2 s, ... up to this (s); a daemon that answered this long
#: starts the sequence over.
MAX_BACKOFF_S = 60.0
FIRST_BACKOFF_S = 0.5


def control_program(program: str) -> str | None:
    """The MPS control program the daemons run: ``program`` itself when it names a path (an
    executable file), else found on the PATH; None when it is not there."""
    if "/" in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program)


@dataclass(frozen=True)
class MpsDaemonSpec:
    """What one resource's control daemon serves: its GPUs and their default limits."""

    resource: str  # "nvidia.com/gpu": its directories are <mpsRoot>/<resource>/
    uuids: tuple[str, ...]  # CUDA_VISIBLE_DEVICES, GPU index order (ordinal = position)
    memory_limits_mib: tuple[int | None, ...]  # per ordinal; None: memory not known
    thread_percentage: int

    @classmethod
    def for_resource(cls, resource: str, replicas: Mapping[int, int], topology: Topology) -> MpsDaemonSpec:
        """The daemon for ``resource``'s replicas (GPU index -> replicas). One thread
        percentage serves the whole daemon (the control program takes one): the share of
        the GPU with the most replicas."""
        indices = sorted(replicas)
        gpus = [topology.gpus[i] for i in indices]
        return cls(
            resource=resource,
            uuids=tuple(g.uuid for g in gpus),
            memory_limits_mib=tuple(mps_memory_limit_mib(g, replicas[g.index]) for g in gpus),
            thread_percentage=mps_thread_percentage(max(replicas.values(), default=1)),
        )

    def commands(self) -> list[str]:
        """The settings, in the order NVIDIA's daemon sends them."""
        out = [
            f"set_default_device_pinned_mem_limit {ordinal} {limit}M"
            for ordinal, limit in enumerate(self.memory_limits_mib) if limit
        ]
        out.append(f"set_default_active_thread_percentage {self.thread_percentage}")
        return out


class MpsControlDaemon(Worker):
    """Starts, watches and restarts the control daemon of one resource (a thread of its
    own); ``on_change()`` is called (no lock held) whenever :attr:`ready` flips (it
    answers, or stops answering). A :class:`agent.sharing.base.Supervisor`."""

    def __init__(
        self,
        spec: MpsDaemonSpec,
        mps_root: str,
        program: str,
        on_change: Callable[[], None],
        *,
        probe_s: float = PROBE_INTERVAL_S,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        adopt: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.mps_root = mps_root
        self.thread_name = f"mps-{spec.resource}"
        self.pipe_dir = mps_resource_dir(mps_root, spec.resource, "pipe")
        self.log_dir = mps_resource_dir(mps_root, spec.resource, "log")
        self.shm_dir = mps_shm_dir(mps_root)
        self.program = program
        self.probe_s = probe_s
        self.command_timeout_s = command_timeout_s
        self.max_backoff_s = max_backoff_s
        self._on_change = on_change
        # Lock order: a leaf, held only to read or flip the state below.
        self._lock = threading.Lock()
        self._answering = False
        self._generation = 0  # increases whenever answering flips
        # thread only: a daemon that may still run is ours (we started it, or adopt it)
        self._started = adopt
        self._detached = False  # set before the thread is stopped: leave the daemon running

    @property
    def ready(self) -> bool:
        """The daemon answers: its replicas can be served."""
        with self._lock:
            return self._answering

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def _set_answering(self, value: bool) -> None:
        with self._lock:
            if self._answering == value:
                return
            self._answering = value
            self._generation += 1
        self._on_change()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        backoff = Backoff(min(FIRST_BACKOFF_S, self.max_backoff_s), self.max_backoff_s)
        starting = Outage(log, f"MPS control daemon for {self.spec.resource}", level=logging.ERROR,
                          recovered_level=None, per_reason=True)
        up_since = 0.0
        while not self._stop.is_set():
            if not self.ready:
                try:
                    self._start_daemon()
                except AgentError as exc:
                    starting.failed(str(exc))
                    self._stop.wait(backoff.next())
                    continue
                log.info(
                    "MPS control daemon for %s answers (GPUs %s, %d%% of the threads and %s per replica)",
                    self.spec.resource, ",".join(self.spec.uuids), self.spec.thread_percentage,
                    ", ".join(f"{m}M" for m in self.spec.memory_limits_mib if m) or "no memory limit",
                )
                starting.recovered()
                up_since = time.monotonic()
                self._set_answering(True)
            if self._stop.wait(self.probe_s):
                break
            if time.monotonic() - up_since >= self.max_backoff_s:
                backoff.reset()  # up long enough: the next restart is immediate again
            try:
                self._control("get_default_active_thread_percentage")
            except AgentError as exc:
                log.error(
                    "MPS control daemon for %s stopped answering (%s): its replicas are unhealthy;"
                    " restarting it", self.spec.resource, exc,
                )
                self._set_answering(False)
                if backoff.last_s and self._stop.wait(backoff.last_s):  # the first restart is at once
                    break
                backoff.next()
        if not self._detached:
            self._quit()
        self._set_answering(False)

    def detach(self, timeout_s: float = 5.0) -> None:
        """Stop supervising and leave the daemon running (the agent stops; a later one adopts
        it)."""
        self._detached = True
        self.stop(timeout_s)

    def _start_daemon(self) -> None:
        """Start the daemon and give it its settings; AgentError when any step fails. One
        that answers already is kept if we started it (a probe it missed, not a death), and
        told to quit otherwise (left by an agent that stopped without quitting it)."""
        for path in (self.pipe_dir, self.log_dir, self.shm_dir):
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise AgentError(f"cannot create {path}: {exc.strerror or exc}") from None
        try:
            self._control("get_default_active_thread_percentage")
        except AgentError:
            pass
        else:
            if self._started:
                return
            log.warning("an MPS control daemon already serves %s: telling it to quit", self.pipe_dir)
            self._control("quit")
        self._run_program(["-d"], None)
        self._started = True
        for command in [*self.spec.commands(), "get_default_active_thread_percentage"]:
            if self._stop.is_set():
                raise AgentError("stopping")
            self._control(command)

    def _control(self, command: str) -> str:
        """Send one command to the running daemon; its answer (AgentError if it fails)."""
        return self._run_program([], command)

    def _run_program(self, args: list[str], command: str | None) -> str:
        program = control_program(self.program)
        if program is None:
            raise AgentError(f"MPS control program {self.program} is not there: not an executable file, or not on"
                             " the PATH (--mps-control-binary)")
        env = {
            "CUDA_VISIBLE_DEVICES": ",".join(self.spec.uuids),
            "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
        }
        what = " ".join([os.path.basename(program), *args]) + (f" <<< {command}" if command else "")
        # output goes to a file, not a pipe: with -d the daemon may keep the parent's
        # descriptors open, and reading a pipe would wait for the daemon to end
        with tempfile.TemporaryFile() as output:
            try:
                done = subprocess.run(
                    [program, *args], input=(command + "\n").encode() if command else None,
                    stdin=None if command else subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                    env=env, timeout=self.command_timeout_s, check=False,
                )
            except subprocess.TimeoutExpired:
                raise AgentError(f"{what}: no answer in {self.command_timeout_s:g} s") from None
            except OSError as exc:
                raise AgentError(f"{what}: cannot run {program}: {exc.strerror or exc}") from None
            output.seek(0)
            text = output.read(4096).decode(errors="replace").strip()
        if done.returncode != 0:
            detail = f": {text.splitlines()[-1]}" if text else ""
            raise AgentError(f"{what}: exit status {done.returncode}{detail}")
        return text

    def _quit(self) -> None:
        if not self._started:
            return
        self._started = False
        try:
            self._control("quit")
            log.info("MPS control daemon for %s told to quit", self.spec.resource)
        except AgentError as exc:
            log.warning("MPS control daemon for %s: quit failed: %s", self.spec.resource, exc)
