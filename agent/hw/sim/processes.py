"""Simulated GPU processes: the ``processes:`` list of a machine spec's GPU entry, and the
fake ``/proc`` tree that holds their cgroup files.

A GPU entry may carry::

    processes:
      - pid: 4242                   # required, >= 1; the host PID NVML reports
        used_memory_mib: 10240      # framebuffer the process holds (default 0)
        sm_util: 35                 # % of SM time over the last sample period (default 0)
        mem_util: 12                # % of memory-bandwidth time (default 0)
        cgroup: "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/..."

``cgroup`` is the file ``/proc/<pid>/cgroup`` as the kernel shows it (several lines for
cgroup v1); without it the process has no cgroup file, as when it exited between NVML's
answer and the read. One PID may use several GPUs (it is listed under each); it then has one
cgroup. The fake NVML answers ``nvmlDeviceGetComputeRunningProcesses`` and
``nvmlDeviceGetProcessUtilization`` from these entries; :func:`write_proc_tree` writes
``<root>/<pid>/cgroup`` for each PID that has a cgroup.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.errors import InputFormatError

__all__ = ["ProcessSpec", "check_process_cgroups", "read_processes", "write_proc_tree"]

_KEYS = frozenset({"pid", "used_memory_mib", "sm_util", "mem_util", "cgroup"})


@dataclass(frozen=True)
class ProcessSpec:
    """One process on one GPU (module docstring)."""

    pid: int
    used_memory_mib: int = 0
    sm_util: int = 0
    mem_util: int = 0
    cgroup: str | None = None  # the whole /proc/<pid>/cgroup text; None: no such file


def _int(value: object, where: str, source: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputFormatError(f"{source}: {where}: expected an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo} to {hi}" if hi is not None else f">= {lo}"
        raise InputFormatError(f"{source}: {where}: expected {bound}, got {value}")
    return value


def read_processes(value: object, source: str, where: str) -> tuple[ProcessSpec, ...]:
    """The ``processes`` list of one GPU entry (None: no processes). InputFormatError names
    ``source``, the key path and what was expected."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputFormatError(f"{source}: {where}: expected a list, got {type(value).__name__}")
    out: list[ProcessSpec] = []
    seen: set[int] = set()
    for j, raw in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(raw, Mapping):
            raise InputFormatError(f"{source}: {at}: expected a mapping, got {type(raw).__name__}")
        unknown = sorted(set(map(str, raw)) - _KEYS)
        if unknown:
            raise InputFormatError(
                f"{source}: {at}: unknown keys {unknown}; expected some of {sorted(_KEYS)}"
            )
        if "pid" not in raw:
            raise InputFormatError(f"{source}: {at}.pid: required")
        pid = _int(raw["pid"], f"{at}.pid", source, 1, 2**31 - 1)
        if pid in seen:
            raise InputFormatError(f"{source}: {at}.pid: {pid} given twice on this GPU")
        seen.add(pid)
        cgroup = raw.get("cgroup")
        if cgroup is not None and (not isinstance(cgroup, str) or not cgroup.strip()):
            raise InputFormatError(
                f"{source}: {at}.cgroup: expected the /proc/<pid>/cgroup text, got {cgroup!r}"
            )
        out.append(ProcessSpec(
            pid=pid,
            used_memory_mib=_int(raw.get("used_memory_mib", 0), f"{at}.used_memory_mib", source, 0),
            sm_util=_int(raw.get("sm_util", 0), f"{at}.sm_util", source, 0, 100),
            mem_util=_int(raw.get("mem_util", 0), f"{at}.mem_util", source, 0, 100),
            cgroup=cgroup,
        ))
    return tuple(out)


def check_process_cgroups(
    per_gpu: Iterable[tuple[int, Sequence[ProcessSpec]]], source: str
) -> None:
    """A PID listed on several GPUs is one process: it has one cgroup (or none)."""
    cgroups: dict[int, tuple[int, str | None]] = {}
    for index, processes in per_gpu:
        for p in processes:
            first = cgroups.setdefault(p.pid, (index, p.cgroup))
            if first[1] != p.cgroup:
                raise InputFormatError(
                    f"{source}: gpus[{index}].processes: PID {p.pid} has another cgroup than "
                    f"on gpus[{first[0]}] (one process has one cgroup)"
                )


def write_proc_tree(root: str, processes: Iterable[ProcessSpec]) -> None:
    """Write ``<root>/<pid>/cgroup`` for every process that has a cgroup (a PID on several
    GPUs once)."""
    os.makedirs(root, exist_ok=True)
    written: set[int] = set()
    for p in processes:
        if p.cgroup is None or p.pid in written:
            continue
        written.add(p.pid)
        os.makedirs(os.path.join(root, str(p.pid)), exist_ok=True)
        text = p.cgroup if p.cgroup.endswith("\n") else p.cgroup + "\n"
        with open(os.path.join(root, str(p.pid), "cgroup"), "w", encoding="utf-8") as f:
            f.write(text)
