"""The containers' NCCL topology files on the host: one per allocation, written atomically,
mounted read-only into the container, removed when its allocation is gone.

Public API::

    NcclFiles.from_config(config) -> NcclFiles | None
    nccl_files_for(config, current) -> NcclFiles | None  # the owner's: one per host directory
    NcclFiles.write(key, topology, gpus) -> NcclFile
    NcclFiles.write_later(key, topology, gpus) -> NcclFile;  NcclFiles.wait(key) -> bool
    NcclFiles.remove(key) -> bool
    NcclFiles.sweep(live_keys, min_age_s) -> list[str]
    allocation_key(resource, device_ids) -> str        # a device plugin allocation
    claim_key(claim_uid) -> str                         # a prepared DRA claim
    live_allocation_keys(pod_resources, resources) -> set[str]

A file is named by its allocation (``<host_dir>/<key>.xml``): the device plugin's Allocate
does not say which container it is for, so the key is a digest of the resource and the
device IDs it was given (the kubelet's pod-resources API lists the same IDs per container,
which is how a file whose container is gone is found); a DRA claim's file is named by the
claim's UID. Files live on the host (``nccl.hostDir``, on disk by default): they survive an
agent restart, and the kubelet, which keeps a container's Allocate answer in its checkpoint
and mounts it again when the container restarts, finds them after a reboot too.

One :class:`NcclFiles` per host directory per process: the mode's servers own it
(:func:`nccl_files_for` keeps it across reloads while the directory stays) and hand it to
their request handlers and the sweeper, so the sweep sees what the handlers are writing. It
keeps the node's own NCCL topology file (``topology.ncclTopologyFile``, read as
:class:`NodeFile`) beside the topology, for the containers' files to echo.

What a container needs of NCCL (issue 24), by kind of device:

- whole GPUs: the file of those GPUs;
- time-sliced or MPS replicas: the file of the physical GPUs behind them (NCCL sees the
  physical GPUs by bus ID, whatever the sharing; and it allows one rank per GPU anyway);
- MIG devices: no file. NCCL has no peer-to-peer path between MIG instances and every
  instance of a GPU has the GPU's bus ID, so a file could only describe the whole GPU; the
  nearest NICs are still told in ``GPU_TOPOLOGY_NICS``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.config import Config, state_dir_of
from agent.files import remove_file, remove_stale_temps, write_text_atomic
from agent.nccl.container_file import nccl_topology_xml, nearest_nics
from agent.nccl.node_file import NcclTopologyError, NodeFile, read_nccl_topology
from agent.records import Nic
from agent.topology.model import Topology

log = logging.getLogger(__name__)

#: NCCL's variable naming its topology file
NCCL_TOPO_FILE_ENV = "NCCL_TOPO_FILE"
NCCL_IB_HCA_ENV = "NCCL_IB_HCA"
NICS_ENV = "GPU_TOPOLOGY_NICS"  # the nearest NICs, named for the container
_SUFFIX = ".xml"
_MAX_CACHED = 4096  # rendered texts kept (GPU sets); the cache is emptied when full


@dataclass(frozen=True)
class NcclFile:
    """A written file: its host path and the NICs it names."""

    host_path: str
    nics: tuple[Nic, ...]


def allocation_key(resource: str, device_ids: Iterable[str]) -> str:
    """The key of a device plugin allocation: ``dp-`` and a digest of the resource and its
    device IDs (in any order)."""
    text = "\0".join([resource, *sorted(device_ids)])
    return "dp-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def claim_key(claim_uid: str) -> str:
    """The key of a prepared DRA claim (its UID is already checked as a CDI name)."""
    return f"claim-{claim_uid}"


def live_allocation_keys(pod_resources: Iterable[Any], resources: Iterable[str]) -> set[str]:
    """The keys of every container's allocation of ``resources`` that the kubelet's
    pod-resources ``List`` answer (its ``pod_resources``) still lists."""
    wanted = set(resources)
    keys: set[str] = set()
    for pod in pod_resources:
        for container in pod.containers:
            for dev in container.devices:
                if dev.resource_name in wanted and dev.device_ids:
                    keys.add(allocation_key(dev.resource_name, dev.device_ids))
    return keys


def host_dir_of(config: Config) -> str:
    """``nccl.hostDir``, or where it is by default (:class:`Config`'s ``nccl_host_dir``)."""
    return config.nccl_host_dir or os.path.join(state_dir_of(config), "nccl")


class NcclFiles:
    """The files in one host directory. Thread-safe: each key has its own file, and every
    write is a rename of a complete temp file.

    :meth:`write_later` is the device plugin's: Allocate only names the file (its path is a
    function of the key) and one writer thread writes it; the kubelet calls
    PreStartContainer before it starts the container, and :meth:`wait` there holds the
    container back until its file is in place. A file's text is kept per GPU set (a pure
    function of the frozen topology), so the same set costs one rendering."""

    def __init__(self, host_dir: str, node_file: NodeFile | None = None) -> None:
        self.host_dir = host_dir
        #: the node's NCCL topology file the containers' files echo (None: built from the facts)
        self.node_file = node_file
        self._lock = threading.Condition(threading.Lock())
        self._queue: list[tuple[str, str]] = []  # (key, text) to write
        self._pending: set[str] = set()  # queued or being written
        self._failed: dict[str, str] = {}  # key -> why its last deferred write failed
        self._writer: threading.Thread | None = None
        self._texts: dict[
            tuple[int, int, tuple[int, ...], tuple[str, ...]], tuple[Topology, NodeFile | None, str, tuple[Nic, ...]]
        ] = {}
        self._written: dict[str, str] = {}  # key -> the text this process last wrote for it

    @classmethod
    def from_config(cls, config: Config) -> NcclFiles | None:
        """The files of ``config`` (``nccl.topologyFile: auto``), or None (``off``), with the
        node's NCCL topology file ``config`` names. For a one-shot command: unlike
        :func:`nccl_files_for`, it leaves the directory's temp files alone (the running
        agent's writes may be in flight)."""
        if config.nccl_pod_files != "auto":
            return None
        files = cls(host_dir_of(config))
        files.follow(config)
        return files

    def follow(self, config: Config) -> None:
        """Read the node's NCCL topology file ``config`` names again (a reload). One the
        topology was already read from; should it be unreadable now, the containers' files
        are built from the facts (said once)."""
        path = config.nccl_topology_file
        if not path:
            self.node_file = None
            return
        try:
            self.node_file = read_nccl_topology(path)
        except NcclTopologyError as exc:
            log.error("containers' NCCL topology files are built from the topology, not from %s: %s", path, exc)
            self.node_file = None

    def path(self, key: str) -> str:
        return os.path.join(self.host_dir, key + _SUFFIX)

    def render(
        self, topology: Topology, gpus: Sequence[int], extra_nics: Sequence[Nic] = ()
    ) -> tuple[str, tuple[Nic, ...]]:
        """The file's text and NICs for GPUs ``gpus`` (indices), rendered once per set."""
        node_file = self.node_file
        cache_key = (id(topology), id(node_file), tuple(sorted(gpus)), tuple(n.name for n in extra_nics))
        hit = self._texts.get(cache_key)
        if hit is not None and hit[0] is topology and hit[1] is node_file:
            return hit[2], hit[3]
        nics = nearest_nics(topology, gpus)
        nics += tuple(n for n in extra_nics if n not in nics)
        text = nccl_topology_xml(topology, gpus, nics, node_file)
        if len(self._texts) >= _MAX_CACHED:
            self._texts.clear()
        self._texts[cache_key] = (topology, node_file, text, nics)
        return text, nics

    def write(self, key: str, topology: Topology, gpus: Sequence[int], extra_nics: Sequence[Nic] = ()) -> NcclFile:
        """Write the file of GPUs ``gpus`` (indices) for ``key`` now, atomically (readers see
        the old file or the new one); OSError when the directory cannot be written."""
        text, nics = self.render(topology, gpus, extra_nics)
        self._write_text(key, text)
        return NcclFile(self.path(key), nics)

    def _write_text(self, key: str, text: str) -> None:
        # no fsync: a file lost to a power cut is written again by the next Allocate,
        # PreStartContainer or prepare; the rename alone keeps a reader off half a file
        write_text_atomic(self.path(key), text, fsync=False)

    def write_later(self, key: str, topology: Topology, gpus: Sequence[int]) -> NcclFile:
        """The file of ``gpus`` for ``key``, handed to the writer thread; :meth:`wait`
        returns once it is written."""
        text, nics = self.render(topology, gpus)
        if self._written.get(key) is text:  # the same allocation again: written already (a
            return NcclFile(self.path(key), nics)  # file removed since is PreStartContainer's)
        with self._lock:
            self._queue.append((key, text))
            self._pending.add(key)
            self._failed.pop(key, None)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, name="nccl-files", daemon=True)
                self._writer.start()
            self._lock.notify_all()
        return NcclFile(self.path(key), nics)

    def _write_queued(self) -> None:
        # the writer lives while there is something to write and ends when the queue is
        # empty: a handler replaced by a reload leaves no thread behind, and no one has to
        # stop it
        while True:
            with self._lock:
                if not self._queue:
                    self._writer = None
                    return
                key, text = self._queue.pop(0)
            try:
                self._write_text(key, text)
                self._written[key] = text
            except OSError as exc:
                log.error("cannot write the NCCL topology file %s: %s", self.path(key), exc.strerror or exc)
                with self._lock:
                    self._failed[key] = str(exc.strerror or exc)
            with self._lock:
                if not any(k == key for k, _ in self._queue):
                    self._pending.discard(key)
                self._lock.notify_all()

    def wait(self, key: str, timeout_s: float = 10.0) -> bool:
        """Wait until ``key``'s deferred write is done; True when its file is in place."""
        with self._lock:
            self._lock.wait_for(lambda: key not in self._pending, timeout_s)
            if key in self._pending or key in self._failed:
                return False
        return os.path.exists(self.path(key))

    def remove(self, key: str) -> bool:
        """Remove ``key``'s file; False when there was none."""
        return remove_file(self.path(key))

    def keys(self) -> set[str]:
        """The keys of the files in the directory."""
        try:
            names = os.listdir(self.host_dir)
        except FileNotFoundError:
            return set()
        return {n[: -len(_SUFFIX)] for n in names if n.endswith(_SUFFIX) and not n.startswith(".")}

    def pending(self) -> set[str]:
        """The keys whose deferred write is not done yet (a sweep leaves them alone)."""
        with self._lock:
            return set(self._pending)

    def sweep(self, live_keys: set[str], min_age_s: float, prefix: str = "dp-") -> list[str]:
        """Remove the files of ``prefix`` whose key is not in ``live_keys`` and that are
        older than ``min_age_s`` (an Allocate comes before the kubelet lists the container:
        a fresh file is left alone). Returns the removed keys."""
        now = time.time()
        removed = []
        for key in sorted(self.keys() - live_keys - self.pending()):
            if not key.startswith(prefix):
                continue
            try:
                if now - os.stat(self.path(key)).st_mtime < min_age_s:
                    continue
                os.unlink(self.path(key))
            except FileNotFoundError:
                continue
            removed.append(key)
        if removed:
            log.info("removed %d NCCL topology file(s) of containers the kubelet no longer lists", len(removed))
        return removed


