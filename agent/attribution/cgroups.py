"""Which container a host process belongs to, from its cgroup (``/proc/<pid>/cgroup``).

:func:`parse_cgroup` is pure: the text of a cgroup file -> :class:`CgroupOwner` (container ID,
pod UID, runtime), or None for a process in no Kubernetes pod (a host service, a login
session). It reads every line (cgroup v1 has one per hierarchy, ``ID:controllers:path``; v2
one, ``0::path``; hybrid both) and takes the first path that names a container, looking at
its components from the innermost out, so the cgroup root the kubelet uses (``kubepods``,
``kubelet-kubepods`` in kind), a private cgroup namespace (``/../../…``) or a sub-cgroup
the container made for itself do not matter. The spellings it knows:

=====================  =================================================================
driver, runtime        container component (the pod's is ``pod<uid>`` / ``…-pod<uid_>.slice``)
=====================  =================================================================
systemd, containerd    ``cri-containerd-<id>.scope``
systemd, CRI-O         ``crio-<id>.scope`` (``crio-conmon-<id>.scope`` is CRI-O's monitor:
                       in the pod, not in a container)
systemd, cri-dockerd   ``docker-<id>.scope``
cgroupfs, containerd   ``<id>`` (cri-dockerd spells it the same)
cgroupfs, CRI-O        ``crio-<id>``
=====================  =================================================================

``<id>`` is the runtime's 64-hex container ID; a pod UID is 36 characters with ``-`` (``_``
under the systemd driver, which cannot have ``-`` in a slice name), or 32 hex for a static
pod. A path in a pod with an unknown container spelling gives the pod UID alone.

:class:`CgroupReader` reads the files under a proc root (``--proc-root``, ``/proc`` by
default: the host's, which needs the host PID namespace, since NVML reports host PIDs).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

__all__ = ["CgroupOwner", "CgroupReader", "parse_cgroup"]

log = logging.getLogger(__name__)

_ID = r"[0-9a-f]{64}"
#: (pattern of a whole path component, runtime it tells)
_CONTAINER_COMPONENTS: tuple[tuple[re.Pattern[str], str | None], ...] = (
    (re.compile(rf"cri-containerd-({_ID})\.scope"), "containerd"),
    (re.compile(rf"crio-({_ID})(?:\.scope)?"), "cri-o"),
    (re.compile(rf"docker-({_ID})\.scope"), "docker"),
    (re.compile(rf"({_ID})"), None),  # cgroupfs: containerd or cri-dockerd
)
_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_COMPONENT = re.compile(rf"(?:.*-)?pod({_UUID}|[0-9a-f]{{32}})(?:\.slice)?")
#: the largest cgroup file read (a v1 file with every controller is well under 2 KiB)
_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class CgroupOwner:
    """Where a process lives: its container's ID (None: the path names the pod but no
    container spelling we know), its pod's UID (with ``-``; None: not in a pod path) and
    the runtime the spelling tells (``containerd``, ``cri-o``, ``docker``; None: cannot
    tell)."""

    container_id: str | None
    pod_uid: str | None
    runtime: str | None = None


def _owner_of_path(path: str) -> CgroupOwner | None:
    components = [c for c in path.strip().split("/") if c and c not in (".", "..")]
    container: tuple[str, str | None] | None = None
    pod_uid: str | None = None
    for component in reversed(components):
        if container is None and pod_uid is None:
            for pattern, runtime in _CONTAINER_COMPONENTS:
                m = pattern.fullmatch(component)
                if m is not None:
                    container = (m.group(1), runtime)
                    break
            if container is not None:
                continue
        m = _POD_COMPONENT.fullmatch(component)
        if m is not None:
            pod_uid = m.group(1).replace("_", "-")
            break
    if container is None and pod_uid is None:
        return None
    cid, runtime = container if container is not None else (None, None)
    if cid is not None and pod_uid is None and runtime is None:
        return None  # a bare 64-hex component outside any pod: not a Kubernetes container
    return CgroupOwner(cid, pod_uid, runtime)


def parse_cgroup(text: str) -> CgroupOwner | None:
    """The container (or at least the pod) a ``/proc/<pid>/cgroup`` text names; None when
    no line names one (module docstring)."""
    pod_only: CgroupOwner | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        owner = _owner_of_path(parts[2])
        if owner is None:
            continue
        if owner.container_id is not None:
            return owner
        pod_only = pod_only or owner
    return pod_only


class CgroupReader:
    """Reads ``<proc_root>/<pid>/cgroup``. A process that is gone (it exited between NVML's
    answer and the read) or whose file cannot be read has no owner; an unreadable file is
    logged once (per reason), a vanished one only at debug level."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._warned: set[str] = set()

    def owner(self, pid: int) -> CgroupOwner | None:
        path = os.path.join(self.proc_root, str(pid), "cgroup")
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_BYTES)
        except (FileNotFoundError, ProcessLookupError):
            log.debug("PID %d: no %s (the process exited, or is not in this PID namespace)",
                      pid, path)
            return None
        except OSError as exc:
            reason = type(exc).__name__
            if reason not in self._warned:
                self._warned.add(reason)
                log.warning("cannot read %s: %s; processes whose cgroup cannot be read are "
                            "reported without a pod", path, exc.strerror or exc)
            return None
        return parse_cgroup(data.decode("utf-8", errors="replace"))
