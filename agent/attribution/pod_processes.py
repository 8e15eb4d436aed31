"""Per-pod use of each GPU: the processes NVML lists, mapped to their containers.

Each sampling round, :meth:`PodProcesses.per_pod` takes the processes of every GPU
(:class:`~agent.hw.protocols.ProcessSample`) and

1. reads each host PID's cgroup (:class:`~agent.attribution.cgroups.CgroupReader`) for its
   container ID (or pod UID): once while NVML keeps listing the PID round after round (a
   PID missing from one round is read afresh if it returns: it may be another process; a
   PID that named no container is read again every round);
2. names the container from the runtime's CRI API (:class:`ContainerDirectory`, which calls
   ``ListContainers`` only when an ID it has not seen turns up, at most once per round and
   not again within ``retry_s`` of a failure);
3. adds up, per GPU and container, the processes' SM and memory-bandwidth utilisation and
   framebuffer (:class:`PodUse`).

A process that maps to no pod (a host process, a container outside Kubernetes, a PID gone
before its cgroup was read, an unreadable cgroup file, an unknown runtime's path, a
container the runtime does not list) is not dropped: it counts under :data:`NO_POD`, whose
``pod``, ``namespace`` and ``container`` labels are empty. All of this runs on the sampler's
thread; a scrape only reads the result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from agent.attribution import ContainerRef
from agent.attribution.cgroups import CgroupOwner, CgroupReader
from agent.hw.protocols import ProcessSample
from agent.kubelet.cri import CriClient, CriContainer, CriError

__all__ = ["NO_POD", "ContainerDirectory", "PodProcesses", "PodUse"]

log = logging.getLogger(__name__)

#: The owner of the processes that map to no pod (labels pod="", namespace="", container="").
NO_POD = ContainerRef("", "", "")

_MIB = 1 << 20


@dataclass(frozen=True)
class PodUse:
    """What one container's processes use of one GPU in one round. Utilisations are in %
    (the sum over its processes; None: the GPU's driver gives no per-process utilisation);
    ``fb_used_mib`` None when NVML gave no memory figure for any of them."""

    ref: ContainerRef
    processes: int
    sm_util_pct: float | None
    mem_util_pct: float | None
    fb_used_mib: float | None


class ContainerDirectory:
    """Container ID -> :class:`CriContainer`, from the runtime's ``ListContainers``, asked
    only when an unknown ID turns up (module docstring). Owned by the sampler's thread."""

    def __init__(
        self,
        client: CriClient,
        *,
        retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.retry_s = retry_s
        self.clock = clock
        self._by_id: dict[str, CriContainer] = {}
        self._by_pod_uid: dict[str, CriContainer] = {}
        self._unknown: set[str] = set()  # asked for and not listed at the last refresh
        self._failed_at: float | None = None

    def lookup(self, owners: Collection[CgroupOwner]) -> dict[CgroupOwner, ContainerRef]:
        """The container each owner is, as far as the runtime says; owners it does not
        know are left out."""
        wanted = {o.container_id for o in owners if o.container_id is not None}
        missing = wanted - self._by_id.keys() - self._unknown
        if missing and self._may_ask():
            self._refresh(wanted)
        out: dict[CgroupOwner, ContainerRef] = {}
        for owner in owners:
            ref = self._ref(owner)
            if ref is not None:
                out[owner] = ref
        return out

    def _ref(self, owner: CgroupOwner) -> ContainerRef | None:
        c = self._by_id.get(owner.container_id) if owner.container_id is not None else None
        if c is not None and c.pod:
            return ContainerRef(c.namespace, c.pod, c.container)
        sibling = self._by_pod_uid.get(owner.pod_uid) if owner.pod_uid is not None else None
        if sibling is not None:
            return ContainerRef(sibling.namespace, sibling.pod, "")  # the pod, not the container
        return None

    def _may_ask(self) -> bool:
        return self._failed_at is None or self.clock() - self._failed_at >= self.retry_s

    def _refresh(self, wanted: Collection[str]) -> None:
        try:
            containers = self.client.list_containers()
        except CriError as exc:
            if self._failed_at is None:
                log.warning("CRI ListContainers on %s failed: %s; GPU processes of containers "
                            "not seen before are reported without a pod until it answers "
                            "(retried every %gs)", self.client.socket_path, exc, self.retry_s)
            self._failed_at = self.clock()
            return
        if self._failed_at is not None:
            log.info("CRI ListContainers on %s works again", self.client.socket_path)
        self._failed_at = None
        self._by_id = {c.id: c for c in containers}
        self._by_pod_uid = {c.pod_uid: c for c in containers if c.pod_uid and c.pod}
        self._unknown = {cid for cid in wanted if cid not in self._by_id}

    def close(self) -> None:
        self.client.close()


class PodProcesses:
    """Maps each GPU's processes to containers and adds up their use (module docstring)."""

    def __init__(self, cgroups: CgroupReader, containers: ContainerDirectory) -> None:
        self.cgroups = cgroups
        self.containers = containers
        self._owners: dict[int, CgroupOwner] = {}  # the last round's PIDs in a container

    def per_pod(
        self, processes: Mapping[int, Sequence[ProcessSample]]
    ) -> dict[int, tuple[PodUse, ...]]:
        """GPU index -> the use of each container with processes on it (sorted, NO_POD
        first when present)."""
        pids = {p.pid for procs in processes.values() for p in procs}
        known = self._owners
        owner_of = {pid: known[pid] if pid in known else self.cgroups.owner(pid) for pid in pids}
        self._owners = {pid: o for pid, o in owner_of.items() if o is not None}
        owners = {o for o in owner_of.values() if o is not None}
        refs = self.containers.lookup(owners) if owners else {}
        out: dict[int, tuple[PodUse, ...]] = {}
        for index, procs in processes.items():
            groups: dict[ContainerRef, list[ProcessSample]] = {}
            for p in procs:
                owner = owner_of[p.pid]
                ref = refs.get(owner, NO_POD) if owner is not None else NO_POD
                groups.setdefault(ref, []).append(p)
            out[index] = tuple(_use(ref, groups[ref]) for ref in sorted(groups))
        return out

    def close(self) -> None:
        self.containers.close()


def _use(ref: ContainerRef, procs: Sequence[ProcessSample]) -> PodUse:
    sm = [p.sm_util_pct for p in procs]
    mem = [p.mem_util_pct for p in procs]
    used = [p.used_memory_bytes for p in procs if p.used_memory_bytes is not None]
    return PodUse(
        ref=ref,
        processes=len(procs),
        sm_util_pct=None if None in sm else float(sum(v or 0 for v in sm)),
        mem_util_pct=None if None in mem else float(sum(v or 0 for v in mem)),
        fb_used_mib=float(sum(used) // _MIB) if used else None,
    )