def nccl_files_for(config: Config, current: NcclFiles | None) -> NcclFiles | None:
    """The files ``config`` asks for (None: ``nccl.topologyFile: off``): ``current`` while
    its host directory stays the same (its writer and its pending writes with it), else new
    ones; either way with the node's NCCL topology file ``config`` names read again. New
    ones are the owner's: the temp files its killed writes left there are removed."""
    if config.nccl_pod_files != "auto":
        return None
    host_dir = host_dir_of(config)
    if current is not None and current.host_dir == host_dir:
        files = current
    else:
        # a directory this process has not written in yet: no write of ours is in flight
        # there, so a temp file of one of our files is a killed write's
        removed = remove_stale_temps(host_dir, lambda name: name.startswith(("dp-", "claim-")))
        if removed:
            log.info("NCCL files %s: removed %d temp file(s) of interrupted writes", host_dir, removed)
        files = NcclFiles(host_dir)
    files.follow(config)
    return files


def nic_envs(nics: Sequence[Nic], ib_hca: bool) -> dict[str, str]:
    """``GPU_TOPOLOGY_NICS`` (the nearest NICs' names) and, opted in, ``NCCL_IB_HCA`` naming
    exactly them (``=`` makes NCCL match whole names: ``mlx5_1`` would also match
    ``mlx5_10``). NICs known by bus ID only are not named to NCCL."""
    if not nics:
        return {}
    envs = {NICS_ENV: ",".join(n.name for n in nics)}
    named = [n.name for n in nics if not n.name.startswith("nic-")]
    if ib_hca and named:
        envs[NCCL_IB_HCA_ENV] = "=" + ",".join(named)
    return envs
